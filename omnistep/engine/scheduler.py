"""The step scheduler: pure bookkeeping over ready WorkPlans, no tensors, no asyncio.

Every live loop that is not running has exactly one ready ``WorkPlan``, queued with a priority
(smaller runs first). Plans are grouped by (model, component, ShapeSignature); ``next_batch``
picks the group holding the most urgent plan and takes up to the component's max batch size of
that group's plans, most urgent first. Ties, and plans queued without a priority, go by the
order in which they became ready (``ready_seq``).

Two policies come from the priority the engine passes:

* first come, first served (no priority): the plan that became ready first runs first, which
  interleaves requests round-robin, so a new request's first unit waits for at most one unit of
  every other live request;
* earliest deadline first (the priority is a playback deadline, see ``engine/deadlines.py``):
  the request whose client runs out of audio soonest runs first, so a new request's first chunk
  goes ahead of streams with audio to spare.

Costs: ``enqueue`` is O(log k) (k = plans in the group) plus an O(log g) heap push when the
group's head changes (g = groups with ready plans); ``remove`` is O(1) (entries are dropped
lazily); ``next_batch`` is O(log g) per group it looks at plus O(log k) per unit it takes. A
group whose component is busy is skipped as a whole, never plan by plan.
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


Key = tuple[float, int]  # (priority, ready_seq): the order in which plans run


class _Group:
    """The queued plans of one group key, as a heap by ``Key``, and the group's place in the
    scheduler's heap.

    ``plans`` may hold stale entries (plans removed since: their loop is no longer queued under
    that ready_seq), dropped when they reach the top; ``size`` counts the valid ones.
    ``heap_key`` is the key under which the group's one valid entry sits in the scheduler's
    heap (None: the group is gone); entries with another key are stale. It is at most the key
    of the group's most urgent valid plan (removing that plan leaves the entry early;
    ``next_batch`` moves it back when it pops it).
    """

    __slots__ = ("key", "model_id", "component", "plans", "size", "heap_key")

    def __init__(self, key: GroupKey):
        self.key = key
        self.model_id, self.component = key[0], key[1]
        self.plans: list[tuple[float, int, LiveLoop]] = []
        self.size = 0
        self.heap_key: Key | None = None

    def head(self) -> Key | None:
        """Key of the most urgent valid plan (dropping stale entries on top); None if none."""
        plans = self.plans
        while plans:
            priority, seq, live = plans[0]
            if live.queued and live.ready_seq == seq:
                return (priority, seq)
            heapq.heappop(plans)
        return None


class Scheduler:
    """Groups ready plans by shape and hands out batches (see module docstring).

    Args:
        max_batch_size: ``max_batch_size(model_id, component) -> int`` for a group.
    """

    def __init__(self, max_batch_size: Callable[[str, str], int]):
        self._max_batch_size = max_batch_size
        self._seq = itertools.count()
        self._heap: list[tuple[float, int, _Group]] = []  # (key of the group's head, group)
        self._groups: dict[GroupKey, _Group] = {}
        self.num_queued = 0

    def enqueue(self, live: LiveLoop, priority: float | None = None) -> None:
        """Queue a live loop whose ``plan`` is set, with ``priority`` (smaller runs first; None:
        its ready order, first come first served). Raises ValueError if it has no plan."""
        plan = live.plan
        if plan is None:
            raise ValueError("enqueue needs a live loop with a plan")
        seq = live.ready_seq = next(self._seq)
        prio = float(seq) if priority is None else priority
        live.queued = True
        key = (live.model_id, plan.component, plan.shape)
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = _Group(key)
        heapq.heappush(group.plans, (prio, seq, live))
        group.size += 1
        if group.heap_key is None or (prio, seq) < group.heap_key:
            group.heap_key = (prio, seq)
            heapq.heappush(self._heap, (prio, seq, group))
        self.num_queued += 1

    def remove(self, live: LiveLoop) -> None:
        """Take a queued live loop out (abort); no-op if not queued."""
        if not live.queued:
            return
        live.queued = False
        group = self._groups[live.group_key]
        group.size -= 1
        if not group.size:
            self._drop(group)
        self.num_queued -= 1

    def next_batch(self, can_run: Callable[[str, str], bool] | None = None) -> Batch | None:
        """The next batch to run, or None when nothing runnable is ready. Marks its entries in
        flight. ``can_run(model_id, component)`` False skips groups of a busy component (their
        plans keep their place)."""
        heap = self._heap
        skipped: list[tuple[float, int, _Group]] = []
        batch = None
        while heap and batch is None:
            item = heapq.heappop(heap)
            priority, seq, group = item
            if group.heap_key != (priority, seq):
                continue  # stale: the group emptied, or was moved back already
            head = group.head()
            assert head is not None  # a group with a heap key has valid plans
            if head != (priority, seq):  # its most urgent plan was removed: move the group back
                group.heap_key = head
                heapq.heappush(heap, (*head, group))
                continue
            if can_run is not None and not can_run(group.model_id, group.component):
                skipped.append(item)
                continue
            batch = self._take(group)
        for item in skipped:
            heapq.heappush(heap, item)
        return batch

    def _take(self, group: _Group) -> Batch:
        """Take up to the max batch size of ``group``'s plans, most urgent first."""
        plans = group.plans
        count = min(self._max_batch_size(group.model_id, group.component), group.size)
        entries: list[LiveLoop] = []
        while len(entries) < count:
            _, seq, live = heapq.heappop(plans)
            if live.queued and live.ready_seq == seq:
                live.queued = False
                live.in_flight = True
                entries.append(live)
        group.size -= count
        self.num_queued -= count
        head = group.head() if group.size else None
        if head is not None:
            group.heap_key = head
            heapq.heappush(self._heap, (*head, group))
        else:
            self._drop(group)
        plan = entries[0].plan
        assert plan is not None
        return Batch(group.model_id, group.component, plan.kind, entries)

    def _drop(self, group: _Group) -> None:
        """Forget an empty group; its heap entry goes stale."""
        del self._groups[group.key]
        group.heap_key = None
