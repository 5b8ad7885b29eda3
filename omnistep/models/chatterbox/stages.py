"""Chatterbox's S3Gen and HiFT as scheduler components.

``FlowDenoiser`` runs DENOISE_STEP units (``loops.denoise``): a unit's ``start`` payload
(``FlowStart``: the speech tokens, the voice, the noise seed) prepares the request's flow inputs
(encoder, speaker projection, prompt mel) and draws its initial noise; every unit is one Euler
step (10 per utterance, ``S3GenFlow.step``), units of requests with the same number of frames
stepping together in one estimator call (each row at its own step); after the last step the
request's mel rows ``[frames, 80]`` are the result.

``HiFTVocoder`` runs AUDIO_CHUNK units (``loops.audio_decode``): in the reference setting
one chunk per request (the whole mel, upstream's noise layout); streamed, each unit carries the
mel from frame 0 and decodes its chunk with ``context`` frames each side (``HiFT.decode_window``:
F0 over the whole prefix, the phase carried in float64, noise drawn per frame). The first 40 ms
get upstream's ``trim_fade``.

A streamed request's flow windows (``card.flow_windows``) re-solve every frame from the first
with the tokens so far (``FlowStart.frames``: the look-ahead tokens' rows cut, upstream's
``finalize=False``), from frame-major noise (``initial_noise(streamed=True)``).

Rollouts: a request with ``flow_noise_level`` a > 0 samples every Euler step as Flow-GRPO's SDE
(``runners.flow_matching``: ``sde_terms``, ``sde_mean``, ``sde_noise`` seeded
``derived_seed(seed, 3)``, blocks of ``SDE_BLOCK`` frames over all frames, the prompt's
included), and a unit that asks for its record gets the shared ``core.DenoiseStepRecord``
(float32 ``[frames, 80]`` state, mean and sample over all the flow's frames, the voice prompt's
first: window ``(0, prompt frames, frames, frames)``; std; float64 log-prob; its ``FlowStart``
as ``conditioning``), so the offline API and ``/v1/rollouts`` carry it as any denoise loop's
steps; ``score_steps`` recomputes the log-probs with the same code.
Weight updates and trainer copies take the flow's tensors by their published names
(``flow.*`` of ``s3gen.safetensors``).

Noise: the flow's initial state is ``torch.randn((1, 80, T))`` of a CPU generator seeded with
``derived_seed(request seed, 1)`` (upstream's ``randn_like(mu)`` after ``torch.manual_seed``
of that seed), HiFT's source noise ``SourceNoise.draw`` of one seeded ``derived_seed(seed, 2)``.

Imports torch, numpy, ``omnistep.core``, ``omnistep.loops`` (payload types) and this family's
modules.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from omnistep.core import DenoiseStepRecord, WorkUnitKind, derived_seed
from omnistep.layers.training import require_training_copy, training_copy
from omnistep.loops import AudioChunkInput
from omnistep.loops.denoise import DenoiseInput, DenoiseOutput
from omnistep.models.chatterbox.frontend import Voice
from omnistep.models.chatterbox.hift import HiFT, trim_fade
from omnistep.models.chatterbox.s3gen import CFG_RATE, NUM_STEPS, S3GenFlow, S3GenInputs
from omnistep.runners.flow_matching import (
    cosine_time_points,
    frame_noise,
    gaussian_logprob,
    sde_mean,
    sde_noise,
    sde_terms,
)

SDE_SEED_KEY = 3
"""``derived_seed`` key of a request's SDE noise."""
SDE_BLOCK = 50
"""Frames per SDE noise block (``sde_noise``)."""
FLOW_PREFIX = "flow."
"""The flow's tensors' prefix in ``s3gen.safetensors`` (weight-update names)."""


@dataclass(frozen=True, eq=False)
class FlowStart:
    """A window's first flow unit: ``tokens`` ``[n]`` int64 (S3 ids: every token so far), its
    voice, its seed, its SDE noise level (0: the ODE), and ``frames``: None for the last
    window (all the tokens' frames), else the output frames a streamed chunk solves (the
    look-ahead tokens' rows cut, ``S3GenFlow.prepare_inputs``)."""

    tokens: torch.Tensor
    voice: Voice
    seed: int
    noise_level: float = 0.0
    frames: int | None = None


@dataclass(frozen=True, eq=False)
class FlowState:
    """A request between flow steps: its prepared inputs, state ``x`` ``[80, T]`` and the
    number of steps taken."""

    inputs: S3GenInputs
    x: torch.Tensor
    step: int
    start: FlowStart


def initial_noise(seed: int, frames: int, mel_dim: int = 80, streamed: bool = False):
    """``[mel_dim, frames]`` float32 on the CPU: upstream's ``torch.randn_like(mu)`` (``[1,
    mel_dim, T]``) after ``torch.manual_seed(seed)``, from a CPU generator of its own; or,
    ``streamed``, ``frame_noise`` (frame-major: frame ``f``'s noise depends on ``seed`` and
    ``f`` only, so the windows of a streamed request start from the same noise on the frames
    they share)."""
    if streamed:
        return frame_noise(int(seed), frames, mel_dim).transpose(0, 1)
    generator = torch.Generator().manual_seed(int(seed))
    return torch.randn((1, mel_dim, frames), generator=generator)[0]


class FlowDenoiser:
    """DENOISE_STEP component over ``S3GenFlow`` (see the module docstring).

    Args:
        flow: the loaded flow.
        num_steps: Euler steps per utterance (upstream 10).
        cfg_rate: the flow's guidance rate (upstream 0.7).
        batch_invariant: step every request alone (bit-identical whatever the batch).
        streamed: draw the initial noise frame-major (``initial_noise``), as streamed
            windows need; False draws upstream's layout (the reference setting).
    """

    serving: bool = True
    """False on a ``training_copy``: it scores and trains, and never runs units."""

    def __init__(
        self,
        flow: S3GenFlow,
        num_steps: int = NUM_STEPS,
        cfg_rate: float = CFG_RATE,
        batch_invariant: bool = False,
        streamed: bool = False,
    ):
        self.flow = flow
        self.streamed = streamed
        self.num_steps = num_steps
        self.cfg_rate = cfg_rate
        self.batch_invariant = batch_invariant
        self.weight_version = 0
        device = next(flow.parameters()).device
        self.times = cosine_time_points(num_steps, torch.float32, device)

    def _weights(self) -> dict[str, torch.Tensor]:
        return {FLOW_PREFIX + n: p for n, p in self.flow.named_parameters()}

    def weight_specs(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """``name -> (shape, dtype)`` of every flow tensor a weight update may change, by the
        published names (``flow.*``)."""
        return {name: (tuple(t.shape), str(t.dtype)) for name, t in self._weights().items()}

    @torch.no_grad()
    def update_weights(self, tensors) -> None:
        """Copy checked tensors (``ModelInstance.check_weights``) into the flow in place."""
        targets = self._weights()
        for name, value in tensors.items():
            targets[name].copy_(torch.as_tensor(value))

    def training_copy(self) -> FlowDenoiser:
        """A trainer's copy (``omnistep.layers.training``): its own flow weights, equal to
        these; it scores (``score_steps``) and hands out ``trainable_weights``."""
        return training_copy(self)

    def trainable_weights(self, names: list[str] | None = None) -> dict[str, torch.Tensor]:
        """A training copy's flow parameters by published name (all when ``names`` is None),
        set to require grad.

        Raises:
            ServingWeightsError: this component serves (take ``training_copy()`` first).
            KeyError: a name the flow does not have.
        """
        require_training_copy(self)
        weights = self._weights()
        chosen = {n: weights[n] for n in (weights if names is None else names)}
        for tensor in chosen.values():
            tensor.requires_grad_(True)
        return chosen

    def _begin(self, start: FlowStart) -> FlowState:
        v = start.voice
        inputs = self.flow.prepare(
            start.tokens, v.gen_tokens, v.gen_mel, v.gen_embedding, start.frames
        )
        noise = initial_noise(start.seed, inputs.num_frames, self.flow.mel_dim, self.streamed)
        return FlowState(inputs, noise.to(inputs.mu), 0, start)

    def _sde(
        self, state: FlowState, ode_next: torch.Tensor, k1: torch.Tensor
    ) -> tuple[torch.Tensor, DenoiseStepRecord | None]:
        """The SDE sample and its record from the ODE step (``[mel_dim, T]``), or the ODE
        step and None at noise level 0."""
        a, step = state.start.noise_level, state.step
        if a <= 0:
            return ode_next, None
        mean, std = self._sde_mean(state.x, ode_next, k1, step, a)
        frames, mel_dim = state.x.shape[-1], state.x.shape[0]
        seed = _sde_seed(state.start)
        eps = sde_noise(seed, step, 0, frames, SDE_BLOCK, mel_dim).transpose(0, 1)
        x_next = mean + std * eps.to(mean)
        record = DenoiseStepRecord(
            step=step,
            t=float(self.times[step]),
            t_next=float(self.times[step + 1]),
            x=_rows(state.x),
            mean=_rows(mean),
            std=std,
            x_next=_rows(x_next),
            logprob=float(gaussian_logprob(x_next[None], mean[None], std)[0]),
            window=(0, state.inputs.prompt_frames, frames, frames),
            weight_version=self.weight_version,
            conditioning=state.start,
        )
        return x_next, record

    def _sde_mean(self, x, ode_next, k1, step: int, noise_level: float):
        drift, std = sde_terms(self.times, step, noise_level)
        return sde_mean(ode_next, drift, self.times[step], k1, x), std

    def score_steps(self, records: Sequence[DenoiseStepRecord]) -> torch.Tensor:
        """The log-probs of recorded SDE steps (``DenoiseStepRecord``s whose ``conditioning``
        is their ``FlowStart``) recomputed by serving's code (conditioning, guided velocity,
        Euler step, drift correction), float64 ``[S]`` in the records' order. Autograd
        follows the caller's grad mode on a training copy; on the serving component never
        (no graph reaches serving weights).

        Raises:
            TypeError: a record whose ``conditioning`` is not a ``FlowStart``.
            ValueError: a record whose ``x`` or ``x_next`` is not ``[frames, mel_dim]`` of
                the frames its conditioning makes.
        """
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.serving):
            return self._score_steps(records)

    def _score_steps(self, records: Sequence[DenoiseStepRecord]) -> torch.Tensor:
        device = next(self.flow.parameters()).device
        out = []
        for r in records:
            start = r.conditioning
            if not isinstance(start, FlowStart):
                raise TypeError(
                    f"an S3Gen step's conditioning must be a FlowStart, got {type(start).__name__}"
                )
            v = start.voice
            inputs = self.flow.prepare_inputs(
                start.tokens, v.gen_tokens, v.gen_mel, v.gen_embedding, start.frames
            )
            x = torch.as_tensor(r.x).transpose(0, 1)[None].to(inputs.mu)  # [1, mel_dim, T]
            if x.shape[1:] != inputs.mu.shape[-2:] or np.shape(r.x_next) != np.shape(r.x):
                raise ValueError(
                    f"step {r.step}'s x and x_next must be [{inputs.num_frames}, "
                    f"{self.flow.mel_dim}] (the frames its conditioning makes), got "
                    f"{tuple(np.shape(r.x))} and {tuple(np.shape(r.x_next))}"
                )
            ode_next, k1 = self.flow.step([inputs], x, self.times, [r.step], self.cfg_rate)
            mean, std = self._sde_mean(x, ode_next, k1, r.step, start.noise_level)
            x_next = torch.as_tensor(r.x_next).transpose(0, 1)[None].to(mean)
            out.append(gaussian_logprob(x_next, mean, std)[0])
        if not out:
            return torch.zeros(0, dtype=torch.float64, device=device)
        return torch.stack(out)

    @torch.inference_mode()
    def execute(self, kind: WorkUnitKind, payloads: Sequence[DenoiseInput]) -> list[DenoiseOutput]:
        """One Euler step per unit, in the units' order.

        Raises:
            ValueError: ``kind`` is not DENOISE_STEP (and what ``S3GenFlow.prepare`` raises).
        """
        if not self.serving:
            raise RuntimeError("a training copy of S3Gen's flow does not serve")
        if kind is not WorkUnitKind.DENOISE_STEP:
            raise ValueError(f"S3Gen runs DENOISE_STEP units, got {kind}")
        states = [self._begin(p.start) if p.start is not None else p.state for p in payloads]
        groups: dict[int, list[int]] = {}
        for i, s in enumerate(states):
            key = i if self.batch_invariant else s.inputs.num_frames
            groups.setdefault(key, []).append(i)
        nxt: list[FlowState | None] = [None] * len(states)
        records: list[DenoiseStepRecord | None] = [None] * len(states)
        for rows in groups.values():
            batch = [states[i] for i in rows]
            x, k1 = self.flow.step(
                [s.inputs for s in batch],
                torch.stack([s.x for s in batch]),
                self.times,
                [s.step for s in batch],
                self.cfg_rate,
            )
            for j, i in enumerate(rows):
                s = batch[j]
                x_next, records[i] = self._sde(s, x[j], k1[j])
                nxt[i] = FlowState(s.inputs, x_next, s.step + 1, s.start)
        return [
            self._output(s, r if p.record else None)
            for s, r, p in zip(nxt, records, payloads, strict=True)
        ]

    def _output(self, state: FlowState, record: DenoiseStepRecord | None) -> DenoiseOutput:
        if state.step < self.num_steps:
            return DenoiseOutput(state, record=record)
        mel = state.x[:, state.inputs.prompt_frames :].transpose(0, 1).float().cpu()
        # [frames] rows of [80]
        return DenoiseOutput(state, done=True, result=list(mel), record=record)


def _sde_seed(start: FlowStart) -> int:
    """The SDE noise seed of a window: ``derived_seed(seed, 3)`` for the last window, keyed
    by its frames for a streamed chunk's (each window's transitions drawn independently)."""
    if start.frames is None:
        return derived_seed(start.seed, SDE_SEED_KEY)
    return derived_seed(start.seed, SDE_SEED_KEY, start.frames)


def _rows(x: torch.Tensor) -> np.ndarray:
    """A flow state ``[mel_dim, T]`` as the record's float32 numpy ``[T, mel_dim]``."""
    return np.ascontiguousarray(x.transpose(0, 1).float().cpu().numpy())


class HiFTVocoder:
    """AUDIO_CHUNK component over ``HiFT`` (see the module docstring): a unit's ``extras`` is
    its request's HiFT noise seed.

    Args:
        hift: the loaded vocoder.
        context: None: each unit is the whole mel (upstream's one call, its noise layout).
            An int: the streamed form; a unit's frames are the utterance's mel from frame 0
            to its window's end (``left`` = the chunk's first frame, up to ``context`` frames
            of look-ahead after the chunk), and the generator runs on the chunk with
            ``context`` frames on each side (``HiFT.decode_window``).
    """

    def __init__(self, hift: HiFT, context: int | None = None):
        if context is not None and context < 0:
            raise ValueError(f"context must be >= 0 or None, got {context}")
        self.hift = hift
        self.context = context

    @torch.inference_mode()
    def execute(self, kind: WorkUnitKind, payloads: Sequence[AudioChunkInput]) -> list[np.ndarray]:
        """Each unit's chunk samples, float32 ``[chunk * 480]``.

        Raises:
            ValueError: ``kind`` is not AUDIO_CHUNK, or (streamed) a unit whose frames do not
                start at the utterance's first frame.
        """
        if kind is not WorkUnitKind.AUDIO_CHUNK:
            raise ValueError(f"HiFT runs AUDIO_CHUNK units, got {kind}")
        decode = self._decode if self.context is None else self._decode_streamed
        return [decode(p) for p in payloads]

    def _mel(self, unit: AudioChunkInput) -> torch.Tensor:
        device = next(self.hift.parameters()).device
        return torch.stack(list(unit.frames)).transpose(0, 1)[None].to(device)  # [1, 80, W]

    def _decode(self, unit: AudioChunkInput) -> np.ndarray:
        mel = self._mel(unit)
        generator = torch.Generator().manual_seed(int(unit.extras))
        wav, _ = self.hift(mel, self.hift.draw_noise(mel.shape[-1], generator))
        if unit.start == 0:
            wav = trim_fade(wav)
        hop = self.hift.config.samples_per_frame
        out = wav[0, unit.left * hop : (unit.left + unit.chunk) * hop]
        return np.ascontiguousarray(out.float().cpu().numpy())

    def _decode_streamed(self, unit: AudioChunkInput) -> np.ndarray:
        if unit.start != 0:
            raise ValueError(f"a streamed HiFT unit's frames start at frame 0, got {unit.start}")
        mel = self._mel(unit)
        first = max(0, unit.left - self.context)
        end = min(len(unit.frames), unit.left + unit.chunk + self.context)
        noise = self.hift.stream_noise(int(unit.extras), first, end)
        wav = self.hift.decode_window(mel[..., :end], first, end, noise)
        if first == 0:
            wav = trim_fade(wav)
        hop = self.hift.config.samples_per_frame
        out = wav[0, (unit.left - first) * hop : (unit.left - first + unit.chunk) * hop]
        return np.ascontiguousarray(out.float().cpu().numpy())
