"""Event counts and timings the engine keeps for monitoring. Pure Python; no prometheus_client.

The engine updates an ``EngineMetrics`` where events happen, with a few integer increments
each: a request ends (its status; its real-time factor when it finished with audio), a request
publishes its first audio (time to first audio), a batch returns (its size, per component and
unit kind). What the engine holds at a moment (live requests, queued units, KV blocks) is not
kept: ``measure_occupancy`` reads it from the engine's state when asked
(``AsyncEngine.occupancy()``, ``AsyncEngine.stats()``).
``omnistep.server.metrics`` turns both into Prometheus metrics at scrape time.

Both run on the event loop thread, so no locks are needed.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from omnistep.core import ModelInstance, RequestAbortedError, RequestTimeoutError
from omnistep.engine.stream import RequestRun
from omnistep.kv import kv_usage

REQUEST_STATUSES = ("ok", "error", "aborted", "timeout", "rejected")
"""How a request ended: finished, failed in a step, aborted (client gone, shutdown), aborted at
the request timeout, or refused because the engine was full (HTTP 429)."""

TTFA_BUCKETS = (0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0)
"""Upper bounds (seconds) of the time-to-first-audio histogram."""

RTF_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0, 10.0)
"""Upper bounds of the real-time-factor histogram (wall seconds per audio second)."""

BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
"""Upper bounds (units) of the batch size histogram."""


class Histogram:
    """Counts of observed values in fixed buckets, with their sum (Prometheus semantics: a
    value lands in the first bucket whose upper bound is >= it; larger ones in +Inf).

    Args:
        bounds: increasing finite upper bounds.
    """

    __slots__ = ("bounds", "counts", "sum", "count")

    def __init__(self, bounds: Sequence[float]):
        if list(bounds) != sorted(set(bounds)):
            raise ValueError(f"bucket bounds must increase strictly, got {bounds}")
        self.bounds = tuple(float(b) for b in bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        """Add one observation."""
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def cumulative(self) -> list[tuple[float, int]]:
        """``(upper bound, observations <= it)`` per bucket, ending with ``(inf, count)``."""
        out, total = [], 0
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            total += count
            out.append((bound, total))
        return out


def batch_histogram(
    sizes: Mapping[int, int], bounds: Sequence[float] = BATCH_SIZE_BUCKETS
) -> Histogram:
    """A Histogram of batch sizes from exact counts (``{size: batches}``)."""
    hist = Histogram(bounds)
    for size, batches in sizes.items():
        hist.counts[bisect.bisect_left(hist.bounds, size)] += batches
        hist.sum += size * batches
        hist.count += batches
    return hist


def request_status(error: BaseException | None) -> str:
    """The ``REQUEST_STATUSES`` entry of a request that ended with ``error`` (None: ok)."""
    if error is None:
        return "ok"
    if isinstance(error, RequestTimeoutError):  # a subclass of RequestAbortedError
        return "timeout"
    if isinstance(error, RequestAbortedError):
        return "aborted"
    return "error"


class EngineMetrics:
    """Counters and histograms of one engine, by model card id.

    Args:
        models: the card ids of the engine's models.

    Attributes:
        requests: requests by ``(model, status)``; statuses are ``REQUEST_STATUSES``. Requests
            refused as invalid input (HTTP 400/404) never start and are not counted.
        ttfa: per model, seconds from ``add_request`` (the wait for EDF admission included) to
            the request's first audio chunk; one observation per request that sent audio,
            whatever its end.
        rtf: per model, wall seconds from ``add_request`` to the end divided by the seconds of
            audio sent, for requests that finished ok with audio.
        batches: batches by ``(model, component, unit kind, size)``; the engine increments it
            directly, once per batch.
    """

    def __init__(self, models: Iterable[str]):
        self.requests: Counter[tuple[str, str]] = Counter()
        self.ttfa = {model: Histogram(TTFA_BUCKETS) for model in models}
        self.rtf = {model: Histogram(RTF_BUCKETS) for model in self.ttfa}
        self.batches: Counter[tuple[str, str, str, int]] = Counter()

    def first_audio(self, model: str, seconds: float) -> None:
        """A request of ``model`` published its first audio ``seconds`` after it was added."""
        self.ttfa[model].observe(seconds)

    def request_ended(
        self, model: str, error: BaseException | None, wall_s: float, audio_s: float
    ) -> None:
        """A request of ``model`` ended (``error`` None: ok) after ``wall_s`` seconds, having
        sent ``audio_s`` seconds of audio."""
        status = request_status(error)
        self.requests[(model, status)] += 1
        if status == "ok" and audio_s > 0.0:
            self.rtf[model].observe(wall_s / audio_s)

    def rejected(self, model: str) -> None:
        """A request of ``model`` was refused: the engine was full."""
        self.requests[(model, "rejected")] += 1

    def batch_sizes(self) -> dict[tuple[str, str], Counter[int]]:
        """Batches by ``(model, component)``: ``{size: batches}``."""
        out: dict[tuple[str, str], Counter[int]] = {}
        for (model, component, _, size), batches in self.batches.items():
            out.setdefault((model, component), Counter())[size] += batches
        return out

    def work_units(self) -> Counter[tuple[str, str, str]]:
        """WorkUnits executed by ``(model, component, unit kind)``."""
        out: Counter[tuple[str, str, str]] = Counter()
        for (model, component, kind, size), batches in self.batches.items():
            out[(model, component, kind)] += size * batches
        return out


@dataclass(frozen=True)
class Occupancy:
    """What an engine holds at one moment, by label; every count is 0 when it is idle.

    Attributes:
        live_requests: unfinished requests by model (every served model listed).
        waiting_requests: of those, the ones waiting for EDF admission, by model.
        queued_units: WorkUnits ready in the scheduler.
        running_batches: batches being executed by ``(model, component)`` (every component).
        live_loops: live loops by ``(model, loop kind)`` (every kind the model's card has).
        kv_blocks: ``(used, free)`` KV blocks by ``(model, component)``, for the components
            that keep a paged KV cache (in process or in Ray actors).
    """

    live_requests: dict[str, int]
    waiting_requests: dict[str, int]
    queued_units: int
    running_batches: dict[tuple[str, str], int]
    live_loops: dict[tuple[str, str], int]
    kv_blocks: dict[tuple[str, str], tuple[int, int]]

    def totals(self) -> dict[str, int]:
        """Each count summed over its labels (``AsyncEngine.stats()``): ``live_requests``,
        ``waiting_requests``, ``live_loops``, ``queued_units``, ``running_batches``,
        ``kv_blocks_used``."""
        return {
            "live_requests": sum(self.live_requests.values()),
            "waiting_requests": sum(self.waiting_requests.values()),
            "live_loops": sum(self.live_loops.values()),
            "queued_units": self.queued_units,
            "running_batches": sum(self.running_batches.values()),
            "kv_blocks_used": sum(used for used, _free in self.kv_blocks.values()),
        }


def kv_blocks(models: Mapping[str, ModelInstance]) -> dict[tuple[str, str], tuple[int, int]]:
    """``(used, free)`` KV blocks by ``(model id, component name)`` of every component keeping
    a paged KV cache (``omnistep.kv.kv_usage``; in the actors for components placed there)."""
    found = {}
    for model_id, model in models.items():
        for name, component in model.components.items():
            usage = kv_usage(component)
            if usage is not None:
                found[(model_id, name)] = usage
    return found


def measure_occupancy(
    models: Mapping[str, ModelInstance],
    runs: Iterable[RequestRun],
    busy: Mapping[tuple[str, str], int],
    queued_units: int,
) -> Occupancy:
    """What an engine holds now, every label that can occur listed (0 when idle).

    Args:
        models: the engine's models by card id.
        runs: its unfinished requests (a run with ``held`` set waits for admission).
        busy: batches being executed by ``(model, component)``.
        queued_units: WorkUnits ready in its scheduler.
    """
    live = dict.fromkeys(models, 0)
    waiting = dict.fromkeys(models, 0)
    loops = {(m, spec.kind.value): 0 for m, i in models.items() for spec in i.card.loops}
    for run in runs:
        live[run.card_id] += 1
        if run.held is not None:
            waiting[run.card_id] += 1
        for live_loop in run.live.values():
            key = (run.card_id, live_loop.loop.kind.value)
            loops[key] = loops.get(key, 0) + 1
    running = {
        (model_id, name): busy.get((model_id, name), 0)
        for model_id, model in models.items()
        for name in model.components
    }
    return Occupancy(live, waiting, queued_units, running, loops, kv_blocks(models))
