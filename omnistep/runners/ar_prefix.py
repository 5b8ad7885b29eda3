"""Prompt reuse of a ``PagedARModel``: a group's computed prompt that its other members fork
(``GroupPrompts``), prompt prefixes a family names and the model keeps across requests
(``KeptPrefixes``), and salted prefix caching (``PrefixCache``). The module docstring of
``omnistep.runners.paged_ar`` says what each does ("Groups", "Prefixes", "Prefix caching");
the model's admission calls these, and its forward computes what they queue.

A MoE stack's routing of reused rows is kept with them (recorded when they were computed), so
a prompt that starts on reused rows still reports the routing of every row
(``ARStepOutput.prompt_routing``).

Imports torch, ``omnistep.kv`` and the AR loop's payload types (``omnistep.loops.ar_decode``).
"""

from __future__ import annotations

import hashlib
import itertools
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from omnistep.kv import KVCacheFullError, chain_hashes
from omnistep.loops.ar_decode import ARPrefillInput


def content_hashes(rows: torch.Tensor, block_size: int) -> list[int]:
    """Chained content hashes (``omnistep.kv.chain_hashes``) of input rows ``[n, in_dim]``,
    one per block of ``block_size`` rows: equal hashes, bit-equal rows."""
    raw = rows.detach().contiguous().view(torch.uint8).cpu().numpy()  # [n, in_dim * bytes]
    return chain_hashes([row.tobytes() for row in raw], block_size)


def prefix_split(model: Any, prompt: Any, num_rows: int) -> tuple[Hashable, int] | None:
    """``(label, n)`` of a prefill of ``num_rows`` rows whose first ``n`` rows come from a kept
    prefix (the family's ``_prompt_prefix``, at most ``num_rows - 1`` rows so the last row is
    computed), else None (also for ``stream_prompt_rows`` families and guided prompts)."""
    if model.stream_prompt_rows or model._guidance(prompt) is not None:
        return None
    prefix = model._prompt_prefix(prompt)
    if prefix is None:
        return None
    label, n = prefix
    n = min(int(n), num_rows - 1)
    return None if n < 1 else (label, n)


# ---------------------------------------------------------------- groups
@dataclass(frozen=True)
class SharedPrompt:
    """A computed prompt that later members of its group start from."""

    seq_id: str
    num_tokens: int
    last_hidden: torch.Tensor  # [hidden], the final hidden state of the prompt's last row
    stream: Any  # what the computing sequence's prefill output streamed
    routing: torch.Tensor | None = None  # MoE routing of its rows [n, layers, k], if recorded


class GroupPrompts:
    """The computed prompts of sample groups (``ARPrefillInput.share_group``), by
    ``(group, content hash of the prompt's rows)``; a prompt lives as long as the sequence
    that computed it holds its blocks.

    Args:
        model: the owner; its ``lengths`` and ``blocks.block_size`` are read.
    """

    def __init__(self, model: Any):
        self.model = model
        self.prompts: dict[Hashable, SharedPrompt] = {}

    def __bool__(self) -> bool:
        return bool(self.prompts)

    def __getitem__(self, key: Hashable) -> SharedPrompt:
        return self.prompts[key]

    def key(self, unit: ARPrefillInput, rows: torch.Tensor) -> Hashable | None:
        """``(group, content hash of its rows)`` of a fresh prefill that may share its
        group's equal prompt, else None."""
        if unit.share_group is None or unit.generated:
            return None
        return unit.share_group, content_hashes(rows, self.model.blocks.block_size)[-1]

    def keep(self, key: Hashable, prompt: SharedPrompt) -> None:
        """Keep a prompt its group's first member just computed."""
        self.prompts[key] = prompt

    def live(self, key: Hashable) -> bool:
        """Whether a group prompt is kept and its sequence still holds its blocks (a
        preempted sequence lost them; its entry is dropped then)."""
        shared = self.prompts.get(key)
        if shared is None:
            return False
        lengths = self.model.lengths
        if shared.seq_id in lengths and lengths[shared.seq_id] >= shared.num_tokens:
            return True
        del self.prompts[key]
        return False

    def forget(self, seq_id: str) -> None:
        """Forget the group prompts ``seq_id`` computed."""
        for key in [k for k, shared in self.prompts.items() if shared.seq_id == seq_id]:
            del self.prompts[key]


# ---------------------------------------------------------------- kept prefixes
@dataclass(frozen=True)
class KeptPrefix:
    """A prompt prefix computed once (``_prompt_prefix``), kept for later prompts with it."""

    seq_id: str  # the sequence holding its blocks
    num_tokens: int
    label: Hashable  # the family's name for it (``_prompt_prefix``), for ``drop_prefixes``
    hashes: tuple[int, ...]  # chained content hashes of its rows, one per block


PrefixJobs = dict[Hashable, tuple[torch.Tensor, list[int]]]
"""Kept prefixes a batch made and computes before its prefills: key -> (rows, block table)."""


class KeptPrefixes:
    """The kept prefixes of a model, an LRU (least recently used first) of at most
    ``model.max_kept_prefixes``, by the chained content hash of their rows.

    Args:
        model: the owner; its ``table``, ``blocks``, ``max_kept_prefixes``, ``_forward_tables``,
            ``last_routing`` and ``num_prefill_rows`` are used.

    Attributes:
        kept: content hash of the prefix's rows -> ``KeptPrefix``.
        routing: content hash -> the MoE routing ``[n, layers, k]`` of the prefix's rows,
            recorded when they were computed (a MoE stack's only).
    """

    def __init__(self, model: Any):
        self.model = model
        self.kept: OrderedDict[Hashable, KeptPrefix] = OrderedDict()
        self.routing: dict[Hashable, torch.Tensor] = {}
        self._ids = itertools.count()

    def __len__(self) -> int:
        return len(self.kept)

    @property
    def blocks_held(self) -> int:
        """Blocks held by kept prefixes and by no request (what ``drop`` frees)."""
        blocks = self.model.blocks
        return sum(
            1
            for kept in self.kept.values()
            for block in blocks.block_table(kept.seq_id)
            if blocks.ref_count(block) == 1
        )

    def drop(self, match: Callable[[Hashable], bool] | None = None) -> int:
        """Forget kept prefixes (all, or those whose label ``match`` accepts) and free their
        blocks (those requests share stay with the requests). Returns how many."""
        keys = [k for k, kept in self.kept.items() if match is None or match(kept.label)]
        for key in keys:
            self.drop_key(key)
        return len(keys)

    def drop_key(self, key: Hashable) -> None:
        """Forget one kept prefix and free its blocks (idempotent)."""
        kept = self.kept.pop(key, None)
        self.routing.pop(key, None)
        if kept is not None:
            self.model.table.free(kept.seq_id)

    def make_room(self, num_blocks: int, pinned: set[Hashable]) -> bool:
        """Evict kept prefixes (least recently used first, none in ``pinned``) until
        ``num_blocks`` blocks are free; whether they are."""
        while self.model.blocks.num_free_blocks < num_blocks:
            victim = next((k for k in self.kept if k not in pinned), None)
            if victim is None:
                return False
            self.drop_key(victim)
        return True

    def trim(self, pinned: set[Hashable]) -> None:
        """Evict the least recently used kept prefixes beyond ``max_kept_prefixes``."""
        extra = len(self.kept) - self.model.max_kept_prefixes
        for key in [k for k in self.kept if k not in pinned][: max(0, extra)]:
            self.drop_key(key)

    def admit(
        self,
        seq_id: str,
        rows: torch.Tensor,
        split: tuple[Hashable, int],
        jobs: PrefixJobs,
        pinned: set[Hashable],
    ) -> Hashable | None:
        """Admit a prefill of ``rows`` whose first ``n`` rows are a kept prefix, found by their
        content hash in the block manager (``BlockManager.match``): the sequence shares the
        prefix's blocks (made now, and queued in ``jobs`` for this batch to compute, if none
        is kept) and grows to all its rows. Kept prefixes are evicted when blocks are short;
        last, the sequence takes its prefix's blocks over (the prefix is no longer kept), so
        it needs no more blocks than a whole prefill. Returns the prefix's key, None: not
        admitted (nothing held).

        Raises:
            KVCacheFullError: longer than the whole pool.
        """
        model = self.model
        table, blocks = model.table, model.blocks
        label, n = split
        hashes = tuple(content_hashes(rows[:n], blocks.block_size))
        key = hashes[-1]
        num_rows = rows.shape[0]
        table.free(seq_id)
        whole = blocks.blocks_needed(num_rows)
        if whole > blocks.num_blocks:
            raise KVCacheFullError(seq_id, whole, blocks.num_blocks)
        pinned.add(key)
        kept = self.kept.get(key)
        created = kept is None
        if kept is None:
            keeping = blocks.blocks_needed(n) + whole - n // blocks.block_size
            if not self.make_room(keeping, pinned) and not self.make_room(whole, pinned):
                return None
            prefix_id = f"prefix/{type(model).__name__}/{next(self._ids)}"
            kept = KeptPrefix(prefix_id, n, label, hashes)
            table.admit_prefill(kept.seq_id, n)
            blocks.cache(kept.seq_id, hashes)  # computed by this batch before any reads it
            self.kept[key] = kept
            jobs[key] = (rows[:n], blocks.block_table(kept.seq_id))
        self.kept.move_to_end(key)
        table.share(seq_id, blocks.match(hashes), n)
        if not self.make_room(table.extend_cost(seq_id, num_rows), pinned):
            self.drop_key(key)  # take its blocks over: no private copy of the last one
        if table.extend(seq_id, num_rows):
            return key
        table.free(seq_id)
        if created:
            self.drop_key(key)
            del jobs[key]
        return None

    def compute(self, jobs: PrefixJobs) -> dict[Hashable, torch.Tensor]:
        """One varlen forward of queued prefixes alone (rows ``[n, in_dim]``, positions
        ``0..n-1``) into their blocks. Returns each one's MoE routing ``[n, layers, k]`` (a
        MoE stack's; kept in ``routing`` while the prefix is kept), by key."""
        model = self.model
        lens = [r.shape[0] for r, _ in jobs.values()]
        rows = torch.cat([r for r, _ in jobs.values()])
        positions = torch.cat([torch.arange(n, device=model.device) for n in lens])
        model._forward_tables(rows, positions, lens, lens, [t for _, t in jobs.values()])
        model.num_prefill_rows += sum(lens)
        if model.last_routing is None:
            return {}
        routing = dict(zip(jobs, model.last_routing.split(lens), strict=True))
        for key, rows_routing in routing.items():
            if key in self.kept:
                self.routing[key] = rows_routing
        return routing


# ---------------------------------------------------------------- prefix caching
@dataclass
class SaltedRows:
    """What a salted sequence fed so far (prefix caching): per row a digest of its input
    bytes and positions keyed by the salt, and (``stream_prompt_rows``) its streamed row
    ``[1, ...]``; ``streams`` None once a row's stream is unknown (a replay after a
    preemption streams only its last row); ``routing``: a MoE stack's routing of each row
    ``[1.., layers, k]``, None once unknown. Nothing is cached for a sequence freed before
    its prefill ran."""

    salt: bytes
    digests: list[bytes]
    streams: list[torch.Tensor] | None
    routing: list[torch.Tensor] | None = None
    computed: bool = False  # its prefill ran: the K/V of its rows are in its blocks


@dataclass(frozen=True)
class CachedStart:
    """Where an admitted salted prefill starts: ``num_cached`` rows taken from the cache,
    their streamed rows ``[num_cached, ...]`` (``stream_prompt_rows``, a fresh prefill) and
    their MoE routing ``[num_cached, layers, k]`` (None: none cached, a dense stack, or
    unknown)."""

    num_cached: int = 0
    stream: torch.Tensor | None = None
    routing: torch.Tensor | None = None


class PrefixCache:
    """Salted prefix caching (vLLM's automatic prefix caching with its ``cache_salt``): a
    salted sequence's rows are digested as they are fed; when it ends its full blocks are
    registered in the block manager's evictable cache, with their streamed rows and their
    MoE routing beside them.

    Args:
        model: the owner; its ``table``, ``blocks``, ``prefix_caching``,
            ``stream_prompt_rows``, ``positions``, ``_admit``, ``_guidance``,
            ``_prompt_prefix`` and ``lengths`` are used.

    Attributes:
        salted: the live salted sequences' records.
        streams: block content hash -> the rows a cached block streamed ``[block_size, ...]``.
        routing: block content hash -> the MoE routing of its rows ``[block_size, layers, k]``.
    """

    def __init__(self, model: Any):
        self.model = model
        self.salted: dict[str, SaltedRows] = {}
        self.streams: dict[int, torch.Tensor] = {}
        self.routing: dict[int, torch.Tensor] = {}

    def salt(self, unit: ARPrefillInput) -> bytes | None:
        """The unit's salt as a BLAKE2b key (at most 64 bytes: longer salts are digested),
        or None when the prefill neither reuses nor keeps blocks (no salt, no
        ``prefix_caching``, a guided or group prompt, or one with a kept prefix)."""
        model = self.model
        salt = getattr(unit, "cache_salt", None)
        if salt is None or not model.prefix_caching or unit.share_group is not None:
            return None
        if model._guidance(unit.prompt) is not None or model._prompt_prefix(unit.prompt):
            return None
        key = str(salt).encode()
        return key if len(key) <= 64 else hashlib.blake2b(key).digest()

    @staticmethod
    def row_digests(rows: torch.Tensor, positions: torch.Tensor, salt: bytes) -> list[bytes]:
        """A 16-byte BLAKE2b digest, keyed by ``salt``, of each input row ``[n, in_dim]``
        with its rope positions (``[n]`` or ``[position_rows, n]``): equal digests, equal K/V
        inputs (M-RoPE positions differ between equal ids in other places)."""
        raw = rows.detach().contiguous().view(torch.uint8).cpu().numpy()
        pos = positions.reshape(-1, rows.shape[0]).T.contiguous().cpu().numpy().astype("<i8")
        return [
            hashlib.blake2b(r.tobytes() + p.tobytes(), digest_size=16, key=salt).digest()
            for r, p in zip(raw, pos, strict=True)
        ]

    def admit(
        self, unit: ARPrefillInput, rows: torch.Tensor, salt: bytes, pinned: set[Hashable]
    ) -> CachedStart | None:
        """Admit a salted prefill: start on the longest cached prefix of its rows (whole
        blocks, the last row always computed; for ``stream_prompt_rows`` a fresh prefill
        only as far as the blocks' streamed rows are kept), grow to all its rows. None:
        nothing held.

        Raises:
            KVCacheFullError: longer than the whole pool.
        """
        model = self.model
        table, blocks = model.table, model.blocks
        seq_id, num_rows, size = unit.seq_id, rows.shape[0], blocks.block_size
        whole = blocks.blocks_needed(num_rows)
        if whole > blocks.num_blocks:
            raise KVCacheFullError(seq_id, whole, blocks.num_blocks)
        digests = self.row_digests(rows, model.positions.rows(unit.prompt, 0, num_rows), salt)
        hashes = chain_hashes(digests, size)[: (num_rows - 1) // size]
        matched = blocks.match(hashes)
        fresh_stream = model.stream_prompt_rows and not unit.generated
        if fresh_stream:
            known = itertools.takewhile(lambda h: h in self.streams, hashes)
            matched = matched[: len(list(known))]
        num_cached = len(matched) * size
        table.free(seq_id)
        if matched:
            table.share(seq_id, matched, num_cached)
            room = model.prefixes.make_room(table.extend_cost(seq_id, num_rows), pinned)
            admitted = room and table.extend(seq_id, num_rows)
            if not admitted:
                table.free(seq_id)  # the cached blocks go back to the cache
        else:
            admitted = model._admit(seq_id, num_rows, pinned)
        if not admitted:
            return None
        cached = hashes[: len(matched)]
        stream = torch.cat([self.streams[h] for h in cached]) if fresh_stream and matched else None
        routing = None
        moe = model.llama.config.moe is not None
        if moe and all(h in self.routing for h in cached):
            routing = torch.cat([self.routing[h] for h in cached]) if cached else None
        record = SaltedRows(salt, digests, [] if fresh_stream else None)
        if moe and (routing is not None or not cached):
            record.routing = [] if routing is None else [routing]
        self.salted[seq_id] = record
        model.num_cached_rows += num_cached
        return CachedStart(num_cached, stream, routing)

    def note_prefill(self, seq_id: str, stream: Any, routing: torch.Tensor | None) -> None:
        """Keep a salted prefill's streamed rows (one per prompt row when fresh) and the
        routing of the rows it computed."""
        record = self.salted.get(seq_id)
        if record is None:
            return
        record.computed = True
        if record.routing is not None:
            if routing is None:
                record.routing = None
            else:
                record.routing.append(routing)
        if record.streams is None:
            return
        if isinstance(stream, torch.Tensor) and stream.shape[0] == len(record.digests):
            record.streams.append(stream)
        else:
            record.streams = None

    def note_fed(
        self,
        units: Sequence[Any],
        rows: torch.Tensor,
        positions: torch.Tensor,
        streams: list,
        routing: torch.Tensor | None,
    ) -> None:
        """Add each salted sequence's fed row (digest, streamed row, routing) of a decode
        step; ``rows`` ``[B, in_dim]``, the first ``B`` columns of ``positions`` and of
        ``routing`` ``[B.., layers, k]`` (None: a dense stack) are the units'."""
        for j, unit in enumerate(units):
            record = self.salted.get(unit.seq_id)
            if record is None:
                continue
            pos = positions[..., j : j + 1]
            record.digests += self.row_digests(rows[j : j + 1], pos, record.salt)
            if record.routing is not None:
                if routing is None:
                    record.routing = None
                else:
                    record.routing.append(routing[j : j + 1])
            if record.streams is not None:
                if isinstance(streams[j], torch.Tensor):
                    record.streams.append(streams[j])
                else:
                    record.streams = None

    def forget(self, seq_id: str) -> None:
        """Drop a sequence's record without caching its blocks (a preemption)."""
        self.salted.pop(seq_id, None)

    def keep(self, seq_id: str) -> None:
        """Register a salted sequence's full blocks in the evictable cache (with their
        streamed rows and routing), before it is freed; forget its record."""
        model = self.model
        record = self.salted.pop(seq_id, None)
        if record is None or not record.computed or seq_id not in model.lengths:
            return
        size = model.blocks.block_size
        num_rows = min(model.lengths[seq_id], len(record.digests))
        hashes = chain_hashes(record.digests[:num_rows], size)[: num_rows // size]
        if not hashes:
            return
        model.blocks.cache(seq_id, hashes, keep=True)
        for rows, kept in ((record.streams, self.streams), (record.routing, self.routing)):
            whole = torch.cat(rows) if rows else None
            if whole is not None and whole.shape[0] >= len(hashes) * size:
                for b, content in enumerate(hashes):
                    kept[content] = whole[b * size : (b + 1) * size].clone()
        live = self.model.blocks.cached_hashes()
        for kept in (self.streams, self.routing):
            for content in [h for h in kept if h not in live]:
                del kept[content]

    def clear(self) -> None:
        """Forget every record and what cached blocks kept (a weight update)."""
        self.salted.clear()
        self.streams.clear()
        self.routing.clear()
