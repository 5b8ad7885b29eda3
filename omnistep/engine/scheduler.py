"""The step scheduler: pure bookkeeping over ready WorkPlans, no tensors, no asyncio.

Every live loop that is not running has exactly one ready ``WorkPlan``. Plans are grouped by
(model, component, ShapeSignature); ``next_batch`` picks the group whose oldest plan became ready
first and takes up to the component's max batch size of that group's plans, oldest first. Ordering
by the time a plan became ready interleaves requests round-robin, so a new request's first unit
waits for at most one unit of every other live request. Each operation is O(log n) in ready plans.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from omnistep.core import Loop, LoopState, ShapeSignature, WorkPlan, WorkUnitKind
from omnistep.core.program import LoopNode

GroupKey = tuple[str, str, ShapeSignature]


@dataclass(eq=False)
class LiveLoop:
    """One running loop of one request, as the scheduler tracks it.

    Attributes:
        request_id: the owning request.
        model_id: the card id of the model instance that runs it.
        node: the program node that started it.
        loop: the card's loop object (stateless; state is in ``state``).
        state: the request's loop state.
        plan: the ready plan while queued or running; None otherwise.
        ready_seq: global order in which ``plan`` became ready.
        queued: waiting in a group; ``in_flight``: part of a batch being executed.
    """

    request_id: str
    model_id: str
    node: LoopNode
    loop: Loop
    state: LoopState
    plan: WorkPlan | None = None
    ready_seq: int = 0
    queued: bool = False
    in_flight: bool = False

    @property
    def group_key(self) -> GroupKey:
        assert self.plan is not None
        return (self.model_id, self.plan.component, self.plan.shape)


@dataclass
class Batch:
    """Units of one group run as one ``Component.execute`` call."""

    model_id: str
    component: str
    kind: WorkUnitKind
    entries: list[LiveLoop] = field(default_factory=list)

    @property
    def payloads(self) -> list:
        """One payload per entry, in order."""
        return [e.plan.payload for e in self.entries if e.plan is not None]


class Scheduler:
    """Groups ready plans by shape and hands out batches (see module docstring).

    Args:
        max_batch_size: ``max_batch_size(model_id, component) -> int`` for a group.
    """

    def __init__(self, max_batch_size: Callable[[str, str], int]):
        self._max_batch_size = max_batch_size
        self._seq = itertools.count()
        self._heap: list[tuple[int, LiveLoop]] = []
        self._groups: dict[GroupKey, dict[int, LiveLoop]] = {}
        self.num_queued = 0

    def enqueue(self, live: LiveLoop) -> None:
        """Queue a live loop whose ``plan`` is set. Raises ValueError if it has no plan."""
        if live.plan is None:
            raise ValueError("enqueue needs a live loop with a plan")
        live.ready_seq = next(self._seq)
        live.queued = True
        self._groups.setdefault(live.group_key, {})[live.ready_seq] = live
        heapq.heappush(self._heap, (live.ready_seq, live))
        self.num_queued += 1

    def remove(self, live: LiveLoop) -> None:
        """Take a queued live loop out (abort); no-op if not queued."""
        if not live.queued:
            return
        group = self._groups[live.group_key]
        del group[live.ready_seq]
        if not group:
            del self._groups[live.group_key]
        live.queued = False
        self.num_queued -= 1

    def next_batch(self, can_run: Callable[[str, str], bool] | None = None) -> Batch | None:
        """The next batch to run, or None when nothing runnable is ready. Marks its entries in
        flight. ``can_run(model_id, component)`` False skips groups of a busy component (their
        plans keep their place)."""
        skipped: list[tuple[int, LiveLoop]] = []
        batch = None
        while self._heap and batch is None:
            item = heapq.heappop(self._heap)
            head = item[1]
            if not head.queued:
                continue
            if can_run is not None and not can_run(head.model_id, head.group_key[1]):
                skipped.append(item)
                continue
            batch = self._take_group(head)
        for item in skipped:
            heapq.heappush(self._heap, item)
        return batch

    def _take_group(self, head: LiveLoop) -> Batch:
        key = head.group_key
        group = self._groups[key]
        limit = self._max_batch_size(head.model_id, key[1])
        entries = list(itertools.islice(group.values(), limit))
        for live in entries:
            self.remove(live)
            live.in_flight = True
        assert head.plan is not None
        return Batch(head.model_id, key[1], head.plan.kind, entries)
