"""VoxCPM2's LocDiT solve as WorkUnits of its own (``VoxCPMOptions.inner_solve = "units"``).

In the default form (``"in_step"``) ``ar.VoxCPMAR`` solves every request's patch inside its AR
unit, as Qwen3-TTS's code predictor fills its codebooks. In this form the AR unit stops after
the stop decision and the solve's initial noise: its ``ARStepOutput.hidden`` is a
``SolveStart`` (the packed row the in-step solve would have read), and the loop
(``loop.VoxCPMLoop`` with a ``solve_component``) runs the solve as DENOISE_STEP units on
``LocDiTSolver``, one Euler step each, then the request's next AR step reads the patch. The
scheduler sees every Euler step: steps of different requests, at different points of their
solves, batch together (one estimator call, per-row times), and other requests' AR steps run
between them.

The numbers are the in-step form's: the same packed row, ``dit_condition`` on it, the same
schedule (``LocDiT.schedule``), CFG-Zero*'s zeroed first steps skipped, each Euler step
``x + (-dt) v`` with ``LocDiT.guided_velocity``; under ``batch_invariant`` every row-wise call
runs in 16-row chunks (``map_row_chunks``), so a request's patches are bit-equal to the in-step
form's (tests/test_voxcpm_inner_solve.py). ODE only: the Flow-GRPO SDE (``flow_noise_level``)
is solved in step (the card refuses it here).

Imports: torch, ``omnistep.core``, ``omnistep.layers``, ``omnistep.loops``,
``omnistep.runners``, this family's ``lm`` and ``locdit``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from omnistep.core import WorkUnitKind
from omnistep.layers.batch_invariant import map_row_chunks
from omnistep.loops.denoise import DenoiseInput, DenoiseOutput
from omnistep.models.voxcpm.lm import VoxCPMBackbone
from omnistep.runners.flow_matching import cfg_zero_init_steps, euler_delta


@dataclass(frozen=True, eq=False)
class SolveStart:
    """An AR step's patch to solve (``ARStepOutput.hidden`` in the units form).

    Attributes:
        row: ``[2H + P C + C P + 1]`` (the component's dtype and device): ``[lm row (H) |
            residual row (H) | previous patch (``[P, C]`` order) | initial noise (``[C, P]``
            order) | cfg_value]``, as ``VoxCPMAR`` packs it for the in-step solve.
        num_steps: Euler steps of the solve (``VoxCPMPrompt.timesteps``).
    """

    row: torch.Tensor
    num_steps: int


@dataclass(frozen=True, eq=False)
class SolveState:
    """A solve between two DENOISE_STEP units.

    Attributes:
        mu: ``[2 W]`` the LocDiT conditioning (``dit_condition`` of the step's LM rows).
        cond: ``[C, P]`` the previous patch.
        x: ``[C, P]`` the state after ``step`` Euler steps.
        cfg: 0-d, the guidance scale.
        step: Euler steps done (CFG-Zero*'s zeroed ones counted).
        num_steps: Euler steps of the solve.
    """

    mu: torch.Tensor
    cond: torch.Tensor
    x: torch.Tensor
    cfg: torch.Tensor
    step: int
    num_steps: int


class LocDiTSolver:
    """The DENOISE_STEP component of the units form (module docstring): one Euler step of
    every unit's solve per ``execute``; a ``DenoiseInput.start`` is a ``SolveStart``, a
    ``DenoiseInput.state`` a ``SolveState``. The output's ``state`` is the next
    ``SolveState``; when the solve is done, ``result`` is the patch ``[P, C]`` float32 on the
    CPU.

    Args:
        backbone: the loaded ``VoxCPMBackbone`` (shared with the ``lm`` component: its weight
            updates reach this component too).
        batch_invariant: row-wise calls in fixed 16-row chunks.
    """

    def __init__(self, backbone: VoxCPMBackbone, batch_invariant: bool = False):
        config = backbone.config
        self.backbone = backbone
        self.width, self.patch, self.feat = config.hidden_size, config.patch_size, config.feat_dim
        self.batch_invariant = batch_invariant
        self._schedules: dict[tuple[int, torch.dtype, str], torch.Tensor] = {}

    def execute(self, kind: WorkUnitKind, payloads: Sequence[DenoiseInput]) -> list[DenoiseOutput]:
        """One Euler step of each payload's solve (see the class docstring).

        Raises:
            ValueError: another unit kind, or a payload with neither a start nor a state.
        """
        if kind is not WorkUnitKind.DENOISE_STEP:
            raise ValueError(f"LocDiTSolver cannot run {kind}")
        with torch.no_grad():
            states = self._states(payloads)
            xs = self._euler(states)
        out = []
        for s, x in zip(states, xs, strict=True):
            state = SolveState(s.mu, s.cond, x, s.cfg, s.step + 1, s.num_steps)
            if state.step < state.num_steps:
                out.append(DenoiseOutput(state))
                continue
            patch = x.float().cpu().view(self.feat, self.patch).T.contiguous()
            out.append(DenoiseOutput(state, done=True, result=patch))
        return out

    def _row_wise(self, fn, x: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        return map_row_chunks(fn, x) if self.batch_invariant else fn(x)

    def _states(self, payloads: Sequence[DenoiseInput]) -> list[SolveState]:
        """Each payload's ``SolveState``; the starts' conditioning computed in one row-wise
        call over their packed rows (the in-step solve's layout), their zeroed steps done."""
        h, c, p = self.width, self.feat, self.patch
        starts = [i for i, u in enumerate(payloads) if u.start is not None]
        if any(u.start is None and u.state is None for u in payloads):
            raise ValueError("a LocDiT step needs a SolveStart or a SolveState")
        states: list[SolveState | None] = [u.state for u in payloads]
        if starts:
            rows = torch.stack([payloads[i].start.row for i in starts])
            condition = self.backbone.dit_condition
            mu = self._row_wise(lambda r: condition(r[:, :h], r[:, h : 2 * h]), rows)
            for j, i in enumerate(starts):
                start: SolveStart = payloads[i].start
                rest = start.row[2 * h :]
                cond = rest[: p * c].reshape(p, c).T
                noise = rest[p * c : -1].reshape(c, p)
                zero = cfg_zero_init_steps(start.num_steps + 1)
                states[i] = SolveState(mu[j], cond, noise, rest[-1], zero, start.num_steps)
        return states  # type: ignore[return-value]

    def _euler(self, states: Sequence[SolveState]) -> list[torch.Tensor]:
        """The next Euler step of every state, one estimator call per row chunk: ``x`` ``[C,
        P]`` each."""
        c, p = self.feat, self.patch
        dit = self.backbone.estimator
        mu = torch.stack([s.mu for s in states])
        times = torch.stack([self._time(s) for s in states])  # [B, 2]: t, dt
        cfg = torch.stack([s.cfg for s in states]).to(mu.dtype)
        flat = [torch.stack([getattr(s, n) for s in states]).flatten(1) for n in ("cond", "x")]
        # per row: [mu (2 W) | cond (C P) | x (C P) | t | dt | cfg]
        packed = torch.cat([mu, *flat, times.to(mu.dtype), cfg[:, None]], dim=-1)
        cp = c * p

        def step(r: torch.Tensor) -> torch.Tensor:
            cond = r[:, 2 * dit.width : 2 * dit.width + cp].reshape(-1, c, p)
            x = r[:, 2 * dit.width + cp : 2 * dit.width + 2 * cp].reshape(-1, c, p)
            t, dt, scale = r[:, -3], r[:, -2], r[:, -1]

            def velocity(time: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
                return dit.guided_velocity(r[:, : 2 * dit.width], cond, y, time, scale)

            delta, _ = euler_delta(velocity, t, -dt, x)
            return (x + delta).flatten(1)

        return list(self._row_wise(step, packed).view(-1, c, p))

    def _time(self, state: SolveState) -> torch.Tensor:
        """``[2]`` the ``(t, dt)`` of the state's next Euler step (``LocDiT.schedule``)."""
        dtype, device = state.x.dtype, state.x.device
        key = (state.num_steps, dtype, str(device))
        if key not in self._schedules:
            schedule = self.backbone.estimator.schedule(state.num_steps, dtype, device)
            self._schedules[key] = torch.stack([torch.stack(pair) for pair in schedule])
        return self._schedules[key][state.step]
