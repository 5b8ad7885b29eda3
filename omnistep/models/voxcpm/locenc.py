"""VoxCPM2's local encoder (LocEnc): one latent patch -> one LM input row.

Upstream ``voxcpm/modules/locenc/local_encoder.py: VoxCPMLocEnc``: the patch's P latent frames
``[C]`` are projected to the stack width, a learned ``special_token`` row is prepended, a
bidirectional MiniCPM stack runs over the P + 1 rows, and the special row's output is the
patch's embedding (then ``enc_to_lm_proj``, outside this module, maps it to the LM width).
"""

from __future__ import annotations

import torch
from torch import nn

from omnistep.layers.llama import LlamaConfigLite, LlamaModel


class LocEnc(nn.Module):
    """Parameter names are upstream's under ``feat_encoder.``: ``special_token`` ``[1, 1, 1,
    width]``, ``in_proj``, ``encoder.layers.*``, ``encoder.norm``."""

    def __init__(self, stack: LlamaConfigLite, feat_dim: int):
        super().__init__()
        self.special_token = nn.Parameter(torch.zeros(1, 1, 1, stack.hidden_size))
        self.in_proj = nn.Linear(feat_dim, stack.hidden_size)
        self.encoder = LlamaModel(stack)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """``[B, T, P, C]`` patches -> ``[B, T, width]`` embeddings."""
        batch, steps, frames, _ = patches.shape
        x = self.in_proj(patches)
        special = self.special_token.expand(batch, steps, 1, -1)
        x = torch.cat([special, x], dim=2).reshape(batch * steps, frames + 1, -1)
        out = self.encoder.forward_bidirectional(x)[:, 0]
        return out.view(batch, steps, -1)
