"""Scheduler and engine overhead per WorkUnit, on a null model that does no work.

    .venv/bin/python bench/scheduler_overhead.py                 # L = 10,100,1000
    .venv/bin/python bench/scheduler_overhead.py --loops 1000 --profile

The ``null`` card (``omnistep.models.toy.null``) runs one loop per request; each step is one
AR_TOKEN WorkUnit of one shared ShapeSignature, and its component returns at once. For every
L in ``--loops`` the benchmark submits L requests at once to an ``AsyncEngine`` (the real path:
scheduler, in-process executor thread, folding, publishing, the request streams), consumes
their streams, and stops when all have finished. Each request runs ``max(--units // L,
--min-steps)`` steps (by default 2000, 200 and 50 for L = 10, 100, 1000), so request start and
finish are spread over a realistic number of steps.

Reported per configuration (best and median of ``--repeat`` runs):

- us/unit: total wall time (first ``add_request`` to last stream end) / units executed;
- units/batch: mean batch size (units are batched by shape up to ``max_batch_size``);
- a split from one extra instrumented run (``time.perf_counter`` around the parts; the wrappers
  cost time of their own, so that run's us/unit is shown as ``instr``): ``sched`` =
  ``Scheduler.next_batch`` / ``enqueue`` / ``remove``; ``fold`` = ``AsyncEngine._fold`` (loop
  advance, publish, the loop's next plan) without the scheduler calls inside it; ``exec`` = the
  component's ``execute`` in the worker thread; ``rest`` = the remainder of the wall time: the
  step loop, asyncio tasks and futures, the hand-off to the worker thread and back (and the
  wait for it), stream consumers, request start and finish.

Each L runs with the engine's default ``max_batch_size`` and with ``max_batch_size = 1`` (every
unit its own batch: the worst case), or with the sizes ``--batch-sizes`` lists. ``--profile``
adds a cProfile pass of the largest L at the default batch size and prints the top functions by
own time. Target: <= 20 us per unit at L = 1000 with the default configuration. Results:
``bench/results/scheduler_overhead.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import os
import platform
import pstats
import statistics
import subprocess
import time
from pathlib import Path

from omnistep.core import ModelInstance, Request, SamplingParams
from omnistep.engine import AsyncEngine, EngineConfig
from omnistep.models.toy.null import build_null_card

RESULTS = Path(__file__).parent / "results" / "scheduler_overhead.json"
TARGET_US = 20.0


class _Timers:
    """Accumulates perf_counter seconds of wrapped callables, by part name.

    Only the outermost call of a part counts (a scheduler method that calls another wrapped one
    is timed once), and scheduler time inside ``_fold`` counts as scheduler, not fold.
    """

    def __init__(self) -> None:
        self.seconds = {"sched": 0.0, "fold": 0.0, "exec": 0.0}
        self._active: set[str] = set()
        self._sched_in_fold = 0.0

    def wrap(self, part: str, fn):
        def timed(*args, **kwargs):
            if part in self._active:
                return fn(*args, **kwargs)
            self._active.add(part)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                self._active.discard(part)
                self.seconds[part] += elapsed
                if part == "sched" and "fold" in self._active:
                    self._sched_in_fold += elapsed

        return timed

    def split(self) -> dict[str, float]:
        """Seconds per part, with scheduler time inside ``_fold`` moved to ``sched``."""
        out = dict(self.seconds)
        out["fold"] -= self._sched_in_fold
        return out


def _instrument(engine: AsyncEngine, model: ModelInstance) -> _Timers:
    timers = _Timers()
    sched = engine._scheduler
    for name in ("next_batch", "enqueue", "remove"):
        setattr(sched, name, timers.wrap("sched", getattr(sched, name)))
    engine._fold = timers.wrap("fold", engine._fold)
    component = model.components["null"]
    component.execute = timers.wrap("exec", component.execute)  # in the worker thread
    return timers


async def run_once(
    num_loops: int,
    steps: int,
    max_batch_size: int,
    *,
    emit_every: int = 0,
    instrument: bool = False,
    profiler: cProfile.Profile | None = None,
) -> dict:
    """Run ``num_loops`` null requests of ``steps`` units each, all at once; returns the numbers.

    Raises:
        AssertionError: a request did not run exactly ``steps`` units, or units went missing.
    """
    model = ModelInstance.load(build_null_card(emit_every=emit_every))
    engine = AsyncEngine(
        [model], EngineConfig(max_batch_size=max_batch_size, max_queued=max(num_loops, 1))
    )
    timers = _instrument(engine, model) if instrument else None
    sampling = SamplingParams(max_new_tokens=steps)
    requests = [Request("null", seed=i, sampling=sampling) for i in range(num_loops)]

    async def consume(stream) -> str:
        last = ""
        async for chunk in stream:
            last = chunk.text
        return last

    if profiler is not None:
        profiler.enable()
    start = time.perf_counter()
    streams = [engine.add_request(r) for r in requests]
    finals = await asyncio.gather(*(consume(s) for s in streams))
    wall = time.perf_counter() - start
    if profiler is not None:
        profiler.disable()
    await engine.shutdown()

    units = sum(engine.units_by_kind.values())
    batches = sum(engine.batch_sizes.values())
    assert finals == [str(steps)] * num_loops, "a loop did not run exactly its steps"
    assert units == num_loops * steps, f"{units} units executed, expected {num_loops * steps}"
    out = {
        "wall_s": wall,
        "units": units,
        "batches": batches,
        "us_per_unit": wall / units * 1e6,
        "units_per_batch": units / batches,
    }
    if timers is not None:
        split = timers.split()
        split["rest"] = wall - split["sched"] - split["fold"] - split["exec"]
        out["split_us_per_unit"] = {k: v / units * 1e6 for k, v in split.items()}
    return out


def measure(num_loops: int, steps: int, max_batch_size: int, repeat: int, emit_every: int) -> dict:
    """Best and median us/unit over ``repeat`` runs, plus one instrumented run's split."""
    runs = [
        asyncio.run(run_once(num_loops, steps, max_batch_size, emit_every=emit_every))
        for _ in range(repeat)
    ]
    timed = asyncio.run(
        run_once(num_loops, steps, max_batch_size, emit_every=emit_every, instrument=True)
    )
    per_unit = [r["us_per_unit"] for r in runs]
    return {
        "live_loops": num_loops,
        "steps_per_loop": steps,
        "max_batch_size": max_batch_size,
        "emit_every": emit_every,
        "units": runs[0]["units"],
        "units_per_batch": statistics.median(r["units_per_batch"] for r in runs),
        "us_per_unit_best": min(per_unit),
        "us_per_unit_median": statistics.median(per_unit),
        "us_per_unit_runs": per_unit,
        "split_us_per_unit": timed["split_us_per_unit"],
        "instrumented_us_per_unit": timed["us_per_unit"],
    }


def profile(num_loops: int, steps: int, max_batch_size: int, emit_every: int, top: int) -> str:
    """cProfile of one run (event-loop thread only), top functions by own time."""
    profiler = cProfile.Profile()
    asyncio.run(
        run_once(num_loops, steps, max_batch_size, emit_every=emit_every, profiler=profiler)
    )
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def _table(rows: list[dict]) -> str:
    columns = [
        ("L", 5, "live_loops", "d"),
        ("steps", 5, "steps_per_loop", "d"),
        ("max_bs", 6, "max_batch_size", "d"),
        ("units", 6, "units", "d"),
        ("u/batch", 7, "units_per_batch", ".1f"),
        ("us/unit", 8, "us_per_unit_best", ".1f"),
        ("median", 8, "us_per_unit_median", ".1f"),
        ("instr", 6, "instrumented_us_per_unit", ".1f"),
    ]
    parts = [("sched", 6), ("fold", 6), ("exec", 6), ("rest", 6)]
    head = " ".join(f"{name:>{w}}" for name, w, _, _ in columns + [(*p, "", "") for p in parts])
    lines = [head, "-" * len(head)]
    for r in rows:
        cells = [f"{r[key]:>{w}{fmt}}" for _, w, key, fmt in columns]
        cells += [f"{r['split_us_per_unit'][name]:>{w}.1f}" for name, w in parts]
        lines.append(" ".join(cells))
    return "\n".join(lines)


def _git_rev() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).parent,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loops", default="10,100,1000", help="live loops L, comma-separated")
    parser.add_argument("--units", type=int, default=20000, help="units per run (all loops)")
    parser.add_argument("--min-steps", type=int, default=50, help="fewest steps per loop")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per configuration")
    parser.add_argument("--emit-every", type=int, default=0, help="stream a chunk every k steps")
    parser.add_argument(
        "--batch-sizes", default=None, help="max_batch_size values (default: the engine's, 1)"
    )
    parser.add_argument("--profile", action="store_true", help="cProfile the largest L")
    parser.add_argument("--top", type=int, default=25, help="functions shown by --profile")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    loops = [int(x) for x in args.loops.split(",")]
    steps = {n: max(args.units // n, args.min_steps, 1) for n in loops}
    default_bs = EngineConfig().max_batch_size
    sizes = [int(x) for x in args.batch_sizes.split(",")] if args.batch_sizes else [default_bs, 1]
    load_before = os.getloadavg()
    rows = []
    for max_bs in sizes:
        for num_loops in loops:
            rows.append(measure(num_loops, steps[num_loops], max_bs, args.repeat, args.emit_every))
            print(_table(rows[-1:]).splitlines()[-1], flush=True)
    load_after = os.getloadavg()
    print()
    print(
        "us per WorkUnit (wall / units), best and median of the timed runs; instr = the"
        " instrumented run, split into sched + fold + exec + rest (us per unit)"
    )
    print(_table(rows))
    at_target = [r for r in rows if r["live_loops"] == 1000 and r["max_batch_size"] == default_bs]
    if at_target:
        best = at_target[0]["us_per_unit_best"]
        verdict = "meets" if best <= TARGET_US else "misses"
        print(
            f"\nL=1000, default batch: {best:.1f} us/unit ({verdict} the {TARGET_US:g} us target)"
        )
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f}")
    report = {
        "benchmark": "scheduler_overhead",
        "git_rev": _git_rev(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "load_average_before": load_before,
        "load_average_after": load_after,
        "target_us_per_unit_at_1000": TARGET_US,
        "default_max_batch_size": default_bs,
        "configs": rows,
    }
    if args.profile:
        text = profile(max(loops), steps[max(loops)], default_bs, args.emit_every, args.top)
        print(text)
        report["profile"] = text
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
