"""Helpers the in-process benchmarks share (``bench/omni.py``, ``bench/qwen3_tts.py``): machine
load, medians, and a timer around a component's ``execute``.

Standard library only (the component is duck-typed), so any bench script can import it: a
script run as ``python bench/x.py`` has ``bench/`` first on its path.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from typing import Any


def load_avg() -> list[float]:
    """The 1-, 5- and 15-minute load averages, rounded to 2 decimals."""
    return [round(x, 2) for x in os.getloadavg()]


def median(xs: list[float]) -> float:
    """The median of ``xs``; NaN for none."""
    return float(statistics.median(xs)) if xs else math.nan


def union_seconds(intervals: list[tuple[float, float]]) -> float:
    """Seconds covered by the union of ``(start, end)`` intervals (overlaps counted once)."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


class ExecTimer:
    """Wraps a component's ``execute`` (as an instance attribute) and logs each call's
    ``(kind, batch size, start, end)`` (``time.perf_counter`` seconds) in ``log``."""

    def __init__(self, component: Any):
        self.log: list[tuple[str, int, float, float]] = []
        inner = component.execute

        def execute(kind: Any, payloads: Any) -> Any:
            start = time.perf_counter()
            try:
                return inner(kind, payloads)
            finally:
                self.log.append((kind.value, len(payloads), start, time.perf_counter()))

        component.execute = execute

    def seconds(self) -> dict[str, float]:
        """Seconds spent in ``execute``, by unit kind."""
        out: dict[str, float] = {}
        for kind, _, s, e in self.log:
            out[kind] = out.get(kind, 0.0) + e - s
        return out

    def summary(self) -> dict[str, dict[str, float]]:
        """Per unit kind: calls, units, seconds, ms per call, largest and mean batch."""
        out: dict[str, dict[str, float]] = {}
        for kind in sorted({k for k, _, _, _ in self.log}):
            rows = [(b, e - s) for k, b, s, e in self.log if k == kind]
            total = sum(t for _, t in rows)
            out[kind] = {
                "calls": len(rows),
                "units": sum(b for b, _ in rows),
                "seconds": round(total, 3),
                "ms_per_call": round(1000 * total / len(rows), 2),
                "max_batch": max(b for b, _ in rows),
                "mean_batch": round(sum(b for b, _ in rows) / len(rows), 2),
            }
        return out
