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

Admission by the KV pool (``omnistep.kv.KVPool``, as nano-vllm's scheduler asks its block
manager): for a component that keeps a paged KV cache, a PREFILL batch takes plans, most urgent
first, only while the pool admits them (their blocks, after a shared prefix, are taken then);
a group whose most urgent prefill does not fit is skipped, keeping its place, so the decode
steps that will free blocks run instead of a prefill that would fail. An AR_TOKEN batch whose
next tokens do not fit preempts its least urgent sequences (their steps answer preempted and
their loops prefill again later) until the rest fit, under every policy.

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
from omnistep.kv import KVPool

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
        kv_pool: ``kv_pool(model_id, component)``: the component's KV pool, None when it
            keeps none (or runs where the scheduler cannot ask it); no admission then.

    Attributes:
        num_queued: plans queued now.
        num_preemptions: sequences preempted so far to let a decode batch fit.
        num_kv_waits: times a group's most urgent prefill waited for KV blocks.
    """

    def __init__(
        self,
        max_batch_size: Callable[[str, str], int],
        kv_pool: Callable[[str, str], KVPool | None] | None = None,
    ):
        self._max_batch_size = max_batch_size
        self._kv_pool = kv_pool
        self.num_preemptions = 0
        self.num_kv_waits = 0
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
            if batch is None:  # its most urgent prefill waits for KV blocks
                self.num_kv_waits += 1
                skipped.append(item)
        for item in skipped:
            heapq.heappush(heap, item)
        return batch

    def _take(self, group: _Group) -> Batch | None:
        """Take up to the max batch size of ``group``'s plans, most urgent first, prefills only
        while the KV pool admits them; None (nothing taken) when the first does not fit. A
        decode batch preempts its least urgent sequences until the rest fit."""
        pool = self._kv_pool(group.model_id, group.component) if self._kv_pool else None
        plans = group.plans
        count = min(self._max_batch_size(group.model_id, group.component), group.size)
        entries: list[LiveLoop] = []
        while len(entries) < count:
            _, seq, live = plans[0]
            if not (live.queued and live.ready_seq == seq):
                heapq.heappop(plans)  # stale
                continue
            plan = live.plan
            assert plan is not None
            prefill = plan.kind is WorkUnitKind.PREFILL
            if pool is not None and prefill and not pool.admit(plan.payload):
                break
            heapq.heappop(plans)
            live.queued = False
            live.in_flight = True
            entries.append(live)
        if not entries:
            return None
        group.size -= len(entries)
        self.num_queued -= len(entries)
        head = group.head() if group.size else None
        if head is not None:
            group.heap_key = head
            heapq.heappush(self._heap, (*head, group))
        else:
            self._drop(group)
        kind = entries[0].plan.kind  # type: ignore[union-attr]
        if pool is not None and kind is WorkUnitKind.AR_TOKEN:
            self._fit_decode(pool, entries)
        return Batch(group.model_id, group.component, kind, entries)

    def _fit_decode(self, pool: KVPool, entries: list[LiveLoop]) -> None:
        """Preempt the least urgent sequences of a decode batch until the others' next
        tokens fit (all of them, if even the most urgent's does not). The preempted units
        stay in the batch: the component answers them preempted."""
        payloads = [e.plan.payload for e in entries]  # type: ignore[union-attr]
        while payloads and not pool.can_append(payloads):
            pool.preempt(payloads.pop())
            self.num_preemptions += 1

    def _drop(self, group: _Group) -> None:
        """Forget an empty group; its heap entry goes stale."""
        del self._groups[group.key]
        group.heap_key = None
