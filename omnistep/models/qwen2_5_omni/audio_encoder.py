"""Qwen2.5-Omni's audio tower (``thinker.audio_tower.*``): a Whisper-style encoder over 128-bin
log-mel features, run on many clips at once.

Mirrors transformers' ``Qwen2_5OmniAudioEncoder`` (models/qwen2_5_omni/modeling_qwen2_5_omni.py,
5.24): each clip's mel frames are cut into chunks of ``2 * n_window`` frames (the last may be
shorter); per chunk ``gelu(conv1)`` (k3, stride 1; padding frames zeroed), ``gelu(conv2)`` (k3,
stride 2), plus the sinusoid table from position 0; pre-LN transformer layers (q/v/out with
bias, k without, exact GELU MLP) attend within a chunk only; then a clip's chunk outputs are
joined, mean-pooled in pairs (``AvgPool1d(2, 2)``), ``ln_post`` and ``proj`` to the thinker
width. So a clip of ``L`` frames gives ``((L - 1) // 2 + 1 - 2) // 2 + 1`` rows (25 per second).

Batching: every chunk of every clip runs as one batch ``[num_chunks, frames, d]`` with a key
padding mask (chunks are independent, so this equals upstream's per-chunk attention).

Imports torch only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class AudioEncoderConfig:
    """``thinker_config.audio_config`` (defaults: Qwen2.5-Omni-7B, transformers'
    ``Qwen2_5OmniAudioEncoderConfig``)."""

    num_mel_bins: int = 128
    encoder_layers: int = 32
    encoder_attention_heads: int = 20
    encoder_ffn_dim: int = 5120
    d_model: int = 1280
    max_source_positions: int = 1500
    n_window: int = 100
    output_dim: int = 3584

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> AudioEncoderConfig:
        """From ``config.json``, its ``thinker_config`` or the ``audio_config`` itself.

        Raises:
            ValueError: an activation other than GELU, or ``scale_embedding`` (not in any
                published checkpoint).
        """
        for key in ("thinker_config", "audio_config"):
            raw = raw.get(key, raw)
        if raw.get("activation_function", "gelu") != "gelu" or raw.get("scale_embedding"):
            raise ValueError("only the published audio tower (gelu, no embedding scale) runs")
        names = [f.name for f in cls.__dataclass_fields__.values()]
        return cls(**{k: raw[k] for k in names if raw.get(k) is not None})


def num_audio_tokens(num_frames: int) -> int:
    """Rows the tower gives for ``num_frames`` mel frames (upstream's
    ``_get_feat_extract_output_lengths``): ``((L - 1) // 2 + 1 - 2) // 2 + 1``."""
    return ((num_frames - 1) // 2 + 1 - 2) // 2 + 1


def min_audio_samples(hop_length: int) -> int:
    """The fewest samples that give the tower one row: the log-mel keeps ``ceil(n / hop)``
    frames (``media_features.log_mel``) and ``num_audio_tokens`` needs 3 of them, so
    ``2 * hop + 1`` (321 at hop 160, 20 ms at 16 kHz)."""
    frames = next(f for f in range(1, 64) if num_audio_tokens(f) >= 1)
    return (frames - 1) * hop_length + 1


def sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> torch.Tensor:
    """Whisper's position table ``[length, channels]``: sin then cos of ``t * exp(-i *
    log(max_timescale) / (channels / 2 - 1))``."""
    increment = math.log(max_timescale) / (channels // 2 - 1)
    inv = torch.exp(-increment * torch.arange(channels // 2).float())
    scaled = torch.arange(length)[:, None] * inv[None, :]
    return torch.cat([torch.sin(scaled), torch.cos(scaled)], dim=1)


class _Layer(nn.Module):
    def __init__(self, c: AudioEncoderConfig):
        super().__init__()
        d = c.d_model
        self.heads = c.encoder_attention_heads
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(d, d)
        self.self_attn.k_proj = nn.Linear(d, d, bias=False)
        self.self_attn.v_proj = nn.Linear(d, d)
        self.self_attn.out_proj = nn.Linear(d, d)
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, c.encoder_ffn_dim)
        self.fc2 = nn.Linear(c.encoder_ffn_dim, d)
        self.final_layer_norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``x`` ``[chunks, T, d]``; ``mask`` bool ``[chunks, 1, 1, T]`` (True: a real frame)."""
        n, t, d = x.shape
        a = self.self_attn
        h = self.self_attn_layer_norm(x)

        def split(proj: nn.Linear) -> torch.Tensor:
            return proj(h).view(n, t, self.heads, d // self.heads).transpose(1, 2)

        q, k, v = split(a.q_proj), split(a.k_proj), split(a.v_proj)
        out = F.scaled_dot_product_attention(q, k, v, mask)  # [chunks, heads, T, head_dim]
        x = x + a.out_proj(out.transpose(1, 2).reshape(n, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))


class QwenAudioEncoder(nn.Module):
    """The audio tower (see module docstring); parameter names are the checkpoint's
    (``conv1``, ``conv2``, ``layers.{l}.*``, ``ln_post``, ``proj``, ``audio_bos_eos_token``)."""

    def __init__(self, config: AudioEncoderConfig):
        super().__init__()
        c = self.config = config
        self.conv1 = nn.Conv1d(c.num_mel_bins, c.d_model, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(c.d_model, c.d_model, kernel_size=3, stride=2, padding=1)
        self.layers = nn.ModuleList(_Layer(c) for _ in range(c.encoder_layers))
        self.ln_post = nn.LayerNorm(c.d_model)
        self.proj = nn.Linear(c.d_model, c.output_dim)
        self.audio_bos_eos_token = nn.Embedding(2, c.output_dim)  # loaded, unused upstream too
        self.register_buffer(
            "positions", sinusoids(c.max_source_positions, c.d_model), persistent=False
        )

    def _chunks(self, features: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
        """``[num_chunks, mel, 2 * n_window]`` zero-padded chunks of every clip, in clip order,
        and each chunk's frame count."""
        size = 2 * self.config.n_window
        pieces = [piece for f in features for piece in f.split(size, dim=1)]
        lengths = [p.shape[1] for p in pieces]
        width = max(lengths)
        return torch.stack([F.pad(p, (0, width - p.shape[1])) for p in pieces]), lengths

    def forward(self, features: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Encode clips.

        Args:
            features: per clip, log-mel ``[num_mel_bins, num_frames]`` (``num_frames >= 1``),
                in the module's dtype and device.

        Returns:
            per clip, ``[num_audio_tokens(num_frames), output_dim]``.
        """
        padded, lengths = self._chunks(features)
        frames = torch.tensor(lengths, device=padded.device)
        valid = torch.arange(padded.shape[2], device=padded.device) < frames[:, None]
        x = F.gelu(self.conv1(padded)) * valid[:, None, :].to(padded.dtype)
        x = F.gelu(self.conv2(x)).transpose(1, 2)  # [chunks, T', d]
        x = x + self.positions[: x.shape[1]].to(x.dtype)
        after = (frames - 1) // 2 + 1
        keep = torch.arange(x.shape[1], device=x.device) < after[:, None]  # [chunks, T']
        for layer in self.layers:
            x = layer(x, keep[:, None, None, :])
        rows = x[keep]  # every chunk's real frames, clip after clip
        out, start = [], 0
        for f in features:
            n = (f.shape[1] - 1) // 2 + 1
            clip = rows[start : start + n]
            start += n
            pooled = clip[: 2 * (n // 2)].view(n // 2, 2, -1).mean(dim=1)
            out.append(self.proj(self.ln_post(pooled)))
        return out
