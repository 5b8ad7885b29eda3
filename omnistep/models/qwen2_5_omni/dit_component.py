"""The DENOISE_STEP component of Qwen2.5-Omni's token2wav: each unit one flow-matching solver
step of the DiT (``dit.DiT``), batched across requests, recorded as a Flow-GRPO step under SDE
noise (``omnistep.runners.flow_matching``), and the denoise loop's window starts.

Imports: torch, ``omnistep.core``, ``omnistep.layers.training``, ``omnistep.loops.denoise``,
``omnistep.runners.flow_matching``, this family's ``dit``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from omnistep.core import DenoiseStepRecord, ProgramContext, Request, WorkUnitKind
from omnistep.layers.training import require_training_copy, training_copy
from omnistep.loops.denoise import DenoiseInput, DenoiseOutput
from omnistep.models.qwen2_5_omni.dit import DiT
from omnistep.runners.flow_matching import FlowStep, FrameNoise


@dataclass(frozen=True, slots=True, eq=False)
class Token2WavStart:
    """A window's first DENOISE_STEP payload: its codec ids ``[n]``, the voice's ``cond``
    ``[1, enc_emb_dim]`` and ``ref_mel`` ``[1, L, mel_dim]``, the window's initial noise
    float32 ``[repeats n, mel_dim]`` (``frame_noise`` of the request seed, CPU), its first
    mel frame ``offset`` in the utterance and the frames it keeps ``[out_start, out_end)``;
    the SDE's ``noise_level`` (``SamplingParams.flow_noise_level``; 0: the ODE) and
    ``sde_seed`` (the request seed)."""

    codes: tuple[int, ...]
    cond: torch.Tensor
    ref_mel: torch.Tensor
    noise: torch.Tensor
    offset: int = 0
    out_start: int = 0
    out_end: int = 0
    noise_level: float = 0.0
    sde_seed: int = 0


DIT_PREFIX = "token2wav.code2wav_dit_model."
"""The official checkpoint's prefix of the DiT's tensors."""


@dataclass(frozen=True, slots=True, eq=False)
class WindowState:
    """The DiT's state of one window between DENOISE_STEP units: the ODE state and the start
    it came from (what a recorded step's replay needs)."""

    ode: Any
    start: Token2WavStart


class DiTComponent:
    """Runs DENOISE_STEP units: a window's start builds its ODE state (speaker features, the
    window's noise), then every unit is one solver step, all units of a call in the same DiT
    forwards (``batch_invariant``: each unit alone, so its numbers never depend on the batch;
    batched forwards differ from one unit's by float rounding, ~1e-6).

    With SDE noise (the start's ``noise_level`` > 0) each step is a Flow-GRPO policy step
    (``omnistep.runners.flow_matching.sde_terms``); a unit that asks for its record gets a
    ``DenoiseStepRecord`` (``score_steps`` recomputes its log-prob).
    """

    serving: bool = True
    """False on a ``training_copy``: it scores and trains, and never runs units."""

    def __init__(self, dit: DiT, batch_invariant: bool = False):
        self.dit = dit
        self.batch_invariant = batch_invariant
        self.weight_version = 0

    @torch.inference_mode()
    def execute(self, kind: WorkUnitKind, payloads: list[DenoiseInput]) -> list[DenoiseOutput]:
        if not self.serving:
            raise RuntimeError("a training copy of the DiT does not serve")
        if kind is not WorkUnitKind.DENOISE_STEP:
            raise ValueError(f"the DiT cannot run {kind}")
        windows = [p.state if p.state is not None else self._start(p.start) for p in payloads]
        states = [w.ode for w in windows]
        if self.batch_invariant:
            stepped = [new for state in states for new in self.dit.ode_step([state])]
        else:
            stepped = self.dit.ode_step(states)
        outputs = []
        for payload, window, new in zip(payloads, windows, stepped, strict=True):
            result = DiT.finalize(new)[0].T.contiguous() if new.done else None  # [frames, mel]
            record = None
            if payload.record and new.last is not None:
                record = self._record(new.last, window.start)
            outputs.append(DenoiseOutput(WindowState(new, window.start), new.done, result, record))
        return outputs

    def _start(self, start: Token2WavStart) -> WindowState:
        device = self.dit.device
        ode = self.dit.initial_state(
            torch.tensor([start.codes], device=device),
            start.cond.to(device),
            start.ref_mel.to(device),
            noise=start.noise.unsqueeze(0),
            offset=start.offset,
            noise_level=start.noise_level,
            sde_seed=start.sde_seed,
        )
        return WindowState(ode, start)

    def _record(self, step: FlowStep, start: Token2WavStart) -> DenoiseStepRecord:
        frames = step.x.shape[1]
        window = (start.offset, start.out_start, start.out_end, start.offset + frames)
        return DenoiseStepRecord(
            step=step.step,
            t=step.t,
            t_next=step.t_next,
            x=step.x[0].numpy(),
            mean=step.mean[0].numpy(),
            std=step.std,
            x_next=step.x_next[0].numpy(),
            logprob=float(step.logprob[0]),
            window=window,
            weight_version=self.weight_version,
            conditioning=start,
        )

    # -- weights (checkpoint names: ``token2wav.code2wav_dit_model.*``)

    def _weights(self) -> dict[str, torch.Tensor]:
        return {DIT_PREFIX + name: p for name, p in self.dit.named_parameters()}

    def weight_specs(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """``name -> (shape, dtype)`` of every DiT tensor a weight update may change, by the
        official checkpoint's names."""
        return {name: (tuple(t.shape), str(t.dtype)) for name, t in self._weights().items()}

    @torch.no_grad()
    def update_weights(self, tensors: Mapping[str, Any]) -> None:
        """Copy checked tensors (``ModelInstance.check_weights``) into the DiT in place; the
        pre-packed CPU linears repack on their next call (their weights' versions changed)."""
        targets = self._weights()
        for name, value in tensors.items():
            targets[name].copy_(torch.as_tensor(value))

    def training_copy(self) -> DiTComponent:
        """A trainer's copy (``omnistep.layers.training``): its own DiT weights, equal to
        these; it scores (``score_steps``) and hands out ``trainable_weights``, and never
        serves."""
        return training_copy(self)

    def trainable_weights(self, names: list[str] | None = None) -> dict[str, torch.Tensor]:
        """A training copy's DiT parameters by checkpoint name (all when ``names`` is None),
        set to require grad: what a Flow-GRPO trainer's optimizer takes (``score_steps``
        computes from them). Send new values to serving with the engine's
        ``update_weights``.

        Raises:
            ServingWeightsError: this component serves (take ``training_copy()`` first).
            KeyError: a name the DiT does not have.
        """
        require_training_copy(self)
        weights = self._weights()
        chosen = {n: weights[n] for n in (weights if names is None else names)}
        for tensor in chosen.values():
            tensor.requires_grad_(True)
        return chosen

    def score_steps(self, records: list[DenoiseStepRecord]) -> torch.Tensor:
        """The log-probs of recorded SDE steps recomputed (``DiT.step_logprob``: the same code
        as serving), float64 ``[S]`` in the records' order. Autograd follows the caller's
        grad mode on a training copy; on the serving component never (no graph reaches
        serving weights)."""
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.serving):
            return self._score_steps(records)

    def _score_steps(self, records: list[DenoiseStepRecord]) -> torch.Tensor:
        out = []
        for r in records:
            start: Token2WavStart = r.conditioning
            step = FlowStep(
                step=r.step,
                t=r.t,
                t_next=r.t_next,
                x=torch.as_tensor(r.x)[None],
                mean=torch.as_tensor(r.mean)[None],
                std=r.std,
                x_next=torch.as_tensor(r.x_next)[None],
                logprob=torch.tensor([r.logprob], dtype=torch.float64),
                offset=start.offset,
            )
            codes = torch.tensor([start.codes], device=self.dit.device)
            out.append(
                self.dit.step_logprob(codes, start.cond, start.ref_mel, step, start.noise_level)
            )
        if not out:
            return torch.zeros(0, dtype=torch.float64, device=self.dit.device)
        return torch.cat(out)


def token2wav_starts(repeats: int, mel_dim: int):
    """``make_start`` of the denoise loop: a window's codes, the voice, and the window's rows
    of the request's ``frame_noise`` (drawn once per request, as far as the windows reach,
    kept in the request's ``dit_noise`` slot): a frame's noise depends on the seed and its
    position only, whatever the chunk schedule."""

    def make_start(req: Request, ctx: ProgramContext, items: list[Any], window: Any) -> Any:
        if not items:
            return None
        noise = ctx.slots.get("dit_noise")
        if noise is None:
            noise = ctx.slots["dit_noise"] = FrameNoise(int(req.seed or 0), mel_dim)
        speaker = ctx.slots["speaker"]
        codes = items[window.start // repeats : window.end // repeats]
        return Token2WavStart(
            tuple(int(frame[0]) for frame in codes),
            torch.as_tensor(speaker["cond"]).float(),
            torch.as_tensor(speaker["ref_mel"]).float(),
            noise.rows(window.start, window.end),
            window.start,
            window.out_start,
            window.out_end,
            float(req.sampling.flow_noise_level or 0.0),
            int(req.seed or 0),
        )

    return make_start
