"""Qwen3-Omni's audio encoder (``thinker.audio_tower``): log-mel frames -> thinker-width rows.

Follows transformers' ``Qwen3OmniMoeAudioEncoder`` (models/qwen3_omni_moe/
modeling_qwen3_omni_moe.py; written here from its description, weights by its names):

1. A clip's mel frames ``[num_mel_bins, T]`` are cut into chunks of ``2 * n_window`` frames
   (100 published; the last one shorter).
2. Each chunk goes through three 3x3 ``Conv2d``s of stride 2 (padding 1, GELU after each) over
   (mel, time): ``[1, mel, L] -> [C, mel / 8, ceil-ish(L / 8)]``, then ``conv_out`` (no bias)
   maps the ``C * mel / 8`` features of each time step to ``d_model``; every chunk gets the
   sinusoid positions ``0..`` of its own frames (the positions restart per chunk). A 100-frame
   chunk gives 13 rows (``output_lengths``).
3. The rows of all chunks, in order, go through ``encoder_layers`` pre-LayerNorm transformer
   layers whose (bidirectional) attention is cut into windows of ``13 * n_window_infer /
   (2 * n_window)`` rows (104 published, 8 s), each clip's windows on their own (one
   attention call per window length, ``layers.segment_attention``: no ``[rows, rows]`` mask,
   which for a batch of long clips grew with the square of all their rows).
4. ``ln_post``, ``proj1``, GELU, ``proj2`` -> ``[rows, output_dim]`` (the thinker's width).

Padding. transformers zero-pads every chunk to the longest chunk of its batch before the
convs; the padded frames' GELU(bias) outputs then reach the last kept rows of a shorter chunk
through the second and third convs, so a clip's rows depend on what it was batched with. Here
each clip's chunks are padded as that clip alone would be: to ``2 * n_window`` frames when the
clip has a full chunk, else to the clip's own length (a clip under ``2 * n_window`` frames is
its own chunk, unpadded). A clip's rows are then transformers' rows for that clip processed
alone, whatever it is batched with (chunks of one padded length share a conv call).

Imports numpy, torch and ``omnistep.layers``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from omnistep.layers.segment_attention import segment_attention


@dataclass(frozen=True)
class AudioEncoderConfig:
    """``thinker_config.audio_config`` (``Qwen3OmniMoeAudioEncoderConfig``), defaults
    transformers' (published: d_model 1280, 32 layers, 20 heads, output_dim 2048)."""

    num_mel_bins: int = 128
    d_model: int = 1280
    encoder_layers: int = 32
    encoder_attention_heads: int = 20
    encoder_ffn_dim: int = 5120
    max_source_positions: int = 1500
    n_window: int = 50
    n_window_infer: int = 800
    output_dim: int = 3584
    downsample_hidden_size: int = 480
    activation_function: str = "gelu"
    scale_embedding: bool = False

    def __post_init__(self) -> None:
        if self.activation_function != "gelu":
            raise ValueError(
                f"audio_config.activation_function {self.activation_function!r}: only gelu"
            )
        if self.scale_embedding:
            raise ValueError("audio_config.scale_embedding=True is not supported")
        if self.d_model % self.encoder_attention_heads:
            raise ValueError("audio_config: d_model must divide by encoder_attention_heads")

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> AudioEncoderConfig:
        """From ``config.json``, its ``thinker_config`` or the ``audio_config`` itself."""
        raw = raw.get("thinker_config", raw)
        raw = raw.get("audio_config", raw)
        return cls(**{k: raw[k] for k in cls.__dataclass_fields__ if raw.get(k) is not None})

    @property
    def chunk_frames(self) -> int:
        """Mel frames per conv chunk (``2 * n_window``)."""
        return 2 * self.n_window

    @property
    def window_rows(self) -> int:
        """Rows per attention window: a full chunk's rows times ``n_window_infer`` over the
        chunk's frames (transformers' ``get_audio_cu_seqlens``; 13 * 8 = 104 published)."""
        return conv_output_length(self.chunk_frames) * (self.n_window_infer // self.chunk_frames)

    def output_length(self, frames: int) -> int:
        """Rows of a clip of ``frames`` mel frames (``_get_feat_extract_output_lengths``)."""
        full, rest = divmod(int(frames), self.chunk_frames)
        return full * conv_output_length(self.chunk_frames) + (
            conv_output_length(rest) if rest else 0
        )


def min_audio_samples(hop_length: int, n_fft: int) -> int:
    """The fewest samples that give the tower one row: the unpadded log-mel keeps ``n // hop``
    frames (``media_features.log_mel_unpadded``) and one frame gives one row, and its STFT
    reflect-pads ``n_fft // 2`` samples, which needs more than that many: 201 at hop 160,
    n_fft 400 (12.6 ms at 16 kHz)."""
    frames = next(f for f in range(1, 64) if conv_output_length(f) >= 1)
    return max(frames * hop_length, n_fft // 2 + 1)


def conv_output_length(frames: int) -> int:
    """Time steps after the three stride-2 convs of a chunk of ``frames`` mel frames."""
    for _ in range(3):
        frames = (frames - 1) // 2 + 1
    return frames


def sinusoid_positions(length: int, channels: int, max_timescale: float = 10000.0) -> torch.Tensor:
    """float32 ``[length, channels]``: ``sin`` then ``cos`` of ``t * exp(-i * log(max) /
    (channels / 2 - 1))`` (Whisper's ``sinusoids``, transformers' ``SinusoidsPositionEmbedding``).

    Raises:
        ValueError: odd ``channels``.
    """
    if channels % 2:
        raise ValueError(f"sinusoid positions need even channels, got {channels}")
    step = np.log(max_timescale) / (channels // 2 - 1)
    inv = torch.exp(-step * torch.arange(channels // 2).float())
    t = torch.arange(length)[:, None] * inv[None, :]
    return torch.cat([torch.sin(t), torch.cos(t)], dim=1)


class _Attention(nn.Module):
    def __init__(self, config: AudioEncoderConfig):
        super().__init__()
        d = config.d_model
        self.heads = config.encoder_attention_heads
        self.q_proj, self.k_proj = nn.Linear(d, d), nn.Linear(d, d)
        self.v_proj, self.out_proj = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor, windows: Sequence[int]) -> torch.Tensor:
        n, d = x.shape
        shape = (n, self.heads, d // self.heads)
        q, k, v = (
            p(x).view(shape).transpose(0, 1) for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        out = segment_attention(q, k, v, windows)  # [H, n, hd]
        return self.out_proj(out.transpose(0, 1).reshape(n, d))


class _Layer(nn.Module):
    def __init__(self, config: AudioEncoderConfig):
        super().__init__()
        d = config.d_model
        self.self_attn = _Attention(config)
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, config.encoder_ffn_dim)
        self.fc2 = nn.Linear(config.encoder_ffn_dim, d)
        self.final_layer_norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor, windows: Sequence[int]) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x), windows)
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))


class Qwen3AudioEncoder(nn.Module):
    """The audio tower (module docstring); parameters under transformers' names, so
    ``load_state_dict`` takes the ``thinker.audio_tower.*`` tensors with the prefix removed."""

    def __init__(self, config: AudioEncoderConfig):
        super().__init__()
        self.config = config
        c = config.downsample_hidden_size
        self.conv2d1 = nn.Conv2d(1, c, 3, 2, padding=1)
        self.conv2d2 = nn.Conv2d(c, c, 3, 2, padding=1)
        self.conv2d3 = nn.Conv2d(c, c, 3, 2, padding=1)
        mel = config.num_mel_bins
        for _ in range(3):
            mel = (mel + 1) // 2
        self.conv_out = nn.Linear(c * mel, config.d_model, bias=False)
        self.layers = nn.ModuleList(_Layer(config) for _ in range(config.encoder_layers))
        self.ln_post = nn.LayerNorm(config.d_model)
        self.proj1 = nn.Linear(config.d_model, config.d_model)
        self.proj2 = nn.Linear(config.d_model, config.output_dim)
        positions = sinusoid_positions(config.max_source_positions, config.d_model)
        self.register_buffer("positions", positions, persistent=False)

    def forward(self, mels: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Rows ``[output_length(T_i), output_dim]`` per clip of mel frames ``[mel, T_i]``
        (all clips' chunks through the convs in one batch, their windows in one attention).

        Raises:
            ValueError: a clip with no frames or another mel width.
        """
        cfg = self.config
        size = cfg.chunk_frames
        chunks: list[tuple[torch.Tensor, int]] = []  # (chunk padded, its padded length)
        for mel in mels:
            if mel.ndim != 2 or mel.shape[0] != cfg.num_mel_bins or mel.shape[1] == 0:
                raise ValueError(f"mel frames must be [{cfg.num_mel_bins}, T>0], got {mel.shape}")
            width = min(size, mel.shape[1])
            chunks += [(F.pad(p, (0, width - p.shape[1])), width) for p in mel.split(size, dim=1)]
        rows: list[torch.Tensor | None] = [None] * len(chunks)
        for width in sorted({w for _, w in chunks}):
            index = [i for i, (_, w) in enumerate(chunks) if w == width]
            out = self._downsample(torch.stack([chunks[i][0] for i in index]))
            for i, piece in zip(index, out, strict=True):
                rows[i] = piece
        kept = [conv_output_length(p.shape[1]) for mel in mels for p in mel.split(size, dim=1)]
        x = torch.cat([r[:n] for r, n in zip(rows, kept, strict=True)])  # [rows, d]
        lengths = [cfg.output_length(m.shape[1]) for m in mels]
        windows = self._windows(lengths)
        for layer in self.layers:
            x = layer(x, windows)
        x = self.proj2(F.gelu(self.proj1(self.ln_post(x))))
        return list(x.split(lengths))

    def _downsample(self, chunks: torch.Tensor) -> torch.Tensor:
        """``[B, mel, L]`` chunks -> ``[B, conv_output_length(L), d_model]`` with positions."""
        x = chunks.unsqueeze(1).to(self.conv_out.weight.dtype)  # [B, 1, mel, L]
        for conv in (self.conv2d1, self.conv2d2, self.conv2d3):
            x = F.gelu(conv(x))
        b, c, f, t = x.shape
        x = self.conv_out(x.permute(0, 3, 1, 2).reshape(b, t, c * f))
        return x + self.positions[:t].to(x.dtype)

    def _windows(self, lengths: Sequence[int]) -> list[int]:
        """The attention windows' lengths in rows, in order: each clip's rows cut into
        ``window_rows`` (its last window shorter)."""
        window = self.config.window_rows
        return [min(window, n - start) for n in lengths for start in range(0, n, window)]
