"""Chatterbox's S3Gen and HiFT as scheduler components.

``FlowDenoiser`` runs DENOISE_STEP units (``loops.denoise``): a unit's ``start`` payload
(``FlowStart``: the speech tokens, the voice, the noise seed) prepares the request's flow inputs
(encoder, speaker projection, prompt mel) and draws its initial noise; every unit is one Euler
step (10 per utterance, ``S3GenFlow.step``), units of requests with the same number of frames
stepping together in one estimator call (each row at its own step); after the last step the
request's mel rows ``[frames, 80]`` are the result.

``HiFTVocoder`` runs AUDIO_CHUNK units (``loops.audio_decode``): HiFT's source is the cumulative
phase of the F0 over the whole utterance and its noise is drawn for the whole utterance, so the
card decodes one chunk per request (the whole mel, once the flow has finished); the first 40 ms
get upstream's ``trim_fade``.

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

from omnistep.core import WorkUnitKind
from omnistep.loops import AudioChunkInput
from omnistep.loops.denoise import DenoiseInput, DenoiseOutput
from omnistep.models.chatterbox.frontend import Voice
from omnistep.models.chatterbox.hift import HiFT, trim_fade
from omnistep.models.chatterbox.s3gen import CFG_RATE, NUM_STEPS, S3GenFlow, S3GenInputs
from omnistep.runners.flow_matching import cosine_time_points


@dataclass(frozen=True, eq=False)
class FlowStart:
    """A request's first flow unit: ``tokens`` ``[n]`` int64 (S3 ids), its voice, its seed."""

    tokens: torch.Tensor
    voice: Voice
    seed: int


@dataclass(frozen=True, eq=False)
class FlowState:
    """A request between flow steps: its prepared inputs, state ``x`` ``[80, T]`` and the
    number of steps taken."""

    inputs: S3GenInputs
    x: torch.Tensor
    step: int


def initial_noise(seed: int, frames: int, mel_dim: int = 80) -> torch.Tensor:
    """``[mel_dim, frames]``: upstream's ``torch.randn_like(mu)`` (``[1, mel_dim, T]``) after
    ``torch.manual_seed(seed)``, from a CPU generator of its own."""
    generator = torch.Generator().manual_seed(int(seed))
    return torch.randn((1, mel_dim, frames), generator=generator)[0]


class FlowDenoiser:
    """DENOISE_STEP component over ``S3GenFlow`` (see the module docstring).

    Args:
        flow: the loaded flow.
        num_steps: Euler steps per utterance (upstream 10).
        cfg_rate: the flow's guidance rate (upstream 0.7).
        batch_invariant: step every request alone (bit-identical whatever the batch).
    """

    def __init__(
        self,
        flow: S3GenFlow,
        num_steps: int = NUM_STEPS,
        cfg_rate: float = CFG_RATE,
        batch_invariant: bool = False,
    ):
        self.flow = flow
        self.num_steps = num_steps
        self.cfg_rate = cfg_rate
        self.batch_invariant = batch_invariant
        device = next(flow.parameters()).device
        self.times = cosine_time_points(num_steps, torch.float32, device)

    def _begin(self, start: FlowStart) -> FlowState:
        v = start.voice
        inputs = self.flow.prepare(start.tokens, v.gen_tokens, v.gen_mel, v.gen_embedding)
        noise = initial_noise(start.seed, inputs.num_frames, self.flow.mel_dim)
        return FlowState(inputs, noise.to(inputs.mu), 0)

    def execute(self, kind: WorkUnitKind, payloads: Sequence[DenoiseInput]) -> list[DenoiseOutput]:
        """One Euler step per unit, in the units' order.

        Raises:
            ValueError: ``kind`` is not DENOISE_STEP (and what ``S3GenFlow.prepare`` raises).
        """
        if kind is not WorkUnitKind.DENOISE_STEP:
            raise ValueError(f"S3Gen runs DENOISE_STEP units, got {kind}")
        states = [self._begin(p.start) if p.start is not None else p.state for p in payloads]
        groups: dict[int, list[int]] = {}
        for i, s in enumerate(states):
            key = i if self.batch_invariant else s.inputs.num_frames
            groups.setdefault(key, []).append(i)
        nxt: list[FlowState | None] = [None] * len(states)
        for rows in groups.values():
            batch = [states[i] for i in rows]
            x, _ = self.flow.step(
                [s.inputs for s in batch],
                torch.stack([s.x for s in batch]),
                self.times,
                [s.step for s in batch],
                self.cfg_rate,
            )
            for j, i in enumerate(rows):
                nxt[i] = FlowState(batch[j].inputs, x[j], batch[j].step + 1)
        return [self._output(s) for s in nxt]

    def _output(self, state: FlowState) -> DenoiseOutput:
        if state.step < self.num_steps:
            return DenoiseOutput(state)
        mel = state.x[:, state.inputs.prompt_frames :].transpose(0, 1).float().cpu()
        return DenoiseOutput(state, done=True, result=list(mel))  # [frames] rows of [80]


class HiFTVocoder:
    """AUDIO_CHUNK component over ``HiFT`` (see the module docstring): a unit's ``extras`` is
    its request's HiFT noise seed."""

    def __init__(self, hift: HiFT):
        self.hift = hift

    @torch.inference_mode()
    def execute(self, kind: WorkUnitKind, payloads: Sequence[AudioChunkInput]) -> list[np.ndarray]:
        """Each unit's chunk samples, float32 ``[chunk * 480]``.

        Raises:
            ValueError: ``kind`` is not AUDIO_CHUNK.
        """
        if kind is not WorkUnitKind.AUDIO_CHUNK:
            raise ValueError(f"HiFT runs AUDIO_CHUNK units, got {kind}")
        return [self._decode(p) for p in payloads]

    def _decode(self, unit: AudioChunkInput) -> np.ndarray:
        device = next(self.hift.parameters()).device
        mel = torch.stack(list(unit.frames)).transpose(0, 1)[None].to(device)  # [1, 80, W]
        generator = torch.Generator().manual_seed(int(unit.extras))
        wav, _ = self.hift(mel, self.hift.draw_noise(mel.shape[-1], generator))
        if unit.start == 0:
            wav = trim_fade(wav)
        hop = self.hift.config.samples_per_frame
        out = wav[0, unit.left * hop : (unit.left + unit.chunk) * hop]
        return np.ascontiguousarray(out.float().cpu().numpy())
