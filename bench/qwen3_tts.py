"""Qwen3-TTS benchmark: the ``qwen3_tts`` card on omnistep vs. ``qwen-tts``'s own ``generate``.

What it measures
----------------
Both sides run the same Qwen3-TTS-12Hz CustomVoice folder with seeded random weights at the
published 0.6B WIDTHS (``omnistep.models.qwen3_tts.tiny.PUBLISHED_0B6_SIZES``: talker hidden 1024,
16 heads / 8 KV heads of 128, intermediate 3072; code predictor the same widths; speech
tokenizer decoder ``PUBLISHED_DECODER``: latent 1024, transformer 512 wide with 16 heads of 64,
intermediate 1024, conv decoder 1536 channels, 16 codebooks of 2048) with FEWER LAYERS by default
(``--depth bench``: talker 8 of 28, code predictor 2 of 5, codec decoder transformer 8 of 8; the
codec's conv stack has no depth to cut). ``--depth full`` is the published depth (28 / 5 / 8),
``--layers T,P,D`` any other. The folder is written once in the official layout by the assets
writer (upstream ``_init_weights`` under a fixed seed, real-scale values: the talker bf16, the
codec f32, as published), cached in ``--root`` and rewritten only when the sizes change. The
Mimi encoder and the text vocabulary keep their tiny test sizes: neither runs here.

Work per request: one of ``TEXTS`` (eight English sentences, 12-15 words), speaker ``vivian``,
language English, GREEDY in both stages (talker codebook 0 and the code predictor's 15
codebooks; the checkpoint's repetition penalty 1.05 on codebook 0 on both sides), capped at
``--frames`` N code frames (default 12 = 0.96 s of 24 kHz audio: qwen-tts takes 1-2 s per frame
here, so 8 x 12 frames are its ~2-4 minutes of a round). Random weights rarely draw EOS,
so nearly every request makes N frames; the frames each side actually made are recorded and the
rates use them. Both sides use the streaming-text prompt layout (text token k added at step k;
``non_streaming_mode=False`` on both sides: a whole text's default is the other layout for
CustomVoice), so the greedy codes are comparable.
Both sides run float32 with the same torch intra-op thread count (``--threads``, default 2).

* **omnistep, in-process** (not the HTTP server): ``AsyncEngine([ModelInstance.load(
  build_card(root, Qwen3TTSOptions(kv_cache_gb=0.25)))])`` with the default ``EngineConfig`` and
  the card's default vocoder chunks (first chunk 1 frame). Requests: ``SamplingParams(
  temperature=0, max_new_tokens=N + 1)`` (N frames: it counts as upstream's),
  ``non_streaming_mode=False``, a different text and seed each. A burst of C submits C
  requests at once and streams them to the end. Per request: TTFA (``add_request`` -> its first
  non-empty AUDIO ``StreamChunk``: the first streamed audio bytes), total seconds, frames
  (``usage["output_tokens"]``), audio seconds. Per burst: aggregate frames/s (frames / wall from
  the first submit to the last chunk), the process CPU seconds, and the split of the work:
  ``execute`` seconds of the talker (PREFILL / AR_TOKEN) and the codec (AUDIO_CHUNK), the code
  predictor's share of the talker (its ``run``, timed inside), so talker forward = talker -
  code predictor. The talker and the codec run on separate worker threads and overlap.
* **qwen-tts 0.1.1** (transformers 4.57.3) in ONE long-lived reference subprocess
  (``tests.qwen3_tts_ref.env.ReferenceSession``; it waits on a pipe, using no CPU, while
  omnistep runs): ``Qwen3TTSModel.from_pretrained(root, dtype=float32)`` once, then per request
  ``generate_custom_voice(text, speaker, language="English", non_streaming_mode=False,
  do_sample=False, subtalker_dosample=False, max_new_tokens=N + 1)`` (upstream drops the frame
  whose codebook 0 was drawn last, so N + 1 yields N frames: one more talker forward than
  omnistep, which counts the same but does not draw that last codebook 0), timed inside the
  subprocess; the talker's ``generate``, the code predictor's ``generate`` and the speech
  tokenizer's ``decode`` are timed by wrappers (``tests.qwen3_tts_ref.upstream_bench``).
  ``generate_custom_voice`` returns the audio only when the whole utterance is generated and
  decoded, so its time to first audio is its whole call. The eight texts run one after
  another (sequential).

Order: one unmeasured warm-up on each side (qwen-tts: ``TEXTS[0]`` capped at 2 frames;
omnistep: ``TEXTS[0]`` under ``ExecutionProfile.ROLLOUT``, which records its greedy codes, then
a burst of 2), then ``--rounds`` rounds (default 2) of ``qwen-tts sequential over the 8
texts``, an unmeasured omnistep burst of 2 (a burst right after the reference's 25-30 s of
work can run slower: the caches went to the other process), then ``omnistep
C=<each level>`` in order, back to back, so no level pays for following the reference (an
earlier order, C=1, reference, C=4, C=8, handed that cost to C=4 and flattered (c): one run
read C=4 p50 0.30 s against C=8 0.27 s). The greedy codes of ``TEXTS[0]``
are compared once (omnistep's warm-up vs qwen-tts's first request of round 1: the work check).
Headline numbers are medians over rounds (TTFA percentiles pool the requests of all rounds);
"paired" ratios use one round's numbers.

Targets (issue 13, item 8)
--------------------------
(a) omnistep TTFA p50 at C=1 <= 0.25x qwen-tts's time to its whole first utterance (the same
text); (b) omnistep aggregate frames/s at C=8 >= 4x qwen-tts run sequentially over the same 8
texts; (c) no TTFA cliff from C=4 to C=8: TTFA p99 at C=8 <= 1.5x TTFA p99 at C=4 (with 8 and 4
requests per round, p99 is close to the maximum). Also printed: real-time factor (seconds per
audio second), CPU seconds per frame (less sensitive to other load), and the per-frame split of
the step time (talker forward, code predictor, codec) on both sides.

How to run
----------
::

    .venv/bin/python bench/qwen3_tts.py                      # depth 8/2/8, N = 12, C = 1,4,8
    .venv/bin/python bench/qwen3_tts.py --depth full --frames 8 --rounds 1
    .venv/bin/python bench/qwen3_tts.py --quick              # tiny sizes, N = 3: ~40 s

``--quick`` uses the tiny test sizes (``TINY_SIZES``), N = 3 and one round: a smoke run for
``tests/test_bench_qwen3_tts.py``, whose numbers mean nothing. Output: a printed table and
``bench/results/qwen3_tts.json`` (``--out``). Wall-clock numbers depend on other load on the
machine: ``os.getloadavg()`` and the CPU seconds go with every measurement.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from omnistep.core import (
    ExecutionProfile,
    ModelInstance,
    Request,
    SamplingParams,
)
from omnistep.engine import AsyncEngine
from omnistep.models.qwen3_tts.card import Qwen3TTSOptions, build_card

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    SENTENCES,
    ExecTimer,
    fmt,
    jsonable,
    load_avg,
    median,
    parse_levels,
    percentile,
    timed_streams,
    union_seconds,
)

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # the checkpoint writer and the reference live in tests/
    sys.path.insert(0, str(REPO))

DEFAULT_ROOT = Path("/tmp/omnistep-qwen3-tts-bench")
QUICK_ROOT = Path("/tmp/omnistep-qwen3-tts-bench-quick")
DEFAULT_OUT = REPO / "bench" / "results" / "qwen3_tts.json"
MARKER = "qwen3-tts-bench-sizes.json"
SAMPLE_RATE = 24000
SPEAKER = "vivian"
LANGUAGE = "english"
SEED = 0
DEPTHS = {"bench": (8, 2, 8), "full": (28, 5, 8)}
"""``--depth`` -> (talker layers, code predictor layers, codec decoder transformer layers)."""
TARGETS = {"ttfa_c1": 0.25, "frames_per_s": 4.0, "ttfa_p99_cliff": 1.5}
TEXTS = SENTENCES


# ----------------------------------------------------------------------------- checkpoint


def bench_sizes(quick: bool, layers: tuple[int, int, int]) -> Any:
    """``Qwen3TTSSizes`` of the run: the tiny test sizes (``quick``) or the published 0.6B
    widths with ``layers`` = (talker, code predictor, codec decoder transformer) layers."""
    from omnistep.models.qwen3_tts.tiny import PUBLISHED_0B6_SIZES, TINY_SIZES

    if quick:
        return TINY_SIZES
    talker, predictor, codec = layers
    return dataclasses.replace(
        PUBLISHED_0B6_SIZES, layers=talker, cp_layers=predictor, dec_layers=codec
    )


def ensure_checkpoint(root: Path, sizes: Any) -> dict[str, Any]:
    """The CustomVoice folder of ``sizes`` at ``root``: written once (seed ``SEED``), reused
    while its marker file names the same sizes; written into a sibling folder and renamed, so
    an interrupted write leaves no half folder behind."""
    from tests.qwen3_tts_ref.assets import write_reference_qwen3_tts

    want = json.dumps({"seed": SEED, "sizes": dataclasses.asdict(sizes)}, sort_keys=True)
    marker = root / MARKER
    if marker.exists() and marker.read_text() == want:
        return {"written": False, "seconds": 0.0}
    start = time.perf_counter()
    tmp = root.with_name(f"{root.name}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    write_reference_qwen3_tts(tmp, "custom_voice", seed=SEED, sizes=sizes)
    (tmp / MARKER).write_text(want)
    if root.exists():
        shutil.rmtree(root)
    tmp.rename(root)
    return {"written": True, "seconds": round(time.perf_counter() - start, 1)}


def parameter_counts(root: Path) -> dict[str, int]:
    """Parameters per part: talker LM, code predictor, codec decoder (from the files)."""
    from safetensors import safe_open

    counts = {"talker": 0, "code_predictor": 0, "codec_decoder": 0}
    files = {
        root / "model.safetensors": "",
        root / "speech_tokenizer" / "model.safetensors": "st:",
    }
    for path, tag in files.items():
        with safe_open(str(path), "pt") as sf:
            for name in sf.keys():  # noqa: SIM118 - safe_open has no __iter__
                n = int(np.prod(sf.get_slice(name).get_shape()))
                if tag and name.startswith("decoder."):
                    counts["codec_decoder"] += n
                elif name.startswith("talker.code_predictor."):
                    counts["code_predictor"] += n
                elif not tag and name.startswith("talker."):
                    counts["talker"] += n
    return counts


# ----------------------------------------------------------------------------- omnistep


class PredictorTimer:
    """Times ``CodePredictor.run`` (the 15 sub-steps inside each talker step)."""

    def __init__(self, predictor: Any):
        self.seconds = 0.0
        inner = predictor.run

        def run(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        predictor.run = run


class Ours:
    """The loaded ``qwen3_tts`` card with its in-process engine (all bursts on one loop)."""

    def __init__(self, root: Path, frames: int):
        self.frames = frames
        self.options = Qwen3TTSOptions(kv_cache_gb=0.25)
        start = time.perf_counter()
        self.model = ModelInstance.load(build_card(str(root), self.options))
        self.load_s = time.perf_counter() - start
        self.timers = {n: ExecTimer(c) for n, c in self.model.components.items()}
        self.predictor = PredictorTimer(self.model.components["talker"].predictor)
        self.engine = AsyncEngine([self.model])
        self.seed = 1000
        print(f"omnistep: loaded in {self.load_s:.1f}s", flush=True)

    def info(self) -> dict[str, Any]:
        opts = dataclasses.asdict(self.options)
        opts["dtype"] = str(opts["dtype"])
        return {
            "options": opts,
            "load_s": round(self.load_s, 2),
            "engine": "in-process AsyncEngine",
            "engine_config": dataclasses.asdict(self.engine.config),
        }

    async def close(self) -> None:
        await self.engine.shutdown()
        # The step loop leaves its pending ``Event.wait`` waiter behind after shutdown.
        leftovers = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in leftovers:
            task.cancel()
        await asyncio.gather(*leftovers, return_exceptions=True)
        del self.engine, self.model, self.timers
        gc.collect()

    def request(self, i: int, seed: int, rollout: bool = False) -> Request:
        return Request(
            "qwen3-tts",
            text=TEXTS[i % len(TEXTS)],
            voice=SPEAKER,
            language=LANGUAGE,
            seed=seed,
            sampling=SamplingParams(temperature=0, max_new_tokens=self.frames + 1),
            profile=ExecutionProfile.ROLLOUT if rollout else ExecutionProfile.SERVE,
            non_streaming_mode=False,
        )

    async def codes(self, i: int) -> np.ndarray:
        """The greedy codes ``[frames, 16]`` of ``TEXTS[i]`` (recorded under ROLLOUT)."""
        stream = self.engine.add_request(self.request(i, seed=1, rollout=True))
        async for _ in stream:
            pass
        return np.array([r.tokens for r in stream.trajectories["decode"]], dtype=np.int64)

    async def burst(self, c: int, tag: str = "", quiet: bool = False) -> dict[str, Any]:
        for t in self.timers.values():
            t.log.clear()
        self.predictor.seconds = 0.0
        load = load_avg()
        cpu0 = time.process_time()
        seed0, self.seed = self.seed, self.seed + c
        reqs = [self.request(i, seed=seed0 + i) for i in range(c)]
        start, timed = await timed_streams(self.engine, reqs)
        per = [
            {
                "text": i % len(TEXTS),
                "ttfa_s": t.ttfa_s,
                "total_s": t.total_s,
                "frames": int(t.stream.usage.get("output_tokens", 0)),
                "audio_s": t.samples / SAMPLE_RATE,
            }
            for i, t in enumerate(timed)
        ]
        wall = time.perf_counter() - start
        cpu = time.process_time() - cpu0
        frames = sum(p["frames"] for p in per)
        audio = sum(p["audio_s"] for p in per)
        talker = self.timers["talker"].seconds()
        codec = self.timers["codec"].seconds()
        talker_s = sum(talker.values())
        codec_s = sum(codec.values())
        intervals = {n: [(s, e) for _, _, s, e in t.log] for n, t in self.timers.items()}
        busy = {n: round(union_seconds(iv), 3) for n, iv in intervals.items()}
        busy["any"] = round(union_seconds([x for iv in intervals.values() for x in iv]), 3)
        ttfa = [p["ttfa_s"] for p in per if p["ttfa_s"] is not None]
        res = {
            "concurrency": c,
            "tag": tag,
            "wall_s": wall,
            "frames": frames,
            "audio_s": audio,
            "frames_per_s": frames / wall,
            "rtf": wall / audio if audio else float("nan"),
            "ttfa_p50_s": percentile(ttfa, 50),
            "ttfa_p99_s": percentile(ttfa, 99),
            "ttfa_max_s": max(ttfa, default=float("nan")),
            "total_p50_s": median([p["total_s"] for p in per]),
            "cpu_s": cpu,
            "cpu_ms_per_frame": 1000 * cpu / max(frames, 1),
            "split_s": {
                "talker_forward": talker_s - self.predictor.seconds,
                "code_predictor": self.predictor.seconds,
                "codec": codec_s,
            },
            "exec": {n: t.summary() for n, t in self.timers.items()},
            "busy_s": busy,
            "loadavg_before": load,
            "loadavg": load_avg(),
            "requests": per,
        }
        if not quiet:
            print(
                f"  omnistep {tag:<8} C={c:<2} wall {wall:6.2f}s  {res['frames_per_s']:6.2f} "
                f"frames/s  TTFA p50 {res['ttfa_p50_s']:6.3f}s p99 {res['ttfa_p99_s']:6.3f}s  "
                f"RTF {res['rtf']:5.2f}  load {res['loadavg'][0]}",
                flush=True,
            )
        return res


# ----------------------------------------------------------------------------- qwen-tts


class Reference:
    """``qwen-tts`` in one ``ReferenceSession`` subprocess, the model loaded once."""

    TARGET = "tests.qwen3_tts_ref.upstream_bench"

    def __init__(self, root: Path, frames: int, threads: int):
        from tests.qwen3_tts_ref.env import ReferenceSession

        self.frames = frames
        self.session = ReferenceSession()
        start = time.perf_counter()
        self.info = self.session.call(f"{self.TARGET}:load", root=str(root), threads=threads)
        self.info["start_and_load_s"] = round(time.perf_counter() - start, 2)
        self.info.pop("speakers", None)
        print(f"qwen-tts: started and loaded in {self.info['start_and_load_s']:.1f}s", flush=True)

    def close(self) -> None:
        self.session.close()

    def one(self, i: int, frames: int | None = None) -> dict[str, Any]:
        """``TEXTS[i]`` capped at ``frames`` (default: the run's N) code frames."""
        out = self.session.call(
            f"{self.TARGET}:synthesize",
            text=TEXTS[i % len(TEXTS)],
            speaker=SPEAKER,
            language=LANGUAGE.capitalize(),
            max_new_tokens=(frames or self.frames) + 1,
            greedy=True,
            non_streaming_mode=False,
        )
        out["text"] = i % len(TEXTS)
        out["audio_s"] = out.pop("samples") / out.pop("sample_rate")
        return out

    def sequential(self, c: int, tag: str = "", quiet: bool = False) -> dict[str, Any]:
        load = load_avg()
        per = [self.one(i) for i in range(c)]
        seconds = sum(r["seconds"] for r in per)
        frames = sum(r["frames"] for r in per)
        audio = sum(r["audio_s"] for r in per)
        split = {
            k: sum(r["phases_s"].get(k, 0.0) for r in per)
            for k in ("talker_forward", "code_predictor", "codec")
        }
        res = {
            "concurrency": c,
            "tag": tag,
            "wall_s": seconds,
            "frames": frames,
            "audio_s": audio,
            "frames_per_s": frames / seconds,
            "rtf": seconds / audio if audio else float("nan"),
            "first_utterance_s": per[0]["seconds"],
            "cpu_s": sum(r["cpu_s"] for r in per),
            "cpu_ms_per_frame": 1000 * sum(r["cpu_s"] for r in per) / max(frames, 1),
            "split_s": split,
            "loadavg_before": load,
            "loadavg": load_avg(),
            "requests": [{k: v for k, v in r.items() if k != "codes"} for r in per],
            "codes_text0": per[0]["codes"],
        }
        if not quiet:
            print(
                f"  qwen-tts {tag:<8} x{c:<2} wall {seconds:6.2f}s  {res['frames_per_s']:6.2f} "
                f"frames/s  first utterance {res['first_utterance_s']:6.3f}s  "
                f"RTF {res['rtf']:5.2f}  load {res['loadavg'][0]}",
                flush=True,
            )
        return res


# ----------------------------------------------------------------------------- driver


def run_all(args: argparse.Namespace, levels: list[int]) -> dict[str, Any]:
    ref = Reference(args.root, args.frames, args.threads)
    loop = asyncio.new_event_loop()
    try:
        warm_ref = ref.one(0, frames=2)  # warm-up, 2 frames
        ours = Ours(args.root, args.frames)
        ours_codes = loop.run_until_complete(ours.codes(0))  # warm-up under ROLLOUT
        loop.run_until_complete(ours.burst(min(2, levels[-1]), quiet=True))  # warm-up, batched
        rounds = []
        for r in range(1, args.rounds + 1):
            print(f"round {r}/{args.rounds}", flush=True)
            rnd: dict[str, Any] = {"ours": {}}
            rnd["ref_sequential"] = ref.sequential(len(TEXTS), f"round {r}")
            loop.run_until_complete(ours.burst(min(2, levels[-1]), quiet=True))  # re-warm
            for c in levels:
                rnd["ours"][str(c)] = loop.run_until_complete(ours.burst(c, f"round {r}"))
            rounds.append(rnd)
            if r == 1:
                work = work_check(ours_codes, rnd["ref_sequential"].pop("codes_text0"))
                print(f"  greedy work check on TEXTS[0]: {work}", flush=True)
            else:
                rnd["ref_sequential"].pop("codes_text0")
        info = ours.info()
        loop.run_until_complete(ours.close())
    finally:
        loop.close()
        ref.close()
    return {
        "rounds": rounds,
        "omnistep": info,
        "qwen_tts": ref.info,
        "work_check": work,
        "warmup_reference_2_frames_s": round(warm_ref["seconds"], 3),
    }


def work_check(ours: np.ndarray, theirs: np.ndarray) -> dict[str, Any]:
    """Greedy codes of the same text on both sides: frame counts, and how many leading frames
    agree in all 16 codebooks (floating-point differences may flip a near-tie later on)."""
    n = min(len(ours), len(theirs))
    same = np.all(ours[:n] == theirs[:n], axis=1) if n else np.zeros(0, bool)
    agree = int(n if same.all() else np.argmin(same))
    return {"frames": [int(len(ours)), int(len(theirs))], "leading_frames_equal": agree}


# ----------------------------------------------------------------------------- report


def ratio_line(name: str, value: float, op: str, target: float, paired: list[float]) -> dict:
    ok = value >= target if op == ">=" else value <= target
    pair = ", ".join(f"{p:.3f}" for p in paired)
    print(
        f"  {name:<62} {value:7.3f}  (target {op} {target:<4}) {'MET   ' if ok else 'MISSED'}"
        f"  paired: {pair}"
    )
    return {
        "name": name,
        "value": round(value, 4),
        "op": op,
        "target": target,
        "met": ok,
        "paired": [round(p, 4) for p in paired],
    }


def _per_frame_ms(split: dict[str, float], frames: int) -> dict[str, float]:
    return {k: round(1000 * v / max(frames, 1), 2) for k, v in split.items()}


def report(levels: list[int], res: dict[str, Any]) -> dict[str, Any]:
    lo, hi = levels[0], levels[-1]
    mid = 4 if 4 in levels else (levels[-2] if len(levels) > 2 else lo)
    rounds = res["rounds"]
    ours = {c: [r["ours"][str(c)] for r in rounds] for c in levels}
    ref = [r["ref_sequential"] for r in rounds]

    def pooled_ttfa(c: int) -> list[float]:
        return [q["ttfa_s"] for b in ours[c] for q in b["requests"] if q["ttfa_s"] is not None]

    table = []
    for c in levels:
        runs = ours[c]
        ttfa = pooled_ttfa(c)
        table.append(
            {
                "side": "omnistep",
                "C": c,
                "rounds": len(runs),
                "ttfa_p50_s": percentile(ttfa, 50),
                "ttfa_p99_s": percentile(ttfa, 99),
                "total_p50_s": median([r["total_p50_s"] for r in runs]),
                "wall_s": median([r["wall_s"] for r in runs]),
                "frames": runs[0]["frames"],
                "frames_per_s": median([r["frames_per_s"] for r in runs]),
                "rtf": median([r["rtf"] for r in runs]),
                "cpu_ms_per_frame": median([r["cpu_ms_per_frame"] for r in runs]),
                "split_ms_per_frame": _per_frame_ms(
                    {k: median([r["split_s"][k] for r in runs]) for k in runs[0]["split_s"]},
                    runs[0]["frames"],
                ),
                "load1_max": max(r["loadavg"][0] for r in runs),
            }
        )
    table.append(
        {
            "side": "qwen-tts",
            "C": f"seq {len(TEXTS)}",
            "rounds": len(ref),
            "ttfa_p50_s": median([r["first_utterance_s"] for r in ref]),
            "ttfa_p99_s": float("nan"),
            "total_p50_s": median([q["seconds"] for r in ref for q in r["requests"]]),
            "wall_s": median([r["wall_s"] for r in ref]),
            "frames": ref[0]["frames"],
            "frames_per_s": median([r["frames_per_s"] for r in ref]),
            "rtf": median([r["rtf"] for r in ref]),
            "cpu_ms_per_frame": median([r["cpu_ms_per_frame"] for r in ref]),
            "split_ms_per_frame": _per_frame_ms(
                {k: median([r["split_s"][k] for r in ref]) for k in ref[0]["split_s"]},
                ref[0]["frames"],
            ),
            "load1_max": max(r["loadavg"][0] for r in ref),
        }
    )

    print()
    head = (
        f"{'side':<9} {'C':>5} {'TTFA p50':>8} {'p99':>7} {'total p50':>9} {'wall':>7} "
        f"{'frames':>6} {'frames/s':>8} {'RTF':>6} {'cpu ms/fr':>9}  "
        f"{'ms/frame: talker / predictor / codec':<36} {'load1':>5}"
    )
    print(head)
    print("-" * len(head))
    for row in table:
        split = row["split_ms_per_frame"]
        parts = " / ".join(f"{split[k]:.0f}" for k in ("talker_forward", "code_predictor", "codec"))
        print(
            f"{row['side']:<9} {row['C']!s:>5} {fmt(row['ttfa_p50_s'], '8.3f')} "
            f"{fmt(row['ttfa_p99_s'], '7.3f')} {row['total_p50_s']:9.3f} {row['wall_s']:7.2f} "
            f"{row['frames']:>6} {row['frames_per_s']:8.2f} {row['rtf']:6.2f} "
            f"{row['cpu_ms_per_frame']:9.0f}  {parts:<36} {row['load1_max']:>5}"
        )
    print(
        "(TTFA: omnistep = first streamed audio; qwen-tts = its whole first utterance, the same "
        "text. ms/frame: seconds of each part / frames of the run; omnistep's talker and codec "
        "overlap, so the parts can add up to more than the wall time per frame.)"
    )

    def paired(fn: Any) -> list[float]:
        return [fn(i) for i in range(len(rounds))]

    print()
    print("targets (headline = medians over rounds, TTFA percentiles over pooled requests):")
    targets = [
        ratio_line(
            f"(a) TTFA p50 C={lo}: omnistep / qwen-tts whole first utterance",
            table[0]["ttfa_p50_s"] / table[-1]["ttfa_p50_s"],
            "<=",
            TARGETS["ttfa_c1"],
            paired(lambda i: ours[lo][i]["ttfa_p50_s"] / ref[i]["first_utterance_s"]),
        ),
        ratio_line(
            f"(b) frames/s C={hi}: omnistep / qwen-tts sequential x{len(TEXTS)}",
            table[levels.index(hi)]["frames_per_s"] / table[-1]["frames_per_s"],
            ">=",
            TARGETS["frames_per_s"],
            paired(lambda i: ours[hi][i]["frames_per_s"] / ref[i]["frames_per_s"]),
        ),
        ratio_line(
            f"(c) TTFA p99 C={hi} / TTFA p99 C={mid} (omnistep)",
            table[levels.index(hi)]["ttfa_p99_s"] / table[levels.index(mid)]["ttfa_p99_s"],
            "<=",
            TARGETS["ttfa_p99_cliff"],
            paired(lambda i: ours[hi][i]["ttfa_p99_s"] / ours[mid][i]["ttfa_p99_s"]),
        ),
    ]
    p50_ratio = table[levels.index(hi)]["ttfa_p50_s"] / table[levels.index(mid)]["ttfa_p50_s"]
    cpu_ratio = table[-1]["cpu_ms_per_frame"] / table[levels.index(hi)]["cpu_ms_per_frame"]
    print(f"  (info) TTFA p50 C={hi} / C={mid}: {p50_ratio:.3f}")
    print(
        f"  (info) CPU ms per frame, qwen-tts / omnistep C={hi}: {cpu_ratio:.3f} "
        "((b) if both sides got the same CPU time)"
    )
    print(f"  (info) greedy work check on TEXTS[0] (frames ours/theirs): {res['work_check']}")
    figures = {
        "ttfa_c1_ratio": targets[0]["value"],
        "frames_per_s_ratio": targets[1]["value"],
        "ttfa_p99_cliff_ratio": targets[2]["value"],
        "ttfa_p50_cliff_ratio": round(p50_ratio, 4),
        "cpu_per_frame_ratio": round(cpu_ratio, 4),
        "omnistep_ttfa_c1_s": table[0]["ttfa_p50_s"],
        "qwen_tts_first_utterance_s": table[-1]["ttfa_p50_s"],
        "omnistep_frames_per_s": {str(r["C"]): r["frames_per_s"] for r in table[:-1]},
        "qwen_tts_frames_per_s": table[-1]["frames_per_s"],
        "omnistep_ttfa_p99_s": {str(r["C"]): r["ttfa_p99_s"] for r in table[:-1]},
        "omnistep_rtf": {str(r["C"]): r["rtf"] for r in table[:-1]},
        "qwen_tts_rtf": table[-1]["rtf"],
    }
    return {"table": table, "targets": targets, "figures": figures}


def parse_layers(text: str) -> tuple[int, int, int]:
    try:
        layers = tuple(int(x) for x in text.split(","))
    except ValueError:
        layers = ()
    if len(layers) != 3 or min(layers) < 1:
        raise argparse.ArgumentTypeError("--layers needs three positive ints: TALKER,PRED,CODEC")
    return layers  # type: ignore[return-value]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--concurrency", type=parse_levels, default=[1, 4, 8], help="e.g. 1,4,8")
    ap.add_argument("--root", type=Path, help=f"checkpoint folder (cache; {DEFAULT_ROOT})")
    ap.add_argument("--depth", choices=sorted(DEPTHS), default="bench", help="layer preset")
    ap.add_argument("--layers", type=parse_layers, help="TALKER,PRED,CODEC layers (over --depth)")
    ap.add_argument("--frames", type=int, help="code frames per request N (default 12)")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads, both sides")
    ap.add_argument("--rounds", type=int, help="rounds of the paired comparisons (default 2)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, N = 3, 1 round")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    args.root = args.root or (QUICK_ROOT if args.quick else DEFAULT_ROOT)
    args.frames = args.frames or (3 if args.quick else 12)
    args.rounds = args.rounds or (1 if args.quick else 2)
    if min(args.frames, args.rounds, args.threads) < 1:
        ap.error("--frames, --rounds and --threads must be >= 1")
    layers = args.layers or DEPTHS[args.depth]
    levels: list[int] = args.concurrency
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    load_start = load_avg()
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, load {load_start}")

    sizes = bench_sizes(args.quick, layers)
    ckpt = ensure_checkpoint(args.root, sizes)
    ckpt["parameters"] = parameter_counts(args.root)
    ckpt["layers"] = {
        "talker": sizes.layers,
        "code_predictor": sizes.cp_layers,
        "codec_decoder": sizes.dec_layers,
    }
    print(f"checkpoint {args.root}: {ckpt}", flush=True)
    res = run_all(args, levels)
    summary = report(levels, res)
    elapsed = time.perf_counter() - t_start
    load_end = load_avg()
    print(f"load average: start {load_start}, end {load_end}; bench took {elapsed:.0f}s")
    result = {
        "machine": {
            "platform": platform.platform(),
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "cpus": os.cpu_count(),
            "torch_threads": args.threads,
        },
        "args": {
            **{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "concurrency": levels,
            "layers": list(layers),
        },
        "settings": {
            "sampling": "greedy (temperature 0 / do_sample=False, subtalker_dosample=False)",
            "frames_cap": args.frames,
            "reference_max_new_tokens": args.frames + 1,
            "texts": list(TEXTS),
            "speaker": SPEAKER,
            "language": LANGUAGE,
            "prompt_layout": "streaming text (non_streaming_mode=False)",
            "omnistep_engine": "in-process AsyncEngine",
        },
        "checkpoint": {"root": str(args.root), "quick": args.quick, **ckpt},
        **summary,
        "raw": res,
        "seconds": round(elapsed, 1),
        "loadavg": {"start": load_start, "end": load_end},
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(jsonable(result), indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
