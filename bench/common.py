"""Helpers the benchmarks share: machine load, medians, a timer around a component's
``execute`` (``bench/omni.py``, ``bench/qwen3_tts.py``), a process's CPU seconds, the pooling of
HTTP bursts measured by ``omnistep.bench.client`` (TTFA, throughput, underruns of its simulated
real-time player; ``bench/speech.py``, ``bench/scheduling.py``) and target rows in the form
``bench/compare.py`` reads.

Standard library only at import (the component is duck-typed; ``pool_bursts`` imports
``omnistep.bench.client`` when called), so any bench script can import it: a script run as
``python bench/x.py`` has ``bench/`` first on its path.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from pathlib import Path
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
        """``call_summary`` of the logged calls."""
        return call_summary(self.log)


def call_summary(calls: list[tuple[str, int, float, float]]) -> dict[str, dict[str, float]]:
    """Per unit kind of ``(kind, batch size, start, end)`` calls: calls, units, seconds, ms
    per call, largest and mean batch."""
    out: dict[str, dict[str, float]] = {}
    for kind in sorted({k for k, _, _, _ in calls}):
        rows = [(b, e - s) for k, b, s, e in calls if k == kind]
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


def process_cpu_seconds(pid: int | None) -> float | None:
    """User + system CPU seconds of process ``pid`` (all its threads, from ``/proc/PID/stat``);
    None if unknown (no pid, no such process, no ``/proc``)."""
    if pid is None:
        return None
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rpartition(")")[2].split()  # fields 3.. of proc(5); utime, stime are 14, 15
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pool_bursts(levels: list[dict]) -> dict:
    """Pool several bursts of one concurrency level into one row.

    Args:
        levels: ``omnistep.bench.client.summarize_level`` dicts (each with its ``results``
            per request and ``audio_s_per_s``), one per burst.

    Returns:
        ``requests`` and ``errors`` (summed); over the successful requests of all bursts:
        TTFA p50/p90/p99/max (``ttfa_p50_s`` ...), end-to-end p50/max (``e2e_p50_s``,
        ``e2e_max_s``), the median audio seconds per request, the simulated player's
        ``underruns`` (count) and ``underrun_s`` (seconds); ``audio_s_per_s``, the median over
        bursts of each burst's audio seconds per wall second, and ``audio_s_per_s_pooled``, all
        bursts' audio over all their wall time. Percentiles are numpy's linear interpolation;
        a figure with no request behind it is None.
    """
    from omnistep.bench.client import percentile

    results = [r for level in levels for r in level["results"] if r.get("error") is None]
    ttfa = sorted(r["ttfa_s"] for r in results if r.get("ttfa_s") is not None)
    e2e = sorted(r["e2e_s"] for r in results if r.get("e2e_s") is not None)
    runs = [u for r in results for u in r.get("underruns_s", [])]
    rates = [level["audio_s_per_s"] for level in levels if level.get("audio_s_per_s")]
    wall = sum(level.get("wall_s") or 0.0 for level in levels)
    return {
        "requests": sum(level["requests"] for level in levels),
        "errors": sum(level["errors"] for level in levels),
        "ttfa_p50_s": percentile(ttfa, 50),
        "ttfa_p90_s": percentile(ttfa, 90),
        "ttfa_p99_s": percentile(ttfa, 99),
        "ttfa_max_s": ttfa[-1] if ttfa else None,
        "e2e_p50_s": percentile(e2e, 50),
        "e2e_max_s": e2e[-1] if e2e else None,
        "audio_s_per_request": statistics.median(r["audio_s"] for r in results)
        if results
        else None,
        "underruns": len(runs),
        "underrun_s": float(sum(runs)),
        "audio_s_per_s": statistics.median(rates) if rates else None,
        "audio_s_per_s_pooled": sum(level.get("audio_s") or 0.0 for level in levels) / wall
        if wall > 0
        else None,
    }


def target_row(name: str, value: float | None, op: str, target: float, paired: list) -> dict:
    """One target as ``bench/compare.py`` reads it: ``name``, ``value``, ``op`` (``"<="`` or
    ``">="``), ``target``, ``met`` (False when ``value`` is None or NaN) and ``paired`` (the
    same figure per round; None where a round has none)."""
    known = value is not None and not math.isnan(value)
    met = known and (value <= target if op == "<=" else value >= target)
    return {
        "name": name,
        "value": round(value, 4) if known else None,
        "op": op,
        "target": target,
        "met": bool(met),
        "paired": [None if p is None else round(p, 4) for p in paired],
    }


SENTENCES = (
    "Please leave the package by the blue door on the left side of the house.",
    "The morning train to the city was late again because of the heavy snow.",
    "She opened the window and listened to the birds singing in the old garden.",
    "We will meet at the corner cafe at noon and walk to the museum together.",
    "His brother fixed the bicycle with a few simple tools and a lot of patience.",
    "The library closes early on Fridays, so return your books before four o'clock.",
    "A small boat drifted slowly across the lake while the sun went down behind the hills.",
    "Remember to water the plants and feed the cat while I am away this weekend.",
)
"""Eight English sentences of 14-16 words: the texts of the family benches (request ``i``
speaks ``SENTENCES[i % 8]``; ``bench/qwen3_tts.py``, ``bench/families.py``)."""


def percentile(xs: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``xs`` (``omnistep.bench.client.percentile``: linear
    interpolation, numpy's default), NaN for none rather than None."""
    from omnistep.bench.client import percentile as client_percentile

    value = client_percentile(xs, q)
    return math.nan if value is None else value


def parse_levels(text: str) -> list[int]:
    """``--concurrency``: ``omnistep.bench.client.parse_levels`` (sorted, unique, each >= 1),
    needing at least two levels, since the benches compare one level against another.

    Raises:
        argparse.ArgumentTypeError: not a comma list of >= 2 positive integers.
    """
    import argparse

    from omnistep.bench.client import parse_levels as client_parse_levels

    try:
        levels = client_parse_levels(text)
    except ValueError:
        levels = []
    if len(levels) < 2:
        raise argparse.ArgumentTypeError("--concurrency needs >= 2 levels >= 1, e.g. 1,4,8")
    return levels


def fmt(x: float | None, spec: str) -> str:
    """``format(x, spec)`` for a table cell; ``-`` for None or NaN (a figure with nothing
    behind it)."""
    return "-" if x is None or x != x else format(x, spec)


def jsonable(x: Any) -> Any:
    """``x`` with what ``json.dumps`` cannot write replaced: dict keys as strings, tuples as
    lists, numpy arrays and scalars (anything with ``tolist``) as Python values, NaN as None."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [jsonable(v) for v in x]
    if hasattr(x, "tolist"):
        return jsonable(x.tolist())
    if isinstance(x, float) and x != x:
        return None
    return x


class StreamTiming:
    """One request of a burst, timed from its submission: ``submitted``, ``first`` (its first
    non-empty audio chunk, None without audio) and ``end`` (``time.perf_counter`` seconds),
    ``samples`` of audio received, ``arrivals``: ``(seconds since submission, samples)`` per
    audio chunk, and its ``stream`` (usage, trajectories)."""

    def __init__(self, stream: Any, submitted: float):
        self.stream, self.submitted = stream, submitted
        self.first: float | None = None
        self.end = submitted
        self.samples = 0
        self.arrivals: list[tuple[float, int]] = []

    @property
    def ttfa_s(self) -> float | None:
        """Seconds from submission to the first audio chunk; None without audio."""
        return None if self.first is None else self.first - self.submitted

    @property
    def total_s(self) -> float:
        """Seconds from submission to the stream's end."""
        return self.end - self.submitted


async def timed_streams(engine: Any, requests: list[Any]) -> tuple[float, list[StreamTiming]]:
    """Submit ``requests`` to ``engine`` (an ``AsyncEngine``: ``add_request``) one after the
    other, read every stream to its end concurrently and time each one's audio chunks (those
    whose ``audio`` holds samples).

    Returns:
        The burst's start (``time.perf_counter`` seconds, before the first submission) and one
        ``StreamTiming`` per request, in order.
    """
    import asyncio

    start = time.perf_counter()
    timings = []
    for request in requests:
        submitted = time.perf_counter()
        timings.append(StreamTiming(engine.add_request(request), submitted))

    async def consume(t: StreamTiming) -> None:
        async for chunk in t.stream:
            audio = getattr(chunk, "audio", None)
            if audio is not None and audio.size:
                now = time.perf_counter()
                t.first = t.first or now
                t.samples += audio.size
                t.arrivals.append((now - t.submitted, audio.size))
        t.end = time.perf_counter()

    await asyncio.gather(*(consume(t) for t in timings))
    return start, timings
