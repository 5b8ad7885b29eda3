"""The step scheduler: pure bookkeeping over ready WorkPlans, no tensors, no asyncio.

Every live loop that is not running has exactly one ready ``WorkPlan``. Plans are grouped by
(model, component, ShapeSignature); ``next_batch`` picks the group whose oldest plan became ready
first and takes up to the component's max batch size of that group's plans, oldest first. Ordering
by the time a plan became ready interleaves requests round-robin, so a new request's first unit
waits for at most one unit of every other live request.

Costs: ``enqueue`` and ``remove`` are O(1) plus an O(log g) heap push when a group appears
(g = groups with ready plans); ``next_batch`` is O(log g) per group it looks at plus O(1) per
unit it takes. A group whose component is busy is skipped as a whole, never plan by plan.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
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


class _Group:
    """The queued plans of one group key, oldest first, and the group's place in the heap.

    ``heap_seq`` is the ready_seq under which the group's one valid heap entry sits (-1: none,
    the group is gone); heap entries with another seq are stale and dropped when popped. It is
    at most the ready_seq of the group's oldest plan (removing the oldest plan leaves the entry
    early; ``next_batch`` moves it back when it pops it).
    """

    __slots__ = ("key", "model_id", "component", "plans", "heap_seq")

    def __init__(self, key: GroupKey, heap_seq: int):
        self.key = key
        self.model_id, self.component = key[0], key[1]
        self.plans: OrderedDict[int, LiveLoop] = OrderedDict()  # ready_seq -> live, in order
        self.heap_seq = heap_seq


class Scheduler:
    """Groups ready plans by shape and hands out batches (see module docstring).

    Args:
        max_batch_size: ``max_batch_size(model_id, component) -> int`` for a group.
    """

    def __init__(self, max_batch_size: Callable[[str, str], int]):
        self._max_batch_size = max_batch_size
        self._seq = itertools.count()
        self._heap: list[tuple[int, _Group]] = []  # (ready_seq of the group's head, group)
        self._groups: dict[GroupKey, _Group] = {}
        self.num_queued = 0

    def enqueue(self, live: LiveLoop) -> None:
        """Queue a live loop whose ``plan`` is set. Raises ValueError if it has no plan."""
        plan = live.plan
        if plan is None:
            raise ValueError("enqueue needs a live loop with a plan")
        seq = live.ready_seq = next(self._seq)
        live.queued = True
        key = (live.model_id, plan.component, plan.shape)
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = _Group(key, seq)
            heapq.heappush(self._heap, (seq, group))
        group.plans[seq] = live
        self.num_queued += 1

    def remove(self, live: LiveLoop) -> None:
        """Take a queued live loop out (abort); no-op if not queued."""
        if not live.queued:
            return
        group = self._groups[live.group_key]
        del group.plans[live.ready_seq]
        if not group.plans:
            self._drop(group)
        live.queued = False
        self.num_queued -= 1

    def next_batch(self, can_run: Callable[[str, str], bool] | None = None) -> Batch | None:
        """The next batch to run, or None when nothing runnable is ready. Marks its entries in
        flight. ``can_run(model_id, component)`` False skips groups of a busy component (their
        plans keep their place)."""
        heap = self._heap
        skipped: list[tuple[int, _Group]] = []
        batch = None
        while heap and batch is None:
            item = heapq.heappop(heap)
            seq, group = item
            if group.heap_seq != seq:
                continue  # stale: the group emptied, or was moved back already
            head = next(iter(group.plans))
            if head != seq:  # the oldest plan was removed: move the group back to its new head
                group.heap_seq = head
                heapq.heappush(heap, (head, group))
                continue
            if can_run is not None and not can_run(group.model_id, group.component):
                skipped.append(item)
                continue
            batch = self._take(group)
        for item in skipped:
            heapq.heappush(heap, item)
        return batch

    def _take(self, group: _Group) -> Batch:
        """Take up to the max batch size of ``group``'s plans, oldest first."""
        plans = group.plans
        count = min(self._max_batch_size(group.model_id, group.component), len(plans))
        entries = [plans.popitem(last=False)[1] for _ in range(count)]
        for live in entries:
            live.queued = False
            live.in_flight = True
        self.num_queued -= count
        if plans:
            head = next(iter(plans))
            group.heap_seq = head
            heapq.heappush(self._heap, (head, group))
        else:
            self._drop(group)
        plan = entries[0].plan
        assert plan is not None
        return Batch(group.model_id, group.component, plan.kind, entries)

    def _drop(self, group: _Group) -> None:
        """Forget an empty group; its heap entry goes stale."""
        del self._groups[group.key]
        group.heap_seq = -1
