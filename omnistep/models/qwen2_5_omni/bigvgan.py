"""Qwen2.5-Omni token2wav's vocoder: BigVGAN, log-mel -> 24 kHz wave, decoded in exact chunks.

Our torch implementation of transformers' ``Qwen2_5OmniToken2WavBigVGANModel`` (transformers
5.24, ``models/qwen2_5_omni/modeling_qwen2_5_omni.py``): log-mel ``[B, mel_dim, frames]`` ->
wave ``[B, 240 frames]`` float in [-1, 1] at 24 kHz; ``BigVGAN.decode_chunk`` decodes any range
of frames exactly, given the receptive field around it.

Architecture: log-mel -> dB normalisation -> conv_pre -> 6
transposed-conv upsamplers (rates 5, 3, 2, 2, 2, 2 = 240) each followed by the mean of 3
anti-aliased AMP resblocks (kernels 3, 7, 11, dilations 1, 3, 5) -> SnakeBeta -> conv_post ->
clamp to [-1, 1]. ``BigVGAN.receptive_field`` is computed from the layer geometry: officially
34 mel frames (0.34 s) on each side, confirmed by perturbation in tests/test_qwen_token2wav.py.

State-dict names equal upstream's ``code2wav_bigvgan_model.*`` (without that prefix).

Imports: torch only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from omnistep.core.config_fields import check_positive_ints, known_fields
from omnistep.layers.snake import SnakeBeta

SAMPLE_RATE = 24000
"""Hz of the official BigVGAN output (no config field carries it; 240 samples per 10 ms frame)."""


@dataclass(frozen=True)
class BigVGANConfig:
    """``Qwen2_5OmniBigVGANConfig``; defaults are transformers' (= the official model)."""

    mel_dim: int = 80
    """Mel bins in."""
    upsample_initial_channel: int = 1536
    """Channels after conv_pre; halved by every upsampler."""
    resblock_kernel_sizes: tuple[int, ...] = (3, 7, 11)
    """Kernel of each of the parallel AMP resblocks after an upsampler."""
    resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    """Dilations (3 each) of the AMP resblocks."""
    upsample_rates: tuple[int, ...] = (5, 3, 2, 2, 2, 2)
    """Strides of the transposed convolutions; their product is the hop length (240)."""
    upsample_kernel_sizes: tuple[int, ...] = (11, 7, 4, 4, 4, 4)
    """Kernels of the transposed convolutions."""

    def __post_init__(self) -> None:
        check_positive_ints(self, ["mel_dim", "upsample_initial_channel"])
        if len(self.resblock_kernel_sizes) != len(self.resblock_dilation_sizes) or any(
            len(d) != 3 for d in self.resblock_dilation_sizes
        ):
            raise ValueError(
                "BigVGANConfig.resblock_dilation_sizes needs 3 dilations per resblock kernel, got "
                f"{self.resblock_dilation_sizes} for kernels {self.resblock_kernel_sizes}"
            )
        if len(self.upsample_rates) != len(self.upsample_kernel_sizes):
            raise ValueError(
                "BigVGANConfig.upsample_rates and upsample_kernel_sizes differ in length: "
                f"{self.upsample_rates} vs {self.upsample_kernel_sizes}"
            )
        for rate, kernel in zip(self.upsample_rates, self.upsample_kernel_sizes, strict=True):
            if kernel < rate or (kernel - rate) % 2:
                raise ValueError(
                    "BigVGANConfig.upsample_kernel_sizes: each kernel must be >= its rate with an "
                    f"even difference (exactly rate x length out), got kernel {kernel}, rate {rate}"
                )
        if self.upsample_initial_channel % 2 ** len(self.upsample_rates):
            raise ValueError(
                "BigVGANConfig.upsample_initial_channel must be divisible by "
                f"2 ** len(upsample_rates), got {self.upsample_initial_channel}"
            )

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> BigVGANConfig:
        """From a ``bigvgan_config`` dict; unknown keys are ignored."""
        return cls(**known_fields(cls, raw))

    @property
    def hop_length(self) -> int:
        """Samples per mel frame: the product of the upsample rates (240)."""
        return math.prod(self.upsample_rates)


Interval = tuple[int, int]
"""Closed range [first, last] of positions of a signal (may run past its ends: no edges here)."""


def _conv_input(iv: Interval, kernel: int, stride: int, dilation: int, pad_left: int) -> Interval:
    """Inputs that conv1d outputs ``iv`` read: output o reads o s + j d - pad_left, j < kernel."""
    return iv[0] * stride - pad_left, iv[1] * stride + (kernel - 1) * dilation - pad_left


def _conv_transpose_input(iv: Interval, kernel: int, stride: int, padding: int) -> Interval:
    """Inputs that conv_transpose1d outputs ``iv`` read: o reads i with 0 <= o + padding - i s
    < kernel."""
    return -(-(iv[0] + padding - kernel + 1) // stride), (iv[1] + padding) // stride


def _module_conv_input(iv: Interval, conv: nn.Conv1d) -> Interval:
    return _conv_input(iv, conv.kernel_size[0], conv.stride[0], conv.dilation[0], conv.padding[0])


def _hull(intervals: Sequence[Interval]) -> Interval:
    return min(iv[0] for iv in intervals), max(iv[1] for iv in intervals)


def kaiser_sinc_filter1d(cutoff: float, half_width: float, kernel_size: int) -> torch.Tensor:
    """Kaiser-windowed sinc low-pass ``[1, 1, kernel_size]`` float32, summing to 1
    (``kaiser_sinc_filter1d`` of the transformers module, from BigVGAN's ``alias_free_torch``)."""
    even = kernel_size % 2 == 0
    half = kernel_size // 2
    attenuation = 2.285 * (half - 1) * math.pi * (4 * half_width) + 7.95
    if attenuation > 50.0:
        beta = 0.1102 * (attenuation - 8.7)
    elif attenuation >= 21.0:
        beta = 0.5842 * (attenuation - 21) ** 0.4 + 0.07886 * (attenuation - 21.0)
    else:
        beta = 0.0
    window = torch.kaiser_window(kernel_size, beta=beta, periodic=False, dtype=torch.float32)
    time = torch.arange(-half, half) + 0.5 if even else torch.arange(kernel_size) - half
    if cutoff == 0:
        return torch.zeros((1, 1, kernel_size), dtype=torch.float32)
    filt = 2 * cutoff * window * torch.sinc(2 * cutoff * time)
    filt /= filt.sum()
    return filt.view(1, 1, kernel_size)


class UpSample1d(nn.Module):
    """``Qwen2_5OmniUpSample1d``: x ratio by a transposed low-pass conv, replicate edges."""

    def __init__(self, ratio: int = 2, kernel_size: int = 12):
        super().__init__()
        self.ratio = ratio
        self.kernel_size = kernel_size
        self.pad = kernel_size // ratio - 1
        self.pad_left = self.pad * ratio + (kernel_size - ratio) // 2
        self.pad_right = self.pad * ratio + (kernel_size - ratio + 1) // 2
        self.register_buffer("filter", self._filter(), persistent=False)

    def _filter(self) -> torch.Tensor:
        return kaiser_sinc_filter1d(0.5 / self.ratio, 0.6 / self.ratio, self.kernel_size)

    def reset_buffers(self, device: torch.device) -> None:
        self.filter = self._filter().to(device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.pad(x, (self.pad, self.pad), mode="replicate")
        filt = self.filter.expand(x.shape[1], -1, -1)
        x = self.ratio * F.conv_transpose1d(x, filt, stride=self.ratio, groups=x.shape[1])
        return x[..., self.pad_left : -self.pad_right]

    def input_interval(self, iv: Interval) -> Interval:
        """Input positions that outputs ``iv`` depend on, away from the signal edges."""
        lo, hi = _conv_transpose_input(iv, self.kernel_size, self.ratio, self.pad_left)
        return lo - self.pad, hi - self.pad


class DownSample1d(nn.Module):
    """``Qwen2_5OmniDownSample1d``: low-pass then / ratio, replicate edges."""

    def __init__(self, ratio: int = 2, kernel_size: int = 12):
        super().__init__()
        self.cutoff = 0.5 / ratio
        self.half_width = 0.6 / ratio
        self.kernel_size = kernel_size
        self.pad_left = kernel_size // 2 - int(kernel_size % 2 == 0)
        self.pad_right = kernel_size // 2
        self.stride = ratio
        self.register_buffer("filter", self._filter(), persistent=False)

    def _filter(self) -> torch.Tensor:
        return kaiser_sinc_filter1d(self.cutoff, self.half_width, self.kernel_size)

    def reset_buffers(self, device: torch.device) -> None:
        self.filter = self._filter().to(device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.pad(x, (self.pad_left, self.pad_right), mode="replicate")
        filt = self.filter.expand(x.shape[1], -1, -1)
        return F.conv1d(x, filt, stride=self.stride, groups=x.shape[1])

    def input_interval(self, iv: Interval) -> Interval:
        """Input positions that outputs ``iv`` depend on, away from the signal edges."""
        return _conv_input(iv, self.kernel_size, self.stride, 1, self.pad_left)


class AntiAliasedActivation1d(nn.Module):
    """``Qwen2_5OmniAntiAliasedActivation1d``: up x2 -> SnakeBeta -> down x2 (length kept)."""

    def __init__(self, channels: int):
        super().__init__()
        self.act = SnakeBeta(channels)
        self.upsample = UpSample1d(2, 12)
        self.downsample = DownSample1d(2, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.downsample(self.act(self.upsample(x)))

    def input_interval(self, iv: Interval) -> Interval:
        return self.upsample.input_interval(self.downsample.input_interval(iv))


class AMPBlock(nn.Module):
    """``Qwen2_5OmniAMPBlock``: 3 residual units act -> conv(dilation d) -> act -> conv(1)."""

    def __init__(self, channels: int, kernel_size: int, dilation: Sequence[int]):
        super().__init__()

        def conv(d: int) -> nn.Conv1d:
            pad = int((kernel_size * d - d) / 2)
            return nn.Conv1d(channels, channels, kernel_size, 1, dilation=d, padding=pad)

        self.convs1 = nn.ModuleList(conv(d) for d in dilation)
        self.convs2 = nn.ModuleList(conv(1) for _ in dilation)
        self.activations = nn.ModuleList(AntiAliasedActivation1d(channels) for _ in range(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        acts1, acts2 = self.activations[::2], self.activations[1::2]
        for conv1, conv2, act1, act2 in zip(self.convs1, self.convs2, acts1, acts2, strict=True):
            x = x + conv2(act2(conv1(act1(x))))
        return x

    def input_interval(self, iv: Interval) -> Interval:
        """Walks the residual units backwards: each needs its output range and what its
        act -> conv -> act -> conv branch reads."""
        acts1, acts2 = self.activations[::2], self.activations[1::2]
        units = list(zip(self.convs1, self.convs2, acts1, acts2, strict=True))
        for conv1, conv2, act1, act2 in reversed(units):
            branch = act2.input_interval(_module_conv_input(iv, conv2))
            iv = _hull([iv, act1.input_interval(_module_conv_input(branch, conv1))])
        return iv


class BigVGAN(nn.Module):
    """``Qwen2_5OmniToken2WavBigVGANModel``: log-mel ``[B, mel_dim, M]`` -> wave ``[B, 240 M]``.

    Parameters are named as upstream (``conv_pre``, ``ups.{i}.0``, ``resblocks.{i}``,
    ``activation_post``, ``conv_post``); the anti-aliasing filters are computed buffers.
    """

    def __init__(self, config: BigVGANConfig):
        super().__init__()
        c = config
        self.config = config
        self.num_residual_blocks = len(c.resblock_kernel_sizes)
        channels = [c.upsample_initial_channel // 2**i for i in range(len(c.upsample_rates) + 1)]
        self.conv_pre = nn.Conv1d(c.mel_dim, channels[0], 7, 1, padding=3)
        self.ups = nn.ModuleList(
            nn.ModuleList(
                [nn.ConvTranspose1d(channels[i], channels[i + 1], k, s, padding=(k - s) // 2)]
            )
            for i, (s, k) in enumerate(zip(c.upsample_rates, c.upsample_kernel_sizes, strict=True))
        )
        self.resblocks = nn.ModuleList(
            AMPBlock(channels[i + 1], k, d)
            for i in range(len(c.upsample_rates))
            for k, d in zip(c.resblock_kernel_sizes, c.resblock_dilation_sizes, strict=True)
        )
        self.activation_post = AntiAliasedActivation1d(channels[-1])
        self.conv_post = nn.Conv1d(channels[-1], 1, 7, 1, padding=3, bias=False)
        self._receptive_field: tuple[int, int] | None = None

    @property
    def hop_length(self) -> int:
        """Samples per mel frame (240)."""
        return self.config.hop_length

    @property
    def sample_rate(self) -> int:
        """Hz (24000)."""
        return SAMPLE_RATE

    def _normalized_mel(self, mel: torch.Tensor) -> torch.Tensor:
        """``process_mel_spectrogram``: log-mel -> dB (floor -115, -20 dB) -> [-1, 1]."""
        max_value, min_db = 1, -115
        min_level = torch.exp(
            torch.tensor(min_db / 20.0 * math.log(10), device=mel.device, dtype=mel.dtype)
        )
        db = 20 * torch.log10(torch.clamp(torch.exp(mel), min=min_level)) - 20
        normalized = (2 * max_value) * ((db - min_db) / (-min_db)) - max_value
        return torch.clamp(normalized, -max_value, max_value)

    def unclamped(self, mel: torch.Tensor) -> torch.Tensor:
        """Wave before the final clamp: ``[B, mel_dim, M]`` -> ``[B, 1, 240 M]``."""
        x = self.conv_pre(self._normalized_mel(mel))
        for i, up in enumerate(self.ups):
            x = up[0](x)
            first = i * self.num_residual_blocks
            blocks = self.resblocks[first : first + self.num_residual_blocks]
            x = sum(block(x) for block in blocks) / self.num_residual_blocks
        return self.conv_post(self.activation_post(x))

    @torch.inference_mode()
    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        """Log-mel ``[B, mel_dim, M]`` (100 frames/s) -> wave ``[B, 240 M]`` in [-1, 1] at 24 kHz.

        Upstream returns ``.squeeze().cpu()`` of the same samples; this keeps ``[B, samples]``
        on the model's device.
        """
        self._check_mel(mel)
        return torch.clamp(self.unclamped(mel.to(self.conv_pre.weight.dtype)), -1.0, 1.0)[:, 0]

    @torch.inference_mode()
    def decode_chunk(self, mel_window: torch.Tensor, left: int, chunk: int) -> torch.Tensor:
        """Samples of mel frames [left, left + chunk) of a window of W frames.

        Args:
            mel_window: ``[B, mel_dim, W]`` = left context + chunk + look-ahead frames; window
                edges act as utterance edges. Rows are independent windows of equal width.
            left: frames of left context at the window start.
            chunk: frames whose samples are returned (>= 1).

        Returns:
            ``[B, 240 chunk]``: equal (within float rounding) to the whole decode's samples
            ``[240 a, 240 (a + chunk))`` for the chunk's first frame a, when the window holds
            ``receptive_field[0]`` frames before the chunk and ``receptive_field[1]`` after it
            (or reaches the utterance edge on that side).
        """
        self._check_mel(mel_window)
        width = mel_window.shape[-1]
        if left < 0 or chunk < 1 or left + chunk > width:
            raise ValueError(
                f"need 0 <= left and 1 <= chunk and left + chunk <= window frames, got "
                f"left={left}, chunk={chunk}, window frames={width}"
            )
        wave = self.forward(mel_window)
        return wave[:, self.hop_length * left : self.hop_length * (left + chunk)]

    @property
    def receptive_field(self) -> tuple[int, int]:
        """(left, right) mel frames a sample depends on beyond its own frame: the context
        ``decode_chunk`` needs on each side. Derived from the layer geometry (every conv, the
        transposed convs, the replicate-padded anti-aliasing filters), no weights involved;
        official config: (34, 34). That is the exact support; the influence decays fast
        (random weights, official geometry: |d sample / d frame| ~1e-10 at 20 frames, and 14
        frames of context already gave chunks within 1e-5 in float32), so a shorter context
        is a weight-dependent approximation to measure on the real checkpoint."""
        if self._receptive_field is None:
            self._receptive_field = self._measure_receptive_field()
        return self._receptive_field

    def _measure_receptive_field(self) -> tuple[int, int]:
        iv = _module_conv_input((0, self.hop_length - 1), self.conv_post)  # samples of frame 0
        iv = self.activation_post.input_interval(iv)
        for i in reversed(range(len(self.ups))):
            first = i * self.num_residual_blocks
            blocks = self.resblocks[first : first + self.num_residual_blocks]
            iv = _hull([block.input_interval(iv) for block in blocks])
            conv = self.ups[i][0]
            iv = _conv_transpose_input(iv, conv.kernel_size[0], conv.stride[0], conv.padding[0])
        lo, hi = _module_conv_input(iv, self.conv_pre)
        return -lo, hi

    def _check_mel(self, mel: torch.Tensor) -> None:
        if mel.dim() != 3 or mel.shape[1] != self.config.mel_dim or mel.shape[2] == 0:
            raise ValueError(
                f"mel must be [batch, {self.config.mel_dim}, frames >= 1], got {tuple(mel.shape)}"
            )
