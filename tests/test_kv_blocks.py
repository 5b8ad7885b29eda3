"""CPU tests of the paged KV-cache bookkeeping (omnistep.kv): no torch."""

import random

import pytest

from omnistep.core.errors import OmnistepError
from omnistep.kv import (
    BlockManager,
    FreeRuns,
    KVCacheConfig,
    KVCacheFullError,
    SequenceTable,
    chain_hashes,
)


def test_blocks_needed_rounds_up():
    manager = BlockManager(num_blocks=8, block_size=4)
    assert [manager.blocks_needed(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    with pytest.raises(ValueError, match="num_tokens"):
        manager.blocks_needed(-1)


def test_allocation_grows_across_block_boundaries():
    manager = BlockManager(num_blocks=8, block_size=4)
    assert manager.allocate("a", 3) == [0]
    assert manager.allocate("a", 4) == [0]  # still fits the first block
    assert manager.allocate("a", 5) == [0, 1]  # token 4 starts block 2
    assert manager.allocate("b", 1) == [5]  # half-way along the free run 2..7
    assert manager.allocate("a", 9) == [0, 1, 2]  # "a" keeps growing into its own run
    assert manager.allocate("a", 2) == [0, 1, 2]  # never shrinks
    assert manager.block_table("a") == [0, 1, 2]
    assert manager.allocate("a", 17) == [0, 1, 2, 3, 4]
    assert manager.allocate("a", 21) == [0, 1, 2, 3, 4, 7]  # 5 is b's: a new extent in 6..7
    assert (manager.num_used_blocks, manager.num_free_blocks, manager.num_sequences) == (7, 1, 2)


def test_block_table_is_a_copy_and_unknown_sequence_raises():
    manager = BlockManager(num_blocks=4, block_size=2)
    manager.allocate(7, 3).append(99)
    manager.block_table(7).append(99)
    assert manager.block_table(7) == [0, 1]
    with pytest.raises(KeyError, match="8"):
        manager.block_table(8)
    assert manager.allocate(8, 0) == [] and 8 in manager


def test_full_pool_raises_and_allocates_nothing():
    manager = BlockManager(num_blocks=4, block_size=4)
    manager.allocate("a", 8)
    manager.allocate("b", 4)
    assert manager.can_allocate("b", 8) and not manager.can_allocate("b", 9)
    assert not manager.can_allocate("c", 5)
    with pytest.raises(KVCacheFullError) as info:
        manager.allocate("b", 12)  # needs 2 more, 1 free
    assert isinstance(info.value, OmnistepError)
    assert (info.value.num_required, info.value.num_free) == (2, 1)
    with pytest.raises(KVCacheFullError):
        manager.allocate("c", 5)
    assert manager.block_table("b") == [3]  # half-way along the free run 2..3
    assert "c" not in manager
    assert manager.num_free_blocks == 1 and manager.num_sequences == 2


def test_free_returns_blocks_and_is_idempotent():
    manager = BlockManager(num_blocks=6, block_size=2)
    manager.allocate("a", 5)
    manager.allocate("b", 2)
    assert manager.free("a") == 3
    assert manager.free("a") == 0
    assert manager.free("never") == 0
    assert manager.num_free_blocks == 5 and manager.num_sequences == 1
    assert manager.allocate("c", 10) == [0, 1, 2, 3, 5]  # b holds block 4
    assert manager.num_free_blocks == 0


def test_usage_reports_counts_and_fraction():
    manager = BlockManager(num_blocks=10, block_size=16)
    manager.allocate("a", 40)
    assert manager.usage() == {
        "num_used_blocks": 3,
        "num_free_blocks": 7,
        "num_blocks": 10,
        "usage": 0.3,
    }


def test_random_alloc_free_cycles_leak_nothing():
    rng = random.Random(1234)
    manager = BlockManager(num_blocks=64, block_size=4)
    num_tokens: dict[int, int] = {}
    for step in range(3000):
        seq_id = rng.randrange(12)
        if rng.random() < 0.25:
            manager.free(seq_id)
            num_tokens.pop(seq_id, None)
            continue
        target = num_tokens.get(seq_id, 0) + rng.randint(0, 9)
        if manager.can_allocate(seq_id, target):
            assert len(manager.allocate(seq_id, target)) == manager.blocks_needed(target)
            num_tokens[seq_id] = target
        else:
            before = manager.usage()
            with pytest.raises(KVCacheFullError):
                manager.allocate(seq_id, target)
            assert manager.usage() == before
        tables = [manager.block_table(s) for s in num_tokens]
        held = [b for table in tables for b in table]
        assert len(held) == len(set(held)) == manager.num_used_blocks, step
    for seq_id in list(num_tokens):
        manager.free(seq_id)
    assert manager.num_free_blocks == 64 and manager.num_sequences == 0
    assert sorted(manager.allocate("all", 64 * 4)) == list(range(64))


def test_tables_growing_in_lock_step_stay_consecutive():
    """16 sequences admitted together and grown one token per step each keep one run of
    consecutive blocks (what lets attention read them without a gather)."""
    manager = BlockManager(num_blocks=1024, block_size=4)  # room: about 3x what they use
    lengths = {s: 5 + s for s in range(16)}
    for s, n in lengths.items():
        manager.allocate(s, n)
    for _ in range(40):
        for s in lengths:
            lengths[s] += 1
            manager.allocate(s, lengths[s])
    for s in lengths:
        table = manager.block_table(s)
        assert table == list(range(table[0], table[0] + len(table))), (s, table)
    held = [b for s in lengths for b in manager.block_table(s)]
    assert len(held) == len(set(held)) == manager.num_used_blocks


def test_a_table_that_meets_its_neighbour_continues_in_another_run():
    manager = BlockManager(num_blocks=8, block_size=2)
    assert manager.allocate("a", 2) == [0]
    assert manager.allocate("b", 2) == [4]
    assert manager.allocate("a", 8) == [0, 1, 2, 3]
    assert manager.allocate("a", 10) == [0, 1, 2, 3, 6]  # 4 is b's; largest free run is 5..7
    manager.free("b")
    # free runs 4..5 and 7: half-way along 4..5, then 6 is a's: the largest run left, 4
    assert manager.allocate("c", 6) == [5, 4, 7]
    assert manager.num_free_blocks == 0


def test_free_runs_agree_with_a_set_of_free_blocks():
    rng = random.Random(5)
    runs, model = FreeRuns(50), set(range(50))
    for _ in range(2000):
        block_id = rng.randrange(50)
        if block_id in model:
            runs.take(block_id)
            model.remove(block_id)
        else:
            with pytest.raises(KeyError):
                runs.take(block_id)
            runs.give([block_id])
            model.add(block_id)
        assert len(runs) == len(model)
        assert all((b in runs) == (b in model) for b in range(-1, 51))
        if model:
            ordered = sorted(model)
            lengths, start = {}, ordered[0]
            for prev, b in zip(ordered, [*ordered[1:], None], strict=True):
                if b != prev + 1:
                    lengths[start], start = prev + 1 - start, b
            best = max(lengths.values())
            assert runs.largest() == (min(s for s, n in lengths.items() if n == best), best)


def test_config_validates_fields():
    assert KVCacheConfig(num_blocks=5).block_size == 16
    with pytest.raises(ValueError, match="num_blocks"):
        KVCacheConfig(num_blocks=0)
    with pytest.raises(ValueError, match="block_size"):
        KVCacheConfig(num_blocks=4, block_size=0)
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(num_blocks=-1, block_size=4)


def test_from_memory_arithmetic():
    # ChatTTS GPT in fp16: 2 (K,V) * 20 layers * 16 tokens * 12 heads * 64 dims * 2 bytes.
    bytes_per_block = 2 * 20 * 16 * 12 * 64 * 2
    assert bytes_per_block == 983_040
    config = KVCacheConfig.from_memory(
        memory_gb=1, num_layers=20, num_kv_heads=12, head_dim=64, dtype_bytes=2
    )
    assert config == KVCacheConfig(num_blocks=(1 << 30) // bytes_per_block, block_size=16)
    assert config.num_blocks == 1092
    half = KVCacheConfig.from_memory(0.5, 20, 12, 64, 4, block_size=32)
    assert half.num_blocks == (1 << 29) // (4 * bytes_per_block) == 136
    manager = BlockManager.from_config(half)
    assert (manager.num_blocks, manager.block_size) == (136, 32)


@pytest.mark.parametrize(
    "field", ["memory_gb", "num_layers", "num_kv_heads", "head_dim", "dtype_bytes", "block_size"]
)
def test_from_memory_rejects_non_positive(field):
    kwargs = dict(
        memory_gb=1.0, num_layers=2, num_kv_heads=2, head_dim=8, dtype_bytes=2, block_size=16
    )
    kwargs[field] = 0
    with pytest.raises(ValueError, match=field):
        KVCacheConfig.from_memory(**kwargs)


def test_from_memory_too_small_for_one_block():
    with pytest.raises(ValueError, match="memory_gb"):
        KVCacheConfig.from_memory(1e-9, num_layers=20, num_kv_heads=12, head_dim=64, dtype_bytes=2)


def test_sequence_table_admits_grows_and_preempts_the_youngest():
    from omnistep.kv import BlockManager, KVCacheFullError, SequenceTable

    table = SequenceTable(BlockManager(num_blocks=4, block_size=4))
    assert table.admit_prefill("old", 4) and table.admit_prefill("young", 4)
    assert not table.admit_prefill("late", 12)  # only 2 blocks free now
    with pytest.raises(KVCacheFullError):
        table.admit_prefill("huge", 17)
    assert table.grow(["old", "young"]) == [0, 1]  # 5 tokens each: 2 blocks each, pool full
    assert table.lengths == {"old": 5, "young": 5}
    for _ in range(3):
        table.grow(["old", "young"])
    assert table.grow(["old", "young"]) == [0]  # 9 tokens need a 3rd block: young preempted
    assert table.num_preemptions == 1 and "young" not in table.lengths
    table.free("old")
    assert table.blocks.num_used_blocks == 0
    with pytest.raises(ValueError):
        table.grow(["never"])


# ------------------------------------------------------------------ shared prefixes (groups)


def test_fork_shares_the_prefix_blocks_by_reference():
    manager = BlockManager(num_blocks=8, block_size=4)
    manager.allocate("leader", 6)  # blocks 0, 1 (the second half full)
    assert manager.fork("leader", "k1", 6) == [0, 1]
    assert manager.fork("leader", "k2", 3) == [0]  # a shorter prefix takes fewer blocks
    assert [manager.ref_count(b) for b in (0, 1, 2)] == [3, 2, 0]
    assert manager.num_used_blocks == 2  # nothing taken from the pool
    with pytest.raises(ValueError, match="already holds"):
        manager.fork("leader", "k1", 6)
    with pytest.raises(ValueError, match="fewer than"):
        manager.fork("leader", "k3", 9)
    with pytest.raises(KeyError):
        manager.fork("nobody", "k4", 1)


def test_copy_on_write_gives_the_writer_a_private_block():
    manager = BlockManager(num_blocks=8, block_size=4)
    manager.allocate("leader", 6)
    manager.fork("leader", "k1", 6)
    assert manager.is_shared("k1", 6) and manager.is_shared("leader", 5)
    source, destination = manager.copy_on_write("k1", 6)
    assert source == 1 and destination not in (0, 1)
    assert manager.block_table("k1") == [0, destination]
    assert manager.block_table("leader") == [0, 1]
    assert manager.ref_count(1) == 1 and not manager.is_shared("leader", 5)
    assert manager.copy_on_write("k1", 7) is None  # already private
    assert manager.copy_on_write("leader", 5) is None
    with pytest.raises(ValueError, match="past"):
        manager.copy_on_write("k1", 8)


def test_copy_on_write_with_no_free_block_raises():
    manager = BlockManager(num_blocks=2, block_size=4)
    manager.allocate("leader", 6)
    manager.fork("leader", "k1", 6)
    with pytest.raises(KVCacheFullError):
        manager.copy_on_write("k1", 6)
    assert manager.block_table("k1") == [0, 1]  # unchanged


def test_a_shared_block_returns_to_the_pool_with_its_last_holder():
    manager = BlockManager(num_blocks=8, block_size=4)
    manager.allocate("leader", 6)
    manager.fork("leader", "k1", 6)
    manager.fork("leader", "k2", 6)
    assert manager.free("leader") == 0  # both blocks still held by k1 and k2
    manager.copy_on_write("k1", 6)
    assert manager.free("k1") == 1  # its private copy; 0 and 1 are k2's now
    assert manager.num_used_blocks == 2
    assert manager.free("k2") == 2
    assert manager.num_free_blocks == 8


def test_sequence_table_grows_forks_and_owes_the_block_copies():
    table = SequenceTable(BlockManager(num_blocks=8, block_size=4))
    assert table.admit_prefill("leader", 6)
    for k in ("k1", "k2"):
        table.fork("leader", k, 6)
    assert table.lengths == {"leader": 6, "k1": 6, "k2": 6}
    assert table.grow(["leader", "k1", "k2"]) == [0, 1, 2]
    copies = table.take_copies()
    # the first two writers copy the shared half-full block; the last one keeps it
    assert [src for src, _ in copies] == [1, 1]
    assert table.blocks.block_table("k2") == [0, 1]
    assert table.take_copies() == []
    assert table.grow(["k1"]) == [0] and table.take_copies() == []  # private now


def test_grow_counts_copies_when_it_preempts():
    # 3 blocks: the leader's 2 plus one free; two sharers writing need two copies
    table = SequenceTable(BlockManager(num_blocks=3, block_size=4))
    table.admit_prefill("leader", 6)
    table.fork("leader", "k1", 6)
    table.fork("leader", "k2", 6)
    assert table.grow(["leader", "k1", "k2"]) == [0, 1]  # k2 (youngest) preempted
    assert table.num_preemptions == 1 and "k2" not in table.lengths
    assert len(table.take_copies()) == 1


def test_random_groups_leak_nothing_and_keep_counts_consistent():
    """Random admissions, forks, decode steps and frees: every block's count equals the
    tables holding it, used + free = pool, and freeing everything empties the pool."""
    rng = random.Random(5)
    manager = BlockManager(num_blocks=40, block_size=4)
    table = SequenceTable(manager)
    next_id = 0
    for _ in range(2000):
        live = list(table.lengths)
        op = rng.random()
        if op < 0.2 or not live:
            next_id += 1
            table.admit_prefill(f"s{next_id}", rng.randint(1, 12))
        elif op < 0.45:
            parent = rng.choice(live)
            next_id += 1
            table.fork(parent, f"s{next_id}", rng.randint(1, table.lengths[parent]))
        elif op < 0.85:
            batch = rng.sample(live, rng.randint(1, len(live)))
            table.grow(batch)
            for source, destination in table.take_copies():
                assert manager.ref_count(source) >= 1 and manager.ref_count(destination) == 1
        else:
            table.free(rng.choice(live))
        holders: dict[int, int] = {}
        for seq_id in table.lengths:
            for block_id in manager.block_table(seq_id):
                holders[block_id] = holders.get(block_id, 0) + 1
        assert all(manager.ref_count(b) == n for b, n in holders.items())
        assert manager.num_used_blocks == len(holders)
    for seq_id in list(table.lengths):
        table.free(seq_id)
    assert manager.num_free_blocks == manager.num_blocks


# ---------------------------------------------------------------- prefix sharing by content hash


def _rows(*ids: int) -> list[bytes]:
    return [i.to_bytes(4, "little") for i in ids]


def test_chain_hashes_name_a_block_by_its_rows_and_everything_before_them():
    a = chain_hashes(_rows(1, 2, 3, 4, 5, 6), block_size=4)
    assert len(a) == 2  # one full block, one partly filled
    assert chain_hashes(_rows(1, 2, 3, 4, 5, 6), 4) == a  # deterministic
    assert chain_hashes(_rows(1, 2, 3, 4, 5, 7), 4) == [
        a[0],
        chain_hashes(_rows(1, 2, 3, 4, 5, 7), 4)[1],
    ]
    assert chain_hashes(_rows(1, 2, 3, 4, 5, 7), 4)[1] != a[1]  # divergent tail
    assert chain_hashes(_rows(9, 2, 3, 4, 5, 6), 4)[1] != a[1]  # same rows after another head
    assert chain_hashes(_rows(1, 2, 3, 4, 5), 4)[1] != a[1]  # fewer rows in the block
    with pytest.raises(ValueError, match="block_size"):
        chain_hashes(_rows(1), 0)


def test_equal_prefixes_share_blocks_by_reference():
    manager = BlockManager(num_blocks=8, block_size=4)
    prompt = _rows(*range(10))  # 2 full blocks and 2 rows
    hashes = chain_hashes(prompt, 4)
    table = manager.allocate("a", 10)
    manager.cache("a", hashes)
    assert manager.match(hashes) == table
    assert manager.share("b", manager.match(hashes)) == table
    assert [manager.ref_count(b) for b in table] == [2, 2, 2]
    assert manager.num_used_blocks == 3  # nothing taken for "b"
    # a prompt that diverges in its second block shares only the first
    other = chain_hashes(_rows(0, 1, 2, 3, 4, 99, 6, 7), 4)
    assert manager.match(other) == table[:1]
    manager.share("c", manager.match(other))
    assert manager.allocate("c", 8)[1] != table[1]  # its own second block
    assert manager.ref_count(table[0]) == 3 and manager.ref_count(table[1]) == 2
    with pytest.raises(ValueError, match="already holds"):
        manager.share("b", table)


def test_divergent_tails_copy_the_shared_partial_block_on_write():
    table = SequenceTable(BlockManager(num_blocks=8, block_size=4))
    hashes = chain_hashes(_rows(*range(6)), 4)
    table.admit_prefill("a", 6)
    table.blocks.cache("a", hashes)
    table.share("b", table.blocks.match(hashes), 6)
    assert table.lengths["b"] == 6
    shared = table.blocks.block_table("a")
    assert table.grow(["b"]) == [0]  # b writes token 6 into the shared partial block
    [(source, destination)] = table.take_copies()
    assert source == shared[1] and destination not in shared
    assert table.blocks.block_table("b") == [shared[0], destination]
    assert table.blocks.ref_count(shared[0]) == 2 and table.blocks.ref_count(shared[1]) == 1
    assert table.grow(["a"]) == [0] and table.take_copies() == []  # a's block is its own now
    with pytest.raises(ValueError, match="do not hold"):
        table.share("c", shared, 9)


def test_hashes_are_forgotten_with_their_blocks():
    manager = BlockManager(num_blocks=4, block_size=2)
    hashes = chain_hashes(_rows(1, 2, 3), 2)
    manager.allocate("a", 3)
    manager.cache("a", hashes)
    manager.share("b", manager.match(hashes))
    manager.free("a")
    assert len(manager.match(hashes)) == 2  # b still holds the rows
    manager.free("b")
    assert manager.match(hashes) == [] and manager.num_free_blocks == 4
    manager.allocate("c", 4)  # the same blocks, other rows: not found by the old hashes
    assert manager.match(hashes) == []
    manager.cache("c", hashes[:1])
    manager.forget_hashes()
    assert manager.match(hashes) == []
    with pytest.raises(ValueError, match="not in use"):
        manager.share("d", [3])


def test_a_later_copy_of_equal_rows_is_the_one_found():
    manager = BlockManager(num_blocks=8, block_size=2)
    hashes = chain_hashes(_rows(1, 2, 3, 4), 2)
    first = manager.allocate("a", 4)
    manager.cache("a", hashes)
    second = manager.allocate("b", 4)
    manager.cache("b", hashes)
    assert manager.match(hashes) == second != first
    manager.free("b")  # b's blocks go back: their hashes with them
    assert manager.match(hashes) == []


def test_preemption_frees_only_blocks_no_one_else_holds():
    table = SequenceTable(BlockManager(num_blocks=8, block_size=4))
    table.admit_prefill("a", 8)
    table.fork("a", "b", 4)
    table.extend("b", 6)
    assert table.preemption_frees("b") == 1 and table.preemption_frees("a") == 1
    assert table.preempt("b") == 1 and "b" in table.preempted and table.num_preemptions == 1
    assert table.preemption_frees("a") == 2
    assert table.preempt("b") == 0 and table.num_preemptions == 1  # not held: nothing
    table.admit_prefill("b", 2)  # a new prefill clears the mark
    assert "b" not in table.preempted


# ------------------------------------------------------------------ evictable prefix cache
def test_kept_blocks_stay_cached_evictable_and_are_taken_back_by_match():
    manager = BlockManager(num_blocks=6, block_size=4)
    manager.allocate("turn1", 10)  # 3 blocks, 2 full
    hashes = chain_hashes([bytes([i]) for i in range(8)], 4)
    manager.cache("turn1", hashes, keep=True)
    table = manager.block_table("turn1")
    assert manager.free("turn1") == 3
    # the 2 full blocks stay cached: free to allocate, not used, still found
    counts = (manager.num_free_blocks, manager.num_used_blocks, manager.num_cached_blocks)
    assert counts == (6, 0, 2)
    assert manager.match(hashes) == table[:2]
    manager.share("turn2", manager.match(hashes))  # taken back: held, not evictable
    assert (manager.num_used_blocks, manager.num_cached_blocks) == (2, 0)
    assert manager.ref_count(table[0]) == 1
    manager.allocate("turn2", 12)
    manager.free("turn2")
    assert manager.num_cached_blocks == 2  # still hashed and kept


def test_evictable_blocks_are_evicted_only_when_free_blocks_run_out_tail_first():
    manager = BlockManager(num_blocks=4, block_size=2)
    manager.allocate("s", 6)
    hashes = chain_hashes([bytes([i]) for i in range(6)], 2)
    manager.cache("s", hashes, keep=True)
    head, middle, tail = manager.block_table("s")
    manager.free("s")
    assert manager.num_cached_blocks == 3
    manager.allocate("a", 2)  # the one never-used free block: nothing evicted
    assert manager.match(hashes) == [head, middle, tail]
    manager.allocate("b", 2)  # evicts the least recently freed: the tail
    assert manager.match(hashes) == [head, middle]
    assert manager.can_allocate("c", 4) and not manager.can_allocate("c", 6)
    manager.allocate("c", 4)  # a big request reclaims the rest
    assert manager.match(hashes) == [] and manager.num_cached_blocks == 0
    for seq in ("a", "b", "c"):
        manager.free(seq)
    assert manager.num_free_blocks == 4 and manager.num_used_blocks == 0


def test_unkept_hashes_are_forgotten_on_free_and_forget_hashes_empties_the_cache():
    manager = BlockManager(num_blocks=4, block_size=2)
    manager.allocate("prefix", 4)
    hashes = chain_hashes([b"a", b"b", b"c", b"d"], 2)
    manager.cache("prefix", hashes)  # not kept: the kept-prefix use
    manager.free("prefix")
    assert manager.match(hashes) == [] and manager.num_cached_blocks == 0
    manager.allocate("kept", 4)
    manager.cache("kept", hashes, keep=True)
    manager.free("kept")
    assert manager.num_cached_blocks == 2
    manager.forget_hashes()
    assert (manager.num_cached_blocks, manager.match(hashes)) == (0, [])
    assert manager.num_free_blocks == 4
    manager.allocate("all", 8)  # every block is allocatable again
