"""Qwen2.5-Omni token2wav: codec tokens -> DiT flow-matching ODE -> mel -> BigVGAN -> 24 kHz wave.

Our torch implementation of transformers' ``Qwen2_5OmniToken2WavModel`` (transformers 5.24,
``models/qwen2_5_omni/modeling_qwen2_5_omni.py``), cut into the pieces a step-level runtime
schedules: every solver step of the ODE is one call (``DiT.ode_step``) that batches any number of
requests, and the vocoder decodes exact chunks (``BigVGAN.decode_chunk``)::

    codes   [B, T]            int64 codec tokens (talker output, ids < num_embeds + 1)
      -> DiT.initial_state     noise [B, 2T, mel_dim] + conditioning computed once per request:
                               speaker encoder (ECAPA-TDNN) of ref_mel, codec embedding (each
                               token -> ``repeats`` = 2 mel frames), speaker vector ``cond``
      -> DiT.ode_step x 9      one fixed-step RK4 (3/8 rule) step of the flow-matching ODE,
                               4 velocity evaluations, each a DiT forward on the cond row and
                               the unconditional row (classifier-free guidance)
      -> DiT.finalize          log-mel [B, mel_dim, 2T], 100 frames per second
      -> BigVGAN               wave [B, 480 T] float, 24 kHz: 240 samples per mel frame

One model per file: ``dit.py`` (``DiT``: the ODE, its solver and the transformer; the ECAPA-TDNN
it conditions on is ``omnistep.layers.ecapa_tdnn``, shared with Qwen3-TTS) and ``bigvgan.py``
(``BigVGAN``).
This module holds the whole model (``Token2Wav``: the offline path, in the shape of the parity
reference) and the loaders; the card loads each half alone (``load_token2wav_part``).

State-dict names equal transformers' ``Qwen2_5OmniToken2WavModel`` (the official checkpoint's
``token2wav.`` keys without that prefix): ``code2wav_dit_model.*`` and ``code2wav_bigvgan_model.*``.

Imports: torch and the part modules (no transformers at run time).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from omnistep.models.qwen2_5_omni.bigvgan import BigVGAN, BigVGANConfig
from omnistep.models.qwen2_5_omni.dit import DiT, DiTConfig
from omnistep.runners.flow_matching import SolverConfig


@dataclass(frozen=True)
class Token2WavConfig:
    """The ``token2wav_config`` of the official ``config.json``."""

    dit: DiTConfig = field(default_factory=DiTConfig)
    bigvgan: BigVGANConfig = field(default_factory=BigVGANConfig)

    def __post_init__(self) -> None:
        if self.dit.mel_dim != self.bigvgan.mel_dim:
            raise ValueError(
                f"DiTConfig.mel_dim ({self.dit.mel_dim}) must equal BigVGANConfig.mel_dim "
                f"({self.bigvgan.mel_dim})"
            )

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> Token2WavConfig:
        """From ``token2wav_config`` (or a whole ``config.json`` dict that contains one)."""
        raw = raw.get("token2wav_config", raw)
        return cls(
            DiTConfig.from_dict(raw.get("dit_config") or {}),
            BigVGANConfig.from_dict(raw.get("bigvgan_config") or {}),
        )


class Token2Wav(nn.Module):
    """``Qwen2_5OmniToken2WavModel``: ``code2wav_dit_model`` (DiT) + ``code2wav_bigvgan_model``."""

    def __init__(self, config: Token2WavConfig):
        super().__init__()
        self.config = config
        self.code2wav_dit_model = DiT(config.dit)
        self.code2wav_bigvgan_model = BigVGAN(config.bigvgan)

    @torch.inference_mode()
    def forward(
        self,
        codes: torch.Tensor,
        cond: torch.Tensor,
        ref_mel: torch.Tensor,
        noise: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
        solver: SolverConfig | None = None,
    ) -> torch.Tensor:
        """Codes ``[B, T]`` -> wave ``[B, 480 T]`` at 24 kHz (``DiT.sample`` then ``BigVGAN``)."""
        mel = self.code2wav_dit_model.sample(codes, cond, ref_mel, noise, generator, solver)
        return self.code2wav_bigvgan_model(mel)

    def reset_buffers(self, device: torch.device) -> None:
        """Recompute the non-saved buffers (RoPE frequencies, anti-aliasing filters) on
        ``device``, float32 as upstream computes them."""
        for module in self.modules():
            if module is not self and hasattr(module, "reset_buffers"):
                module.reset_buffers(device)


def load_token2wav(
    state: Mapping[str, torch.Tensor],
    config: Mapping[str, Any] | Token2WavConfig,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> Token2Wav:
    """Build token2wav from checkpoint tensors, strictly.

    Args:
        state: the official checkpoint's ``token2wav.*`` tensors with that prefix removed
            (``code2wav_dit_model.*``, ``code2wav_bigvgan_model.*``); every name and shape must
            match.
        config: the ``token2wav_config`` dict of ``config.json`` (or the whole ``config.json``
            dict, or a ``Token2WavConfig``).
        device, dtype: where and how the model runs (upstream runs token2wav in float32).
    """
    return _load_strict(Token2Wav, state, config, device, dtype)


def load_token2wav_part(
    part: str,
    state: Mapping[str, torch.Tensor],
    config: Mapping[str, Any] | Token2WavConfig,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> DiT | BigVGAN:
    """Build one half of token2wav alone: ``part`` ``"dit"`` (``DiT``) or ``"bigvgan"``
    (``BigVGAN``), from the checkpoint's ``token2wav.code2wav_dit_model.*`` or
    ``token2wav.code2wav_bigvgan_model.*`` tensors with that prefix removed (strictly). The
    same modules as ``load_token2wav(...).code2wav_<part>_model``; a process that serves one
    half (a Ray actor) loads only its weights.

    Raises:
        ValueError: an unknown ``part``.
    """
    builders = {"dit": lambda c: DiT(c.dit), "bigvgan": lambda c: BigVGAN(c.bigvgan)}
    if part not in builders:
        raise ValueError(f"part must be one of {sorted(builders)}, got {part!r}")
    return _load_strict(builders[part], state, config, device, dtype)


def _load_strict(build, state, config, device, dtype):
    """``build(config)`` on the meta device, every tensor assigned from ``state`` (strict),
    the non-saved buffers recomputed on ``device``; eval mode."""
    if not isinstance(config, Token2WavConfig):
        config = Token2WavConfig.from_dict(config)
    with torch.device("meta"):
        model = build(config)
    model.load_state_dict(dict(state), strict=True, assign=True)
    for module in model.modules():  # not in the checkpoint (meta until now)
        if module is not model and hasattr(module, "reset_buffers"):
            module.reset_buffers(torch.device(device))
    return model.to(device=device, dtype=dtype).eval()
