"""VoxCPM2's local diffusion transformer (LocDiT) and its per-patch flow-matching solve.

The LocDiT predicts the velocity of one latent patch (upstream
``voxcpm/modules/locdit/local_dit_v2.py: VoxCPMLocDiT``): the noisy patch ``x`` ``[N, C, P]``
and the previous patch ``cond`` ``[N, C, P']`` are projected to the stack width, the time
embedding (sinusoidal, scale 1000, then an MLP; plus the same for ``dt``, zero outside mean
mode) and the conditioning ``mu`` ``[N, 2 * width]`` (the LM's and the residual LM's
projected hidden states: two rows) are prepended, and a bidirectional MiniCPM stack runs over
``[mu (2 rows), t (1), cond (P'), x (P)]``; the last P rows, projected back to C, are the
velocity.

``solve`` integrates it from noise (t = 1) to a patch (t = 0) with Euler steps on a swayed
schedule and CFG-Zero* guidance against an unconditional row whose ``mu`` is zero (upstream
``UnifiedCFM.forward`` / ``solve_euler``), with the shared math of
``omnistep.runners.flow_matching``. All rows of a batch run together: each request's
conditional and unconditional rows are one estimator call per step.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from omnistep.layers.llama import LlamaConfigLite, LlamaModel
from omnistep.runners.flow_matching import (
    cfg_zero_init_steps,
    cfg_zero_star,
    euler_delta,
    sway_time_points,
)

SWAY_COEFFICIENT = 1.0
"""Upstream ``UnifiedCFM.forward``'s default ``sway_sampling_coef``."""


def sinusoidal_embedding(t: torch.Tensor, dim: int, scale: float = 1000.0) -> torch.Tensor:
    """``[N]`` times -> ``[N, dim]``: ``sin``/``cos`` of ``scale t exp(-i ln(1e4) / (dim/2 -
    1))`` (upstream ``SinusoidalPosEmb``, sin half first)."""
    half = dim // 2
    freq = torch.exp(
        torch.arange(half, dtype=t.dtype, device=t.device) * -(math.log(10000) / (half - 1))
    )
    angles = scale * t.unsqueeze(1) * freq.unsqueeze(0)
    return torch.cat((angles.sin(), angles.cos()), dim=-1)


class TimestepMLP(nn.Module):
    """``linear_2(silu(linear_1(x)))`` (upstream ``TimestepEmbedding``; names kept)."""

    def __init__(self, width: int):
        super().__init__()
        self.linear_1 = nn.Linear(width, width)
        self.linear_2 = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


class LocDiT(nn.Module):
    """The velocity estimator. Parameter names are upstream's under
    ``feat_decoder.estimator.``: ``in_proj``, ``cond_proj``, ``out_proj``, ``time_mlp``,
    ``delta_time_mlp``, ``decoder.layers.*``, ``decoder.norm``.

    Args:
        stack: the MiniCPM stack (``VoxCPMConfig.local_stack(config.dit)``).
        feat_dim: latent channels C.
    """

    def __init__(self, stack: LlamaConfigLite, feat_dim: int):
        super().__init__()
        width = stack.hidden_size
        self.width = width
        self.feat_dim = feat_dim
        self.in_proj = nn.Linear(feat_dim, width)
        self.cond_proj = nn.Linear(feat_dim, width)
        self.out_proj = nn.Linear(width, feat_dim)
        self.time_mlp = TimestepMLP(width)
        self.delta_time_mlp = TimestepMLP(width)
        self.decoder = LlamaModel(stack)

    def forward(
        self,
        x: torch.Tensor,
        mu: torch.Tensor,
        t: torch.Tensor,
        cond: torch.Tensor,
        dt: torch.Tensor,
    ) -> torch.Tensor:
        """Velocity ``[N, C, P]`` of ``x`` ``[N, C, P]`` at times ``t`` ``[N]`` given ``mu``
        ``[N, k * width]`` and ``cond`` ``[N, C, P']`` (``dt`` ``[N]``: zeros outside mean
        mode)."""
        h = self.in_proj(x.transpose(1, 2))
        c = self.cond_proj(cond.transpose(1, 2))
        temb = self.time_mlp(sinusoidal_embedding(t, self.width).to(h.dtype))
        temb = temb + self.delta_time_mlp(sinusoidal_embedding(dt, self.width).to(h.dtype))
        mu = mu.view(h.shape[0], -1, self.width)
        seq = torch.cat([mu, temb.unsqueeze(1), c, h], dim=1)
        out = self.decoder.forward_bidirectional(seq)
        out = out[:, mu.shape[1] + 1 + c.shape[1] :]
        return self.out_proj(out).transpose(1, 2)

    def solve(
        self,
        mu: torch.Tensor,
        cond: torch.Tensor,
        noise: torch.Tensor,
        num_steps: int,
        cfg_value: float | torch.Tensor,
    ) -> torch.Tensor:
        """One patch per row: Euler from ``noise`` ``[B, C, P]`` over ``num_steps`` steps.

        Args:
            mu: ``[B, 2 * width]`` conditioning; the unconditional rows use zeros.
            cond: ``[B, C, P']`` the previous patch (zeros before the first).
            noise: ``[B, C, P]`` the initial state (upstream: ``randn * temperature``).
            num_steps: Euler steps (upstream ``inference_timesteps``), >= 1.
            cfg_value: guidance scale, a float or ``[B]`` per row.

        Returns:
            ``[B, C, P]`` the patches.

        Raises:
            ValueError: ``num_steps`` < 1.
        """
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        batch = mu.shape[0]
        x = noise
        t_span = sway_time_points(
            num_steps + 1, SWAY_COEFFICIENT, x.dtype, x.device, descending=True
        )
        zero_steps = cfg_zero_init_steps(num_steps + 1)
        if isinstance(cfg_value, torch.Tensor):
            cfg_value = cfg_value.to(x.dtype).view(batch, 1, 1)
        t, dt = t_span[0], t_span[0] - t_span[1]
        mu_in = torch.cat([mu, torch.zeros_like(mu)])
        cond_in = torch.cat([cond, cond])
        zeros = torch.zeros(2 * batch, dtype=x.dtype, device=x.device)

        def velocity(time: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            v = self(torch.cat([y, y]), mu_in, time.expand(2 * batch), cond_in, zeros)
            return cfg_zero_star(v[:batch], v[batch:], cfg_value)

        for step in range(1, num_steps + 1):
            if step > zero_steps:
                delta, _ = euler_delta(velocity, t, -dt, x)
                x = x + delta
            t = t - dt
            if step < num_steps:
                dt = t - t_span[step + 1]
        return x
