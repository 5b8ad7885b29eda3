"""T3's Perceiver resampler: a speech prompt of any length -> 32 rows of the model width.

Upstream ``chatterbox/models/t3/modules/perceiver.py`` (``Perceiver``, ``AttentionBlock2`` with
``flash_attention=True``, i.e. ``F.scaled_dot_product_attention``, no mask): learned queries
``[1, 32, D]`` attend to the prompt (cross-attention), then the result attends to itself, both
with the same block (one LayerNorm for queries and keys, q/k/v/out linears with bias, 4 heads,
a residual around the attention). Imports torch only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class PerceiverResampler(nn.Module):
    """Resample ``[B, T, D]`` prompt rows to ``[B, num_queries, D]``.

    Args:
        dim: model width ``D`` (1024 in the published T3).
        num_queries: learned query rows (upstream ``pre_attention_query_token``, 32).
        num_heads: attention heads (upstream ``num_attn_heads``, 4).

    Weights as upstream names them under ``cond_enc.perceiver.``: ``pre_attention_query``,
    ``attn.norm.*``, ``attn.to_q|to_k|to_v|proj_out.*``.
    """

    def __init__(self, dim: int, num_queries: int = 32, num_heads: int = 4, **factory):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"dim={dim} is not a multiple of num_heads={num_heads}")
        self.num_heads = num_heads
        self.pre_attention_query = nn.Parameter(torch.zeros(1, num_queries, dim, **factory))
        self.attn = nn.Module()
        self.attn.norm = nn.LayerNorm(dim, **factory)
        for name in ("to_q", "to_k", "to_v", "proj_out"):
            setattr(self.attn, name, nn.Linear(dim, dim, **factory))

    def _block(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        """``x + proj_out(attention(q(norm x), k(norm c), v(norm c)))``: ``[B, Tq, D]``."""
        a = self.attn
        b, tq, d = x.shape
        h = self.num_heads

        def heads(t: torch.Tensor) -> torch.Tensor:  # [B, T, D] -> [B, H, T, D / H]
            return t.view(b, t.shape[1], h, d // h).transpose(1, 2)

        xn, cn = a.norm(x), a.norm(context)
        out = F.scaled_dot_product_attention(
            heads(a.to_q(xn)), heads(a.to_k(cn)), heads(a.to_v(cn))
        )
        return x + a.proj_out(out.transpose(1, 2).reshape(b, tq, d))

    def forward(self, prompt: torch.Tensor) -> torch.Tensor:
        """Prompt rows ``[B, T, D]`` -> ``[B, num_queries, D]`` (same dtype)."""
        query = self.pre_attention_query.expand(prompt.shape[0], -1, -1)
        pre = self._block(query, prompt)
        return self._block(pre, pre)
