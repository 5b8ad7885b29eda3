"""ECAPA-TDNN speaker encoder (Desplanques et al. 2020): a mel spectrogram -> one embedding.

One torch implementation serves two families whose upstream code is the same block for block
(TDNN with "same" reflect padding, Res2Net, squeeze-excitation, SE-Res2Net, multi-layer feature
aggregation, attentive statistics pooling, final 1x1 conv), differing only in sizes:

- Qwen2.5-Omni token2wav: transformers' ``ECAPA_TimeDelayNet`` (transformers 5.24,
  ``models/qwen2_5_omni/modeling_qwen2_5_omni.py``), sized by ``DiTConfig``'s ``enc_*`` fields;
  checkpoint names ``code2wav_dit_model.input_embed.spk_encoder.*``; computed once per request
  by ``DiT.initial_state`` (upstream recomputes it in every DiT forward).
- Qwen3-TTS Base: ``qwen_tts`` 0.1.1 ``Qwen3TTSSpeakerEncoder``
  (``core/models/modeling_qwen3_tts.py``), sized by ``speaker_encoder_config``; checkpoint names
  ``speaker_encoder.*``; computed once per cloned voice (``omnistep.models.qwen3_tts.speaker``).
  Its only textual differences from transformers' are a ``masked_fill`` of an all-ones mask in
  the pooling (a no-op) and an in-place ReLU in the SE block.

State-dict names equal both upstreams'. Imports: torch only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn


class EcapaConfig(Protocol):
    """The sizes an ECAPA-TDNN needs (field names shared by Qwen2.5-Omni's ``DiTConfig`` and
    Qwen3-TTS's ``speaker_encoder_config``). ``enc_channels``, ``enc_kernel_sizes`` and
    ``enc_dilations`` have one entry per block: the first TDNN, the SE-Res2Net blocks, the
    multi-layer feature aggregation TDNN (whose channels the pooling and ``fc`` use)."""

    mel_dim: int
    enc_dim: int
    enc_channels: Sequence[int]
    enc_kernel_sizes: Sequence[int]
    enc_dilations: Sequence[int]
    enc_attention_channels: int
    enc_res2net_scale: int
    enc_se_channels: int


class TimeDelayNetBlock(nn.Module):
    """``TimeDelayNetBlock``: conv ("same", reflect padding) -> ReLU. ``[B, C, L]`` -> same L."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, dilation: int):
        super().__init__()
        self.conv = nn.Conv1d(
            in_channels,
            out_channels,
            kernel_size,
            dilation=dilation,
            padding="same",
            padding_mode="reflect",
        )
        self.activation = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.activation(self.conv(x))


class Res2NetBlock(nn.Module):
    """``Res2NetBlock``: channel split in ``scale`` parts, hierarchical TDNNs on parts 1..."""

    def __init__(self, channels: int, scale: int, kernel_size: int, dilation: int):
        super().__init__()
        part = channels // scale
        self.blocks = nn.ModuleList(
            TimeDelayNetBlock(part, part, kernel_size, dilation) for _ in range(scale - 1)
        )
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outputs = []
        for i, part in enumerate(torch.chunk(x, self.scale, dim=1)):
            if i == 0:
                out = part
            elif i == 1:
                out = self.blocks[i - 1](part)
            else:
                out = self.blocks[i - 1](part + out)
            outputs.append(out)
        return torch.cat(outputs, dim=1)


class SqueezeExcitationBlock(nn.Module):
    """``SqueezeExcitationBlock``: channel gates from the time mean. ``[B, C, L]`` -> same."""

    def __init__(self, channels: int, se_channels: int):
        super().__init__()
        self.conv1 = nn.Conv1d(channels, se_channels, 1, padding="same", padding_mode="reflect")
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv1d(se_channels, channels, 1, padding="same", padding_mode="reflect")
        self.sigmoid = nn.Sigmoid()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.sigmoid(self.conv2(self.relu(self.conv1(x.mean(dim=2, keepdim=True)))))
        return x * gate


class SqueezeExcitationRes2NetBlock(nn.Module):
    """``SqueezeExcitationRes2NetBlock``: TDNN -> Res2Net -> TDNN -> SE, plus the input."""

    def __init__(self, config: EcapaConfig, index: int):
        super().__init__()
        c = config
        channels = c.enc_channels[index]
        self.tdnn1 = TimeDelayNetBlock(c.enc_channels[index - 1], channels, 1, 1)
        self.res2net_block = Res2NetBlock(
            channels, c.enc_res2net_scale, c.enc_kernel_sizes[index], c.enc_dilations[index]
        )
        self.tdnn2 = TimeDelayNetBlock(channels, channels, 1, 1)
        self.se_block = SqueezeExcitationBlock(channels, c.enc_se_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.se_block(self.tdnn2(self.res2net_block(self.tdnn1(x)))) + x


class AttentiveStatisticsPooling(nn.Module):
    """``AttentiveStatisticsPooling``: ``[B, C, L]`` -> attention-weighted mean and std
    ``[B, 2C, 1]`` (every frame valid, as upstream calls it)."""

    def __init__(self, channels: int, attention_channels: int):
        super().__init__()
        self.eps = 1e-12
        self.tdnn = TimeDelayNetBlock(channels * 3, attention_channels, 1, 1)
        self.tanh = nn.Tanh()
        self.conv = nn.Conv1d(
            attention_channels, channels, 1, padding="same", padding_mode="reflect"
        )

    def _statistics(self, x: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
        mean = (weights * x).sum(2)
        std = torch.sqrt((weights * (x - mean.unsqueeze(2)).pow(2)).sum(2).clamp(self.eps))
        return mean, std

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[-1]
        mask = torch.ones(x.shape[0], 1, length, dtype=x.dtype, device=x.device)
        mean, std = self._statistics(x, mask / mask.sum(dim=2, keepdim=True))
        mean = mean.unsqueeze(2).repeat(1, 1, length)
        std = std.unsqueeze(2).repeat(1, 1, length)
        attention = self.conv(self.tanh(self.tdnn(torch.cat([x, mean, std], dim=1))))
        mean, std = self._statistics(x, F.softmax(attention, dim=2))
        return torch.cat((mean, std), dim=1).unsqueeze(2)


class SpeakerEncoder(nn.Module):
    """``ECAPA_TimeDelayNet`` / ``Qwen3TTSSpeakerEncoder``: mel ``[B, L, mel_dim]`` (frames
    first) -> ``[B, enc_dim]``, in the parameters' dtype. Every frame counts (no padding mask,
    as both upstreams call it). Reflect padding needs more frames than any block pads:
    L > (kernel - 1) * dilation / 2, i.e. L >= 5 with the published kernels and dilations."""

    def __init__(self, config: EcapaConfig):
        super().__init__()
        c = config
        first = TimeDelayNetBlock(
            c.mel_dim, c.enc_channels[0], c.enc_kernel_sizes[0], c.enc_dilations[0]
        )
        middle = [SqueezeExcitationRes2NetBlock(c, i) for i in range(1, len(c.enc_channels) - 1)]
        self.blocks = nn.ModuleList([first, *middle])
        self.mfa = TimeDelayNetBlock(
            c.enc_channels[-1], c.enc_channels[-1], c.enc_kernel_sizes[-1], c.enc_dilations[-1]
        )
        self.asp = AttentiveStatisticsPooling(c.enc_channels[-1], c.enc_attention_channels)
        self.fc = nn.Conv1d(
            c.enc_channels[-1] * 2, c.enc_dim, 1, padding="same", padding_mode="reflect"
        )

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        x = mel.transpose(1, 2)
        outputs = []
        for block in self.blocks:
            x = block(x)
            outputs.append(x)
        x = self.mfa(torch.cat(outputs[1:], dim=1))  # multi-layer feature aggregation
        return self.fc(self.asp(x)).squeeze(-1)
