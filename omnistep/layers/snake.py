"""SnakeBeta, the periodic activation of BigVGAN-style vocoders (Lee et al. 2022, BigVGAN,
arXiv 2206.04658): shared by Qwen2.5-Omni's BigVGAN and the Qwen3-TTS codec decoder; Snake
(Ziyin et al. 2020, arXiv 2006.08195), HiFTNet's (Chatterbox's HiFT).

Imports torch only.
"""

from __future__ import annotations

import torch
from torch import nn


class SnakeBeta(nn.Module):
    """``Qwen2_5OmniSnakeBeta``: x + sin^2(x e^alpha) / (e^beta + 1e-9), per channel.

    ``channels_last``: activations ``[B, T, C]`` (the Qwen3-TTS codec's time-major conv
    stack) instead of ``[B, C, T]``."""

    def __init__(self, channels: int, channels_last: bool = False):
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels))
        self.no_div_by_zero = 0.000000001
        self.channels_last = channels_last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, C, T]`` (``[B, T, C]`` channels-last) -> the same. Without autograd the same
        operations run in place on one new tensor (bit-identical): at the vocoders' output
        rates (``[B, 96, 1920 T]`` for the Qwen3-TTS codec) the four temporaries of the plain
        form each cost fresh pages."""
        if self.channels_last:
            alpha, beta = torch.exp(self.alpha), torch.exp(self.beta)
        else:
            alpha = torch.exp(self.alpha.unsqueeze(0).unsqueeze(-1))
            beta = torch.exp(self.beta.unsqueeze(0).unsqueeze(-1))
        inv_beta = 1.0 / (beta + self.no_div_by_zero)
        if torch.is_grad_enabled() and any(t.requires_grad for t in (x, self.alpha, self.beta)):
            return x + inv_beta * torch.pow(torch.sin(x * alpha), 2)
        out = torch.mul(x, alpha).sin_().pow_(2)
        return out.mul_(inv_beta).add_(x)


class Snake(nn.Module):
    """Snake with a linear-scale alpha: ``x + sin^2(alpha x) / (alpha + 1e-9)`` per channel of
    ``[B, C, T]`` (CosyVoice / Chatterbox ``hifigan.Snake`` with ``alpha_logscale=False``)."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(channels))
        self.no_div_by_zero = 0.000000001

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha = self.alpha.unsqueeze(0).unsqueeze(-1)
        return x + (1.0 / (alpha + self.no_div_by_zero)) * torch.pow(torch.sin(x * alpha), 2)
