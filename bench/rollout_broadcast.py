"""Weight broadcast benchmark: a trainer's update of the full-size ChatTTS GPT sent to 2 rollout
replicas on Ray (``omnistep.rollout_replicas``) against the same update applied in process.

What it measures
----------------
The FULL-SIZE ChatTTS checkpoint with seeded random weights (written once into ``--root`` by
``omnistep.models.chattts.tiny.write_full_size_chattts``, as ``bench/ar_decode.py`` does). The
tensors are every tensor a trainer trains (``Trainer.weights()``: the GPT's), perturbed, as
``Trainer.state()`` hands them to ``update_weights``.

* **in process**: ``OmniEngine.update_weights(tensors)`` (check incl. NaN/Inf, pause, copy in
  place), median of ``--reps``.
* **broadcast to N replicas**: ``RolloutReplicas.apply_weights(tensors)``: announce + version
  and shape checks on every replica, gloo broadcast (trainer rank 0, replicas 1..N) into fresh
  buffers while they serve, each replica's NaN/Inf check, then every replica's
  ``apply_weights``; median of ``--reps`` after a first one that also forms the process group
  (reported apart). ``transfer`` is the part up to every replica holding checked tensors.

Target (issue 31, item 9): broadcast to 2 replicas <= 2x the in-process update.

How to run
----------
::

    .venv/bin/python bench/rollout_broadcast.py                 # full size, 2 replicas, 3 reps
    .venv/bin/python bench/rollout_broadcast.py --size tiny --reps 2   # seconds

``measure_broadcast(root, ...)`` returns the same figures as a dict (for ``bench/rollout.py``).
It prints a table and writes ``bench/results/rollout_broadcast.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ar_decode import SIZES, ensure_checkpoint, load_avg  # noqa: E402

from omnistep.offline import OmniEngine  # noqa: E402
from omnistep.rollout_replicas import RolloutReplicas  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "bench" / "results" / "rollout_broadcast.json"
OPTIONS = {"kv_cache_gb": 0.05}


def _tensors(engine: OmniEngine, seed: int) -> dict[str, torch.Tensor]:
    """Every trained tensor, perturbed (a trainer's ``state()`` after a step)."""
    trainer = engine.trainer()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in trainer.weights().values():
            if tensor.is_floating_point():
                tensor.add_(torch.randn(tensor.shape, generator=gen) * 1e-3)
    return trainer.state()


def measure_broadcast(
    root: Path, replicas: int = 2, reps: int = 3, threads: int = 1, backend: str = "gloo"
) -> dict[str, Any]:
    """Seconds of the in-process update and of the broadcast to ``replicas`` Ray replicas of
    the same tensors (medians of ``reps``; see the module docstring). Starts (and stops) a
    local Ray when none runs."""
    import ray

    torch.set_num_threads(threads)
    spec = f"chattts={root}"
    with OmniEngine(spec, **OPTIONS) as local:
        tensors = _tensors(local, 0)
        num_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        in_process = []
        for v in range(1, reps + 1):
            start = time.perf_counter()
            local.update_weights(tensors, version=v)
            in_process.append(time.perf_counter() - start)
    owns = not ray.is_initialized()
    if owns:
        ray.init(num_cpus=replicas * threads, include_dashboard=False, log_to_driver=False)
    try:
        start = time.perf_counter()
        with RolloutReplicas.start(
            spec, n=replicas, num_cpus=threads, backend=backend, **OPTIONS
        ) as group:
            started_s = time.perf_counter() - start
            first = group.apply_weights(tensors, version=1)
            reports = [group.apply_weights(tensors, version=v) for v in range(2, reps + 2)]
    finally:
        if owns:
            ray.shutdown()
    broadcast = statistics.median(r.total_s for r in reports)
    update = statistics.median(in_process)
    return {
        "tensors": len(tensors),
        "mb": round(num_bytes / 1e6, 1),
        "replicas": replicas,
        "backend": backend,
        "threads": threads,
        "in_process_s": round(update, 3),
        "broadcast_s": round(broadcast, 3),
        "broadcast_announce_s": round(statistics.median(r.announce_s for r in reports), 3),
        "broadcast_transfer_s": round(statistics.median(r.transfer_s for r in reports), 3),
        "broadcast_commit_s": round(statistics.median(r.commit_s for r in reports), 3),
        "first_broadcast_s": round(first.total_s, 3),
        "ratio": round(broadcast / update, 2),
        "replicas_start_s": round(started_s, 1),
        "in_process_runs_s": [round(x, 3) for x in in_process],
        "broadcast_runs_s": [round(r.total_s, 3) for r in reports],
        "load_avg": load_avg(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    parser.add_argument("--root", type=Path, default=None, help="checkpoint folder")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    root = args.root or SIZES[args.size][1]
    written = ensure_checkpoint(root, args.size)
    result = {"size": args.size, "checkpoint": written, **measure_broadcast(
        root, args.replicas, args.reps, args.threads, args.backend
    )}  # fmt: skip
    print(f"{'tensors':>24}: {result['tensors']} ({result['mb']} MB)")
    keys = ("in_process_s", "broadcast_s", "broadcast_announce_s", "broadcast_transfer_s")
    for key in (*keys, "broadcast_commit_s", "first_broadcast_s"):
        print(f"{key:>24}: {result[key]:.3f}")
    print(f"{'broadcast / in process':>24}: {result['ratio']:.2f}x (target <= 2x)")
    print(f"{'load average':>24}: {result['load_avg']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
