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

``solve_sde`` samples the same solve as Flow-GRPO's SDE (arXiv 2505.05470) for RL: every
Euler step after CFG-Zero*'s zeroed ones (``sde_steps``) is a Gaussian transition
(``sde_step``: the Euler step plus the shared drift correction of
``runners.flow_matching.sde_terms`` / ``sde_mean``, in their ascending time ``1 - t``), and it
returns the chain and the means a rollout records; ``sde_step`` recomputes one step's mean
from a recorded state (a trainer's score).
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
    sde_mean,
    sde_terms,
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

    def schedule(
        self, num_steps: int, dtype: torch.dtype, device: torch.device | str
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(t, dt)`` of each of ``num_steps`` Euler steps (0-d tensors; the step goes from
        ``t`` to ``t - dt``, t = 1 noise), computed by upstream ``solve_euler``'s recurrence
        (``t = t - dt``; ``dt = t - t_span[step + 1]``) on the descending swayed schedule, so
        the floats are upstream's; ``solve`` and the SDE scoring read the same list.

        Raises:
            ValueError: ``num_steps`` < 1.
        """
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        t_span = sway_time_points(num_steps + 1, SWAY_COEFFICIENT, dtype, device, descending=True)
        t, dt = t_span[0], t_span[0] - t_span[1]
        out = []
        for step in range(1, num_steps + 1):
            out.append((t, dt))
            t = t - dt
            if step < num_steps:
                dt = t - t_span[step + 1]
        return out

    def guided_velocity(
        self,
        mu: torch.Tensor,
        cond: torch.Tensor,
        x: torch.Tensor,
        time: torch.Tensor,
        cfg_value: float | torch.Tensor,
    ) -> torch.Tensor:
        """CFG-Zero* velocity ``[B, C, P]`` of states ``x`` ``[B, C, P]`` at the 0-d time
        ``time``: one estimator call over the conditional rows (``mu`` ``[B, 2 * width]``)
        and the unconditional ones (zero ``mu``), ``cond`` ``[B, C, P']`` the previous patch,
        ``cfg_value`` a float or ``[B]`` (upstream ``solve_euler``'s guided step)."""
        batch = x.shape[0]
        if isinstance(cfg_value, torch.Tensor):
            cfg_value = cfg_value.to(x.dtype).view(batch, 1, 1)
        mu_in = torch.cat([mu, torch.zeros_like(mu)])
        zeros = torch.zeros(2 * batch, dtype=x.dtype, device=x.device)
        v = self(torch.cat([x, x]), mu_in, time.expand(2 * batch), torch.cat([cond, cond]), zeros)
        return cfg_zero_star(v[:batch], v[batch:], cfg_value)

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
        return self.solve_sde(mu, cond, noise, num_steps, cfg_value)[0]

    def solve_sde(
        self,
        mu: torch.Tensor,
        cond: torch.Tensor,
        noise: torch.Tensor,
        num_steps: int,
        cfg_value: float | torch.Tensor,
        noise_level: float = 0.0,
        eps: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``solve``, each Euler step after CFG-Zero*'s zeroed ones sampled as Flow-GRPO's SDE
        when ``noise_level`` a > 0 (``sde_step``): ``x_next = mean + std * eps``.

        Args:
            mu, cond, noise, num_steps, cfg_value: as ``solve``.
            noise_level: the SDE's noise scale a (0: the ODE, bit-equal to ``solve``'s).
            eps: ``[B, S, C, P]`` standard normal noise of the ``S = sde_steps(num_steps)``
                SDE steps (needed when a > 0).

        Returns:
            ``(patch [B, C, P], states [B, S + 1, C, P], means [B, S, C, P])``: the chain
            the SDE steps went through (``states[:, s]`` before SDE step s, ``states[:, S]``
            the patch) and each step's Gaussian mean. With a = 0, ``S`` = 0.

        Raises:
            ValueError: ``num_steps`` < 1, or a > 0 without ``eps`` of ``S`` steps.
        """
        schedule = self.schedule(num_steps, noise.dtype, noise.device)
        zero_steps = cfg_zero_init_steps(num_steps + 1)
        num_sde = sde_steps(num_steps) if noise_level > 0 else 0
        if num_sde and (eps is None or eps.shape[1] != num_sde):
            raise ValueError(f"noise_level > 0 needs eps [B, {num_sde}, C, P]")
        x, states, means = noise, [], []
        for step in range(1, num_steps + 1):
            if step <= zero_steps:
                continue  # CFG-Zero*: the first steps' velocity is zero, x stays
            if not num_sde:
                t, dt = schedule[step - 1]
                delta, _ = euler_delta(
                    lambda time, y: self.guided_velocity(mu, cond, y, time, cfg_value), t, -dt, x
                )
                x = x + delta
                continue
            mean, std = self.sde_step(mu, cond, x, schedule, step, cfg_value, noise_level)
            states.append(x)
            means.append(mean)
            x = mean + std * eps[:, step - zero_steps - 1].to(mean)
        states.append(x)
        empty = x.new_zeros(x.shape[0], 0, *x.shape[1:])
        return x, torch.stack(states, 1), torch.stack(means, 1) if means else empty

    def sde_step(
        self,
        mu: torch.Tensor,
        cond: torch.Tensor,
        x: torch.Tensor,
        schedule: list[tuple[torch.Tensor, torch.Tensor]],
        step: int,
        cfg_value: float | torch.Tensor,
        noise_level: float,
    ) -> tuple[torch.Tensor, float]:
        """``(mean [B, C, P], std)`` of Euler step ``step`` (1-based, of ``schedule``) from
        ``x`` ``[B, C, P]`` sampled as Flow-GRPO's SDE (arXiv 2505.05470, eq. 9) with the
        shared math of ``runners.flow_matching`` (``sde_terms``, ``sde_mean``): the ODE step
        ``x - dt v`` plus the drift correction, in the ascending time ``1 - t`` (0 = noise)
        those functions use, with velocity ``-v``. The step's std and drift are the same for
        every row. Differentiable in the estimator's weights and in ``mu``."""
        t, dt = schedule[step - 1]
        delta, v = euler_delta(
            lambda time, y: self.guided_velocity(mu, cond, y, time, cfg_value), t, -dt, x
        )
        ascending = _ascending(schedule)
        drift, std = sde_terms(ascending, step - 1, noise_level)
        return sde_mean(x + delta, drift, ascending[step - 1], -v, x), std

    def sde_stds(
        self,
        num_steps: int,
        noise_level: float,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> tuple[float, ...]:
        """The standard deviations of a ``num_steps`` solve's SDE steps (``sde_steps`` of
        them, in order), as ``sde_step`` computes them on a schedule in ``dtype`` on
        ``device``."""
        ascending = _ascending(self.schedule(num_steps, dtype, device))
        first = num_steps - sde_steps(num_steps)
        return tuple(sde_terms(ascending, i, noise_level)[1] for i in range(first, num_steps))


def _ascending(schedule: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
    """A ``LocDiT.schedule``'s time points in the ascending convention of
    ``runners.flow_matching`` (``1 - t``: 0 = noise, 1 = data), the end point included."""
    last_t, last_dt = schedule[-1]
    return [1.0 - float(t) for t, _ in schedule] + [1.0 - float(last_t - last_dt)]


def sde_steps(num_steps: int) -> int:
    """How many of a solve's ``num_steps`` Euler steps are SDE (policy) steps: all but
    CFG-Zero*'s zeroed first ones (``cfg_zero_init_steps``), whose velocity is zero and whose
    transition has no parameter to train (they stay deterministic)."""
    return num_steps - cfg_zero_init_steps(num_steps + 1)
