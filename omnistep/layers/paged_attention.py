"""Causal attention over a paged KV cache, for varlen batches of prefill and decode tokens.

Imports torch only. The cache is a pool of fixed-size blocks; each sequence owns a block table
(from ``omnistep.kv.BlockManager``) listing its blocks in token order, so token ``t``
of a sequence lives at flat slot ``block_table[t // block_size] * block_size + t % block_size``.

A batch of B sequences flattens their new tokens into N = sum(query_lens) rows. Sequence ``i``
has ``context_lens[i]`` tokens in the cache after this step (its new tokens included); its new
tokens sit at positions ``context_lens[i] - query_lens[i] + j``. Each new token attends causally
to its own sequence's cached tokens up to and including itself. Attention itself is
``torch.nn.functional.scaled_dot_product_attention``; grouped-query attention repeats each KV head
``num_heads // num_kv_heads`` times, query head ``h`` reading KV head ``h // n_rep`` (transformers'
``repeat_kv`` in models/llama/modeling_llama.py).

Two execution paths:
- per sequence (prefill rows always; everything when ``batch_invariant``): one SDPA call per
  sequence on exactly its own keys, no padding. A sequence's result depends only on its own
  inputs, so it is bit-identical alone or in any batch.
- padded decode (decode rows, when not ``batch_invariant`` and ``padded_decode`` is on): the
  one-token queries of all decode sequences run as one SDPA call over their keys padded to the
  longest context, with a boolean mask. A handful of kernel launches per layer instead of a
  handful per sequence, which is what matters on a GPU; but the padded key length changes with
  the batch, and with it the kernel's blocking and reduction order, so a sequence's result may
  differ from its solo run in the last bits (measured on CPU: ~1e-7 for every sequence but the
  longest). On the CPU a call costs microseconds and attention is bandwidth bound: the
  per-sequence path was measured 1.5-3x faster at contexts of 500 (it reads no padding and
  gathers less), slower only for short contexts. So ``AttentionMetadata.padded_decode``
  defaults to "only on CUDA".
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F


class PagedKVCache:
    """K and V block pools of every layer of one model.

    Attributes:
        key_cache, value_cache: ``[num_layers, num_blocks, block_size, num_kv_heads, head_dim]``.
            Zero-initialised: padded decode reads unused slots under a mask, and a NaN there would
            survive the zero attention weight (0 * NaN = NaN).
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ):
        sizes = {
            "num_layers": num_layers,
            "num_blocks": num_blocks,
            "block_size": block_size,
            "num_kv_heads": num_kv_heads,
            "head_dim": head_dim,
        }
        for name, value in sizes.items():
            if value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        self.key_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.value_cache = torch.zeros(shape, dtype=dtype, device=device)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy K and V of every layer from block ``source`` to block ``destination`` for each
        pair (copy-on-write of shared blocks, ``omnistep.kv.SequenceTable.take_copies``). All
        sources are read before any destination is written.

        Raises:
            IndexError: a block id outside the pool.
        """
        if not pairs:
            return
        source = torch.tensor([s for s, _ in pairs], device=self.key_cache.device)
        destination = torch.tensor([d for _, d in pairs], device=self.key_cache.device)
        for pool in (self.key_cache, self.value_cache):
            pool[:, destination] = pool[:, source]

    @property
    def num_layers(self) -> int:
        return self.key_cache.shape[0]

    @property
    def num_blocks(self) -> int:
        return self.key_cache.shape[1]

    @property
    def block_size(self) -> int:
        return self.key_cache.shape[2]

    @property
    def num_kv_heads(self) -> int:
        return self.key_cache.shape[3]

    @property
    def head_dim(self) -> int:
        return self.key_cache.shape[4]

    @property
    def dtype(self) -> torch.dtype:
        return self.key_cache.dtype

    @property
    def device(self) -> torch.device:
        return self.key_cache.device

    @property
    def num_bytes(self) -> int:
        return 2 * self.key_cache.numel() * self.key_cache.element_size()


@dataclass(frozen=True, eq=False)  # holds tensors: compare by identity
class AttentionMetadata:
    """Where a varlen batch's tokens go in the cache and what each attends to.

    Device tensors (for the kernels) and host tuples (for shapes and loops, so the forward never
    synchronises with the device to read them). Build it with ``AttentionMetadata.build``.

    Attributes:
        query_start_loc: LongTensor ``[B + 1]``: sequence ``i``'s new tokens are rows
            ``query_start_loc[i]:query_start_loc[i + 1]`` of the flattened ``[N, ...]`` tensors.
        context_lens: LongTensor ``[B]``: tokens in the cache after this step, new ones included.
        slot_mapping: LongTensor ``[N]``: flat cache slot (``block * block_size + offset``) of
            each new token.
        block_tables: LongTensor ``[B, max_blocks]``: block ids per sequence, padded with 0.
        query_lens_host: new tokens per sequence.
        context_lens_host: ``context_lens`` on the host.
        first_blocks_host: per sequence, the first block id when the blocks its context needs
            are consecutive in the pool (it is then read as one slice, no gather), else -1.
            Worked out once per batch, not per layer.
        block_size: tokens per cache block.
        batch_invariant: run every sequence's attention alone, without padding, so its outputs
            are bit-identical whatever else is in the batch (and the model chunks its row-wise
            work to fixed shapes; see ``omnistep.layers.batch_invariant``).
        padded_decode: run the batch's decode rows as one padded SDPA call (module docstring);
            None = only on CUDA. Ignored when ``batch_invariant``.
    """

    query_start_loc: torch.Tensor
    context_lens: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    query_lens_host: tuple[int, ...]
    context_lens_host: tuple[int, ...]
    block_size: int
    first_blocks_host: tuple[int, ...] = ()
    batch_invariant: bool = False
    padded_decode: bool | None = None

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str | None = None,
        batch_invariant: bool = False,
        padded_decode: bool | None = None,
    ) -> AttentionMetadata:
        """Metadata for B sequences from host lists (one entry per sequence).

        Raises:
            ValueError: lengths disagree, a query is empty or longer than its context, or a
                block table is too short for its context.
        """
        _check_batch(query_lens, context_lens, block_tables, block_size)
        starts = [0, *itertools.accumulate(query_lens)]
        slots = _slot_mapping(query_lens, context_lens, block_tables, block_size)
        max_blocks = max(len(block_table) for block_table in block_tables)
        padded = [table + [0] * (max_blocks - len(table)) for table in block_tables]

        def as_tensor(values: list) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=device)

        return cls(
            query_start_loc=as_tensor(starts),
            context_lens=as_tensor(context_lens),
            slot_mapping=as_tensor(slots),
            block_tables=as_tensor(padded),
            query_lens_host=tuple(query_lens),
            context_lens_host=tuple(context_lens),
            block_size=block_size,
            first_blocks_host=tuple(
                _first_if_consecutive(table, -(-n // block_size))
                for table, n in zip(block_tables, context_lens, strict=True)
            ),
            batch_invariant=batch_invariant,
            padded_decode=padded_decode,
        )

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_host)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens_host)

    @property
    def max_context_len(self) -> int:
        return max(self.context_lens_host)

    @property
    def is_decode_only(self) -> bool:
        return all(query_len == 1 for query_len in self.query_lens_host)

    def query_starts_host(self) -> list[int]:
        """First row of each sequence in the flattened batch, ``[B]`` on the host."""
        return [0, *itertools.accumulate(self.query_lens_host[:-1])]


def _check_batch(
    query_lens: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
) -> None:
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    if not query_lens:
        raise ValueError("query_lens must name at least one sequence")
    if not len(query_lens) == len(context_lens) == len(block_tables):
        raise ValueError(
            f"query_lens, context_lens and block_tables differ in length: "
            f"{len(query_lens)}, {len(context_lens)}, {len(block_tables)}"
        )
    for i, (query_len, context_len) in enumerate(zip(query_lens, context_lens, strict=True)):
        if not 1 <= query_len <= context_len:
            raise ValueError(
                f"query_lens[{i}]={query_len} must be in [1, context_lens[{i}]={context_len}]"
            )
        if len(block_tables[i]) * block_size < context_len:
            raise ValueError(
                f"block_tables[{i}] has {len(block_tables[i])} blocks of {block_size}, "
                f"too few for context_lens[{i}]={context_len}"
            )


def _slot_mapping(
    query_lens: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
) -> list[int]:
    """Flat cache slot of every new token, sequence after sequence."""
    slots = []
    for query_len, context_len, block_table in zip(
        query_lens, context_lens, block_tables, strict=True
    ):
        for position in range(context_len - query_len, context_len):
            block_id = block_table[position // block_size]
            slots.append(block_id * block_size + position % block_size)
    return slots


def write_kv(
    cache: PagedKVCache,
    layer: int,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: AttentionMetadata,
) -> None:
    """Store the new tokens' keys and values ``[N, Hkv, D]`` at ``meta.slot_mapping``."""
    num_kv_heads, head_dim = cache.num_kv_heads, cache.head_dim
    key_slots = cache.key_cache[layer].view(-1, num_kv_heads, head_dim)  # [blocks * size, Hkv, D]
    value_slots = cache.value_cache[layer].view(-1, num_kv_heads, head_dim)
    key_slots.index_copy_(0, meta.slot_mapping, k.to(cache.dtype))
    value_slots.index_copy_(0, meta.slot_mapping, v.to(cache.dtype))


def repeat_kv(x: torch.Tensor, num_rep: int) -> torch.Tensor:
    """``[B, Hkv, S, D] -> [B, Hkv * num_rep, S, D]``, each KV head repeated ``num_rep`` times."""
    if num_rep == 1:
        return x
    batch, num_kv_heads, seq_len, head_dim = x.shape
    x = x[:, :, None].expand(batch, num_kv_heads, num_rep, seq_len, head_dim)
    return x.reshape(batch, num_kv_heads * num_rep, seq_len, head_dim)


def _first_if_consecutive(block_table: list[int], num_blocks: int) -> int:
    """``block_table[0]`` when its first ``num_blocks`` ids are consecutive, else -1."""
    first = block_table[0]
    consecutive = all(block_table[j] == first + j for j in range(1, num_blocks))
    return first if consecutive else -1


def _gather_seq_kv(
    cache: PagedKVCache,
    layer: int,
    block_ids: torch.Tensor,
    context_len: int,
    first_block: int = -1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's cached keys and values, each ``[1, Hkv, context_len, D]``.

    With ``first_block`` >= 0 (the context's blocks are consecutive in the pool from that id,
    see ``AttentionMetadata.first_blocks_host``) the result is a view of the pool, no copy;
    otherwise the blocks ``block_ids`` are gathered with ``index_select``. Both hold the same
    values. On this project's 2-core CPU, SDPA on the view costs 200 us against 347 us with the
    gather for a 160-token context (12 heads of 64, 2 threads, cold cache).
    """
    shape = (-1, cache.num_kv_heads, cache.head_dim)
    if first_block >= 0:
        stop = first_block + len(block_ids)
        k = cache.key_cache[layer, first_block:stop].view(shape)[:context_len]
        v = cache.value_cache[layer, first_block:stop].view(shape)[:context_len]
    else:
        k = cache.key_cache[layer].index_select(0, block_ids).view(shape)[:context_len]
        v = cache.value_cache[layer].index_select(0, block_ids).view(shape)[:context_len]
    return k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)


def _causal_mask(query_len: int, context_len: int, device: torch.device) -> torch.Tensor:
    """Bool ``[query_len, context_len]``: query ``j`` (position ``context_len - query_len + j``)
    sees keys up to its own position (bottom-right aligned causal mask)."""
    query_pos = torch.arange(context_len - query_len, context_len, device=device)
    key_pos = torch.arange(context_len, device=device)
    return key_pos[None, :] <= query_pos[:, None]


def _attend_seq(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of one sequence: ``q`` ``[L, H, D]``, ``k``/``v`` ``[1, Hkv, S, D]``."""
    query_len, num_heads, _ = q.shape
    context_len = k.shape[2]
    k = repeat_kv(k, num_heads // k.shape[1])
    v = repeat_kv(v, num_heads // v.shape[1])
    q = q.transpose(0, 1).unsqueeze(0)  # [1, H, L, D]
    if query_len == 1:  # a decode token sees every cached key
        out = F.scaled_dot_product_attention(q, k, v, scale=scale)
    elif query_len == context_len:  # prefill from scratch: the plain causal mask
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    else:  # prefill continuing a cached prefix
        mask = _causal_mask(query_len, context_len, q.device)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out[0].transpose(0, 1)  # [L, H, D]


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    prefill_len: int | Sequence[int] | None = None,
) -> torch.Tensor:
    """Causal attention of one whole sequence without a cache; differentiable.

    Args:
        q: queries ``[N, H, D]``; ``k``, ``v``: keys and values ``[N, Hkv, D]`` (rotated).
        prefill_len: None: one SDPA call over all rows (plain causal attention). An int in
            ``[1, N]``: the calls ``paged_attention`` makes for a sequence prefilled with
            ``prefill_len`` rows and then decoded one row at a time: one causal call over
            rows ``[0, prefill_len)``, then one call per later row ``i`` over keys
            ``0..i``, on keys laid out as the cache holds them; so each row's result equals
            the per-sequence serving path's to the bit (same kernels, same shapes). A
            sequence of ints (summing to at most N): the prompt was prefilled in consecutive
            pieces (a cached prefix, then the rest): one call per piece over the keys up to
            its end, then the decode rows.

    Returns:
        ``[N, H, D]`` in ``q.dtype``.
    """
    num_tokens = q.shape[0]
    keys = k.transpose(0, 1).unsqueeze(0)  # [1, Hkv, N, D], strides as a cache view's
    values = v.transpose(0, 1).unsqueeze(0)
    if prefill_len is None:
        return _attend_seq(q, keys, values, scale)
    pieces = (prefill_len,) if isinstance(prefill_len, int) else tuple(prefill_len)
    out, n = [], 0
    for piece in pieces:
        end = n + piece
        out.append(_attend_seq(q[n:end], keys[:, :, :end], values[:, :, :end], scale))
        n = end
    for i in range(n, num_tokens):
        out.append(_attend_seq(q[i : i + 1], keys[:, :, : i + 1], values[:, :, : i + 1], scale))
    return torch.cat(out)


def causal_attention_tail(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, per_row: bool = False
) -> torch.Tensor:
    """Causal attention of a sequence's last ``L`` rows without a cache; differentiable.

    Args:
        q: queries ``[L, H, D]`` of the sequence's rows ``N - L .. N - 1``; ``k``, ``v``: keys
            and values ``[N, Hkv, D]`` of all its rows (rotated).
        per_row: one call per row over the keys up to it (the calls serving's decode steps
            made, as ``causal_attention``'s decode rows); else one call for the ``L`` rows
            (a prefill continuing a cached prefix).

    Returns:
        ``[L, H, D]`` in ``q.dtype``.
    """
    keys = k.transpose(0, 1).unsqueeze(0)  # [1, Hkv, N, D], strides as a cache view's
    values = v.transpose(0, 1).unsqueeze(0)
    if not per_row:
        return _attend_seq(q, keys, values, scale)
    start = k.shape[0] - q.shape[0]
    return torch.cat(
        [
            _attend_seq(
                q[r : r + 1], keys[:, :, : start + r + 1], values[:, :, : start + r + 1], scale
            )
            for r in range(q.shape[0])
        ]
    )


def _attend_per_seq(
    q: torch.Tensor,
    cache: PagedKVCache,
    layer: int,
    meta: AttentionMetadata,
    seq_ids: list[int],
    scale: float,
    out: torch.Tensor,
) -> None:
    """Per-sequence path for the sequences ``seq_ids``; writes their rows of ``out``."""
    starts = meta.query_starts_host()
    for i in seq_ids:
        start, end = starts[i], starts[i] + meta.query_lens_host[i]
        context_len = meta.context_lens_host[i]
        num_blocks = -(-context_len // meta.block_size)
        first = meta.first_blocks_host[i] if meta.first_blocks_host else -1
        k, v = _gather_seq_kv(cache, layer, meta.block_tables[i, :num_blocks], context_len, first)
        out[start:end] = _attend_seq(q[start:end], k, v, scale)


def _attend_decode_padded(
    q: torch.Tensor,
    cache: PagedKVCache,
    layer: int,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    max_context_len: int,
    scale: float,
) -> torch.Tensor:
    """One SDPA call for decode queries ``q`` ``[B, H, D]`` over keys padded to the longest
    context; ``block_tables`` ``[B, max_blocks]``, ``context_lens`` ``[B]``.

    Returns ``[B, H, D]``.
    """
    batch, num_heads, head_dim = q.shape
    num_blocks = -(-max_context_len // cache.block_size)
    block_ids = block_tables[:, :num_blocks].flatten()  # [B * blocks]
    shape = (batch, -1, cache.num_kv_heads, head_dim)
    # [B * blocks, block_size, Hkv, D] -> [B, Hkv, max_context_len, D]; index_select is much
    # faster than advanced indexing here on the CPU.
    k = cache.key_cache[layer].index_select(0, block_ids).view(shape)
    v = cache.value_cache[layer].index_select(0, block_ids).view(shape)
    k = k[:, :max_context_len].transpose(1, 2)
    v = v[:, :max_context_len].transpose(1, 2)
    k = repeat_kv(k, num_heads // cache.num_kv_heads)
    v = repeat_kv(v, num_heads // cache.num_kv_heads)
    key_pos = torch.arange(max_context_len, device=q.device)
    mask = (key_pos[None, :] < context_lens[:, None])[:, None, None, :]  # [B, 1, 1, S]
    out = F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=mask, scale=scale)
    return out[:, :, 0]


def paged_attention(
    q: torch.Tensor,
    cache: PagedKVCache,
    layer: int,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its cached tokens.

    The new tokens' keys and values must already be in the cache (``write_kv``).

    Args:
        q: queries ``[N, H, D]``, rows grouped by sequence as ``meta.query_start_loc`` says;
            ``H`` a multiple of ``cache.num_kv_heads``.
        layer: which layer's pool to read.
        scale: softmax scale (usually ``head_dim ** -0.5``).

    Returns:
        ``[N, H, D]`` in ``q.dtype``.
    """
    padded_decode = meta.padded_decode
    if padded_decode is None:
        padded_decode = q.device.type == "cuda"
    all_seq_ids = list(range(meta.num_seqs))
    if meta.batch_invariant or not padded_decode:
        out = torch.empty_like(q)
        _attend_per_seq(q, cache, layer, meta, all_seq_ids, scale, out)
        return out
    if meta.is_decode_only:  # N == B: row i is sequence i's token
        return _attend_decode_padded(
            q, cache, layer, meta.block_tables, meta.context_lens, meta.max_context_len, scale
        )
    return _attend_mixed(q, cache, layer, meta, scale)


def _attend_mixed(
    q: torch.Tensor,
    cache: PagedKVCache,
    layer: int,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Prefill sequences one by one; all decode sequences of the batch in one padded call."""
    out = torch.empty_like(q)
    decode_ids = [i for i, n in enumerate(meta.query_lens_host) if n == 1]
    prefill_ids = [i for i, n in enumerate(meta.query_lens_host) if n > 1]
    _attend_per_seq(q, cache, layer, meta, prefill_ids, scale, out)
    if decode_ids:
        starts = meta.query_starts_host()
        rows = torch.tensor([starts[i] for i in decode_ids], device=q.device)
        seqs = torch.tensor(decode_ids, device=q.device)
        max_context_len = max(meta.context_lens_host[i] for i in decode_ids)
        out[rows] = _attend_decode_padded(
            q[rows],
            cache,
            layer,
            meta.block_tables[seqs],
            meta.context_lens[seqs],
            max_context_len,
            scale,
        )
    return out
