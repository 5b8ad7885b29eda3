"""Flow-matching ODE and SDE math, shared by every family whose decoder integrates a flow
(Qwen2.5-Omni's token2wav DiT today; Chatterbox's S3Gen, VoxCPM's LocDiT and Qwen3-Omni next).

A flow-matching decoder predicts a velocity ``u(t, x)`` that carries noise (t = 0) to data
(t = 1). The denoise loop (``loops.denoise``) makes every solver step one DENOISE_STEP unit;
the component (the family's model) evaluates the velocity, and this module holds the rest:

- ``SolverConfig``: the time schedule, ``t = linspace(0, 1, n)`` with sway sampling
  ``t += s (cos(pi t / 2) - 1 + t)`` (F5-TTS, arXiv 2410.06885, eq. 7; upstream
  ``Qwen2_5OmniToken2WavDiTModel.sample``), and the classifier-free guidance scale.
- ``sway_time_points``: the schedule alone, ascending (0 = noise) or descending (1 = noise,
  VoxCPM's ``UnifiedCFM``); ``cfg_zero_star``, ``cfg_zero_init_steps``: CFG-Zero* guidance
  (Fan et al., arXiv 2503.18886: the unconditional velocity rescaled by its optimal projection
  scale, and the first steps' velocity zeroed; upstream
  ``voxcpm/modules/locdit/unified_cfm.py: solve_euler``).
- ``rk4_38_delta``: one fixed step of Kutta's 3/8 rule (upstream ``RungeKutta4ODESolver``);
  ``euler_delta``: one Euler step (Matcha-TTS / CosyVoice's ``solve_euler``, Chatterbox's S3Gen
  on the cosine schedule ``cosine_time_points``; VoxCPM's LocDiT on the descending sway
  schedule, with a negative ``dt``).
- ``guided_velocity``: classifier-free guidance ``f = c + (c - u) g`` (Ho and Salimans, arXiv
  2207.12598, in upstream's form).
- ``sde_terms``, ``sde_mean``, ``sde_noise``, ``gaussian_logprob``, ``FlowStep``: the step
  sampled as Flow-GRPO's SDE (arXiv 2505.05470, eq. 9) and its Gaussian log-prob, what a
  policy-gradient trainer reads.
- ``frame_noise``, ``FrameNoise``: the initial noise of an utterance, drawn so that a frame's
  noise depends on the seed and its position only (any chunk schedule gets the same noise).

Imports: torch, ``omnistep.core`` (``derived_seed``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from omnistep.core import derived_seed

Velocity = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``(t [R], x [R, ...]) -> u [R, ...]``: a flow's velocity at per-row times."""


@dataclass(frozen=True)
class SolverConfig:
    """The ODE solver; defaults are ``Qwen2_5OmniToken2WavModel.forward``'s."""

    num_steps: int = 10
    """Time points of the schedule; the solver takes ``num_steps - 1`` steps."""
    guidance_scale: float = 0.5
    """Classifier-free guidance g (f = c + (c - u) g); below 1e-5 no unconditional row runs."""
    sway_coefficient: float | None = -1.0
    """Sway sampling s: t += s (cos(pi t / 2) - 1 + t); None keeps the uniform schedule."""

    def __post_init__(self) -> None:
        if not isinstance(self.num_steps, int) or self.num_steps < 2:
            raise ValueError(f"SolverConfig.num_steps must be an int >= 2, got {self.num_steps!r}")

    @property
    def guided(self) -> bool:
        return self.guidance_scale >= 1e-5

    def time_points(self, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        """``[num_steps]`` times in [0, 1], computed exactly as upstream's ``sample``."""
        return sway_time_points(self.num_steps, self.sway_coefficient, dtype, device)


def sway_time_points(
    num_points: int,
    sway: float | None,
    dtype: torch.dtype,
    device: torch.device | str,
    descending: bool = False,
) -> torch.Tensor:
    """``[num_points]`` times: ``linspace(0, 1)`` (``descending``: ``linspace(1, 0)``, the
    convention where t = 1 is noise), then sway sampling ``t += s (cos(pi t / 2) - 1 + t)``
    unless ``sway`` is None. The expressions are upstream's (Qwen2.5-Omni's ``sample``,
    VoxCPM's ``UnifiedCFM.forward``), so the floats match."""
    start, end = (1, 0) if descending else (0, 1)
    t = torch.linspace(start, end, num_points, device=device, dtype=dtype)
    if sway is not None:
        t = t + sway * (torch.cos(torch.pi / 2 * t) - 1 + t)
    return t


def cfg_zero_init_steps(num_points: int) -> int:
    """How many first Euler steps CFG-Zero* leaves at zero velocity: ``max(1, int(0.04 n))``
    of ``n`` time points (upstream ``solve_euler``'s ``zero_init_steps``)."""
    return max(1, int(num_points * 0.04))


def cfg_zero_star(cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
    """CFG-Zero* guidance of per-row velocities ``[B, ...]``: ``s* = <c, u> / (|u|^2 + 1e-8)``
    per row, then ``u s* + scale (c - u s*)`` (arXiv 2503.18886, eq. 7; upstream
    ``UnifiedCFM.optimized_scale`` and ``solve_euler``)."""
    rows = cond.shape[0]
    c, u = cond.reshape(rows, -1), uncond.reshape(rows, -1)
    dot = torch.sum(c * u, dim=1, keepdim=True)
    norm = torch.sum(u**2, dim=1, keepdim=True) + 1e-8
    st = (dot / norm).view(rows, *([1] * (cond.ndim - 1)))
    return uncond * st + scale * (cond - uncond * st)


def rk4_38_delta(
    velocity: Velocity,
    t0: torch.Tensor,
    dt: torch.Tensor,
    t1: torch.Tensor,
    y0: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of Kutta's 3/8 rule from ``t0`` to ``t1 = t0 + dt`` (per-row times ``[R]``,
    state ``y0`` ``[R, frames, dim]``): the increment ``y1 - y0`` and ``k1``, the velocity at
    the step's start (what the SDE's drift correction reads).

    ``k1 = f(t0, y0)``, ``k2 = f(t0 + dt/3, y0 + dt k1/3)``, ``k3 = f(t0 + 2dt/3, y0 + dt (k2 -
    k1/3))``, ``k4 = f(t1, y0 + dt (k1 - k2 + k3))``, ``y1 = y0 + dt (k1 + 3 k2 + 3 k3 + k4) /
    8`` (Kutta 1901; the expressions and their order are upstream ``RungeKutta4ODESolver.
    _rk4_step``'s, so the floats match)."""
    third, two_thirds = 1 / 3, 2 / 3
    h = dt[:, None, None]
    k1 = velocity(t0, y0)
    k2 = velocity(t0 + dt * third, y0 + h * k1 * third)
    k3 = velocity(t0 + dt * two_thirds, y0 + h * (k2 - k1 * third))
    k4 = velocity(t1, y0 + h * (k1 - k2 + k3))
    return (k1 + 3 * (k2 + k3) + k4) * h / 8, k1


def cosine_time_points(
    num_steps: int, dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """``[num_steps + 1]`` times ``1 - cos(pi s / 2)`` over ``s = linspace(0, 1, num_steps +
    1)`` (Matcha-TTS / CosyVoice's ``t_scheduler: cosine``, computed as upstream
    ``ConditionalCFM`` does, so the floats match): denser near t = 0 (noise).

    Raises:
        ValueError: ``num_steps`` is not an int >= 1.
    """
    if not isinstance(num_steps, int) or num_steps < 1:
        raise ValueError(f"num_steps must be an int >= 1, got {num_steps!r}")
    span = torch.linspace(0, 1, num_steps + 1, device=device, dtype=dtype)
    return 1 - torch.cos(span * 0.5 * torch.pi)


def euler_delta(
    velocity: Velocity, t0: torch.Tensor, dt: torch.Tensor, y0: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One Euler step from ``t0`` over ``dt`` (per-row times ``[R]``, or one 0-d time for every
    row; state ``y0`` ``[R, ...]``): the increment ``dt * k1`` and ``k1 = f(t0, y0)``, the
    velocity at the step's start (what the SDE's drift correction reads, as ``rk4_38_delta``
    returns it). On a descending schedule (t = 1 noise -> 0 data, VoxCPM) ``dt`` is negative:
    ``(-h) * k1`` is bit-equal to upstream's ``x - h * v``'s increment."""
    k1 = velocity(t0, y0)
    return dt.view(-1, *([1] * (y0.dim() - 1))) * k1, k1


def guided_velocity(cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
    """Classifier-free guidance as upstream writes it: ``c + (c - u) g`` of the conditional
    velocity ``c`` and the unconditional ``u`` (same shapes), g = ``scale``."""
    return cond + (cond - uncond) * scale


@dataclass(frozen=True, eq=False)
class FlowStep:
    """One SDE solver step of a window, as sampled (a Flow-GRPO policy step).

    The transition is ``x_next ~ N(mean, std^2 I)`` with ``mean`` the ODE step plus the SDE's
    drift correction (``sde_terms``, ``sde_mean``); ``logprob`` is its Gaussian log-density
    at ``x_next`` summed over the window's elements (float64, per row). Tensors are float32
    on the CPU.

    Attributes:
        step: the solver step (0 .. num_steps - 2).
        t, t_next: its start and end time (0 = noise, 1 = mel).
        x: ``[B, frames, mel_dim]`` the state before the step.
        mean: ``[B, frames, mel_dim]`` the transition's mean.
        std: its standard deviation (one scalar for the step).
        x_next: ``[B, frames, mel_dim]`` the sampled next state.
        logprob: ``[B]`` float64 ``log N(x_next; mean, std^2 I)`` summed over frames and bins.
        offset: the window's first utterance frame.
    """

    step: int
    t: float
    t_next: float
    x: torch.Tensor
    mean: torch.Tensor
    std: float
    x_next: torch.Tensor
    logprob: torch.Tensor
    offset: int = 0


def sde_terms(times: torch.Tensor, step: int, noise_level: float) -> tuple[float, float]:
    """``(drift, std)`` of SDE step ``step`` of a schedule ``times`` at noise scale ``a``.

    Flow-GRPO (arXiv 2505.05470, eq. 9; its ``sde_step_with_logprob``) samples a rectified
    flow's reverse SDE ``dx = [v + sigma_t^2 / (2 t') (x + (1 - t') v)] dt' + sigma_t dw`` with
    ``sigma_t = a sqrt(t' / (1 - t'))`` in its time ``t'`` (1 = noise). In ours (``t = 1 - t'``,
    velocity ``u = -v``), over a step of length ``h`` from ``t``::

        mean = x + h u + drift (t u - x),  drift = sigma^2 h / (2 (1 - t)),
        std  = sigma sqrt(h),              sigma = a sqrt((1 - t) / max(t, t_1))

    ``t_1`` (the first time after 0) stands in for ``t = 0``, where ``(1 - t) / t`` diverges,
    as Flow-GRPO substitutes its ``sigma_max``. Here ``x + h u`` is this solver's RK4 step and
    ``u`` the velocity at the step's start (RK4's ``k1``). ``a = 0``: ``(0.0, 0.0)``.
    """
    if noise_level <= 0:
        return 0.0, 0.0
    t, t_next, t_first = (float(times[i]) for i in (step, step + 1, 1))
    h = t_next - t
    sigma = noise_level * math.sqrt((1.0 - t) / max(t, t_first))
    return sigma * sigma * h / (2.0 * (1.0 - t)), sigma * math.sqrt(h)


def sde_noise(seed: int, step: int, start: int, end: int, block: int, mel_dim: int) -> torch.Tensor:
    """The SDE noise of solver step ``step`` of the window of utterance frames ``[start,
    end)`` (``start`` on the block grid), float32 ``[end - start, mel_dim]`` on the CPU: block
    ``j`` draws ``torch.randn((block, mel_dim))`` from a CPU generator seeded
    ``derived_seed(seed, start // block, step, j)`` (not on the device: the same numbers on
    CPU and CUDA).

    Windows draw independent noise, also for the frames two overlapping windows both denoise
    (a left context, a look-ahead): the steps of different windows are then independent
    Gaussian transitions, and the sum of a sample's step log-probs is the log-density of what
    was sampled, what a Flow-GRPO ratio needs (with shared noise the windows' overlapping
    transitions would be one draw counted twice)."""
    first, last = start // block, -(-end // block)
    rows = [
        torch.randn(
            (block, mel_dim),
            generator=torch.Generator().manual_seed(derived_seed(seed, first, step, j)),
        )
        for j in range(first, last)
    ]
    return torch.cat(rows)[: end - start]


def gaussian_logprob(x: torch.Tensor, mean: torch.Tensor, std: float) -> torch.Tensor:
    """``log N(x; mean, std^2 I)`` summed over all but the first dim, float64 ``[B]``."""
    z = (x.double() - mean.double()) / std
    n = z[0].numel()
    return -0.5 * z.square().flatten(1).sum(1) - n * (math.log(std) + 0.5 * math.log(2 * math.pi))


def sde_mean(
    ode_next: torch.Tensor, drift: float, t: torch.Tensor | float, k1: torch.Tensor, x: torch.Tensor
) -> torch.Tensor:
    """The SDE transition's mean: the ODE step ``ode_next`` plus the drift correction
    ``drift (t u - x)`` (``sde_terms``), with ``u = k1`` the velocity at the step's start and
    ``x`` the state there."""
    return ode_next + drift * (t * k1 - x)


def frame_noise(seed: int, frames: int, mel_dim: int) -> torch.Tensor:
    """The ODE's initial noise of an utterance, float32 ``[frames, mel_dim]`` on the CPU.

    Row ``f`` depends on ``seed`` and ``f`` only: ``torch.randn`` on a CPU generator seeded
    with ``seed`` fills rows in order, and drawing ``[a, mel_dim]`` then ``[b, mel_dim]``
    equals drawing ``[a + b, mel_dim]`` (rows of 80 are whole 16-value Box-Muller groups), so
    a chunk's noise does not depend on the chunk schedule. Equal to upstream's
    ``torch.manual_seed(seed); torch.randn([1, frames, mel_dim])`` (tested). ``FrameNoise``
    draws it incrementally.
    """
    return FrameNoise(seed, mel_dim).rows(0, frames)


class FrameNoise:
    """A request's ``frame_noise``, drawn as far as asked (one CPU generator per request)."""

    def __init__(self, seed: int, mel_dim: int):
        self.generator = torch.Generator().manual_seed(int(seed))
        self.mel_dim = mel_dim
        self.drawn = torch.empty(0, mel_dim)

    def rows(self, start: int, end: int) -> torch.Tensor:
        """Noise of frames ``[start, end)``, float32 ``[end - start, mel_dim]``."""
        if end > self.drawn.shape[0]:
            more = torch.randn((end - self.drawn.shape[0], self.mel_dim), generator=self.generator)
            self.drawn = torch.cat([self.drawn, more])
        return self.drawn[start:end]
