"""AR decode benchmark: the ``chattts`` card on omnistep vs. the upstream ``chattts`` package.

What it measures
----------------
Both sides run the same FULL-SIZE ChatTTS checkpoint (official sizes, seeded random weights,
~1.2 GB, written once by ``omnistep.models.chattts.tiny.write_full_size_chattts`` into ``--root``:
the official file set, no ``asset/spk_stat.pt``, so both sides draw speakers from chattts
0.2.5's statistics), in this process, one side at a time,
with the same torch intra-op thread count (``--threads``, default 2, set once with
``torch.set_num_threads``; the count seen inside omnistep's executor threads is recorded).
Every request decodes exactly ``--tokens`` frames (N): omnistep with
``SamplingParams(max_new_tokens=N, min_new_tokens=N)``, upstream with ``max_new_token=N,
min_new_token=N``. Both mask EOS while fewer than ``min_new_tokens`` frames exist (checked at
start on omnistep's real sampling row, and on every request's frame count afterwards).

* **omnistep, in-process.** ``AsyncEngine([ModelInstance.load(build_card(root,
  ChatTTSOptions(...)))])`` with the default ``EngineConfig`` (recorded). A burst of C submits
  C requests at once (different short English texts and seeds, the default voice: a speaker
  drawn from the seed) and streams them to the end. Per burst: aggregate decode tokens/s
  (C * N frames / wall time from the first submit to the last chunk; model load and warm-up
  excluded), per request the time to first audio (TTFA: from its ``add_request`` to its first
  non-empty audio ``StreamChunk``) and total time, the process CPU seconds, and each
  component's ``execute`` calls (kind, batch, seconds; GPT and vocoder may overlap on the
  engine's worker threads, so busy time is reported per component and as a union).
* **upstream ``chattts`` 0.2.5**, loaded on the same folder with the test shims
  (``tests.chattts_ref.reference.load_upstream_chat``), one random speaker string for all calls,
  ``Chat.infer(texts, skip_refine_text=True, split_text=False, params_infer_code=
  InferCodeParams(spk_emb=spk, max_new_token=N, min_new_token=N, show_tqdm=False))``: the code
  GPT, then Decoder+Vocos on its hidden states, like omnistep's card (whose refine-text stage
  is off by default; ``split_text`` would call the DVAE encoder, which the shims stub out).
  Single request: tokens/s = N / wall, end to end (omnistep's numbers include its vocoder too);
  the GPT alone (``Chat._infer_code``) once for reference. Lock-step batch: a list of 8 texts in
  one call, 8 N / wall. Streaming: ``stream=True`` with upstream's stream defaults
  (``stream_batch`` 24, ``pass_first_n_batches`` 2; N >= 73 so it cannot end first): seconds
  from the call to the first yielded wav chunk.

* **GEMM floor.** Once per round, the GPT backbone's 140 weight GEMMs (every ``nn.Linear`` of the
  20 layers) alone, on 1, 8 and C_max input rows: milliseconds per decode step that no runtime
  using these fp32 kernels can beat, hence a ceiling on tokens/s at a given batch.

Order: the machine is shared, so the comparisons run in ``--rounds`` rounds (default 2), each
``upstream single, ours C=lowest, upstream stream TTFA, ours C=<other levels>, upstream batch of
8`` (levels that no target uses, e.g. C=4, only in the first round); "paired" ratios compare
numbers of the same round. Then ``batch_invariant=True`` at the lowest and highest level, and
TTFA at C=1 for ``lookahead`` in 8, 16, 32 (other settings default; N = first_chunk + lookahead
+ 4 frames, which does not change when the first chunk is cut), each ``--rounds`` times; a last
upstream single run closes (a drift check, not part of the medians).

Targets
-------
(a) omnistep tok/s at C=1 >= 1.0x upstream single; (b) omnistep aggregate tok/s at C=16 >= 10x
upstream single and >= 2.5x upstream's lock-step batch of 8; (c) omnistep TTFA at C=1 <= 0.25x
upstream's streamed time to first audio. Headline ratios are medians over the rounds of each
side; the paired (same-round) ratios are printed beside them. If the levels do not include 1
or 16, the lowest and highest level stand in.

Device (``--device``, default ``cpu``): ``cuda`` loads omnistep's components there
(``ModelInstance.load(card, device)``, as ``omnistep serve --device cuda``) and upstream's
``Chat`` too (``Chat.load(device=...)``); the GEMM floor runs on it, and every timed interval
ends (upstream's and the floor's also begin) after ``torch.cuda.synchronize``
(``bench/device_timing.py``). ``bench/gpu.sh`` runs this on a lent GPU. ``--size tiny`` uses
the servable tiny checkpoint (GPT width 768, 2 layers) instead: seconds, for dry runs and tests.

How to run
----------
::

    .venv/bin/python bench/ar_decode.py                      # C = 1,4,16, N = 128, 2 rounds
    .venv/bin/python bench/ar_decode.py --concurrency 1,4,16 --tokens 96 --root /tmp/ckpt
    .venv/bin/python bench/ar_decode.py --device cuda --concurrency 1,16 --tokens 96

It prints a table and the ratios and writes everything to ``bench/results/ar_decode.json``
(``--out``). Wall-clock numbers depend on other load on the machine: ``os.getloadavg()`` and
the process CPU time are stored with each measurement.
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
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from omnistep.core import ModelInstance, Request, SamplingParams, WorkUnitKind
from omnistep.engine import AsyncEngine
from omnistep.models.chattts.card import ChatTTSOptions, build_card, make_sampling
from omnistep.sampling import sample

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    call_summary,
    fmt,
    jsonable,
    load_avg,
    median,
    timed_streams,
    union_seconds,
)
from device_timing import DEVICES, device_info, now, resolve_device  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEFAULT_ROOT = Path("/tmp/omnistep-chattts-full")
#: ``--size`` -> the checkpoint writer of ``omnistep.models.chattts.tiny`` and its default folder:
#: ``full`` the official sizes (~1.2 GB); ``tiny`` the servable tiny one (GPT width 768, so the
#: shipped speaker statistics and every voice apply, 2 layers; ~40 MB): quick runs and tests.
SIZES = {
    "full": ("write_full_size_chattts", DEFAULT_ROOT),
    "tiny": ("write_servable_tiny_chattts", Path("/tmp/omnistep-chattts-servable-tiny")),
}
DEFAULT_OUT = REPO / "bench" / "results" / "ar_decode.json"
UPSTREAM_STREAM_MIN_TOKENS = 3 * 24 + 1  # pass_first_n_batches=2 -> first yield at 72 frames
UPSTREAM_BATCH = 8
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


# ----------------------------------------------------------------------------- checkpoint


def _import_test_helpers() -> None:
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))


def ensure_checkpoint(root: Path, size: str = "full") -> dict[str, Any]:
    """The checkpoint of ``size`` (a ``SIZES`` key) at ``root`` (written once; a complete
    folder is reused, whatever size it holds)."""
    _import_test_helpers()
    from omnistep.models.chattts import tiny as assets
    from omnistep.models.chattts.tiny import info_path

    write = getattr(assets, SIZES[size][0])

    # the info file is moved beside the folder last; an older cache (info inside) is rewritten
    if info_path(root).exists():
        return {"written": False, "seconds": 0.0}
    start = time.perf_counter()
    tmp = root.with_name(f"{root.name}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    write(tmp)
    if root.exists():
        shutil.rmtree(root)
    tmp.rename(root)
    info_path(tmp).rename(info_path(root))
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
    """Wraps a component's ``execute`` (an instance attribute, so nested calls such as the
    batch-invariant vocoder's per-row calls are logged too) to log kind, batch and interval.

    On CUDA the interval ends after ``torch.cuda.synchronize`` (``device_timing.now``): a call's
    kernels are counted in its own interval. Both ChatTTS components read their results back to
    the host before returning, so this waits for nothing more in practice; the start is not
    synchronised, which would wait for the other component's kernels (the engine runs them on
    worker threads)."""

    def __init__(self, name: str, component: Any, device: torch.device | str = "cpu"):
        self.name = name
        self.device = torch.device(device)
        self.log: list[tuple[str, int, float, float, int]] = []
        self.threads: set[int] = set()
        self.depth = 0
        inner = component.execute

        def execute(kind: WorkUnitKind, payloads: Any) -> Any:
            self.threads.add(torch.get_num_threads())
            self.depth += 1
            start = time.perf_counter()
            try:
                return inner(kind, payloads)
            finally:
                self.depth -= 1
                end = now(self.device)
                self.log.append((kind.value, len(payloads), start, end, self.depth))

        component.execute = execute

    def outer(self) -> list[tuple[str, int, float, float]]:
        """Top-level calls only: ``(kind, batch, start, end)``."""
        return [(k, b, s, e) for k, b, s, e, d in self.log if d == 0]

    def summary(self) -> dict[str, Any]:
        """``call_summary`` of the top-level calls."""
        return call_summary(self.outer())


def floor_reps(device: torch.device | str) -> int:
    """Timed repetitions of a GEMM floor: 3 on the CPU (tens of ms each), 50 on CUDA (a step's
    GEMMs take well under a millisecond there, so more are averaged)."""
    return 50 if torch.device(device).type == "cuda" else 3


class Ours:
    """One loaded omnistep model with its engine (all bursts run on one event loop), its
    components on ``device`` (``ModelInstance.load``, as ``omnistep serve --device``)."""

    def __init__(self, root: Path, options: dict[str, Any], device: str = "cpu"):
        self.options = options
        self.device = torch.device(device)
        start = time.perf_counter()
        card = build_card(str(root), ChatTTSOptions(**options))
        self.model = ModelInstance.load(card, device=str(self.device))
        self.load_s = now(self.device) - start
        self.timers = {n: ExecTimer(n, c, self.device) for n, c in self.model.components.items()}
        self.engine = AsyncEngine([self.model])
        self.seed = 0
        print(
            f"omnistep {options or 'defaults'} on {self.device}: loaded in {self.load_s:.1f}s",
            flush=True,
        )

    def gemm_floor(self, rows: int, reps: int | None = None) -> dict[str, Any]:
        """Milliseconds per decode step of the GPT backbone's weight GEMMs alone (every
        ``nn.Linear`` of the Llama stack, ``rows`` input rows, cold weights as in decoding),
        on the model's device (CUDA: synchronised before and after the timed loop): a floor
        for one AR_TOKEN step of ``rows`` sequences, on either side. ``reps``: default
        ``floor_reps(device)``."""
        reps = reps or floor_reps(self.device)
        llama = self.model.components["gpt"].llama
        linears = [m for m in llama.modules() if isinstance(m, torch.nn.Linear)]
        xs = {
            m.in_features: torch.randn(
                rows, m.in_features, device=m.weight.device, dtype=m.weight.dtype
            )
            for m in linears
        }
        with torch.inference_mode():
            for m in linears:
                torch.nn.functional.linear(xs[m.in_features], m.weight)
            start = now(self.device)
            for _ in range(reps):
                for m in linears:
                    torch.nn.functional.linear(xs[m.in_features], m.weight)
            ms = 1000 * (now(self.device) - start) / reps
        return {
            "rows": rows,
            "ms_per_step": ms,
            "gemms": len(linears),
            "reps": reps,
            "device": str(self.device),
            "loadavg": load_avg(),
        }

    def info(self) -> dict[str, Any]:
        return {
            "options": self.options,
            "device": str(self.device),
            "load_s": round(self.load_s, 2),
            "engine_config": dataclasses.asdict(self.engine.config),
            "executor_torch_threads": sorted(
                set().union(*(t.threads for t in self.timers.values()))
            ),
        }

    async def close(self) -> None:
        await self.engine.shutdown()
        # The engine's step loop leaves its pending ``Event.wait`` waiter behind after
        # shutdown; cancel it here rather than let it be garbage-collected while pending.
        leftovers = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in leftovers:
            task.cancel()
        await asyncio.gather(*leftovers, return_exceptions=True)
        del self.engine, self.model, self.timers
        gc.collect()

    async def burst(
        self, c: int, tokens: int, tag: str = "", quiet: bool = False
    ) -> dict[str, Any]:
        for t in self.timers.values():
            t.log.clear()
        cpu0 = time.process_time()
        res = await self._burst(c, tokens)
        res["cpu_s"] = time.process_time() - cpu0
        res["cpu_ms_per_token"] = 1000 * res["cpu_s"] / max(res["frames"], 1)
        res["tag"] = tag
        res["exec"] = {n: t.summary() for n, t in self.timers.items()}
        calls = {n: [(s, e) for _, _, s, e in t.outer()] for n, t in self.timers.items()}
        busy = union_seconds([iv for ivs in calls.values() for iv in ivs])
        res["busy_s"] = {n: round(union_seconds(ivs), 3) for n, ivs in calls.items()}
        res["busy_s"]["any"] = round(busy, 3)
        res["idle_s"] = round(res["wall_s"] - busy, 3)  # no component running
        res["overlap_s"] = round(sum(res["busy_s"][n] for n in calls) - busy, 3)
        if not quiet:
            gpt = res["exec"].get("gpt", {}).get("ar_token", {})
            print(
                f"  ours {tag:<18} C={c:<3} N={tokens:<4} wall {res['wall_s']:6.2f}s "
                f"{res['tok_s']:6.1f} tok/s  TTFA p50 {res['ttfa_p50_s']:6.3f}s  "
                f"GPT step {gpt.get('ms_per_call', float('nan')):6.1f} ms  "
                f"cpu {res['cpu_ms_per_token']:5.0f} ms/tok  load {res['loadavg'][0]}",
                flush=True,
            )
        return res

    async def _burst(self, c: int, tokens: int) -> dict[str, Any]:
        seed0, self.seed = self.seed, self.seed + c
        reqs = [
            Request(
                "chattts",
                text=TEXTS[(seed0 + i) % len(TEXTS)],
                seed=seed0 + i,
                sampling=SamplingParams(max_new_tokens=tokens, min_new_tokens=tokens),
            )
            for i in range(c)
        ]
        start, timed = await timed_streams(self.engine, reqs)
        per = [
            {
                "ttfa_s": t.ttfa_s,
                "total_s": t.total_s,
                "frames": int(t.stream.usage.get("output_tokens", -1)),
                "samples": t.samples,
            }
            for t in timed
        ]
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
            "ttfa_p50_s": median(ttfa),
            "ttfa_max_s": max(ttfa, default=float("nan")),
            "total_p50_s": median([p["total_s"] for p in per]),
            "total_max_s": max(p["total_s"] for p in per),
            "requests": per,
            "loadavg": load_avg(),
        }


# ----------------------------------------------------------------------------- upstream


class Upstream:
    """Upstream ``ChatTTS.Chat`` on the same checkpoint (see module docstring), loaded on
    ``device`` (``Chat.load(device=...)``: its GPT, embeddings, decoder and Vocos all go there
    for ``cpu`` and ``cuda``)."""

    def __init__(self, root: Path, tokens: int, device: str = "cpu"):
        _import_test_helpers()
        from tests.chattts_ref.reference import load_upstream_chat

        logging.getLogger("tests.chattts_ref.upstream").setLevel(logging.ERROR)
        self.device = torch.device(device)
        start = time.perf_counter()
        self.chat = load_upstream_chat(root, cached=False, device=self.device)
        self.load_s = now(self.device) - start
        self.tokens = tokens
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.spk = self.chat.sample_random_speaker()
        print(f"upstream chattts on {self.device}: loaded in {self.load_s:.1f}s", flush=True)

    def params(self, n: int) -> Any:
        return self.chat.InferCodeParams(
            spk_emb=self.spk, max_new_token=n, min_new_token=n, show_tqdm=False
        )

    def infer(self, text: Any, n: int, stream: bool = False) -> Any:
        return self.chat.infer(
            text,
            stream=stream,
            skip_refine_text=True,
            split_text=False,
            params_infer_code=self.params(n),
        )

    def warmup(self) -> None:
        self.infer(TEXTS[0], 8)  # numba normaliser JIT, first kernels
        self.infer(list(TEXTS[:UPSTREAM_BATCH]), 8)

    def _timed(self, name: str, fn: Any, frames: int) -> dict[str, Any]:
        cpu0, t0 = time.process_time(), now(self.device)
        extra = fn()
        wall = now(self.device) - t0
        res = {
            "wall_s": wall,
            "tok_s": frames / wall,
            "frames": frames,
            "cpu_s": time.process_time() - cpu0,
            "loadavg": load_avg(),
            **extra,
        }
        res["cpu_ms_per_token"] = 1000 * res["cpu_s"] / frames
        print(
            f"  upstream {name:<24} N={self.tokens:<4} wall {wall:6.2f}s {res['tok_s']:6.1f} "
            f"tok/s  cpu {res['cpu_ms_per_token']:5.0f} ms/tok  load {res['loadavg'][0]}",
            flush=True,
        )
        return res

    def single(self) -> dict[str, Any]:
        def run() -> dict[str, Any]:
            wavs = self.infer(TEXTS[0], self.tokens)
            return {"samples": int(sum(w.size for w in wavs))}

        return self._timed("single (infer)", run, self.tokens)

    def gpt_only(self) -> dict[str, Any]:
        def run() -> dict[str, Any]:
            chat = self.chat
            with torch.no_grad():
                gen = chat._infer_code(
                    [TEXTS[0]], False, chat.device, True, self.params(self.tokens)
                )
                out = next(gen)
            if out.ids[0].shape[0] != self.tokens:
                raise RuntimeError(f"upstream decoded {out.ids[0].shape[0]} frames")
            return {}

        return self._timed("single (_infer_code)", run, self.tokens)

    def batch(self) -> dict[str, Any]:
        def run() -> dict[str, Any]:
            wavs = self.infer(list(TEXTS[:UPSTREAM_BATCH]), self.tokens)
            return {"outputs": len(wavs)}

        return self._timed(f"lock-step batch {UPSTREAM_BATCH}", run, UPSTREAM_BATCH * self.tokens)

    def stream_ttfa(self) -> dict[str, Any]:
        n = max(self.tokens, UPSTREAM_STREAM_MIN_TOKENS)
        t0 = now(self.device)
        gen = self.infer(TEXTS[0], n, stream=True)
        first = next(gen)
        ttfa = now(self.device) - t0
        gen.close()
        res = {"ttfa_s": ttfa, "tokens": n, "first_samples": int(first.size), "loadavg": load_avg()}
        print(f"  upstream stream=True             TTFA {ttfa:6.3f}s  load {res['loadavg'][0]}")
        return res


class NoUpstream:
    """Stands in for ``Upstream`` when it could not load (its error is in the JSON): every
    figure is NaN (null in the JSON), so omnistep's own figures are still measured and the
    ratios to upstream read NaN / MISSED."""

    load_s = float("nan")

    def __init__(self, tokens: int):
        self.tokens = tokens

    def _nan(self, frames: int) -> dict[str, Any]:
        nan = float("nan")
        return {
            "wall_s": nan,
            "tok_s": nan,
            "frames": frames,
            "cpu_s": nan,
            "cpu_ms_per_token": nan,
            "loadavg": load_avg(),
        }

    def single(self) -> dict[str, Any]:
        return self._nan(self.tokens)

    def gpt_only(self) -> dict[str, Any]:
        return self._nan(self.tokens)

    def batch(self) -> dict[str, Any]:
        return self._nan(UPSTREAM_BATCH * self.tokens)

    def stream_ttfa(self) -> dict[str, Any]:
        n = max(self.tokens, UPSTREAM_STREAM_MIN_TOKENS)
        return {"ttfa_s": float("nan"), "tokens": n, "first_samples": 0, "loadavg": load_avg()}


# ----------------------------------------------------------------------------- driver


def section_error(name: str, exc: BaseException) -> dict[str, str]:
    """``{"error": ..., "traceback": ...}`` of a failed bench section, printed to stderr too."""
    tb = traceback.format_exc(limit=-8)
    print(f"bench section {name} FAILED: {exc!r}\n{tb}", file=sys.stderr, flush=True)
    return {"error": f"{type(exc).__name__}: {exc}", "traceback": tb}


async def run_all(args: argparse.Namespace, levels: list[int]) -> dict[str, Any]:
    n, lo, hi = args.tokens, levels[0], levels[-1]
    defaults = ChatTTSOptions()
    warm = defaults.first_chunk + defaults.lookahead + defaults.chunk
    up_error = None
    try:
        up: Upstream | NoUpstream = Upstream(args.root, n, args.device)
        up.warmup()
    except Exception as exc:  # omnistep's figures are still measured
        up_error = section_error("upstream", exc)
        up = NoUpstream(n)
    ours = Ours(args.root, {}, args.device)
    await ours.burst(2, warm, quiet=True)  # warm-up
    out: dict[str, Any] = {"upstream": {"load_s": round(up.load_s, 2)}, "rounds": []}
    if up_error is not None:
        out["upstream"].update(up_error)
    out["upstream"]["gpt_only"] = up.gpt_only()
    for r in range(args.rounds):
        print(f"round {r + 1}/{args.rounds}", flush=True)
        rnd: dict[str, Any] = {"ours": {}}
        rnd["upstream_single"] = up.single()
        rnd["ours"][str(lo)] = await ours.burst(lo, n, f"round {r + 1}")
        rnd["upstream_stream"] = up.stream_ttfa()
        for c in levels[1:]:
            if c == hi or r == 0:  # levels that no target uses: first round only
                rnd["ours"][str(c)] = await ours.burst(c, n, f"round {r + 1}")
        rnd["upstream_batch"] = up.batch()
        rnd["gemm_floor"] = {str(m): ours.gemm_floor(m) for m in sorted({1, UPSTREAM_BATCH, hi})}
        print(
            "  GPT weight-GEMM floor per step: "
            + ", ".join(
                f"{m} rows {g['ms_per_step']:.3g} ms" for m, g in rnd["gemm_floor"].items()
            ),
            flush=True,
        )
        out["rounds"].append(rnd)
    out["omnistep_default"] = ours.info()
    await ours.close()

    # The sections below are secondary: one that fails (a first run on a new device) is
    # recorded with its error and the others, and the report, still run.
    try:
        bi = Ours(args.root, {"batch_invariant": True}, args.device)
        await bi.burst(2, warm, quiet=True)
        out["batch_invariant"] = {
            **bi.info(),
            "bursts": {str(c): await bi.burst(c, n, "batch_invariant") for c in sorted({lo, hi})},
        }
        await bi.close()
    except Exception as exc:
        out["batch_invariant"] = section_error("batch_invariant", exc)

    out["lookahead"] = {}
    for la in (8, 16, 32):
        tok = defaults.first_chunk + la + 4
        try:
            m = Ours(args.root, {"lookahead": la}, args.device)
            await m.burst(1, tok, quiet=True)
            runs = [await m.burst(1, tok, f"lookahead={la}") for _ in range(args.rounds)]
            out["lookahead"][str(la)] = {**m.info(), "bursts": runs}
            await m.close()
        except Exception as exc:
            out["lookahead"][str(la)] = section_error(f"lookahead={la}", exc)

    out["upstream"]["single_end"] = up.single()
    del up
    gc.collect()
    return out


# ----------------------------------------------------------------------------- report


def ratio_line(name: str, value: float, op: str, target: float, paired: list[float]) -> dict:
    ok = value >= target if op == ">=" else value <= target
    pair = ", ".join(f"{p:.2f}" for p in paired)
    print(
        f"  {name:<52} {value:7.3f}  (target {op} {target:<4}) {'MET   ' if ok else 'MISSED'}"
        f"  paired by round: {pair}"
    )
    return {
        "name": name,
        "value": round(value, 4),
        "op": op,
        "target": target,
        "met": ok,
        "paired": [round(p, 4) for p in paired],
    }


def _row(side: str, config: str, c: int, runs: list[dict[str, Any]]) -> dict[str, Any]:
    nan = float("nan")

    def med(key: str) -> float:
        return median([r[key] for r in runs if r.get(key) is not None])

    return {
        "side": side,
        "config": config,
        "C": c,
        "N": runs[0].get("tokens", runs[0].get("frames", 0) // max(c, 1)),
        "runs": len(runs),
        "wall_s": med("wall_s") if "wall_s" in runs[0] else nan,
        "tok_s": med("tok_s") if "tok_s" in runs[0] else nan,
        "ttfa_p50_s": med("ttfa_p50_s") if "ttfa_p50_s" in runs[0] else med("ttfa_s"),
        "cpu_ms_per_token": med("cpu_ms_per_token") if "cpu_ms_per_token" in runs[0] else nan,
        "load1": max(r["loadavg"][0] for r in runs),
        "exact_frames": all(r.get("all_exact", True) for r in runs),
    }


def report(args: argparse.Namespace, levels: list[int], res: dict[str, Any]) -> dict[str, Any]:
    n, lo, hi = args.tokens, levels[0], levels[-1]
    rounds = res["rounds"]
    up = res["upstream"]
    ours_by_c = {c: [r["ours"][str(c)] for r in rounds if str(c) in r["ours"]] for c in levels}
    up_single = [r["upstream_single"] for r in rounds]
    up_batch = [r["upstream_batch"] for r in rounds]
    up_stream = [r["upstream_stream"] for r in rounds]

    rows = [_row("omnistep", "default", c, ours_by_c[c]) for c in levels]
    rows += [
        _row("omnistep", "batch_invariant", int(c), [b])
        for c, b in res["batch_invariant"].get("bursts", {}).items()
    ]
    rows += [
        _row("omnistep", f"lookahead={la}", 1, v["bursts"])
        for la, v in res["lookahead"].items()
        if "bursts" in v
    ]
    for i, s in enumerate([*up_single, up["single_end"]]):
        s["tokens"] = n
        tag = "end: drift check" if i == len(up_single) else f"round {i + 1}"
        rows.append(_row("upstream", f"single ({tag})", 1, [s]))
    up["gpt_only"]["tokens"] = n
    rows.append(_row("upstream", "_infer_code only", 1, [up["gpt_only"]]))
    for b in up_batch:
        b["tokens"] = n
    rows.append(_row("upstream", f"infer batch {UPSTREAM_BATCH}", UPSTREAM_BATCH, up_batch))
    rows.append(_row("upstream", "infer stream=True", 1, up_stream))

    print()
    defaults = ChatTTSOptions()
    vocoder = {
        k: getattr(defaults, k)
        for k in ("first_chunk", "chunk", "chunk_growth", "max_chunk", "left_context")
    }
    vocoder["lookahead"] = defaults.lookahead
    print(
        f"vocoder defaults (ChatTTSOptions): {vocoder}; torch.set_num_threads({args.threads}); "
        f"engine {res['omnistep_default']['engine_config']}"
    )
    head = (
        f"{'side':<9} {'config':<26} {'C':>3} {'N':>4} {'runs':>4} {'wall s':>7} {'tok/s':>7} "
        f"{'TTFA p50':>9} {'cpu ms/tok':>10} {'load1 max':>9}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['side']:<9} {r['config']:<26} {r['C']:>3} {r['N']:>4} {r['runs']:>4} "
            f"{fmt(r['wall_s'], '7.2f')} {fmt(r['tok_s'], '7.1f')} "
            f"{fmt(r['ttfa_p50_s'], '9.3f')} {fmt(r['cpu_ms_per_token'], '10.0f')} "
            f"{r['load1']:>9}"
        )

    single = median([s["tok_s"] for s in up_single])
    batch = median([b["tok_s"] for b in up_batch])
    ttfa = median([s["ttfa_s"] for s in up_stream])
    ours_lo = median([b["tok_s"] for b in ours_by_c[lo]])
    ours_hi = median([b["tok_s"] for b in ours_by_c[hi]])
    ours_ttfa = median([b["ttfa_p50_s"] for b in ours_by_c[lo]])

    def paired(fn: Any) -> list[float]:
        return [fn(r) for r in rounds]

    print()
    print("targets (headline = medians over the rounds; paired = same round):")
    targets = [
        ratio_line(
            f"(a) ours C={lo} tok/s / upstream single",
            ours_lo / single,
            ">=",
            1.0,
            paired(lambda r: r["ours"][str(lo)]["tok_s"] / r["upstream_single"]["tok_s"]),
        ),
        ratio_line(
            f"(b) ours C={hi} tok/s / upstream single",
            ours_hi / single,
            ">=",
            10.0,
            paired(lambda r: r["ours"][str(hi)]["tok_s"] / r["upstream_single"]["tok_s"]),
        ),
        ratio_line(
            f"(b) ours C={hi} tok/s / upstream batch {UPSTREAM_BATCH}",
            ours_hi / batch,
            ">=",
            2.5,
            paired(lambda r: r["ours"][str(hi)]["tok_s"] / r["upstream_batch"]["tok_s"]),
        ),
        ratio_line(
            f"(c) ours TTFA C={lo} / upstream stream TTFA",
            ours_ttfa / ttfa,
            "<=",
            0.25,
            paired(lambda r: r["ours"][str(lo)]["ttfa_p50_s"] / r["upstream_stream"]["ttfa_s"]),
        ),
    ]
    bi_cost = {}
    for c, b in res["batch_invariant"].get("bursts", {}).items():
        base = median([x["tok_s"] for x in ours_by_c[int(c)]])
        base_cpu = median([x["cpu_ms_per_token"] for x in ours_by_c[int(c)]])
        bi_cost[c] = {
            "default_tok_s": base,
            "batch_invariant_tok_s": b["tok_s"],
            "slowdown": base / b["tok_s"],
            "cpu_ms_per_token_default": base_cpu,
            "cpu_ms_per_token_batch_invariant": b["cpu_ms_per_token"],
        }
        print(
            f"  batch_invariant cost at C={c}: {b['tok_s']:.1f} vs {base:.1f} tok/s "
            f"({base / b['tok_s']:.2f}x slower; cpu {b['cpu_ms_per_token']:.0f} vs "
            f"{base_cpu:.0f} ms/token)"
        )
    gpt_ours = _gpt_tok_s(ours_by_c[lo])
    print(
        f"  GPT alone at C={lo}: ours {gpt_ours:.1f} tok/s (its execute calls), "
        f"upstream _infer_code {up['gpt_only']['tok_s']:.1f} tok/s"
    )
    floors = {
        m: median([r["gemm_floor"][m]["ms_per_step"] for r in rounds])
        for m in rounds[0]["gemm_floor"]
    }
    ceiling = {m: int(m) * 1000 / ms for m, ms in floors.items()}
    print(
        "  GPT weight-GEMM floor per step (ms): "
        + ", ".join(f"{m} rows {ms:.3g}" for m, ms in floors.items())
        + f"; GEMM-only ceiling at C={hi}: {ceiling[str(hi)]:.0f} tok/s = "
        f"{ceiling[str(hi)] / single:.1f}x upstream single, "
        f"{ceiling[str(hi)] / batch:.1f}x upstream batch {UPSTREAM_BATCH}"
    )
    return {
        "gemm_floor_ms_per_step": floors,
        "gemm_only_ceiling_tok_s": ceiling,
        "vocoder_defaults": vocoder,
        "table": rows,
        "targets": targets,
        "batch_invariant_cost": bi_cost,
        "gpt_only_tok_s": {"omnistep": gpt_ours, "upstream": up["gpt_only"]["tok_s"]},
    }


def _gpt_tok_s(bursts: list[dict[str, Any]]) -> float:
    """Frames per second of GPT compute alone (its prefill and decode calls) over the bursts."""
    frames = sum(b["frames"] for b in bursts)
    seconds = sum(v["seconds"] for b in bursts for v in b["exec"]["gpt"].values())
    return frames / seconds if seconds else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--concurrency", default="1,4,16", help="omnistep burst sizes")
    ap.add_argument("--tokens", type=int, default=128, help="frames per request (N)")
    ap.add_argument(
        "--root", type=Path, default=None, help="checkpoint folder (cache; default by --size)"
    )
    ap.add_argument("--size", choices=sorted(SIZES), default="full", help="checkpoint sizes")
    ap.add_argument(
        "--device", choices=DEVICES, default="cpu", help="where both sides run (cpu, cuda)"
    )
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads, both sides")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of the paired comparisons")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()
    args.root = args.root or SIZES[args.size][1]
    levels = sorted({int(x) for x in args.concurrency.split(",") if x.strip()})
    device = resolve_device(args.device)  # one clear error when CUDA is asked and absent
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, load {load_avg()}, "
        f"device {device_info(device)}"
    )

    ckpt = ensure_checkpoint(args.root, args.size)
    ckpt["bytes"] = checkpoint_bytes(args.root)
    print(f"checkpoint {args.root}: {ckpt}", flush=True)
    eos_check = check_min_new_tokens()
    print(f"min_new_tokens masks EOS: {eos_check}", flush=True)

    res = asyncio.run(run_all(args, levels))
    summary = report(args, levels, res)
    elapsed = time.perf_counter() - t_start
    print(f"load average now {load_avg()}; bench took {elapsed:.0f}s")
    result = {
        "machine": {
            "platform": platform.platform(),
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "cpus": os.cpu_count(),
            "torch_threads": args.threads,
            **device_info(device),
        },
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "checkpoint": {"root": str(args.root), **ckpt},
        "min_new_tokens_check": eos_check,
        **summary,
        "raw": res,
        "seconds": round(elapsed, 1),
        "loadavg_end": load_avg(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(jsonable(result), indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
