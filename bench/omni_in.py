"""Omni input benchmark (issue 27, item 8): Qwen2.5-Omni hearing audio, on omnistep vs.
transformers' ``generate``.

What it measures
----------------
A Qwen2.5-Omni checkpoint with seeded random weights is written once into ``--root``
(``omnistep.models.qwen2_5_omni.tiny.write_qwen_omni``): ``--size tiny`` (the test sizes,
``TINY_SIZES``) or ``--size audio-full`` (tiny LMs and token2wav, but the audio tower at the
published width, ``d_model`` 1280, 20 heads, ffn 5120, 128 mel bins, with ``--audio-layers``
layers instead of 32: reduced depth, full width, so the encoder's cost per layer is the real
one), or ``--size thinker-wide`` (the thinker at Qwen2.5-0.5B's width, hidden 896, 14 heads,
2 KV heads, ffn 4864, 4 layers: (c)'s prefill then costs compute, not per-call overhead).
Everything runs in this process on ``--device`` with ``--threads`` torch threads.

(a) **commit -> first audio byte, C=1.** omnistep: a uvicorn server of the card
(``QwenOmniOptions``: thinker capped at ``--thinker-tokens``, greedy talker capped at
``--talker-tokens``, the default chunked DiT) driven by the openai SDK's
``client.realtime.connect``: a session (no VAD, audio out, instructions "Be brief.") gets a
``--question-seconds`` clip (24 kHz pcm16), then ``input_audio_buffer.commit`` and
``response.create``; the time from sending the commit to the first
``response.output_audio.delta`` (TTFA) and to ``response.done``. transformers:
``Qwen2_5OmniForConditionalGeneration.generate`` (``tests.qwen_omni_ref.reference``'s model,
float32, eager attention) on the same chat (the card's speech system prompt, "Be brief.", the
user turn holding the same clip resampled to 16 kHz as the session does), greedy talker, the
same caps; ``generate`` returns audio only at its end, so its time to first audio is its whole
time (prompt building and feature extraction included).

(b) **commit -> first audio byte at C=8.** ``--concurrency`` sessions on one server, each
with its own ``--question-seconds`` clip, all committed at once: the p99 of their TTFAs
against (a)'s C=1 TTFA of the same round (target: p99 / p50 <= 3; medians over rounds).

(c) **a second turn's prefill with the session's KV kept vs recomputing the history.** One
session answers a ``--history-seconds`` clip (10 s: a conversation's earlier turns), then the
(a) clip; the thinker's PREFILL calls of the second
turn are timed (seconds, rows computed, rows taken from the prefix cache). Then the very
request the server sent for turn 2 is run again with no ``cache_salt``: the whole history
computed (its audio's encoder rows come from the encoder cache in both runs). Reported: the
kept / recomputed ratio of PREFILL seconds (target <= 0.3) and of rows.

(d) **encoder: 8 concurrent 10 s clips vs 8 sequential.** ``--concurrency`` chat requests,
each with its own ``--clip-seconds`` clip and one thinker token (text only), submitted at once
to an ``AsyncEngine``; then the same number one after another (new clips: the encoder's cache
would answer repeats). Each ``encoder.execute`` call is timed (batch size, seconds). Reported:
the concurrent encoder wall (first ENCODE call start -> last end) against the sequential sum
of ENCODE calls, and both end-to-end walls.

Targets: (a) omnistep TTFA < transformers' time to its first audio (``a_ratio``: the issue
asks <= 0.3); (b) p99 at C=8 <= 3x the C=1 TTFA; (c) kept / recomputed prefill <= 0.3; (d)
concurrent encoder wall < sequential encoder time (the scheduler batches the 8 items into few
forwards).

How to run
----------
::

    .venv/bin/python bench/omni_in.py                                # tiny, 3 rounds
    .venv/bin/python bench/omni_in.py --size audio-full --audio-layers 4 --device cuda

It prints one line per measurement and writes everything to ``bench/results/omni_in.json``
(``--out``), with ``os.getloadavg()`` beside the numbers (wall-clock depends on other load).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import dataclasses
import json
import os
import platform
import socket
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
DEFAULT_ROOT = Path("/tmp/omnistep-omni-in-bench")
DEFAULT_OUT = REPO / "bench" / "results" / "omni_in.json"
MARKER = "omni-in-bench-sizes.json"
API_RATE = 24_000
INSTRUCTIONS = "Be brief."

PARTS = ("a", "b", "c", "d")
SIZES: dict[str, dict[str, Any]] = {
    "tiny": {},
    # the published audio tower's width (Qwen2.5-Omni-7B audio_config), depth from --audio-layers
    "audio-full": {"audio_d_model": 1280, "audio_heads": 20, "audio_ffn": 5120},
    # a wider thinker (Qwen2.5-0.5B-like width, 4 layers), so (c)'s prefill is compute, not
    # per-call overhead
    "thinker-wide": {
        "hidden": 896,
        "heads": 14,
        "kv_heads": 2,
        "intermediate": 4864,
        "layers": 4,
        "mrope_section": (16, 8, 8),
    },
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring); bad values exit with status 2."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--audio-layers", type=int, default=2, help="audio tower depth (audio-full)")
    ap.add_argument("--root", type=Path, default=DEFAULT_ROOT)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--parts", default="a,b,c,d", help="which measurements: a,b,c,d or some")
    ap.add_argument("--question-seconds", type=float, default=3.0)
    ap.add_argument(
        "--history-seconds", type=float, default=10.0, help="(c): the first turn's clip"
    )
    ap.add_argument("--clip-seconds", type=float, default=10.0)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--thinker-tokens", type=int, default=8)
    ap.add_argument("--talker-tokens", type=int, default=64)
    ap.add_argument("--skip-transformers", action="store_true")
    args = ap.parse_args(argv)
    parts = set(args.parts.split(","))
    if not parts or parts - set(PARTS):
        ap.error(f"--parts takes some of {','.join(PARTS)}")
    positive = ("audio_layers", "threads", "rounds", "concurrency", "thinker_tokens")
    if any(getattr(args, name) < 1 for name in positive) or args.talker_tokens < 1:
        ap.error("counts must be >= 1")
    if (
        min(args.question_seconds, args.clip_seconds, args.history_seconds) <= 0
        or max(args.clip_seconds, args.history_seconds) > 300
    ):
        ap.error("clip lengths must be in (0, 300] s (the feature extractor reads 300 s)")
    args.parts = sorted(parts)
    return args


def sizes_of(args: argparse.Namespace):  # noqa: ANN201 - QwenOmniSizes
    """The ``QwenOmniSizes`` of ``--size`` (``--audio-layers`` for ``audio-full``)."""
    from omnistep.models.qwen2_5_omni.tiny import TINY_SIZES

    extra = {"audio_layers": args.audio_layers} if args.size == "audio-full" else {}
    return dataclasses.replace(TINY_SIZES, **SIZES[args.size], **extra)


def ensure_checkpoint(root: Path, sizes) -> bool:  # noqa: ANN001
    """Write the checkpoint of ``sizes`` at ``root`` unless its marker names them; True when
    written."""
    from omnistep.models.qwen2_5_omni.tiny import write_qwen_omni

    want = json.dumps(dataclasses.asdict(sizes), sort_keys=True)
    marker = root / MARKER
    if marker.exists() and marker.read_text() == want:
        return False
    write_qwen_omni(root, sizes, seed=0)
    marker.write_text(want)
    return True


def clip(seconds: float, rate: int, seed: int) -> np.ndarray:
    """A deterministic float32 "speech-like" clip: noise-modulated tones, peak below 0.5."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    tone = np.sin(2 * np.pi * (180 + 40 * seed) * t) * (0.5 + 0.5 * np.sin(2 * np.pi * 3 * t))
    return (0.3 * tone + 0.05 * rng.standard_normal(t.size)).astype(np.float32)


def load_model(args: argparse.Namespace):  # noqa: ANN201 - ModelInstance
    from omnistep.core import ModelInstance
    from omnistep.models.qwen2_5_omni.card import QwenOmniOptions, build_card
    from omnistep.sampling import SamplingRow

    options = QwenOmniOptions(
        kv_cache_gb=0.25,
        thinker_max_new_tokens=args.thinker_tokens,
        talker_max_new_tokens=args.talker_tokens,
        talker_sampling=SamplingRow(temperature=0.0, min_keep=1),
    )
    return ModelInstance.load(build_card(str(args.root), options), device=args.device)


# ----------------------------------------------------------------------------- (a) (b) (c)
@contextlib.asynccontextmanager
async def serving(model):  # noqa: ANN001, ANN201
    """``(openai.AsyncOpenAI client, engine)`` of a fresh in-process uvicorn server of the card."""
    import openai
    import uvicorn

    from omnistep.engine import AsyncEngine
    from omnistep.server import ServerConfig, build_app

    engine = AsyncEngine([model])
    app = build_app(engine, ServerConfig(voices_db=":memory:"))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    task = asyncio.ensure_future(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield openai.AsyncOpenAI(api_key="x", base_url=f"http://127.0.0.1:{port}/v1"), engine
    finally:
        server.should_exit = True
        await task
        await engine.shutdown()


SESSION = {
    "type": "realtime",
    "instructions": INSTRUCTIONS,
    "output_modalities": ["audio"],
    "audio": {"input": {"turn_detection": None}},
}


async def spoken_turn(conn, question: np.ndarray) -> dict[str, Any]:  # noqa: ANN001
    """One turn on an open session: append the clip, commit, ``response.create``; seconds
    from sending the commit to the first audio delta (TTFA) and to ``response.done``."""
    pcm = base64.b64encode((question * 32767).astype("<i2").tobytes()).decode()
    await conn.input_audio_buffer.append(audio=pcm)
    start = time.perf_counter()
    await conn.input_audio_buffer.commit()
    await conn.response.create()
    first, audio_bytes, transcript = None, 0, ""
    async for event in conn:
        if event.type == "response.output_audio.delta":
            first = first or time.perf_counter()
            audio_bytes += len(base64.b64decode(event.delta))
        elif event.type == "response.output_audio_transcript.delta":
            transcript += event.delta
        elif event.type == "error":
            raise RuntimeError(f"realtime error: {event.error.message}")
        elif event.type == "response.done":
            break
    done = time.perf_counter()
    if first is None:
        raise RuntimeError("the response had no audio")
    return {
        "ttfa_s": first - start,
        "total_s": done - start,
        "audio_s": audio_bytes / 2 / API_RATE,
        "transcript": transcript,
    }


async def realtime_ttfa(model, questions: list[np.ndarray]) -> list[dict[str, Any]]:  # noqa: ANN001
    """(a) / (b): one session per clip on one fresh server, all committed at once; each
    session's ``spoken_turn``."""

    async def session(client, question: np.ndarray) -> dict[str, Any]:  # noqa: ANN001
        async with client.realtime.connect(model="qwen2.5-omni") as conn:
            await conn.session.update(session=SESSION)
            return await spoken_turn(conn, question)

    async with serving(model) as (client, _):
        return list(await asyncio.gather(*(session(client, q) for q in questions)))


class PrefillMeter:
    """Times the thinker's PREFILL calls (seconds, rows computed, rows from the cache)."""

    def __init__(self, thinker):  # noqa: ANN001
        self.thinker = thinker
        self.calls: list[float] = []
        self._real = thinker.execute

    def __enter__(self) -> PrefillMeter:
        from omnistep.core import WorkUnitKind

        def timed(kind, payloads):  # noqa: ANN001, ANN202
            start = time.perf_counter()
            out = self._real(kind, payloads)
            if kind is WorkUnitKind.PREFILL:
                self.calls.append(time.perf_counter() - start)
            return out

        self.thinker.execute = timed
        return self

    def __exit__(self, *exc: object) -> None:
        del self.thinker.execute

    def take(self, since: tuple[int, int, int]) -> dict[str, float]:
        """The PREFILL seconds and rows since ``since`` (``mark()``)."""
        calls, rows, cached = since
        return {
            "prefill_s": sum(self.calls[calls:]),
            "prefill_rows": self.thinker.num_prefill_rows - rows,
            "cached_rows": self.thinker.num_cached_rows - cached,
        }

    def mark(self) -> tuple[int, int, int]:
        return len(self.calls), self.thinker.num_prefill_rows, self.thinker.num_cached_rows


async def second_turn(model, first: np.ndarray, second: np.ndarray) -> dict[str, Any]:  # noqa: ANN001
    """(c): a session's second turn with its KV kept (the session's salt), then the same
    request (the server's, recorded) with no salt: the history computed again. The thinker's
    PREFILL seconds and rows of each."""
    thinker = model.components["thinker"]
    sent: list[Any] = []
    async with serving(model) as (client, engine):
        add_request = engine.add_request

        def recording(req, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            sent.append(req)
            return add_request(req, *args, **kwargs)

        engine.add_request = recording
        with PrefillMeter(thinker) as meter:
            async with client.realtime.connect(model="qwen2.5-omni") as conn:
                await conn.session.update(session=SESSION)
                turn1 = await spoken_turn(conn, first)
                mark = meter.mark()
                turn2 = await spoken_turn(conn, second)
                kept = meter.take(mark)
            again = dataclasses.replace(
                sent[-1], cache_salt=None, request_id=f"again-{time.time()}"
            )
            mark = meter.mark()
            async for _ in add_request(again):
                pass
            recomputed = meter.take(mark)
    return {
        "turn1": turn1,
        "turn2": turn2,
        "kept": kept,
        "recomputed": recomputed,
        "rows_ratio": kept["prefill_rows"] / recomputed["prefill_rows"],
        "time_ratio": kept["prefill_s"] / recomputed["prefill_s"],
    }


def transformers_first_audio(args: argparse.Namespace, question: np.ndarray) -> dict[str, float]:
    """transformers' ``generate`` on the session's chat (see the module docstring): seconds
    to its (only) audio, and the audio seconds."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from omnistep.audio.resample import Resampler
    from omnistep.models.qwen2_5_omni.card import SPEECH_SYSTEM_PROMPT
    from tests.qwen_omni_ref import reference

    model, _ = reference.load_reference(args.root)
    resampler = Resampler(API_RATE, 16000, quality="VHQ")
    heard = np.concatenate([resampler.process(question), resampler.flush()])
    messages = [
        {"role": "system", "content": SPEECH_SYSTEM_PROMPT},
        {"role": "system", "content": INSTRUCTIONS},
        {"role": "user", "content": [{"type": "audio"}]},
    ]
    start = time.perf_counter()
    features, mask = reference.mel_features([heard])
    rows = ((int(mask.sum()) - 1) // 2 + 1 - 2) // 2 + 1
    audio_id = model.config.thinker_config.audio_token_index
    ids = [
        i
        for t in reference.prompt_ids(args.root, messages).tolist()
        for i in ([t] * rows if t == audio_id else [t])
    ]
    with reference._run():  # noqa: SLF001 - the reference's no-grad, forked-RNG context
        model.talker.rope_deltas = None
        _, wav = model.generate(
            input_ids=torch.tensor([ids]),
            input_features=features,
            feature_attention_mask=mask,
            speaker="Chelsie",
            thinker_max_new_tokens=args.thinker_tokens,
            talker_max_new_tokens=args.talker_tokens,
            talker_do_sample=False,
            talker_repetition_penalty=1.0,
            talker_eos_token_id=reference.talker_eos_token_ids(args.root),
            use_audio_in_video=False,
        )
    seconds = time.perf_counter() - start
    return {"first_audio_s": seconds, "audio_s": wav.numel() / API_RATE}


# ----------------------------------------------------------------------------- (d)
async def encoder_run(model, clips: list[np.ndarray], concurrent: bool) -> dict[str, Any]:  # noqa: ANN001
    """Chat requests of one clip each (one thinker token, text only), all at once or one
    after another; every ENCODE call timed."""
    from omnistep.core import ChatMessage, MediaItem, MediaKind, Modality, Request, SamplingParams
    from omnistep.engine import AsyncEngine

    encoder = model.components["encoder"]
    real = encoder.execute
    calls: list[tuple[int, float, float]] = []

    def timed(kind, payloads):  # noqa: ANN001, ANN202
        start = time.perf_counter()
        out = real(kind, payloads)
        calls.append((len(payloads), start, time.perf_counter()))
        return out

    def request(i: int, samples: np.ndarray) -> Request:
        item = MediaItem.of(MediaKind.AUDIO, samples, sample_rate=16000, source="clip")
        message = ChatMessage("user", "What is said?", parts=(item, "What is said?"))
        return Request(
            "qwen2.5-omni",
            messages=(message,),
            seed=i,
            sampling=SamplingParams(temperature=0.0, max_new_tokens=1),
            output_modalities=frozenset({Modality.TEXT}),
        )

    async def drain(stream) -> None:  # noqa: ANN001
        async for _ in stream:
            pass

    engine = AsyncEngine([model])
    encoder.execute = timed
    try:
        start = time.perf_counter()
        if concurrent:
            streams = [engine.add_request(request(i, c)) for i, c in enumerate(clips)]
            await asyncio.gather(*(drain(s) for s in streams))
        else:
            for i, c in enumerate(clips):
                await drain(engine.add_request(request(i, c)))
        wall = time.perf_counter() - start
    finally:
        del encoder.execute
        await engine.shutdown()
    return {
        "wall_s": wall,
        "encoder_calls": [n for n, _, _ in calls],
        "encoder_busy_s": sum(b - a for _, a, b in calls),
        "encoder_wall_s": max(b for *_, b in calls) - min(a for _, a, _ in calls),
    }


def median(values: list[float]) -> float:
    return float(np.median(values))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the measurements, print them and write ``--out``; returns the record."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from tests.qwen_omni_ref import reference

    reference.THREADS = args.threads
    sizes = sizes_of(args)
    written = ensure_checkpoint(args.root, sizes)
    model = load_model(args)
    record: dict[str, Any] = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "checkpoint_written": written,
        "sizes": dataclasses.asdict(sizes),
        "host": platform.node(),
        "rounds": [],
    }
    question = clip(args.question_seconds, API_RATE, seed=0)
    questions = [
        clip(args.question_seconds, API_RATE, seed=10 + i) for i in range(args.concurrency)
    ]
    if "a" in args.parts and not args.skip_transformers:
        transformers_first_audio(args, question)  # warm-up (loads the reference model)
    if {"a", "b", "c"} & set(args.parts):
        asyncio.run(realtime_ttfa(model, [question]))  # warm-up
    for rnd in range(args.rounds):
        row: dict[str, Any] = {"load_avg": os.getloadavg()}
        if {"a", "b"} & set(args.parts):
            (row["omnistep_a"],) = asyncio.run(realtime_ttfa(model, [question]))
        if "a" in args.parts:
            if not args.skip_transformers:
                row["transformers_a"] = transformers_first_audio(args, question)
            print(f"round {rnd} (a) omnistep TTFA {row['omnistep_a']['ttfa_s']:.3f} s", end="")
            if "transformers_a" in row:
                print(f", transformers first audio {row['transformers_a']['first_audio_s']:.3f} s")
            else:
                print()
        if "b" in args.parts:
            row["concurrent_b"] = asyncio.run(realtime_ttfa(model, questions))
            ttfas = [r["ttfa_s"] for r in row["concurrent_b"]]
            print(
                f"round {rnd} (b) TTFA at C={args.concurrency}: p50 {median(ttfas):.3f} s, "
                f"p99 {float(np.percentile(ttfas, 99)):.3f} s "
                f"(C=1 {row['omnistep_a']['ttfa_s']:.3f} s)"
            )
        if "c" in args.parts:
            history = clip(args.history_seconds, API_RATE, seed=5)
            row["second_turn_c"] = c = asyncio.run(second_turn(model, history, question))
            print(
                f"round {rnd} (c) second turn's prefill: kept {c['kept']['prefill_rows']} rows "
                f"{c['kept']['prefill_s']:.4f} s vs recomputed {c['recomputed']['prefill_rows']} "
                f"rows {c['recomputed']['prefill_s']:.4f} s (time ratio {c['time_ratio']:.3f})"
            )
        if "d" in args.parts:
            base = 1000 * (rnd + 1)
            clips = [clip(args.clip_seconds, 16000, base + i) for i in range(2 * args.concurrency)]
            row["concurrent_d"] = asyncio.run(encoder_run(model, clips[: args.concurrency], True))
            row["sequential_d"] = asyncio.run(encoder_run(model, clips[args.concurrency :], False))
            c, s = row["concurrent_d"], row["sequential_d"]
            print(
                f"round {rnd} (d) encoder: {args.concurrency} concurrent wall "
                f"{c['encoder_wall_s']:.3f} s (batches {c['encoder_calls']}) vs sequential "
                f"{s['encoder_busy_s']:.3f} s; end-to-end {c['wall_s']:.3f} s vs "
                f"{s['wall_s']:.3f} s"
            )
        record["rounds"].append(row)
    summary: dict[str, Any] = {}
    rounds = record["rounds"]
    if {"a", "b"} & set(args.parts):
        summary["omnistep_ttfa_s"] = median([r["omnistep_a"]["ttfa_s"] for r in rounds])
    if "a" in args.parts and not args.skip_transformers:
        theirs = median([r["transformers_a"]["first_audio_s"] for r in rounds])
        summary["transformers_first_audio_s"] = theirs
        summary["a_ratio"] = summary["omnistep_ttfa_s"] / theirs
        summary["a_met"] = summary["omnistep_ttfa_s"] < theirs
    if "b" in args.parts:
        p99 = median(
            [float(np.percentile([x["ttfa_s"] for x in r["concurrent_b"]], 99)) for r in rounds]
        )
        summary["concurrent_ttfa_p99_s"] = p99
        summary["b_ratio"] = p99 / summary["omnistep_ttfa_s"]
        summary["b_met"] = summary["b_ratio"] <= 3
    if "c" in args.parts:
        turns = [r["second_turn_c"] for r in rounds]
        summary["second_turn_rows_ratio"] = median([t["rows_ratio"] for t in turns])
        summary["second_turn_prefill_ratio"] = median([t["time_ratio"] for t in turns])
        summary["c_met"] = summary["second_turn_prefill_ratio"] <= 0.3
    if "d" in args.parts:
        conc = median([r["concurrent_d"]["encoder_wall_s"] for r in rounds])
        seq = median([r["sequential_d"]["encoder_busy_s"] for r in rounds])
        summary |= {
            "encoder_concurrent_wall_s": conc,
            "encoder_sequential_s": seq,
            "encoder_speedup": seq / conc,
            "d_met": conc < seq,
        }
    record["summary"] = summary
    print(json.dumps(summary, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1, default=str))
    return record


if __name__ == "__main__":
    main()
