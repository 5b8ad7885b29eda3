"""Scheduler unit tests with hand-built plans: grouping by shape, order, batch limits, removal."""

from omnistep.core import ShapeSignature, WorkPlan, WorkUnitKind
from omnistep.core.program import LoopNode
from omnistep.engine import LiveLoop, Scheduler

NODE = LoopNode("n", "l")


def _live(req: str, dims=(1,), component="c", tag="", kind=WorkUnitKind.AR_TOKEN) -> LiveLoop:
    live = LiveLoop(req, "m", NODE, loop=None, state=None)  # type: ignore[arg-type]
    live.plan = WorkPlan(kind, component, ShapeSignature(kind, dims, tag), payload=req)
    return live


def _sched(limit=8) -> Scheduler:
    return Scheduler(lambda model, component: limit)


def test_groups_by_shape_and_component():
    s = _sched()
    lives = [_live("a"), _live("b", dims=(2,)), _live("c"), _live("d", component="v")]
    for live in lives:
        s.enqueue(live)
    first = s.next_batch()
    assert [e.request_id for e in first.entries] == ["a", "c"]
    assert first.payloads == ["a", "c"]
    assert all(e.in_flight and not e.queued for e in first.entries)
    assert [e.request_id for e in s.next_batch().entries] == ["b"]
    second = s.next_batch()
    assert (second.component, [e.request_id for e in second.entries]) == ("v", ["d"])
    assert s.next_batch() is None
    assert s.num_queued == 0


def test_tags_keep_units_apart():
    s = _sched()
    for name in "abc":
        s.enqueue(_live(name, tag=name))
    sizes = [len(s.next_batch().entries) for _ in range(3)]
    assert sizes == [1, 1, 1]


def test_batch_limit_and_fifo_within_group():
    s = _sched(limit=3)
    for i in range(7):
        s.enqueue(_live(f"r{i}"))
    batches = [[e.request_id for e in s.next_batch().entries] for _ in range(3)]
    assert batches == [["r0", "r1", "r2"], ["r3", "r4", "r5"], ["r6"]]


def test_oldest_ready_group_goes_first():
    s = _sched()
    s.enqueue(_live("x", dims=(5,)))
    s.enqueue(_live("y", dims=(1,)))
    s.enqueue(_live("z", dims=(5,)))
    assert [e.request_id for e in s.next_batch().entries] == ["x", "z"]


def test_remove_drops_queued_units():
    s = _sched()
    a, b = _live("a"), _live("b")
    s.enqueue(a)
    s.enqueue(b)
    s.remove(a)
    s.remove(a)  # idempotent
    assert [e.request_id for e in s.next_batch().entries] == ["b"]
    assert s.next_batch() is None


def test_requeued_units_do_not_jump_an_older_group():
    """Units taken in a batch and queued again are younger than a group that waited meanwhile."""
    s = _sched(limit=2)
    a, b, c = _live("a"), _live("b"), _live("c", dims=(2,))
    for live in (a, b, c):
        s.enqueue(live)
    for live in s.next_batch().entries:  # a, b run and come back with their next plans
        live.in_flight = False
        s.enqueue(live)
    assert [e.request_id for e in s.next_batch().entries] == ["c"]
    assert [e.request_id for e in s.next_batch().entries] == ["a", "b"]


def test_removing_a_group_head_keeps_the_order_of_the_rest():
    s = _sched()
    x1, y, x2 = _live("x1", dims=(5,)), _live("y"), _live("x2", dims=(5,))
    for live in (x1, y, x2):
        s.enqueue(live)
    s.remove(x1)  # group (5,) now starts at x2, which became ready after y
    assert [e.request_id for e in s.next_batch().entries] == ["y"]
    assert [e.request_id for e in s.next_batch().entries] == ["x2"]
    assert s.next_batch() is None and s.num_queued == 0


def test_busy_component_is_skipped_and_keeps_its_place():
    s = _sched()
    for live in (_live("a"), _live("b", component="v"), _live("c")):
        s.enqueue(live)
    batch = s.next_batch(lambda model, component: component != "c")
    assert (batch.component, [e.request_id for e in batch.entries]) == ("v", ["b"])
    assert s.next_batch(lambda model, component: False) is None
    assert [e.request_id for e in s.next_batch().entries] == ["a", "c"]


# ---------------------------------------------------------------- priorities (EDF)


def test_most_urgent_group_goes_first_and_urgent_plans_lead_their_batch():
    s = _sched(limit=2)
    s.enqueue(_live("late", dims=(5,)), priority=9.0)
    s.enqueue(_live("soon", dims=(1,)), priority=2.0)
    s.enqueue(_live("mid", dims=(5,)), priority=4.0)
    s.enqueue(_live("urgent", dims=(5,)), priority=1.0)
    s.enqueue(_live("tie", dims=(5,)), priority=4.0)  # same deadline as "mid", ready later
    assert [e.request_id for e in s.next_batch().entries] == ["urgent", "mid"]
    assert [e.request_id for e in s.next_batch().entries] == ["soon"]
    assert [e.request_id for e in s.next_batch().entries] == ["tie", "late"]
    assert s.next_batch() is None and s.num_queued == 0


def test_removing_the_most_urgent_plan_reorders_groups():
    s = _sched()
    a = _live("a", dims=(1,))
    s.enqueue(a, priority=1.0)
    s.enqueue(_live("b", dims=(1,)), priority=5.0)
    s.enqueue(_live("c", dims=(2,)), priority=3.0)
    s.remove(a)
    assert [e.request_id for e in s.next_batch().entries] == ["c"]
    assert [e.request_id for e in s.next_batch().entries] == ["b"]


def test_a_requeued_plan_gets_its_new_priority():
    s = _sched(limit=1)
    x, y = _live("x"), _live("y")
    s.enqueue(x, priority=1.0)
    s.enqueue(y, priority=2.0)
    assert s.next_batch().entries == [x]
    x.in_flight = False
    s.enqueue(x, priority=3.0)  # a stream that now has audio buffered
    assert s.next_batch().entries == [y]
    assert s.next_batch().entries == [x]


# ---------------------------------------------------------------- admission by the KV pool


class FakePool:
    """A KV pool of ``num_blocks`` blocks as the scheduler sees it (``omnistep.kv.KVPool``):
    a prefill payload ``(seq_id, blocks)`` takes its blocks when they are free; a decode step
    of a held sequence takes one more block; ``preempt`` frees a sequence's blocks."""

    def __init__(self, num_blocks: int):
        self.num_free = num_blocks
        self.held: dict[str, int] = {}
        self.admitted: list[str] = []
        self.preempted: list[str] = []

    def admit(self, payload) -> bool:
        seq_id, blocks = payload
        if blocks > self.num_free:
            return False
        self.num_free -= blocks
        self.held[seq_id] = blocks
        self.admitted.append(seq_id)
        return True

    def can_append(self, payloads) -> bool:
        return sum(1 for seq_id, _ in payloads if seq_id in self.held) <= self.num_free

    def preemption_frees(self, payload) -> int:
        return self.held.get(payload[0], 0)

    def preempt(self, payload) -> int:
        freed = self.held.pop(payload[0], 0)
        self.num_free += freed
        self.preempted.append(payload[0])
        return freed

    def finish(self, seq_id: str) -> None:
        self.num_free += self.held.pop(seq_id)


def _unit(req: str, blocks: int, kind=WorkUnitKind.PREFILL) -> LiveLoop:
    live = LiveLoop(req, "m", NODE, loop=None, state=None)  # type: ignore[arg-type]
    live.plan = WorkPlan(kind, "talker", ShapeSignature(kind), payload=(req, blocks))
    return live


def _pooled(pool: FakePool, limit: int = 8) -> Scheduler:
    return Scheduler(lambda model, component: limit, lambda model, component: pool)


def _ids(batch) -> list[str]:
    return [e.request_id for e in batch.entries]


def test_prefills_are_admitted_in_order_while_their_blocks_fit():
    """FCFS: a, b fit (4 of 5 blocks); c (2) does not, and neither does the younger d (1):
    admission stops at the first that does not fit, which keeps its place until blocks free."""
    pool = FakePool(5)
    s = _pooled(pool)
    for live in (_unit("a", 2), _unit("b", 2), _unit("c", 2), _unit("d", 1)):
        s.enqueue(live)
    assert _ids(s.next_batch()) == ["a", "b"]
    assert pool.admitted == ["a", "b"] and pool.num_free == 1
    assert s.next_batch() is None and s.num_queued == 2 and s.num_kv_waits == 1
    pool.finish("a")
    assert _ids(s.next_batch()) == ["c", "d"]
    assert pool.admitted == ["a", "b", "c", "d"] and pool.num_free == 0


def test_a_prefill_without_room_lets_less_urgent_decode_steps_run():
    """EDF: the most urgent unit is a prefill that does not fit; it is not dispatched (it
    would fail) and the decode steps that will free its room run instead."""
    pool = FakePool(4)
    s = _pooled(pool)
    for live in (_unit("x", 2), _unit("y", 2)):
        s.enqueue(live)
    assert _ids(s.next_batch()) == ["x", "y"]
    s.enqueue(_unit("late", 3), priority=0.0)  # earliest deadline, 3 blocks, none free
    for name in ("x", "y"):
        s.enqueue(_unit(name, 0, WorkUnitKind.AR_TOKEN), priority=5.0)
    batch = s.next_batch()
    assert batch.kind is WorkUnitKind.AR_TOKEN and _ids(batch) == ["x", "y"]
    assert pool.preempted == ["y"]  # no block free: y's 2 blocks make room for x's step
    assert pool.num_free == 2
    assert s.next_batch() is None  # "late" still does not fit
    pool.finish("x")
    assert _ids(s.next_batch()) == ["late"]


def test_can_append_preempts_the_least_urgent_sequences_of_a_decode_batch():
    """Three sequences of one block each fill the pool: the two least urgent (by priority,
    not by arrival) are preempted and stay in the batch; the most urgent's step fits."""
    pool = FakePool(3)
    s = _pooled(pool)
    for name in "abc":
        s.enqueue(_unit(name, 1))
    assert _ids(s.next_batch()) == ["a", "b", "c"] and pool.num_free == 0
    for name, priority in (("a", 3.0), ("b", 1.0), ("c", 2.0)):
        s.enqueue(_unit(name, 0, WorkUnitKind.AR_TOKEN), priority=priority)
    assert pool.preemption_frees(("a", 0)) == 1
    batch = s.next_batch()
    assert _ids(batch) == ["b", "c", "a"]  # most urgent first; all three run
    assert pool.preempted == ["a", "c"] and s.num_preemptions == 2
    assert set(pool.held) == {"b"} and pool.num_free == 2


def test_a_decode_batch_that_fits_preempts_nothing():
    pool = FakePool(4)
    s = _pooled(pool)
    for name in "ab":
        s.enqueue(_unit(name, 1))
    s.next_batch()
    for name in "ab":
        s.enqueue(_unit(name, 0, WorkUnitKind.AR_TOKEN))
    assert _ids(s.next_batch()) == ["a", "b"]
    assert pool.preempted == [] and s.num_preemptions == 0


def test_components_without_a_pool_are_not_admitted():
    s = Scheduler(lambda model, component: 8, lambda model, component: None)
    for live in (_unit("a", 100), _unit("b", 100)):
        s.enqueue(live)
    assert _ids(s.next_batch()) == ["a", "b"]
