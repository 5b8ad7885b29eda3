"""AR decode benchmark: the ``chattts`` card on omnistep vs. the upstream ``chattts`` package.

What it measures
----------------
Both sides run the same FULL-SIZE ChatTTS checkpoint (official sizes, seeded random weights,
~1.2 GB, written once by ``tests.chattts_ref.assets.write_full_size_chattts`` into ``--root`` plus
``asset/spk_stat.pt`` as the tests' fixture writes it), in this process, with the same torch
intra-op thread count (``--threads``, default 2, set with ``torch.set_num_threads``; the thread
count seen inside omnistep's executor thread is recorded too). Every request decodes exactly
``--tokens`` frames (N): omnistep with ``SamplingParams(max_new_tokens=N, min_new_tokens=N)``,
upstream with ``max_new_token=N, min_new_token=N``; both mask EOS before ``min_new_tokens``
(checked at start on the real sampler, and afterwards on every request's frame count).

* **omnistep, in-process.** ``AsyncEngine([ModelInstance.load(build_card(root,
  ChatTTSOptions(...)))])``. For each concurrency level C (``--concurrency``, default 1,4,16)
  a burst submits C requests at once (different short English texts, different seeds, the
  default voice: a speaker drawn from the seed) and streams them to the end. Per burst:
  aggregate decode tokens/s (C * N frames / wall time from the first submit to the last
  chunk; model load and a warm-up burst excluded), and per request the time to first audio
  (TTFA: from its ``add_request`` to its first non-empty audio ``StreamChunk``) and total time.
  C=1 runs ``--repeats`` times (median). The components' ``execute`` calls are timed (kind,
  batch size, seconds) to split the wall time into GPT decode, prefill, vocoder and the rest.
  Then the lowest and highest level again with ``batch_invariant=True`` (its cost), and TTFA at
  C=1 for ``lookahead`` in 8, 16, 32 (other vocoder settings default; ``--repeats`` runs each,
  N = first_chunk + lookahead + 4, which does not change when the first chunk is cut).

* **upstream ``chattts`` 0.2.5** loaded on the same folder with the test shims
  (``tests.chattts_ref.reference.load_upstream_chat``), one random speaker string for all calls:
  ``Chat.infer(text, skip_refine_text=True, split_text=False, params_infer_code=
  InferCodeParams(spk_emb=spk, max_new_token=N, min_new_token=N, show_tqdm=False))``, i.e. the
  code GPT and the Decoder+Vocos on the hidden states (refinement is a separate text-LM pass
  that omnistep's card does not have, and ``split_text`` would call the DVAE encoder, which
  the shims stub): (1) one text, ``--repeats`` times at the start and once at the end (drift
  check); tokens/s = N / wall (end to end, like omnistep's, which includes its vocoder); the
  GPT alone (``Chat._infer_code``) is timed too; (2) its lock-step batch of 8 (a list of 8
  texts in one call); tokens/s = 8 N / wall; (3) ``stream=True`` with the stream defaults
  (``stream_batch`` 24, ``pass_first_n_batches`` 2, with N >= 73 so it cannot end first):
  seconds from the call to the first yielded wav chunk.

Targets
-------
(a) omnistep tok/s at C=1 >= 1.0x upstream single; (b) omnistep aggregate tok/s at C=16 >= 10x
upstream single and >= 2.5x upstream's lock-step batch of 8; (c) omnistep TTFA at C=1 <= 0.25x
upstream's streamed time to first audio. Upstream numbers are medians over their runs. If the
levels do not include 1 or 16, the lowest and highest level stand in.

How to run
----------
::

    .venv/bin/python bench/ar_decode.py                      # C = 1,4,16, N = 128
    .venv/bin/python bench/ar_decode.py --concurrency 1,4,16 --tokens 96 --root /tmp/ckpt

It prints a table and the ratios and writes everything to ``bench/results/ar_decode.json``
(``--out``). Wall-clock numbers depend on other load: ``os.getloadavg()`` is stored with each
measurement.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import logging
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from omnistep.core import ModelInstance, Request, SamplingParams, WorkUnitKind
from omnistep.engine import AsyncEngine
from omnistep.models.chattts.card import ChatTTSOptions, build_card, make_sampling
from omnistep.sampling import sample

REPO = Path(__file__).resolve().parents[1]
DEFAULT_ROOT = Path("/tmp/omnistep-chattts-full")
DEFAULT_OUT = REPO / "bench" / "results" / "ar_decode.json"
UPSTREAM_STREAM_MIN_TOKENS = 3 * 24 + 1  # pass_first_n_batches=2 -> first yield at 72 frames
EOS = 625

TEXTS = (
    "hello world this is a test of the voice",
    "good morning the weather is nice today",
    "thank you for the help with my work",
    "the man came home after a long day",
    "we can read the sentence out loud",
    "my father will write a new part",
    "look at the big picture on the air",
    "she said the water was very hot",
    "they go to the house near the earth",
    "people think the first word is right",
    "give me the name of the old boy",
    "the animal did move through the light",
    "this chat model can speak the text",
    "what kind of thing do you want",
    "small hand and large home at the port",
    "time to show every good line again",
)


def load_avg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _med(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


# ----------------------------------------------------------------------------- checkpoint


def _import_test_helpers() -> None:
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))


def ensure_checkpoint(root: Path) -> dict[str, Any]:
    """The full-size checkpoint at ``root`` (written once; a complete folder is reused)."""
    _import_test_helpers()
    import pybase16384 as b14

    from tests.chattts_ref.assets import INFO_FILE, read_info, write_full_size_chattts

    spk = root / "asset" / "spk_stat.pt"
    if (root / INFO_FILE).exists() and spk.exists():
        return {"written": False, "seconds": 0.0}
    start = time.perf_counter()
    tmp = root.with_name(f"{root.name}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    write_full_size_chattts(tmp)
    stat = np.frombuffer(b14.decode_from_string(read_info(tmp).spk_stat), dtype=np.float16)
    torch.save(torch.from_numpy(stat.copy()), tmp / "asset" / "spk_stat.pt")
    if root.exists():
        shutil.rmtree(root)
    tmp.rename(root)
    return {"written": True, "seconds": round(time.perf_counter() - start, 1)}


def checkpoint_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


# ----------------------------------------------------------------------------- checks


def check_min_new_tokens() -> dict[str, Any]:
    """The card's sampling row on logits where EOS dominates every codebook: EOS must never be
    drawn while ``num_generated < min_new_tokens`` and always be drawn after."""
    build = make_sampling(EOS)
    row = build(Request("chattts", text="x", sampling=SamplingParams(min_new_tokens=10)))
    logits = torch.randn(64, 4, EOS + 1)
    logits[..., EOS] = 50.0
    history = [torch.zeros(4, 0, dtype=torch.long)] * 64
    gens = [torch.Generator().manual_seed(i) for i in range(64)]
    before = sample(logits, [row] * 64, history, [9] * 64, gens).tokens
    after = sample(logits, [row] * 64, history, [10] * 64, gens).tokens
    result = {
        "eos_drawn_before_min": int((before == EOS).sum()),
        "eos_drawn_at_min_of_256": int((after == EOS).sum()),
    }
    result["ok"] = result["eos_drawn_before_min"] == 0 and result["eos_drawn_at_min_of_256"] > 0
    return result


# ----------------------------------------------------------------------------- omnistep


class ExecTimer:
    """Wraps a component's ``execute`` (instance attribute) to log kind, batch and seconds."""

    def __init__(self, name: str, component: Any):
        self.name = name
        self.log: list[tuple[str, int, float]] = []
        self.threads: set[int] = set()
        inner = component.execute

        def execute(kind: WorkUnitKind, payloads: Any) -> Any:
            self.threads.add(torch.get_num_threads())
            start = time.perf_counter()
            out = inner(kind, payloads)
            self.log.append((kind.value, len(payloads), time.perf_counter() - start))
            return out

        component.execute = execute

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for kind in sorted({k for k, _, _ in self.log}):
            rows = [(b, s) for k, b, s in self.log if k == kind]
            out[kind] = {
                "calls": len(rows),
                "units": sum(b for b, _ in rows),
                "seconds": round(sum(s for _, s in rows), 3),
                "ms_per_call": round(1000 * sum(s for _, s in rows) / len(rows), 2),
                "max_batch": max(b for b, _ in rows),
            }
        return out


def load_ours(root: Path, **options: Any) -> tuple[ModelInstance, float, dict[str, ExecTimer]]:
    start = time.perf_counter()
    model = ModelInstance.load(build_card(str(root), ChatTTSOptions(**options)))
    seconds = time.perf_counter() - start
    timers = {name: ExecTimer(name, comp) for name, comp in model.components.items()}
    return model, seconds, timers


async def _burst(engine: AsyncEngine, c: int, tokens: int, seed0: int) -> dict[str, Any]:
    reqs = [
        Request(
            "chattts",
            text=TEXTS[(seed0 + i) % len(TEXTS)],
            seed=seed0 + i,
            sampling=SamplingParams(max_new_tokens=tokens, min_new_tokens=tokens),
        )
        for i in range(c)
    ]
    start = time.perf_counter()
    submitted, streams = [], []
    for r in reqs:
        submitted.append(time.perf_counter())
        streams.append(engine.add_request(r))

    async def consume(i: int) -> dict[str, Any]:
        first = None
        samples = 0
        async for chunk in streams[i]:
            if chunk.audio is not None and chunk.audio.size:
                if first is None:
                    first = time.perf_counter()
                samples += chunk.audio.size
        end = time.perf_counter()
        return {
            "ttfa_s": None if first is None else first - submitted[i],
            "total_s": end - submitted[i],
            "frames": int(streams[i].usage.get("output_tokens", -1)),
            "samples": samples,
        }

    per = await asyncio.gather(*(consume(i) for i in range(c)))
    wall = time.perf_counter() - start
    frames = sum(p["frames"] for p in per)
    ttfa = [p["ttfa_s"] for p in per if p["ttfa_s"] is not None]
    return {
        "concurrency": c,
        "tokens": tokens,
        "wall_s": wall,
        "frames": frames,
        "all_exact": all(p["frames"] == tokens for p in per),
        "tok_s": frames / wall,
        "ttfa_p50_s": _med(ttfa),
        "ttfa_max_s": max(ttfa, default=float("nan")),
        "total_p50_s": _med([p["total_s"] for p in per]),
        "total_max_s": max(p["total_s"] for p in per),
        "requests": per,
        "loadavg": load_avg(),
    }


async def run_ours(
    model: ModelInstance,
    timers: dict[str, ExecTimer],
    plan: list[tuple[int, int, int]],
    warmup_tokens: int,
) -> list[dict[str, Any]]:
    """Warm up, then one burst per ``(C, N, repeats)`` entry of ``plan``."""
    engine = AsyncEngine([model])
    try:
        await _burst(engine, 2, warmup_tokens, 10_000)
        results = []
        seed = 0
        for c, tokens, repeats in plan:
            for _ in range(repeats):
                for t in timers.values():
                    t.log.clear()
                res = await _burst(engine, c, tokens, seed)
                seed += c
                res["exec"] = {n: t.summary() for n, t in timers.items()}
                compute = sum(s for t in timers.values() for _, _, s in t.log)
                res["exec_seconds"] = round(compute, 3)
                res["other_seconds"] = round(res["wall_s"] - compute, 3)
                results.append(res)
                print(
                    f"  ours C={c:<3} N={tokens:<4} wall {res['wall_s']:6.2f}s "
                    f"{res['tok_s']:7.1f} tok/s  TTFA p50 {res['ttfa_p50_s']:.3f}s  "
                    f"load {res['loadavg'][0]}",
                    flush=True,
                )
        return results
    finally:
        await engine.shutdown()


def ours_config(
    root: Path, options: dict[str, Any], plan: list[tuple[int, int, int]], warmup: int
) -> dict[str, Any]:
    model, load_s, timers = load_ours(root, **options)
    print(f"omnistep {options or 'defaults'}: loaded in {load_s:.1f}s", flush=True)
    try:
        bursts = asyncio.run(run_ours(model, timers, plan, warmup))
        threads = sorted(set().union(*(t.threads for t in timers.values())))
    finally:
        del model, timers
        gc.collect()
    return {"options": options, "load_s": round(load_s, 2), "bursts": bursts, "threads": threads}


def _by_c(cfg: dict[str, Any], c: int) -> list[dict[str, Any]]:
    return [b for b in cfg["bursts"] if b["concurrency"] == c]


# ----------------------------------------------------------------------------- upstream


def run_upstream(root: Path, tokens: int, repeats: int) -> dict[str, Any]:
    _import_test_helpers()
    from tests.chattts_ref.reference import load_upstream_chat

    logging.getLogger("tests.chattts_ref.upstream").setLevel(logging.ERROR)
    start = time.perf_counter()
    chat = load_upstream_chat(root, cached=False)
    load_s = time.perf_counter() - start
    print(f"upstream chattts: loaded in {load_s:.1f}s", flush=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        spk = chat.sample_random_speaker()

    def params(n: int) -> Any:
        return chat.InferCodeParams(spk_emb=spk, max_new_token=n, min_new_token=n, show_tqdm=False)

    def infer(text: Any, n: int, stream: bool = False) -> Any:
        return chat.infer(
            text,
            stream=stream,
            skip_refine_text=True,
            split_text=False,
            params_infer_code=params(n),
        )

    def single(tag: str) -> dict[str, Any]:
        t0 = time.perf_counter()
        wavs = infer(TEXTS[0], tokens)
        wall = time.perf_counter() - t0
        res = {
            "tag": tag,
            "wall_s": wall,
            "tok_s": tokens / wall,
            "samples": int(sum(w.size for w in wavs)),
            "loadavg": load_avg(),
        }
        print(
            f"  upstream single ({tag}) N={tokens} wall {wall:6.2f}s {res['tok_s']:7.1f} tok/s "
            f"load {res['loadavg'][0]}",
            flush=True,
        )
        return res

    out: dict[str, Any] = {"load_s": round(load_s, 2), "speaker": "torch seed 0"}
    infer(TEXTS[0], 8)  # warm-up (numba normaliser JIT, first kernels)
    infer(list(TEXTS[:8]), 8)
    out["single"] = [single("start") for _ in range(repeats)]

    gpt = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        with torch.no_grad():
            res = next(chat._infer_code([TEXTS[0]], False, chat.device, True, params(tokens)))
        wall = time.perf_counter() - t0
        assert res.ids[0].shape[0] == tokens, res.ids[0].shape
        gpt.append({"wall_s": wall, "tok_s": tokens / wall, "loadavg": load_avg()})
    out["gpt_only_single"] = gpt
    print(f"  upstream GPT only: {_med([g['tok_s'] for g in gpt]):.1f} tok/s", flush=True)

    t0 = time.perf_counter()
    wavs = infer(list(TEXTS[:8]), tokens)
    wall = time.perf_counter() - t0
    out["batch8"] = {
        "wall_s": wall,
        "tok_s": 8 * tokens / wall,
        "outputs": len(wavs),
        "loadavg": load_avg(),
    }
    print(
        f"  upstream lock-step batch 8: wall {wall:6.2f}s {8 * tokens / wall:7.1f} tok/s",
        flush=True,
    )

    n_stream = max(tokens, UPSTREAM_STREAM_MIN_TOKENS)
    stream = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        gen = infer(TEXTS[0], n_stream, stream=True)
        first = next(gen)
        ttfa = time.perf_counter() - t0
        gen.close()
        stream.append({"ttfa_s": ttfa, "first_samples": int(first.size), "loadavg": load_avg()})
        print(f"  upstream stream TTFA {ttfa:.3f}s", flush=True)
    out["stream"] = {"tokens": n_stream, "runs": stream}
    out["_chat"] = chat
    out["_single"] = single
    return out


# ----------------------------------------------------------------------------- report


def ratio_line(name: str, value: float, op: str, target: float) -> dict[str, Any]:
    ok = value >= target if op == ">=" else value <= target
    print(f"  {name:<58} {value:7.3f}  (target {op} {target})  {'MET' if ok else 'MISSED'}")
    return {"name": name, "value": round(value, 4), "op": op, "target": target, "met": ok}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--root", type=Path, default=DEFAULT_ROOT)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2, help="runs of C=1 and upstream single")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()
    levels = sorted({int(x) for x in args.concurrency.split(",") if x.strip()})
    lo, hi, n = levels[0], levels[-1], args.tokens
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, load {load_avg()}")

    ckpt = ensure_checkpoint(args.root)
    ckpt["bytes"] = checkpoint_bytes(args.root)
    print(f"checkpoint {args.root}: {ckpt}", flush=True)
    eos_check = check_min_new_tokens()
    print(f"min_new_tokens masks EOS: {eos_check}", flush=True)

    defaults = ChatTTSOptions()
    vocoder = {k: getattr(defaults, k) for k in ("first_chunk", "chunk", "left_context")}
    vocoder["lookahead"] = defaults.lookahead

    up = run_upstream(args.root, n, args.repeats)

    warm = defaults.first_chunk + defaults.lookahead + defaults.chunk
    plan = [(c, n, args.repeats if c == 1 else 1) for c in levels]
    ours = ours_config(args.root, {}, plan, warm)
    bi_plan = [(c, n, 1) for c in sorted({lo, hi})]
    ours_bi = ours_config(args.root, {"batch_invariant": True}, bi_plan, warm)
    lookahead = {}
    for la in (8, 16, 32):
        tok = defaults.first_chunk + la + 4
        cfg = ours_config(args.root, {"lookahead": la}, [(1, tok, args.repeats)], tok)
        lookahead[la] = cfg

    up["single"].append(up.pop("_single")("end"))
    del up["_chat"]
    gc.collect()

    # ---------------------------------------------------------------- table
    up_single = _med([r["tok_s"] for r in up["single"]])
    up_gpt = _med([r["tok_s"] for r in up["gpt_only_single"]])
    up_b8 = up["batch8"]["tok_s"]
    up_ttfa = _med([r["ttfa_s"] for r in up["stream"]["runs"]])
    rows = []

    def add(side: str, cfg: str, c: int, bursts: list[dict[str, Any]]) -> None:
        rows.append(
            {
                "side": side,
                "config": cfg,
                "C": c,
                "N": bursts[0]["tokens"],
                "runs": len(bursts),
                "wall_s": _med([b["wall_s"] for b in bursts]),
                "tok_s": _med([b["tok_s"] for b in bursts]),
                "ttfa_p50_s": _med([b["ttfa_p50_s"] for b in bursts]),
                "ttfa_max_s": max(b["ttfa_max_s"] for b in bursts),
                "total_p50_s": _med([b["total_p50_s"] for b in bursts]),
                "load1": bursts[-1]["loadavg"][0],
                "exact_frames": all(b["all_exact"] for b in bursts),
            }
        )

    for c in levels:
        add("omnistep", "default", c, _by_c(ours, c))
    for c in sorted({lo, hi}):
        add("omnistep", "batch_invariant", c, _by_c(ours_bi, c))
    for la, cfg in lookahead.items():
        add("omnistep", f"lookahead={la}", 1, cfg["bursts"])
    nan = float("nan")
    for r in up["single"]:
        rows.append(
            {
                "side": "upstream",
                "config": f"infer single ({r['tag']})",
                "C": 1,
                "N": n,
                "runs": 1,
                "wall_s": r["wall_s"],
                "tok_s": r["tok_s"],
                "ttfa_p50_s": nan,
                "ttfa_max_s": nan,
                "total_p50_s": r["wall_s"],
                "load1": r["loadavg"][0],
                "exact_frames": True,
            }
        )
    rows.append(
        {
            "side": "upstream",
            "config": "_infer_code only",
            "C": 1,
            "N": n,
            "runs": len(up["gpt_only_single"]),
            "wall_s": _med([r["wall_s"] for r in up["gpt_only_single"]]),
            "tok_s": up_gpt,
            "ttfa_p50_s": nan,
            "ttfa_max_s": nan,
            "total_p50_s": nan,
            "load1": up["gpt_only_single"][-1]["loadavg"][0],
            "exact_frames": True,
        }
    )
    rows.append(
        {
            "side": "upstream",
            "config": "infer lock-step batch",
            "C": 8,
            "N": n,
            "runs": 1,
            "wall_s": up["batch8"]["wall_s"],
            "tok_s": up_b8,
            "ttfa_p50_s": nan,
            "ttfa_max_s": nan,
            "total_p50_s": up["batch8"]["wall_s"],
            "load1": up["batch8"]["loadavg"][0],
            "exact_frames": True,
        }
    )
    rows.append(
        {
            "side": "upstream",
            "config": "infer stream=True",
            "C": 1,
            "N": up["stream"]["tokens"],
            "runs": len(up["stream"]["runs"]),
            "wall_s": nan,
            "tok_s": nan,
            "ttfa_p50_s": up_ttfa,
            "ttfa_max_s": max(r["ttfa_s"] for r in up["stream"]["runs"]),
            "total_p50_s": nan,
            "load1": up["stream"]["runs"][-1]["loadavg"][0],
            "exact_frames": True,
        }
    )

    print()
    print(f"vocoder defaults (ChatTTSOptions): {vocoder}; torch threads {args.threads}")
    head = (
        f"{'side':<9} {'config':<24} {'C':>3} {'N':>4} {'runs':>4} {'wall s':>7} "
        f"{'tok/s':>7} {'TTFA p50':>9} {'TTFA max':>9} {'total p50':>9} {'load1':>6}"
    )
    print(head)
    print("-" * len(head))

    def fmt(x: float, spec: str) -> str:
        return "-" if x != x else format(x, spec)

    for r in rows:
        print(
            f"{r['side']:<9} {r['config']:<24} {r['C']:>3} {r['N']:>4} {r['runs']:>4} "
            f"{fmt(r['wall_s'], '7.2f')} {fmt(r['tok_s'], '7.1f')} "
            f"{fmt(r['ttfa_p50_s'], '9.3f')} {fmt(r['ttfa_max_s'], '9.3f')} "
            f"{fmt(r['total_p50_s'], '9.2f')} {r['load1']:>6}"
        )

    ours_lo = _med([b["tok_s"] for b in _by_c(ours, lo)])
    ours_hi = _med([b["tok_s"] for b in _by_c(ours, hi)])
    ours_ttfa = _med([b["ttfa_p50_s"] for b in _by_c(ours, lo)])
    print()
    print("targets:")
    ratios = [
        ratio_line(f"(a) ours C={lo} tok/s / upstream single", ours_lo / up_single, ">=", 1.0),
        ratio_line(f"(b) ours C={hi} tok/s / upstream single", ours_hi / up_single, ">=", 10.0),
        ratio_line(
            f"(b) ours C={hi} tok/s / upstream lock-step batch 8", ours_hi / up_b8, ">=", 2.5
        ),
        ratio_line(f"(c) ours TTFA C={lo} / upstream stream TTFA", ours_ttfa / up_ttfa, "<=", 0.25),
    ]
    bi_cost = {}
    for c in sorted({lo, hi}):
        base = _med([b["tok_s"] for b in _by_c(ours, c)])
        bi = _med([b["tok_s"] for b in _by_c(ours_bi, c)])
        bi_cost[c] = {"default_tok_s": base, "batch_invariant_tok_s": bi, "slowdown": base / bi}
        print(
            f"  batch_invariant at C={c}: {bi:.1f} vs {base:.1f} tok/s -> {base / bi:.2f}x slower"
        )
    print(
        f"  GPT only at C={lo}: ours {_gpt_tok_s(_by_c(ours, lo)):.1f} tok/s, upstream {up_gpt:.1f}"
    )
    elapsed = time.perf_counter() - t_start
    print(f"load average now {load_avg()}; bench took {elapsed:.0f}s")

    result = {
        "machine": {
            "platform": platform.platform(),
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "cpus": os.cpu_count(),
            "torch_threads": args.threads,
            "omnistep_executor_threads": {
                "default": ours["threads"],
                "batch_invariant": ours_bi["threads"],
            },
        },
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "checkpoint": {"root": str(args.root), **ckpt},
        "min_new_tokens_check": eos_check,
        "vocoder_defaults": vocoder,
        "omnistep": {
            "default": ours,
            "batch_invariant": ours_bi,
            "lookahead": {str(k): v for k, v in lookahead.items()},
        },
        "upstream": up,
        "table": rows,
        "targets": ratios,
        "batch_invariant_cost": {str(k): v for k, v in bi_cost.items()},
        "seconds": round(elapsed, 1),
        "loadavg_end": load_avg(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(_jsonable(result), indent=1))
    print(f"wrote {args.out}")


def _gpt_tok_s(bursts: list[dict[str, Any]]) -> float:
    """Frames per second of GPT compute alone (prefill + decode calls) over the bursts."""
    frames = sum(b["frames"] for b in bursts)
    seconds = sum(
        v["seconds"] for b in bursts for k, v in b["exec"]["gpt"].items() if k != "audio_chunk"
    )
    return frames / seconds if seconds else float("nan")


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    if isinstance(x, float) and x != x:
        return None
    if dataclasses.is_dataclass(x):
        return _jsonable(dataclasses.asdict(x))
    return x


if __name__ == "__main__":
    main()
