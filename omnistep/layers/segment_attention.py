"""Attention within consecutive segments of a flat token sequence (frames of images and videos,
windows of audio clips): what transformers' encoders compute with ``cu_seqlens`` (flash
attention's varlen form), here without an ``[N, N]`` mask, so memory grows with the longest
segment's SDPA, not with the square of all tokens of a batch.

Imports torch only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


def segment_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: Sequence[int]
) -> torch.Tensor:
    """Attention within consecutive segments of ``lengths`` rows (no row attends outside its
    segment): ``q``, ``k``, ``v`` ``[heads, N, head_dim]`` -> ``[heads, N, head_dim]``;
    segments of one length run as one batched SDPA call (no mask).

    Raises:
        ValueError: ``lengths`` that do not add up to ``N``, or a negative length.
    """
    if sum(lengths) != q.shape[1] or any(n < 0 for n in lengths):
        raise ValueError(f"segment lengths {list(lengths)[:8]}... do not cover {q.shape[1]} rows")
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    out = torch.empty_like(q)
    by_length: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        if n:
            by_length.setdefault(n, []).append(starts[i])
    for n, firsts in by_length.items():
        idx = (torch.tensor(firsts)[:, None] + torch.arange(n)[None, :]).flatten().to(q.device)

        def take(x: torch.Tensor, idx: torch.Tensor = idx, n: int = n) -> torch.Tensor:
            return x[:, idx].view(x.shape[0], -1, n, x.shape[-1]).transpose(0, 1)

        res = F.scaled_dot_product_attention(take(q), take(k), take(v))  # [segs, heads, n, hd]
        out[:, idx] = res.transpose(0, 1).reshape(q.shape[0], -1, q.shape[-1])
    return out
