"""Row-wise work on fixed shapes, so a row's result does not depend on the batch around it.

Imports torch only. Dense kernels pick their algorithm from the problem shape: measured with this
machine's MKL, ``F.linear`` gives a row one result when M = 1, another when M is 2..3 and a third
when M >= 4 (differences ~5e-5 at hidden 768); cuBLAS likewise picks tiles and split-K by M. The
kernels do not look at the other rows' values or at a row's position in the tile (checked here
for every position of 4..512-row calls), so calling them on exactly ``chunk_rows`` rows at a time
(the last chunk zero-padded) makes each row's result a function of that row alone.

A ``RowChunking`` picks the chunk size per row from its own sequence: rows of decode sequences
(one new token) run in small chunks, so a lone decode step pads little; rows of prefill sequences
run in large chunks, so a long prompt is not cut into many small GEMMs. Which class a row falls in
depends only on its sequence's query length, never on the rest of the batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

RowFn = Callable[[torch.Tensor], torch.Tensor]

DEFAULT_CHUNK_ROWS = 16


def map_row_chunks(
    fn: RowFn, x: torch.Tensor, chunk_rows: int = DEFAULT_CHUNK_ROWS
) -> torch.Tensor:
    """``fn(x)`` for a row-wise ``fn``, evaluated on chunks of exactly ``chunk_rows`` rows.

    Args:
        fn: maps ``[M, ...]`` to ``[M, ...]`` treating rows independently (a linear layer, a
            norm, an MLP); it must map zero rows to finite values.
        x: ``[N, ...]``.

    Returns:
        ``fn(x)`` ``[N, ...]``, each row computed by a call of the same shape whatever ``N`` is.
    """
    if chunk_rows <= 0:
        raise ValueError(f"chunk_rows must be > 0, got {chunk_rows}")
    num_rows = x.shape[0]
    num_pad = -num_rows % chunk_rows
    if num_pad:
        x = torch.cat([x, x.new_zeros((num_pad, *x.shape[1:]))])
    outputs = [fn(chunk) for chunk in x.split(chunk_rows)]
    return torch.cat(outputs)[:num_rows]


@dataclass(frozen=True, eq=False)  # holds tensors: compare by identity
class RowGroup:
    """Rows computed together in chunks of ``chunk_rows``.

    Attributes:
        row_ids: LongTensor of row indices into the batch, or None for every row.
        chunk_rows: rows per kernel call.
    """

    row_ids: torch.Tensor | None
    chunk_rows: int


@dataclass(frozen=True)
class RowChunking:
    """Chunk sizes of batch-invariant mode.

    Attributes:
        decode_rows: rows per call for sequences with one new token (a lone decode step is
            padded to this many rows; on a GPU that is free, on a CPU it costs compute).
        prefill_rows: rows per call for sequences with several new tokens.
    """

    decode_rows: int = DEFAULT_CHUNK_ROWS
    prefill_rows: int = 128

    def __post_init__(self) -> None:
        for name in ("decode_rows", "prefill_rows"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    def plan(self, query_lens: Sequence[int], device: torch.device) -> list[RowGroup]:
        """Groups for a varlen batch whose sequences have ``query_lens`` new tokens each."""
        if all(n == 1 for n in query_lens):
            return [RowGroup(None, self.decode_rows)]
        if all(n > 1 for n in query_lens):
            return [RowGroup(None, self.prefill_rows)]
        decode_ids: list[int] = []
        prefill_ids: list[int] = []
        start = 0
        for n in query_lens:
            (decode_ids if n == 1 else prefill_ids).extend(range(start, start + n))
            start += n
        return [
            RowGroup(torch.tensor(decode_ids, device=device), self.decode_rows),
            RowGroup(torch.tensor(prefill_ids, device=device), self.prefill_rows),
        ]


def map_row_groups(fn: RowFn, x: torch.Tensor, groups: Sequence[RowGroup]) -> torch.Tensor:
    """``fn(x)`` for a row-wise ``fn``, each group of rows evaluated in its fixed-size chunks."""
    if len(groups) == 1 and groups[0].row_ids is None:
        return map_row_chunks(fn, x, groups[0].chunk_rows)
    out: torch.Tensor | None = None
    for group in groups:
        y = map_row_chunks(fn, x.index_select(0, group.row_ids), group.chunk_rows)
        if out is None:
            out = y.new_empty((x.shape[0], *y.shape[1:]))
        out.index_copy_(0, group.row_ids, y)
    return out
