"""Paged KV-cache bookkeeping: block-pool sizing and per-sequence block tables.

Pure Python (stdlib only, no torch); imports ``omnistep.core`` and nothing else. A component
that keeps a paged KV cache (``models/``) owns a ``SequenceTable``: it admits decode work by free
blocks and frees a sequence's blocks when it finishes or is aborted, and turns the block tables
into device tensors (``omnistep.layers.paged_attention.AttentionMetadata``); the engine reads
the usage through the component (``kv_usage``). A block holds ``block_size`` consecutive
token positions of one sequence, for every layer, K and V.
"""

from __future__ import annotations

import bisect
import hashlib
from collections import Counter, OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

from omnistep.core.errors import OmnistepError

_BYTES_PER_GIB = 1 << 30


class KVCacheFullError(OmnistepError):
    """Not enough free KV blocks to grow a sequence's block table.

    Attributes:
        seq_id: the sequence that asked for blocks.
        num_required: blocks the request needed beyond those the sequence already held.
        num_free: free blocks in the pool when it asked.
    """

    def __init__(self, seq_id: Hashable, num_required: int, num_free: int):
        super().__init__(
            f"KV cache full: sequence {seq_id!r} needs {num_required} more blocks, {num_free} free"
        )
        self.seq_id = seq_id
        self.num_required = num_required
        self.num_free = num_free


def _check_positive(name: str, value: int | float) -> None:
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")


@dataclass(frozen=True, slots=True)
class KVCacheConfig:
    """Size of one component's paged KV cache.

    Attributes:
        num_blocks: blocks in the pool (each holds K and V of ``block_size`` tokens, all layers).
        block_size: token positions per block.
    """

    num_blocks: int
    block_size: int = 16

    def __post_init__(self) -> None:
        _check_positive("num_blocks", self.num_blocks)
        _check_positive("block_size", self.block_size)

    @classmethod
    def from_memory(
        cls,
        memory_gb: float,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype_bytes: int,
        block_size: int = 16,
    ) -> KVCacheConfig:
        """Size the pool to fit ``memory_gb`` GiB (2**30 bytes) of K and V.

        One block costs ``2 * num_layers * block_size * num_kv_heads * head_dim * dtype_bytes``
        bytes (the 2 is K and V); the pool gets as many whole blocks as fit.

        Raises:
            ValueError: a non-positive argument (named in the message), or a budget below one block.
        """
        sizes = {
            "memory_gb": memory_gb,
            "num_layers": num_layers,
            "num_kv_heads": num_kv_heads,
            "head_dim": head_dim,
            "dtype_bytes": dtype_bytes,
            "block_size": block_size,
        }
        for name, value in sizes.items():
            _check_positive(name, value)
        bytes_per_block = 2 * num_layers * block_size * num_kv_heads * head_dim * dtype_bytes
        num_blocks = int(memory_gb * _BYTES_PER_GIB) // bytes_per_block
        if num_blocks < 1:
            raise ValueError(f"memory_gb={memory_gb} holds no block of {bytes_per_block} bytes")
        return cls(num_blocks=num_blocks, block_size=block_size)


def chain_hashes(rows: Sequence[bytes], block_size: int) -> list[int]:
    """Chained content hashes of a prompt's rows, one per block of ``block_size`` rows (the
    last may be partly filled): hash ``i`` digests hash ``i - 1``, the number of rows in
    block ``i`` and their bytes, so equal hashes mean equal rows from position 0 on (the
    prefix-caching hash of vLLM and nano-vllm: ``hash(prev_block_hash, block_tokens)``).
    BLAKE2b (stdlib ``hashlib``), 64-bit digests.

    Args:
        rows: one ``bytes`` per row (a token id's or an input row's bytes).
        block_size: rows per block.
    """
    _check_positive("block_size", block_size)
    hashes, previous = [], b""
    for start in range(0, len(rows), block_size):
        block = rows[start : start + block_size]
        digest = hashlib.blake2b(previous, digest_size=8)
        digest.update(len(block).to_bytes(4, "little"))
        for row in block:
            digest.update(row)
        previous = digest.digest()
        hashes.append(int.from_bytes(previous, "little"))
    return hashes


class FreeRuns:
    """The free blocks of a pool as sorted runs of consecutive ids ``[start, end)``.

    Membership, taking and freeing a block cost O(log R + R) for R runs (a list insert), finding
    the largest run O(R); R stays near the number of live sequences, not the pool size.
    """

    def __init__(self, num_blocks: int):
        self._starts: list[int] = [0] if num_blocks else []
        self._ends: dict[int, int] = {0: num_blocks} if num_blocks else {}
        self._count = num_blocks

    def __len__(self) -> int:
        return self._count

    def _run_of(self, block_id: int) -> int | None:
        """Index in ``_starts`` of the run holding ``block_id``, None if it is not free."""
        i = bisect.bisect_right(self._starts, block_id) - 1
        if i >= 0 and block_id < self._ends[self._starts[i]]:
            return i
        return None

    def __contains__(self, block_id: int) -> bool:
        return self._run_of(block_id) is not None

    def take(self, block_id: int) -> None:
        """Mark a free block used. Raises ``KeyError`` if it is not free."""
        i = self._run_of(block_id)
        if i is None:
            raise KeyError(block_id)
        start = self._starts[i]
        end = self._ends.pop(start)
        del self._starts[i]
        if block_id + 1 < end:
            self._starts.insert(i, block_id + 1)
            self._ends[block_id + 1] = end
        if start < block_id:
            self._starts.insert(i, start)
            self._ends[start] = block_id
        self._count -= 1

    def give(self, block_ids: Iterable[int]) -> None:
        """Mark used blocks free, merging runs that touch."""
        for block_id in block_ids:
            i = bisect.bisect_right(self._starts, block_id)
            start, end = block_id, block_id + 1
            if i > 0 and self._ends[self._starts[i - 1]] == block_id:  # extends the run before
                i -= 1
                start = self._starts[i]
                del self._starts[i]
            if i < len(self._starts) and self._starts[i] == end:  # joins the run after
                end = self._ends.pop(self._starts[i])
                del self._starts[i]
            self._starts.insert(i, start)
            self._ends[start] = end
            self._count += 1

    def largest(self) -> tuple[int, int]:
        """``(start, length)`` of the longest run (the first of equals). Pool must not be full."""
        start = max(self._starts, key=lambda s: (self._ends[s] - s, -s))
        return start, self._ends[start] - start


class BlockManager:
    """A free list of KV blocks, one block table per sequence, and a reference count per block.

    A block table lists a sequence's block ids in token order: token ``t`` lives in block
    ``block_table[t // block_size]`` at offset ``t % block_size``. Tables only grow until the
    sequence is freed. Every operation is O(1) or O(blocks it moves) (amortised).

    Sharing (a group of samples of one prompt): ``fork`` gives a new sequence the blocks that
    hold a prefix of another's tokens, by reference (each block's count goes up; nothing is
    copied). A block is returned to the pool when the last table holding it is freed. Before a
    sequence writes a token into a block it shares, ``copy_on_write`` gives it a private copy:
    a fresh block replaces the shared one in its table, and the caller copies the K/V contents
    (the pair it returns) before writing.

    Prefix sharing by content (as vLLM's and nano-vllm's block managers): ``cache`` registers a
    sequence's blocks under the chained content hashes of its rows (``chain_hashes``; a partly
    filled last block under the hash of the rows it holds), and ``match`` finds the blocks of
    an equal prefix for ``share`` to start another table on, by reference. A block's hashes
    are forgotten when it returns to the pool (or by ``forget_hashes``, when the K/V they
    name are stale, e.g. after a weight update). Rows past a partly filled block's hash may
    be written by its holder: the hashed rows stay as they were.

    Evictable cache (vLLM's automatic prefix caching, SGLang's radix cache): blocks registered
    with ``cache(..., keep=True)`` (full blocks only) do not return to the pool when their last
    table is freed: they stay hashed, with no holder, in an LRU of evictable blocks (a freed
    table's last block first, so a prefix outlives its tail), where ``match`` still finds
    them and ``share`` takes them back. They count as free (``num_free_blocks``,
    ``can_allocate``): a block is taken from the LRU, its hashes forgotten, only when no
    unhashed free block is left (``num_cached_blocks`` counts them, ``drop_cached`` empties
    the LRU).

    Placement keeps each table consecutive where it can, so attention reads a sequence as one
    slice of the pool instead of gathering its blocks (``omnistep.layers.paged_attention``): a
    table grows into the block after its last one when that block is free; otherwise (a new
    table, or the next block is taken) it starts a new extent in the largest run of free blocks,
    at the run's start when the run begins the pool, else half-way along it, leaving the first
    half for the table that ends just before the run. Sequences that grow in lock-step thus
    spread over the pool instead of interleaving block by block. Free blocks are kept as runs
    (``FreeRuns``), so placement costs O(runs), about the number of live sequences.
    """

    def __init__(self, num_blocks: int, block_size: int):
        _check_positive("num_blocks", num_blocks)
        _check_positive("block_size", block_size)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = FreeRuns(num_blocks)
        self._block_tables: dict[Hashable, list[int]] = {}
        self._refs: dict[int, int] = {}  # block id -> tables holding it (used blocks only)
        self._cached: dict[int, int] = {}  # content hash -> block id holding those rows
        self._hashes_of: dict[int, list[int]] = {}  # block id -> content hashes it holds
        self._keep: set[int] = set()  # blocks that stay cached when freed (``cache(keep=)``)
        # held by no table, still hashed; least recently freed first
        self._evictable: OrderedDict[int, None] = OrderedDict()

    @classmethod
    def from_config(cls, config: KVCacheConfig) -> BlockManager:
        return cls(config.num_blocks, config.block_size)

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take: free ones and evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        """Blocks some table holds."""
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Evictable blocks: held by no table, kept for their content hashes."""
        return len(self._evictable)

    @property
    def num_sequences(self) -> int:
        return len(self._block_tables)

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._block_tables

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` token positions."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        return -(-num_tokens // self.block_size)

    def _num_missing(self, seq_id: Hashable, num_tokens: int) -> int:
        held = len(self._block_tables.get(seq_id, ()))
        return max(0, self.blocks_needed(num_tokens) - held)

    def can_allocate(self, seq_id: Hashable, num_tokens: int) -> bool:
        """Whether the sequence's table can grow to hold ``num_tokens`` tokens in total."""
        return self._num_missing(seq_id, num_tokens) <= self.num_free_blocks

    def allocate(self, seq_id: Hashable, num_tokens: int) -> list[int]:
        """Grow the sequence's table to cover ``num_tokens`` tokens in total; return the table.

        A new ``seq_id`` starts an empty table. Asking for fewer tokens than the table already
        covers changes nothing.

        Raises:
            KVCacheFullError: too few free blocks; nothing is allocated then.
        """
        num_missing = self._num_missing(seq_id, num_tokens)
        if num_missing > self.num_free_blocks:
            raise KVCacheFullError(seq_id, num_missing, self.num_free_blocks)
        block_table = self._block_tables.setdefault(seq_id, [])
        for _ in range(num_missing):
            block_table.append(self._take_after(block_table[-1] if block_table else None))
        return list(block_table)

    def _take_after(self, previous: int | None) -> int:
        """Take a free block for a table whose last block is ``previous``: the one after it if
        free, else a new extent (``_extent_start``); when only evictable blocks are left, the
        least recently freed is evicted first. The pool is not full."""
        if not self._free:
            self._evict_one()
        block_id = previous + 1 if previous is not None else -1
        if block_id not in self._free:
            block_id = self._extent_start()
        self._free.take(block_id)
        self._refs[block_id] = 1
        return block_id

    def fork(self, parent: Hashable, child: Hashable, num_tokens: int) -> list[int]:
        """Start ``child`` on the blocks that hold ``parent``'s first ``num_tokens`` tokens,
        shared by reference (no block is taken from the pool). Returns the child's table.

        Raises:
            KeyError: ``parent`` holds no table.
            ValueError: ``child`` already holds one, or ``parent`` covers fewer tokens.
        """
        table = self.block_table(parent)
        if child in self._block_tables:
            raise ValueError(f"sequence {child!r} already holds a block table")
        needed = self.blocks_needed(num_tokens)
        if needed > len(table):
            raise ValueError(
                f"sequence {parent!r} holds {len(table)} blocks, fewer than the {needed} that "
                f"{num_tokens} tokens need"
            )
        shared = table[:needed]
        for block_id in shared:
            self._refs[block_id] += 1
        self._block_tables[child] = shared
        return list(shared)

    def share(self, seq_id: Hashable, block_ids: Sequence[int]) -> list[int]:
        """Start ``seq_id``'s table on used blocks (``match``'s), by reference: each block's
        count goes up, none is taken from the pool. Returns the table.

        Raises:
            ValueError: ``seq_id`` already holds a table, or a block is not in use.
        """
        if seq_id in self._block_tables:
            raise ValueError(f"sequence {seq_id!r} already holds a block table")
        free = [b for b in block_ids if b not in self._refs and b not in self._evictable]
        if free:
            raise ValueError(f"block {free[0]} is not in use: it holds no K/V to share")
        for block_id in block_ids:
            if block_id in self._evictable:  # a cached block taken back
                del self._evictable[block_id]
                self._refs[block_id] = 0
            self._refs[block_id] += 1
        self._block_tables[seq_id] = list(block_ids)
        return list(block_ids)

    def cache(self, seq_id: Hashable, hashes: Sequence[int], keep: bool = False) -> None:
        """Register the sequence's first ``len(hashes)`` blocks under ``hashes``
        (``chain_hashes`` of the rows they hold, in order); a hash registered before moves
        to this sequence's block (the latest copy of equal rows is the one found). With
        ``keep`` (full blocks only), the blocks stay cached, evictable, once no table holds
        them (the class docstring's "Evictable cache").

        Raises:
            KeyError: the sequence holds no table. ValueError: more hashes than blocks.
        """
        table = self.block_table(seq_id)
        if len(hashes) > len(table):
            raise ValueError(f"{len(hashes)} hashes for {len(table)} blocks of {seq_id!r}")
        for block_id, content in zip(table, hashes, strict=False):
            if keep:
                self._keep.add(block_id)
            previous = self._cached.get(content)
            if previous == block_id:
                continue
            if previous is not None:
                self._unhash(previous, content)
            self._cached[content] = block_id
            self._hashes_of.setdefault(block_id, []).append(content)

    def _unhash(self, block_id: int, content: int) -> None:
        """Drop one hash of a block; an evictable block left with none returns to the pool."""
        hashes = self._hashes_of[block_id]
        hashes.remove(content)
        if not hashes:
            del self._hashes_of[block_id]
            if block_id in self._evictable:
                del self._evictable[block_id]
                self._keep.discard(block_id)
                self._free.give([block_id])

    def _evict_one(self) -> None:
        """Return the least recently freed evictable block to the pool, forgetting its
        hashes. There is one."""
        block_id, _ = self._evictable.popitem(last=False)
        self._keep.discard(block_id)
        for content in self._hashes_of.pop(block_id, ()):
            del self._cached[content]
        self._free.give([block_id])

    def drop_cached(self) -> int:
        """Evict every evictable block (their K/V are no longer wanted); returns how many."""
        count = len(self._evictable)
        while self._evictable:
            self._evict_one()
        return count

    def match(self, hashes: Sequence[int]) -> list[int]:
        """The blocks holding the longest prefix of ``hashes`` (``chain_hashes`` of a
        prompt's rows) that is registered: block ``i`` holds the rows hash ``i`` names."""
        blocks = []
        for content in hashes:
            block_id = self._cached.get(content)
            if block_id is None:
                break
            blocks.append(block_id)
        return blocks

    def cached_hashes(self) -> set[int]:
        """The content hashes registered now (a view; do not change it)."""
        return self._cached.keys()  # type: ignore[return-value]

    def forget_hashes(self) -> None:
        """Forget every registered content hash (the K/V they name are stale); evictable
        blocks return to the pool."""
        self.drop_cached()
        self._cached.clear()
        self._hashes_of.clear()
        self._keep.clear()

    def ref_count(self, block_id: int) -> int:
        """Tables holding ``block_id`` (0 for a free block)."""
        return self._refs.get(block_id, 0)

    def is_shared(self, seq_id: Hashable, position: int) -> bool:
        """Whether the block holding token ``position`` of the sequence is held by another
        table too (writing there needs ``copy_on_write`` first)."""
        table = self._block_tables.get(seq_id, ())
        index = position // self.block_size
        return index < len(table) and self._refs[table[index]] > 1

    def copy_on_write(self, seq_id: Hashable, position: int) -> tuple[int, int] | None:
        """Make the block that holds token ``position`` of the sequence its own before it
        writes there: if another table shares it, a free block replaces it in this table and
        ``(source, destination)`` is returned (the caller copies the K/V contents); None when
        the block is already private.

        Raises:
            KeyError: the sequence holds no table.
            ValueError: ``position`` lies past the table.
            KVCacheFullError: the block is shared and no block is free.
        """
        table = self._block_tables.get(seq_id)
        if table is None:
            raise KeyError(f"no block table for sequence {seq_id!r}")
        index = position // self.block_size
        if not 0 <= index < len(table):
            raise ValueError(f"position {position} lies past sequence {seq_id!r}'s blocks")
        source = table[index]
        if self._refs[source] == 1:
            return None
        if not self.num_free_blocks:
            raise KVCacheFullError(seq_id, 1, 0)
        destination = self._take_after(table[index - 1] if index else None)
        self._refs[source] -= 1
        table[index] = destination
        return source, destination

    def _extent_start(self) -> int:
        """Where a new extent starts: in the largest run of free blocks (the first of equals),
        at its start if it begins the pool, else half-way along it. The pool is not full."""
        best_start, best_len = self._free.largest()
        return best_start if best_start == 0 else best_start + best_len // 2

    def block_table(self, seq_id: Hashable) -> list[int]:
        """A copy of the sequence's block table.

        Raises:
            KeyError: the sequence holds no table (never allocated, or freed).
        """
        try:
            return list(self._block_tables[seq_id])
        except KeyError:
            raise KeyError(f"no block table for sequence {seq_id!r}") from None

    def free(self, seq_id: Hashable) -> int:
        """Return the sequence's blocks to the pool (kept ones, ``cache(keep=True)``, to the
        evictable cache, last block first); a no-op for an unknown sequence.

        Returns:
            The number of blocks that became free or evictable (blocks another table still
            shares stay).
        """
        block_table = self._block_tables.pop(seq_id, None)
        if not block_table:
            return 0
        released, kept = [], []
        for block_id in block_table:
            self._refs[block_id] -= 1
            if not self._refs[block_id]:
                del self._refs[block_id]
                if block_id in self._keep and block_id in self._hashes_of:
                    kept.append(block_id)
                    continue
                self._keep.discard(block_id)
                for content in self._hashes_of.pop(block_id, ()):
                    del self._cached[content]
                released.append(block_id)
        for block_id in reversed(kept):  # a prefix's tail is evicted before its head
            self._evictable[block_id] = None
        self._free.give(released)
        return len(released) + len(kept)

    def usage(self) -> dict[str, int | float]:
        """Pool occupancy for metrics."""
        used = self.num_used_blocks
        return {
            "num_used_blocks": used,
            "num_free_blocks": self.num_free_blocks,
            "num_blocks": self.num_blocks,
            "usage": used / self.num_blocks,
        }


class SequenceTable:
    """Token counts of a component's sequences on top of a BlockManager: admission of
    prefills by free blocks and growth of decode batches with preemption of the youngest.

    Shared by every AR component (``omnistep.runners.paged_ar.PagedARModel``), which keeps the
    KV tensors itself. Pure Python. A sequence may start as a ``fork`` of another's prefix
    (shared blocks); a decode step that writes into a shared block first gets a private copy,
    and the block pairs to copy wait in ``take_copies()`` for the component, which must copy
    them before the step's forward writes.

    Attributes:
        blocks: the block manager.
        lengths: tokens in the cache per sequence id.
        num_preemptions: sequences freed to make room for older ones.
        preempted: sequences freed by ``preempt`` and not admitted or freed since (their
            pending decode step answers preempted).
    """

    def __init__(self, blocks: BlockManager):
        self.blocks = blocks
        self.lengths: dict[Hashable, int] = {}
        self.num_preemptions = 0
        self.preempted: set[Hashable] = set()
        self._copies: list[tuple[int, int]] = []

    def fork(self, parent: Hashable, child: Hashable, num_tokens: int) -> None:
        """(Re)start ``child`` on ``parent``'s first ``num_tokens`` tokens, sharing their
        blocks (``BlockManager.fork``); no block is taken from the pool.

        Raises:
            KeyError / ValueError: as ``BlockManager.fork``.
        """
        self.free(child)
        self.blocks.fork(parent, child, num_tokens)
        self.lengths[child] = num_tokens

    def share(self, seq_id: Hashable, block_ids: Sequence[int], num_tokens: int) -> None:
        """(Re)start ``seq_id`` on blocks holding an equal prefix of ``num_tokens`` tokens
        (``BlockManager.match``), by reference; no block is taken from the pool.

        Raises:
            ValueError: the blocks do not hold ``num_tokens`` tokens, or one is not in use.
        """
        if self.blocks.blocks_needed(num_tokens) != len(block_ids):
            raise ValueError(f"{len(block_ids)} blocks do not hold {num_tokens} tokens")
        self.free(seq_id)
        self.blocks.share(seq_id, block_ids)
        self.lengths[seq_id] = num_tokens

    def take_copies(self) -> list[tuple[int, int]]:
        """The ``(source, destination)`` block copies owed since the last call, in order."""
        copies, self._copies = self._copies, []
        return copies

    def _blocks_to_write(self, seq_ids: Iterable[Hashable]) -> int:
        """Free blocks the next token of each sequence needs together: a new block where a
        token starts one, and a private copy for each writer of a shared block but the last of
        its holders (that one keeps the block)."""
        new, writers = 0, Counter[int]()
        for seq_id in seq_ids:
            length = self.lengths[seq_id]
            table = self.blocks.block_table(seq_id)
            if self.blocks.blocks_needed(length + 1) > len(table):
                new += 1
            elif self.blocks.is_shared(seq_id, length):
                writers[table[length // self.blocks.block_size]] += 1
        return new + sum(min(n, self.blocks.ref_count(b) - 1) for b, n in writers.items())

    def blocks_to_grow(self, seq_ids: Iterable[Hashable]) -> int:
        """Free blocks ``grow(seq_ids)`` takes (new blocks and private copies of shared ones)."""
        return self._blocks_to_write(seq_ids)

    def extend_cost(self, seq_id: Hashable, num_tokens: int) -> int:
        """Free blocks ``extend(seq_id, num_tokens)`` takes: the blocks past the sequence's
        table, plus a private copy of the shared block its first new token lands in."""
        length = self.lengths[seq_id]
        missing = self.blocks.blocks_needed(num_tokens) - len(self.blocks.block_table(seq_id))
        copy = num_tokens > length and self.blocks.is_shared(seq_id, length)
        return max(0, missing) + int(copy)

    def extend(self, seq_id: Hashable, num_tokens: int) -> bool:
        """Grow a sequence to ``num_tokens`` tokens at once (a prefill continuing the tokens it
        holds, e.g. the rest of a prompt after a forked prefix): a private copy of the shared
        block its first new token lands in (the pair waits in ``take_copies()``), then the new
        blocks. False, and nothing changed, when ``extend_cost`` blocks are not free.

        Raises:
            KeyError: the sequence holds no table.
        """
        if self.extend_cost(seq_id, num_tokens) > self.blocks.num_free_blocks:
            return False
        length = self.lengths[seq_id]
        if num_tokens > length and self.blocks.is_shared(seq_id, length):
            pair = self.blocks.copy_on_write(seq_id, length)
            if pair is not None:
                self._copies.append(pair)
        self.blocks.allocate(seq_id, num_tokens)
        self.lengths[seq_id] = max(length, num_tokens)
        return True

    def free(self, seq_id: Hashable) -> None:
        """Release the sequence's blocks (those no other sequence shares go back to the pool)
        and forget it (idempotent)."""
        self.blocks.free(seq_id)
        self.lengths.pop(seq_id, None)
        self.preempted.discard(seq_id)

    def preemption_frees(self, seq_id: Hashable) -> int:
        """Blocks ``preempt(seq_id)`` returns to the pool: those only this sequence holds."""
        if seq_id not in self.blocks:
            return 0
        return sum(1 for b in self.blocks.block_table(seq_id) if self.blocks.ref_count(b) == 1)

    def preempt(self, seq_id: Hashable) -> int:
        """Free a held sequence to make room (preemption by recompute), remembering it in
        ``preempted``; returns the blocks freed (0, and nothing marked, if it holds none)."""
        if seq_id not in self.lengths:
            return 0
        freed = self.blocks.free(seq_id)
        self.lengths.pop(seq_id)
        self.preempted.add(seq_id)
        self.num_preemptions += 1
        return freed

    def admit_prefill(self, seq_id: Hashable, num_tokens: int) -> bool:
        """(Re)start ``seq_id`` with blocks for ``num_tokens``; False when they are not free now.

        Raises:
            KVCacheFullError: the sequence needs more blocks than the whole pool.
        """
        self.free(seq_id)
        needed = self.blocks.blocks_needed(num_tokens)
        if needed > self.blocks.num_blocks:
            raise KVCacheFullError(seq_id, needed, self.blocks.num_blocks)
        if not self.blocks.can_allocate(seq_id, num_tokens):
            return False
        self.blocks.allocate(seq_id, num_tokens)
        self.lengths[seq_id] = num_tokens
        return True

    def context(self, seq_ids: list[Hashable]) -> tuple[list[int], list[list[int]]]:
        """(tokens in the cache, block table) of each sequence, the attention metadata's
        host-side inputs."""
        return [self.lengths[s] for s in seq_ids], [self.blocks.block_table(s) for s in seq_ids]

    def grow(self, seq_ids: list[Hashable]) -> list[int]:
        """Grow every sequence by one token; when the pool runs out, preempt (free) the
        youngest (``seq_ids`` is oldest first) until the rest fit. Returns the kept indices.

        Raises:
            ValueError: a sequence that was never admitted.
        """
        unknown = [s for s in seq_ids if s not in self.lengths]
        if unknown:
            raise ValueError(f"decode step for sequence {unknown[0]!r} without a prefill")
        keep = list(range(len(seq_ids)))
        while keep:
            if self._blocks_to_write(seq_ids[i] for i in keep) <= self.blocks.num_free_blocks:
                break
            self.free(seq_ids[keep.pop()])
            self.num_preemptions += 1
        for i in keep:
            seq_id = seq_ids[i]
            self.lengths[seq_id] += 1
            self.blocks.allocate(seq_id, self.lengths[seq_id])
            pair = self.blocks.copy_on_write(seq_id, self.lengths[seq_id] - 1)
            if pair is not None:
                self._copies.append(pair)
        return keep


def kv_usage(component: object) -> tuple[int, int] | None:
    """(used, free) blocks of a component's paged KV cache, or None when it keeps none.

    Read from the component's ``kv_blocks()`` when it has one (a stand-in for a component that
    runs elsewhere, such as ``omnistep.engine.ray_executor.RemoteComponent``), else from its
    ``table`` when that is a ``SequenceTable``.
    """
    report = getattr(type(component), "kv_blocks", None)
    if callable(report):
        return component.kv_blocks()  # type: ignore[attr-defined]
    table = getattr(component, "table", None)
    if isinstance(table, SequenceTable):
        return table.blocks.num_used_blocks, table.blocks.num_free_blocks
    return None
