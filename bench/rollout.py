"""Rollout benchmark: sample groups on the full-size ChatTTS checkpoint, side by side in one run.

What it measures
----------------
One process, the FULL-SIZE ChatTTS checkpoint with seeded random weights (written once into
``--root`` by ``omnistep.models.chattts.tiny.write_full_size_chattts``, as ``bench/ar_decode.py``
does), the same torch thread count on every side (``--threads``, default 2). Every sample
decodes exactly ``--tokens`` frames (N): ``min_new_tokens = max_new_tokens = N``.

* **groups**: ``AsyncOmniEngine.rollout`` of ``--inputs`` inputs x ``--n`` samples (default
  2 x 8 = 16) with one fixed voice, so each input's prompt is prefilled once and its KV blocks
  shared by the group. Tokens/s = 16 N / wall; prompt rows the GPT computed (prefill work).
* **independent**: the same 16 requests (same texts, voice, seeds) with no group: every request
  prefills its own prompt.
* **upstream lock-step**: ``chattts`` 0.2.5 ``Chat.infer`` on the same 16 texts in one call
  (one random speaker, ``skip_refine_text``), 16 N / wall; and upstream single (one text) for
  the "x upstream single" ratio.
* **decode step vs GEMM floor**: the GPT's AR_TOKEN ``execute`` time per call at 16 rows (from
  the groups run) and at 1 row (a lone request), against the backbone's 140 weight GEMMs alone
  on 16 and 1 rows, measured in the same run with serving's own kernels (each ``PackedLinear``
  called: the pre-packed oneDNN GEMM), and, for reference, with plain ``F.linear``
  (``Ours.gemm_floor`` of ``bench/ar_decode.py``, which upstream's kernels run).
  The in-engine steps share the 2 cores with the vocoder's chunks; the same steps run
  directly on the component (nothing beside them) are reported too (``standalone``).
* **update_weights**: ``AsyncEngine.update_weights`` of every GPT tensor (the checkpoint's
  names, from memory: a perturbed copy) in ``pause`` mode, and the first decode step after it
  (where the pre-packed linears repack), median of ``--update-reps``.

Targets (issue 12, item 8): 16-row GPT step <= 1.2x its GEMM floor; 1-row step <= 1.3x;
aggregate tokens/s of the 16 >= 10x upstream single; ``update_weights`` <= 1 s on CPU.

Device (``--device``, default ``cpu``): ``cuda`` loads omnistep's components there
(``ModelInstance.load(card, device)``, as ``omnistep serve --device cuda``) and upstream's
``Chat`` too; both GEMM floors run on it (serving's linears are plain ``F.linear`` there), the
generators of the standalone steps live there, the weight update's new tensors are made there,
and every timed interval ends (and begins) after ``torch.cuda.synchronize``
(``bench/device_timing.py``). ``bench/gpu.sh`` runs this on a lent GPU.

How to run
----------
::

    .venv/bin/python bench/rollout.py                          # 2 x 8, N = 96
    .venv/bin/python bench/rollout.py --tokens 64 --skip-upstream --root /tmp/ckpt
    .venv/bin/python bench/rollout.py --device cuda --threads 8
    .venv/bin/python bench/rollout.py --size tiny --tokens 4 --n 2 --update-reps 1  # seconds
    .venv/bin/python bench/rollout.py --grpo chattts,qwen3_tts --tokens 32   # GRPO split

``--grpo`` times one GRPO iteration's phases instead (``bench/grpo_split.py``: rollout, score
packed and per sample, backward, optimizer, update_weights) and writes ``rollout_grpo.json``;
with ``--broadcast`` also the weight broadcast to 2 Ray replicas (``bench/rollout_broadcast.py``).

It prints a table and writes ``bench/results/rollout.json`` (``--out``); the load average is
stored with each measurement (compare only figures of one run).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ar_decode import (  # noqa: E402 - bench/ is not a package
    SIZES,
    TEXTS,
    ExecTimer,
    Ours,
    Upstream,
    checkpoint_bytes,
    ensure_checkpoint,
    floor_reps,
    load_avg,
    section_error,
)
from device_timing import DEVICES, device_info, now, resolve_device  # noqa: E402

from omnistep.core import Request, SamplingParams  # noqa: E402
from omnistep.offline import AsyncOmniEngine  # noqa: E402
from omnistep.parity import collect  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "bench" / "results" / "rollout.json"
VOICE = "alloy"


class PrefillRows:
    """Counts the prompt rows the GPT computes (wraps ``PagedARModel._compute_prefills``)."""

    def __init__(self, gpt: Any):
        self.rows = 0
        self._inner = gpt._compute_prefills
        gpt._compute_prefills = self

    def __call__(self, units: list, inputs: list) -> Any:
        self.rows += sum(int(x.shape[0]) for x in inputs)
        return self._inner(units, inputs)


def serving_gemm_floor(llama: torch.nn.Module, rows: int, reps: int | None = None) -> float:
    """Milliseconds per decode step of the backbone's weight GEMMs alone, each run by the
    layer itself (``PackedLinear``: on the CPU the pre-packed oneDNN kernel serving uses, on
    CUDA ``F.linear``) on ``rows`` input rows on the weights' device (CUDA: synchronised
    before and after the timed loop): the floor of one AR_TOKEN step with serving's kernels.
    ``reps``: default ``floor_reps(device)``."""
    linears = [m for m in llama.modules() if isinstance(m, torch.nn.Linear)]
    device = linears[0].weight.device
    reps = reps or floor_reps(device)
    xs = {
        m.in_features: torch.randn(rows, m.in_features, device=device, dtype=m.weight.dtype)
        for m in linears
    }
    with torch.inference_mode():
        for m in linears:  # pack and warm
            m(xs[m.in_features])
        start = now(device)
        for _ in range(reps):
            for m in linears:
                m(xs[m.in_features])
        return 1000 * (now(device) - start) / reps


def standalone_step_ms(model: Any, rows: int, steps: int = 20) -> float:
    """Median milliseconds of a GPT AR_TOKEN step of ``rows`` sequences run directly (no
    engine: nothing, such as the vocoder, computes beside it), after a prefill and 5 warm-up
    steps, each with its generator on the component's device; the sequences are freed after.
    A step's interval ends after its tokens are on the host (and, on CUDA, a synchronise)."""
    from omnistep.core import ProgramContext, WorkUnitKind
    from omnistep.loops.ar_decode import ARPrefillInput, ARStepInput
    from omnistep.sampling import make_generator

    gpt = model.components["gpt"]
    request = Request("chattts", text=TEXTS[0], voice=VOICE, seed=1)
    ctx = ProgramContext(request, model)
    model.card.program.nodes[0].fn(ctx)
    row = model.loops["decode"].config.make_sampling(request)
    ids = [f"bench-{i}" for i in range(rows)]
    gens = [make_generator(i, gpt.device) for i in range(rows)]
    prefill = [
        ARPrefillInput(s, ctx.slots["prompt"], (), (), row, g)
        for s, g in zip(ids, gens, strict=True)
    ]
    history = [[out.tokens] for out in gpt.execute(WorkUnitKind.PREFILL, prefill)]
    times = []
    try:
        for n in range(1, steps + 6):
            units = [
                ARStepInput(s, h[-1], n, tuple(h[-16:]), row, g)
                for s, h, g in zip(ids, history, gens, strict=True)
            ]
            start = now(gpt.device)
            outs = gpt.execute(WorkUnitKind.AR_TOKEN, units)
            if n > 5:
                times.append(1000 * (now(gpt.device) - start))
            for h, out in zip(history, outs, strict=True):
                h.append(out.tokens)
    finally:
        for s in ids:
            gpt.free_sequence(s)
    return float(statistics.median(times))


def _ar_ms(timer: ExecTimer, rows: int) -> float:
    """Median milliseconds of the GPT's AR_TOKEN calls with exactly ``rows`` units."""
    times = [1000 * (e - s) for k, b, s, e in timer.outer() if k == "ar_token" and b == rows]
    return float(statistics.median(times)) if times else float("nan")


async def run_ours(args: argparse.Namespace) -> dict[str, Any]:
    ours = Ours(args.root, {"kv_cache_gb": 1.0}, args.device)
    omni = AsyncOmniEngine(ours.engine)
    gpt = ours.model.components["gpt"]
    counter = PrefillRows(gpt)
    timer = ours.timers["gpt"]
    sampling = SamplingParams(max_new_tokens=args.tokens, min_new_tokens=args.tokens)
    inputs = list(TEXTS[: args.inputs])
    total = args.inputs * args.n
    await collect(ours.engine, Request("chattts", text=TEXTS[0], voice=VOICE, seed=1))  # warm-up

    out: dict[str, Any] = {"floor_ms": {}, "floor_f_linear_ms": {}, "standalone_step_ms": {}}
    for rows in (1, total):
        out["floor_ms"][rows] = serving_gemm_floor(gpt.llama, rows)
        out["floor_f_linear_ms"][rows] = ours.gemm_floor(rows)["ms_per_step"]
        out["standalone_step_ms"][rows] = standalone_step_ms(ours.model, rows)

    timer.log.clear()
    counter.rows = 0
    start = now(ours.device)
    groups = await omni.rollout(
        inputs, n=args.n, seed=100, voice=VOICE, sampling=sampling, progress=False
    )
    wall = now(ours.device) - start
    frames = sum(len(s.loops["decode"].tokens) for g in groups for s in g.samples)
    out["groups"] = {
        "wall_s": wall,
        "tok_s": frames / wall,
        "frames": frames,
        "prefill_rows": counter.rows,
        "step_ms_16": _ar_ms(timer, total),
        "loadavg": load_avg(),
    }
    print(
        f"  groups      {args.inputs}x{args.n}: {frames / wall:6.1f} tok/s, prefill rows "
        f"{counter.rows}, {total}-row step {out['groups']['step_ms_16']:.1f} ms",
        flush=True,
    )

    timer.log.clear()
    counter.rows = 0
    requests = [
        Request("chattts", text=text, voice=VOICE, seed=100 + k, sampling=sampling)
        for text in inputs
        for k in range(args.n)
    ]
    start = now(ours.device)
    done = await asyncio.gather(*(collect(ours.engine, r) for r in requests))
    wall = now(ours.device) - start
    out["independent"] = {
        "wall_s": wall,
        "tok_s": total * args.tokens / wall,
        "prefill_rows": counter.rows,
        "step_ms_16": _ar_ms(timer, total),
        "samples": sum(d.audio.size for d in done),
        "loadavg": load_avg(),
    }
    print(
        f"  independent {total}: {out['independent']['tok_s']:6.1f} tok/s, prefill rows "
        f"{counter.rows}",
        flush=True,
    )

    timer.log.clear()
    await collect(ours.engine, Request("chattts", text=TEXTS[0], voice=VOICE, seed=5,
                                       sampling=sampling))  # fmt: skip
    out["single_step_ms_1"] = _ar_ms(timer, 1)

    # the new weights in memory on the weights' device (a trainer's, beside the engine)
    state = {name: t for name, t in gpt._weight_tensors().items()}
    generator = torch.Generator().manual_seed(0)
    new = {n: t.detach() + 1e-3 * torch.randn(t.shape, generator=generator, dtype=t.dtype)
           .to(t.device) for n, t in state.items()}  # fmt: skip
    updates, first_steps = [], []
    for version in range(1, args.update_reps + 1):
        start = now(ours.device)
        await ours.engine.update_weights("chattts", new, version=version)
        updates.append(now(ours.device) - start)
        timer.log.clear()
        await collect(ours.engine, Request("chattts", text=TEXTS[1], voice=VOICE, seed=version,
                                           sampling=SamplingParams(max_new_tokens=2)))  # fmt: skip
        first_steps.append(_ar_ms(timer, 1))
    out["update_weights"] = {
        "tensors": len(new),
        "bytes": sum(t.numel() * t.element_size() for t in new.values()),
        "seconds_median": statistics.median(updates),
        "seconds": updates,
        "first_step_ms": first_steps,
        "loadavg": load_avg(),
    }
    print(
        f"  update_weights: {statistics.median(updates):.3f} s for {len(new)} tensors", flush=True
    )
    await ours.close()
    return out


def run_upstream(args: argparse.Namespace) -> dict[str, Any]:
    up = Upstream(args.root, args.tokens, args.device)
    up.warmup()
    single = up.single()
    texts = [TEXTS[i % args.inputs] for i in range(args.inputs * args.n)]

    def batch() -> dict[str, Any]:
        return {"outputs": len(up.infer(texts, args.tokens))}

    lockstep = up._timed(f"lock-step batch {len(texts)}", batch, len(texts) * args.tokens)
    return {"single": single, "lockstep": lockstep}


def report(args: argparse.Namespace, ours: dict[str, Any], up: dict[str, Any] | None) -> dict:
    total = args.inputs * args.n
    floor16, floor1 = ours["floor_ms"][total], ours["floor_ms"][1]
    alone = ours["standalone_step_ms"]
    ratios = {
        f"step_{total}_over_floor": ours["groups"]["step_ms_16"] / floor16,
        "step_1_over_floor": ours["single_step_ms_1"] / floor1,
        f"standalone_step_{total}_over_floor": alone[total] / floor16,
        "standalone_step_1_over_floor": alone[1] / floor1,
        "prefill_rows_saved": 1
        - ours["groups"]["prefill_rows"] / max(ours["independent"]["prefill_rows"], 1),
        "groups_over_independent_tok_s": ours["groups"]["tok_s"] / ours["independent"]["tok_s"],
    }
    if up is not None:
        ratios["groups_over_upstream_single"] = ours["groups"]["tok_s"] / up["single"]["tok_s"]
        ratios["groups_over_upstream_lockstep"] = ours["groups"]["tok_s"] / up["lockstep"]["tok_s"]
    targets = {
        f"step_{total}_over_floor": ("<=", 1.2),
        "step_1_over_floor": ("<=", 1.3),
        "groups_over_upstream_single": (">=", 10.0),
    }
    plain = ours["floor_f_linear_ms"]
    print(
        f"\nGEMM floor (serving's linears): 1 row {floor1:.3g} ms, {total} rows "
        f"{floor16:.3g} ms; with F.linear: {plain[1]:.3g} / {plain[total]:.3g} ms"
    )
    for name, value in ratios.items():
        op, target = targets.get(name, ("", None))
        met = (
            ""
            if target is None
            else (" MET" if (value <= target if op == "<=" else value >= target) else " missed")
        )
        print(f"  {name:<34} {value:7.3f}" + (f"  (target {op} {target}){met}" if target else ""))
    upd = ours["update_weights"]["seconds_median"]
    verdict = "MET" if upd <= 1 else "missed"
    print(f"  {'update_weights (s)':<34} {upd:7.3f}  (target <= 1.0) {verdict}")
    return ratios


def run_grpo(args: argparse.Namespace) -> None:
    """``--grpo``: ``grpo_split.run_family`` per family; prints the split and writes
    ``rollout_grpo.json`` beside ``--out``."""
    from grpo_split import run_family

    results = []
    for family in args.grpo.split(","):
        res = run_family(
            family, size=args.size, root=args.root, inputs=args.inputs, n=args.n,
            tokens=args.tokens, iterations=args.iterations, device=args.device,
        )  # fmt: skip
        results.append(res)
        split = ", ".join(f"{k} {v:.3f}" for k, v in res["cpu_s"].items())
        verdict = "MET" if res["score_ratio_cpu"] <= 0.3 else "missed"
        shape = f"{res['samples']} samples x {res['frames_per_sample']} frames"
        print(f"{family} ({shape}), cpu s: {split}")
        print(
            f"  packed score / per-sample score: {res['score_ratio_cpu']:.3f} cpu, "
            f"{res['score_ratio_wall']:.3f} wall (target <= 0.3) {verdict}"
        )
    broadcast = None
    if args.broadcast:
        from rollout_broadcast import measure_broadcast

        root = SIZES[args.size][1]
        ensure_checkpoint(root, args.size)
        broadcast = measure_broadcast(root)
        verdict = "MET" if broadcast["ratio"] <= 2 else "missed"
        print(
            f"broadcast to 2 replicas {broadcast['broadcast_s']:.3f} s, in-process update "
            f"{broadcast['in_process_s']:.3f} s: {broadcast['ratio']:.2f}x (target <= 2x) {verdict}"
        )
    out = args.out.with_name("rollout_grpo.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"load": load_avg(), "results": results, "broadcast": broadcast}
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--inputs", type=int, default=2, help="distinct inputs")
    ap.add_argument("--n", type=int, default=8, help="samples per input")
    ap.add_argument("--tokens", type=int, default=96, help="frames per sample (N)")
    ap.add_argument(
        "--root", type=Path, default=None, help="checkpoint folder (cache; default by --size)"
    )
    ap.add_argument("--size", choices=sorted(SIZES), default="full", help="checkpoint sizes")
    ap.add_argument(
        "--device", choices=DEVICES, default="cpu", help="where every side runs (cpu, cuda)"
    )
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    ap.add_argument("--update-reps", type=int, default=3, help="weight updates timed")
    ap.add_argument("--skip-upstream", action="store_true", help="omnistep sides only")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument(
        "--grpo",
        metavar="FAMILIES",
        help="instead: one GRPO iteration's split (bench/grpo_split.py) for these families, "
        "comma-separated (chattts,qwen3_tts); uses --size --inputs --n --tokens --device",
    )
    ap.add_argument("--iterations", type=int, default=2, help="--grpo: timed iterations")
    ap.add_argument(
        "--broadcast",
        action="store_true",
        help="with --grpo: also the weight broadcast to 2 Ray replicas vs an in-process update "
        "(bench/rollout_broadcast.py, --size's ChatTTS)",
    )
    args = ap.parse_args()
    if args.grpo:
        torch.set_num_threads(args.threads)
        run_grpo(args)
        return
    args.root = args.root or SIZES[args.size][1]
    device = resolve_device(args.device)  # one clear error when CUDA is asked and absent
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    ckpt = ensure_checkpoint(args.root, args.size)
    print(
        f"checkpoint {args.root}: {ckpt}, {checkpoint_bytes(args.root) / 1e9:.2f} GB, "
        f"load {load_avg()}, device {device_info(device)}",
        flush=True,
    )
    ours = asyncio.run(run_ours(args))
    up, up_error = None, None
    if not args.skip_upstream:
        try:
            up = run_upstream(args)
        except Exception as exc:  # omnistep's figures are kept when upstream fails
            up_error = section_error("upstream", exc)
    ratios = report(args, ours, up)
    result = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "torch": torch.__version__,
        "device": device_info(device),
        "ours": ours,
        "upstream": up if up_error is None else up_error,
        "ratios": ratios,
        "seconds": round(time.perf_counter() - start, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {args.out} ({result['seconds']} s)")


if __name__ == "__main__":
    main()
