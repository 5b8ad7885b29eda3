"""Request admission under EDF: whether a new audio request starts now or waits in a queue
until the streams already playing have audio to spare (the policy and its reasons are in
``engine/deadlines.py``).

``Admission`` is the ``AsyncEngine``'s collaborator for it: it keeps the queue of requests
that wait, asks the ``AdmissionPolicy`` with the admitted streams' clocks, the expected run
time of their next units and the measured production rate, and starts a waiting request (its
held plans join the scheduler's queue, through the engine) once the policy allows. The engine
makes one only when scheduling is EDF with an admission guard. Imports ``omnistep.core`` and
the engine's deadline, scheduler and stream types only.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable

from omnistep.core import TEXT_INPUT_SLOT, Modality, ModelInstance, WorkPlan
from omnistep.engine.deadlines import AdmissionPolicy, CapacityMeter, PlaybackClock
from omnistep.engine.stream import RequestRun

ADMISSION_POLL_S = 0.05
"""Seconds between admission checks while requests wait and no step wakes the loop."""


class Admission:
    """The queue of requests waiting for EDF admission, and the policy's answers.

    Args:
        policy: when a waiting request may start.
        capacity: the engine's measured production rate (audio seconds per busy second).
        runs: the engine's unfinished requests.
        unit_seconds: the expected run time of a unit, ``(model id, plan) -> seconds``.
        parallel: batches of a model that can run at once (the rate's number of workers).
        release: starts an admitted request (queues the plans it made while it waited).
        first_audio_s: how soon after admission a request's first audio is due
            (``EngineConfig.first_audio_s``).
    """

    def __init__(
        self,
        policy: AdmissionPolicy,
        capacity: CapacityMeter,
        runs: Callable[[], Iterable[RequestRun]],
        unit_seconds: Callable[[str, WorkPlan], float],
        parallel: Callable[[ModelInstance], int],
        release: Callable[[RequestRun], None],
        first_audio_s: float,
    ):
        self.policy = policy
        self.waiting: deque[RequestRun] = deque()
        """Requests added and not admitted yet, oldest first."""
        self._capacity = capacity
        self._runs = runs
        self._unit_seconds = unit_seconds
        self._parallel = parallel
        self._release = release
        self._first_audio_s = first_audio_s

    def holds(self, run: RequestRun, now: float, continues: bool) -> bool:
        """Whether a new request must wait (it joins the queue then): an audio request that
        does not continue a playing stream (``continues``), while others wait before it or
        the policy says no."""
        if continues or Modality.AUDIO not in run.ctx.request.output_modalities:
            return False
        if self.waiting or not self.may_admit(run, now):
            self.waiting.append(run)
            return True
        return False

    def requeue(self, run: RequestRun) -> bool:
        """Put a request a weight drain held in the queue when it is an audio request (still a
        newcomer: admission decides when it starts); False (not queued) otherwise."""
        if Modality.AUDIO not in run.ctx.request.output_modalities:
            return False
        self.waiting.append(run)
        return True

    def admit_waiting(self) -> None:
        """Admit waiting requests, oldest first, while the admission policy allows; their held
        plans join the queue. A request still waiting is looked at again at the next step."""
        now = time.monotonic()
        while self.waiting:
            run = self.waiting[0]
            if not run.finished:
                if not self.may_admit(run, now):
                    return
                if run.clock is not None and not run.clock.started:
                    # First audio is due first_audio_s after admission, not after arrival:
                    # a request that waited would otherwise be overdue and run ahead of
                    # every admitted stream, starving those whose buffers run low.
                    run.clock.first_audio_s = now - run.clock.arrival + self._first_audio_s
                self._release(run)
            self.waiting.popleft()

    def may_admit(self, run: RequestRun, now: float) -> bool:
        """The admission policy's answer for ``run`` given the admitted audio requests."""
        clocks: dict[int, PlaybackClock] = {}  # by identity: the runs of one stream share one
        leads: dict[int, float] = {}  # clock id -> its next unit's expected seconds (the most)
        for r in self._runs():
            if (
                r.held is None
                and r.clock is not None
                and Modality.AUDIO in r.ctx.request.output_modalities
                and not awaits_client_text(r)
            ):
                key = id(r.clock)
                clocks[key] = r.clock
                leads[key] = max(leads.get(key, 0.0), self._next_unit_seconds(r))
        limit = run.model.card.max_starting
        rate = self._capacity.rate(self._parallel(run.model)) if limit is not None else None
        return self.policy.may_admit(
            now, run.waiting_since, clocks.values(), limit, rate, leads.values()
        )

    def _next_unit_seconds(self, run: RequestRun) -> float:
        """The expected run time of the run's queued units, the longest (0.0: none queued)."""
        return max(
            (
                self._unit_seconds(live.model_id, live.plan)
                for live in run.live.values()
                if live.plan is not None
            ),
            default=0.0,
        )


def awaits_client_text(run: RequestRun) -> bool:
    """Whether the request has nothing to compute until its client sends more text (its text
    input is open and every live loop is parked): its audio running out is then the client's
    pause, not a stream the engine is late for, so admission does not wait on it."""
    text_input = run.ctx.slots.get(TEXT_INPUT_SLOT)
    if text_input is None or text_input.closed:
        return False
    return not any(live.queued or live.in_flight for live in run.live.values())
