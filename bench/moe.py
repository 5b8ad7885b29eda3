"""The MoE layer's step against its expert-GEMM floor (issue 28, item 7(d)).

One ``omnistep.layers.moe.MoEFeedForward`` at Qwen3-Omni-30B-A3B thinker widths (published
``thinker_config.text_config``: hidden 2048, ``moe_intermediate_size`` 768, 128 experts, top 8,
``norm_topk_prob``; ``--experts`` fewer where memory needs: 128 experts are 604M parameters, 2.4
GB in float32, and on a CPU the oneDNN-packed copies of the active experts come on top) with
random weights, on ``--rows`` rows (16: a decode step of 16 sequences). Timed, median of
``--reps`` calls after a warm-up, ``torch`` on ``--threads`` threads:

* ``step``: ``moe(x)``: router, top-k, grouping the (row, slot) assignments by expert, each
  active expert's two GEMMs, SiLU, the weighted sum (and with ``--shared``, the talker's shared
  expert and its gate);
* ``floor``: only the expert GEMMs of the same routing (each active expert's gate/up GEMM on its
  rows and its down GEMM on inputs of its width, the same ``stacked_linear`` kernels), inputs
  gathered beforehand.

``ratio = step / floor`` (target <= 1.3), of process CPU time on a CPU (on a shared machine the
wall time is mostly waiting for a core; run ``--threads 1`` there so no OpenMP thread spins) and
of wall time on CUDA. With ``--batch-invariant`` the batch-invariant mode's
step is timed too (its experts run in chunks of 16 rows, so its floor is different: reported
against the same floor to show the price of the mode). On CUDA every timed call ends with a
synchronize.

    PYTHONPATH=. .venv/bin/python bench/moe.py                      # 32 experts on a CPU
    PYTHONPATH=. .venv/bin/python bench/moe.py --experts 128 --device cuda --dtype bfloat16

Prints one line per mode and writes ``bench/results/moe.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from omnistep.layers.linear import stacked_linear
from omnistep.layers.moe import MoEConfig, MoEFeedForward

TARGET_RATIO = 1.3
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring).

    Raises:
        SystemExit: a bad value (argparse), or top-k above the experts.
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--inner", type=int, default=768, help="moe_intermediate_size")
    parser.add_argument("--experts", type=int, default=32, help="published: 128")
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--shared", type=int, default=0, help="shared expert width (talker)")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--batch-invariant", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "moe.json"))
    args = parser.parse_args(argv)
    for name in ("rows", "hidden", "inner", "experts", "top_k", "reps", "threads"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0")
    if args.top_k > args.experts:
        parser.error("--top-k must not exceed --experts")
    return args


def expert_groups(expert_ids: torch.Tensor, num_experts: int) -> list[tuple[int, torch.Tensor]]:
    """``(expert, row ids)`` of every active expert, in expert order: the rows routed to it
    (a row appears once per slot that chose it)."""
    flat = expert_ids.reshape(-1)
    rows = torch.arange(expert_ids.shape[0], device=expert_ids.device)
    rows = rows.repeat_interleave(expert_ids.shape[1])
    return [(e, rows[flat == e]) for e in range(num_experts) if bool((flat == e).any())]


def _timed(reps: int, fn: Callable[[], object], sync: Callable[[], None]) -> dict[str, float]:
    """Median wall and process CPU seconds of ``reps`` calls after one warm-up call."""
    fn()
    sync()
    walls, cpus = [], []
    for _ in range(reps):
        wall, cpu = time.perf_counter(), time.process_time()
        fn()
        sync()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return {"wall_s": statistics.median(walls), "cpu_s": statistics.median(cpus)}


def build(args: argparse.Namespace) -> tuple[MoEFeedForward, torch.Tensor]:
    """The layer with random weights (std 0.02; the router's 1 / sqrt(hidden), so the routing
    spreads over the experts) and the rows, on ``args.device`` in ``args.dtype``."""
    config = MoEConfig(
        hidden_size=args.hidden,
        moe_intermediate_size=args.inner,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        norm_topk_prob=True,
        shared_expert_intermediate_size=args.shared,
    )
    dtype = DTYPES[args.dtype]
    moe = MoEFeedForward(config, device=args.device, dtype=dtype).eval()
    generator = torch.Generator(device=args.device).manual_seed(args.seed)
    with torch.no_grad():
        for name, p in moe.named_parameters():
            std = 1.0 / args.hidden**0.5 if name == "gate.weight" else 0.02
            p.copy_(torch.randn(p.shape, generator=generator, device=args.device) * std)
    x = torch.randn(args.rows, args.hidden, generator=generator, device=args.device).to(dtype)
    return moe, x


def run(args: argparse.Namespace) -> dict:
    """Time the step and the floor; returns the result record."""
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    moe, x = build(args)
    experts = moe.experts
    with torch.inference_mode():
        routing = moe(x).expert_ids
        groups = expert_groups(routing, args.experts)
        inputs = [(e, x[rows], x.new_zeros(len(rows), args.inner)) for e, rows in groups]

        def floor() -> None:
            for e, rows, inner in inputs:
                stacked_linear(rows, experts.gate_up_proj, e)
                stacked_linear(inner, experts.down_proj, e)

        modes = {"step": lambda: moe(x), "floor": floor}
        if args.batch_invariant:
            modes["step_batch_invariant"] = lambda: moe(x, batch_invariant=True)
        times = {name: _timed(args.reps, fn, sync) for name, fn in modes.items()}
    floor_s = times["floor"]
    for name, t in times.items():
        t["ratio_wall"] = round(t["wall_s"] / floor_s["wall_s"], 3)
        t["ratio_cpu"] = round(t["cpu_s"] / floor_s["cpu_s"], 3) if floor_s["cpu_s"] else None
        print(
            f"{name:22s} {t['wall_s'] * 1e3:9.2f} ms wall {t['cpu_s'] * 1e3:9.2f} ms cpu  "
            f"ratio {t['ratio_wall']:.3f} (cpu {t['ratio_cpu']})",
            flush=True,
        )
    # a shared CPU's wall time is mostly waiting for a core: judge by CPU time there
    basis = "ratio_cpu" if device.type == "cpu" else "ratio_wall"
    ratio = times["step"][basis]
    verdict = "met" if ratio <= TARGET_RATIO else "missed"
    print(f"step / floor = {ratio:.3f} by {basis[6:]} time (target <= {TARGET_RATIO}: {verdict})")
    config = {k: v for k, v in vars(args).items() if k != "out"}
    return {
        "config": config,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "active_experts": len(groups),
        "times": times,
        "ratio": ratio,
        "ratio_basis": basis,
        "target_ratio": TARGET_RATIO,
    }


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    threads = torch.get_num_threads()
    try:
        record = run(args)
    finally:
        torch.set_num_threads(threads)  # a caller's (a test's) setting survives
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
