"""Batched scoring benchmark: ``score`` of 1, 8 and 16 ChatTTS samples, packed into one
teacher-forced forward (``batch_size=16``) against one forward per sample (``batch_size=1``,
the path before packing), forward alone and forward + backward, on a trainer's copy.

Every sample decodes exactly ``--tokens`` frames (``min_new_tokens = max_new_tokens``) with one
voice; the times are the median of ``--reps`` calls, ``torch`` on ``--threads`` threads. The
tiny servable checkpoint has the official GPT width (768) but few layers; ``--full-size``
writes (once, ~1.2 GB into ``--workdir``) the official sizes with random weights.

    PYTHONPATH=. .venv/bin/python bench/score_batch.py [--full-size] [--tokens 64]

Prints a table and writes ``bench/results/score_batch.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from omnistep.core import SamplingParams
from omnistep.offline import OmniEngine


def _time(reps: int, fn, *args) -> tuple[float, float]:
    """Median wall and CPU (this process's) seconds of ``reps`` calls after a warm-up: on a
    shared machine the CPU time is the steadier figure."""
    fn(*args)  # warm-up (oneDNN packs, allocator)
    walls, cpus = [], []
    for _ in range(reps):
        wall, cpu = time.perf_counter(), time.process_time()
        fn(*args)
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return statistics.median(walls), statistics.median(cpus)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--full-size", action="store_true")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch-invariant", action="store_true")
    parser.add_argument("--no-match-serving", action="store_true")
    parser.add_argument("--workdir", default="/tmp/omnistep-score-batch")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from omnistep.models.chattts.tiny import write_full_size_chattts, write_servable_tiny_chattts

    root = Path(args.workdir) / ("chattts-full" if args.full_size else "chattts")
    if not root.exists():
        (write_full_size_chattts if args.full_size else write_servable_tiny_chattts)(root)
    rows = []
    with OmniEngine(
        f"chattts={root}", args.device, kv_cache_gb=0.2, batch_invariant=args.batch_invariant
    ) as engine:
        sampling = SamplingParams(max_new_tokens=args.tokens, min_new_tokens=args.tokens)
        [group] = engine.rollout(
            ["score us all, frame by frame"], n=16, seed=3, voice="alloy", sampling=sampling,
            progress=False,
        )  # fmt: skip
        trainer = engine.trainer()
        weights = trainer.weights()

        def run(samples, batch_size, backward):
            scores = engine.score(
                samples,
                trainer=trainer,
                batch_size=batch_size,
                match_serving=not args.no_match_serving,
            )
            if backward:
                torch.stack([s["decode"].sum() for s in scores]).sum().backward()
                for w in weights.values():
                    w.grad = None
            if args.device != "cpu":
                torch.cuda.synchronize()

        for n in (1, 8, 16):
            samples = group.samples[:n]
            for backward in (False, True):
                before, before_cpu = _time(args.reps, run, samples, 1, backward)
                after, after_cpu = _time(args.reps, run, samples, 16, backward)
                row = {
                    "samples": n,
                    "phase": "forward+backward" if backward else "forward",
                    "per_sample_s": round(before, 4),
                    "packed_s": round(after, 4),
                    "per_sample_cpu_s": round(before_cpu, 4),
                    "packed_cpu_s": round(after_cpu, 4),
                    "ratio_cpu": round(after_cpu / before_cpu, 3),
                }
                rows.append(row)
                print(
                    f"{n:2d} samples {row['phase']:16s} per-sample {before_cpu:7.3f} s cpu "
                    f"({before:7.3f} wall)  packed {after_cpu:7.3f} s cpu ({after:7.3f} wall)  "
                    f"ratio {after_cpu / before_cpu:.2f}",
                    flush=True,
                )
    name = "score_batch_full.json" if args.full_size else "score_batch.json"
    out = Path(__file__).parent / "results" / name
    out.parent.mkdir(exist_ok=True)
    label = {
        "full_size": args.full_size,
        "tokens": args.tokens,
        "threads": args.threads,
        "batch_invariant": args.batch_invariant,
        "match_serving": not args.no_match_serving,
    }
    out.write_text(json.dumps({"config": label, "device": args.device, "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
