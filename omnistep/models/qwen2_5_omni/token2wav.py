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

Solver (``Qwen2_5OmniToken2WavDiTModel.sample`` + ``RungeKutta4ODESolver``), defaults of
``Qwen2_5OmniToken2WavModel.forward``:
    time points  ``t = linspace(0, 1, num_steps)``, ``num_steps`` = 10 points (9 solver steps),
                 then sway sampling ``t += s (cos(pi t / 2) - 1 + t)``, s = -1, i.e.
                 t = 1 - cos(pi u / 2) for u uniform
    step         y1 = y0 + dt (k1 + 3 k2 + 3 k3 + k4) / 8 with k1 = f(t0, y0),
                 k2 = f(t0 + dt/3, y0 + dt k1/3), k3 = f(t0 + 2dt/3, y0 + dt (k2 - k1/3)),
                 k4 = f(t1, y0 + dt (k1 - k2 + k3))  (Kutta's 3/8 rule, no adaptivity)
    velocity     f = c + (c - u) g with g = ``guidance_scale`` = 0.5, c the DiT output with the
                 conditioning and u with ref_mel, ``cond`` zeroed and every code replaced by id 0;
                 g < 1e-5 runs the conditional row only (f = c)
    noise        ``torch.randn([B, 2T, mel_dim])`` from the global RNG upstream; here an explicit
                 tensor or a ``torch.Generator`` (same draw when seeded alike)
The ODE is integrated in the model dtype (upstream forces float32 for token2wav).

Attention (``DiTAttention``, ``DiTDecoderLayer``): frames are grouped in blocks of ``block_size``
(24); a layer attends within its own block, plus the previous block in ``look_backward_layers``
(0, 20) and the next block in ``look_ahead_layers`` (10). RoPE is applied to head 0 only (as
upstream: "only first head is applied with RoPE"), in the interleaved layout of the checkpoint.
Nothing else mixes frames, so requests of different lengths batch with zero padding and a
key-padding mask (see ``DiT.ode_step``). The conditioning (speaker encoder, codec embedding) is
computed once per request, not in each of the 36 evaluations as upstream does.

Vocoder (``Qwen2_5OmniToken2WavBigVGANModel``): log-mel -> dB normalisation -> conv_pre -> 6
transposed-conv upsamplers (rates 5, 3, 2, 2, 2, 2 = 240) each followed by the mean of 3
anti-aliased AMP resblocks (kernels 3, 7, 11, dilations 1, 3, 5) -> SnakeBeta -> conv_post ->
clamp to [-1, 1]. ``BigVGAN.receptive_field`` is computed from the layer geometry: officially
34 mel frames (0.34 s) on each side, confirmed by perturbation in tests/test_qwen_token2wav.py.

State-dict names equal transformers' ``Qwen2_5OmniToken2WavModel`` (the official checkpoint's
``token2wav.`` keys without that prefix): ``code2wav_dit_model.*`` and ``code2wav_bigvgan_model.*``.

Imports: torch only (no transformers at run time).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from omnistep.layers.linear import PackedLinear

SAMPLE_RATE = 24000
"""Hz of the official BigVGAN output (no config field carries it; 240 samples per 10 ms frame)."""
DEFAULT_ROPE_THETA = 10000.0

# ----------------------------------------------------------------------------------------- config


def _as_tuple(value: Any) -> tuple:
    return tuple(_as_tuple(v) if isinstance(v, list | tuple) else v for v in value)


def _check_positive_ints(config: object, names: Sequence[str]) -> None:
    for name in names:
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(
                f"{type(config).__name__}.{name} must be a positive int, got {value!r}"
            )


def _known_fields(cls: type, raw: Mapping[str, Any]) -> dict[str, Any]:
    names = {f.name for f in fields(cls)}
    return {k: _as_tuple(v) if isinstance(v, list) else v for k, v in raw.items() if k in names}


@dataclass(frozen=True)
class DiTConfig:
    """``Qwen2_5OmniDiTConfig``; defaults are transformers' (= the official Qwen2.5-Omni-7B)."""

    hidden_size: int = 1024
    """Transformer width (original config key ``dim``)."""
    num_hidden_layers: int = 22
    """Transformer blocks (original key ``depth``)."""
    num_attention_heads: int = 16
    """Attention heads (original key ``heads``)."""
    ff_mult: int = 2
    """MLP inner width = ff_mult * hidden_size."""
    emb_dim: int = 512
    """Codec embedding width."""
    head_dim: int = 64
    """Per-head width; independent of hidden_size / heads (set it explicitly in small configs)."""
    rope_theta: float = DEFAULT_ROPE_THETA
    """RoPE base (``rope_parameters["rope_theta"]``); only the default rope type exists here."""
    max_position_embeddings: int = 32768
    """Most mel frames per request (2 per codec token)."""
    block_size: int = 24
    """Mel frames per attention block."""
    look_ahead_layers: tuple[int, ...] = (10,)
    """Layers whose queries also see the next block."""
    look_backward_layers: tuple[int, ...] = (0, 20)
    """Layers whose queries also see the previous block."""
    repeats: int = 2
    """Mel frames per codec token."""
    num_embeds: int = 8193
    """Codec vocabulary; the embedding table has num_embeds + 1 rows."""
    mel_dim: int = 80
    """Mel bins."""
    dropout: float = 0.1
    """Training-time dropout (inference ignores it)."""
    enc_emb_dim: int = 192
    """Width of the speaker vector ``cond``."""
    enc_dim: int = 128
    """Output width of the ECAPA speaker encoder run on ``ref_mel``."""
    enc_channels: tuple[int, ...] = (256, 256, 256, 256, 768)
    """ECAPA channels: first TDNN, SE-Res2Net blocks, multi-layer aggregation (last)."""
    enc_kernel_sizes: tuple[int, ...] = (5, 3, 3, 3, 1)
    """ECAPA kernel per entry of enc_channels."""
    enc_dilations: tuple[int, ...] = (1, 2, 3, 4, 1)
    """ECAPA dilation per entry of enc_channels."""
    enc_attention_channels: int = 64
    """Attentive statistics pooling width."""
    enc_res2net_scale: int = 2
    """Res2Net splits per SE-Res2Net block."""
    enc_se_channels: int = 64
    """Squeeze-excitation bottleneck width."""

    def __post_init__(self) -> None:
        _check_positive_ints(
            self,
            [
                "hidden_size", "num_hidden_layers", "num_attention_heads", "ff_mult", "emb_dim",
                "head_dim", "max_position_embeddings", "block_size", "repeats", "num_embeds",
                "mel_dim", "enc_emb_dim", "enc_dim", "enc_attention_channels",
                "enc_res2net_scale", "enc_se_channels",
            ],
        )  # fmt: skip
        n = len(self.enc_channels)
        if n < 2 or len(self.enc_kernel_sizes) != n or len(self.enc_dilations) != n:
            raise ValueError(
                "DiTConfig.enc_channels, enc_kernel_sizes and enc_dilations must have the same "
                f"length >= 2, got {self.enc_channels}, {self.enc_kernel_sizes}, "
                f"{self.enc_dilations}"
            )
        if any(c % self.enc_res2net_scale for c in self.enc_channels[1:-1]):
            raise ValueError(
                f"DiTConfig.enc_channels[1:-1] must be divisible by enc_res2net_scale "
                f"({self.enc_res2net_scale}), got {self.enc_channels}"
            )
        if self.head_dim % 2:
            raise ValueError(f"DiTConfig.head_dim must be even (RoPE), got {self.head_dim}")

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> DiTConfig:
        """From a ``dit_config`` dict: transformers names, or the original ``dim`` / ``depth`` /
        ``heads``; ``rope_parameters`` or a top-level ``rope_theta``; other keys are ignored."""
        values = _known_fields(cls, raw)
        for alias, name in (("dim", "hidden_size"), ("depth", "num_hidden_layers")):
            if name not in values and alias in raw:
                values[name] = raw[alias]
        if "num_attention_heads" not in values and "heads" in raw:
            values["num_attention_heads"] = raw["heads"]
        rope = raw.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"DiTConfig supports rope_type 'default' only, got {rope!r}")
        values["rope_theta"] = float(rope.get("rope_theta", raw.get("rope_theta", 10000.0)))
        return cls(**values)

    @property
    def cond_features(self) -> int:
        """Channels of the per-frame conditioning concatenated to the noisy mel (832)."""
        return self.enc_dim + self.emb_dim + self.enc_emb_dim


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
        _check_positive_ints(self, ["mel_dim", "upsample_initial_channel"])
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
        return cls(**_known_fields(cls, raw))

    @property
    def hop_length(self) -> int:
        """Samples per mel frame: the product of the upsample rates (240)."""
        return math.prod(self.upsample_rates)


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
        t = torch.linspace(0, 1, self.num_steps, device=device, dtype=dtype)
        if self.sway_coefficient is not None:
            t += self.sway_coefficient * (torch.cos(torch.pi / 2 * t) - 1 + t)
        return t


# ------------------------------------------------------------------- DiT: speaker encoder (ECAPA)


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

    def __init__(self, config: DiTConfig, index: int):
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
    """``ECAPA_TimeDelayNet``: reference mel ``[B, L, mel_dim]`` -> ``[B, enc_dim]``."""

    def __init__(self, config: DiTConfig):
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


# ------------------------------------------------------------------------------ DiT: transformer


class DiTInputEmbedding(nn.Module):
    """``DiTInputEmbedding``: ``proj`` of [noisy mel | voice | codes | speaker] per frame.

    Upstream recomputes the speaker encoder of ``ref_mel`` in every forward; here it runs once per
    request in ``DiT.initial_state`` (the same call on the same batch, so the same numbers).
    """

    def __init__(self, config: DiTConfig):
        super().__init__()
        self.proj = PackedLinear(config.mel_dim + config.cond_features, config.hidden_size)
        self.spk_encoder = SpeakerEncoder(config)

    def forward(self, x: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """``x`` ``[R, N, mel_dim]``, ``features`` ``[R, N, cond_features]`` -> ``[R, N, hidden]``
        (the noisy mel and the conditioning concatenated per frame, as upstream)."""
        return self.proj(torch.cat((x, features), dim=-1))


class DiTCodecEmbedding(nn.Module):
    """``DiTCodecEmbedding``: codes ``[B, T]`` -> ``[B, T * repeats, emb_dim]`` (frame-repeated)."""

    def __init__(self, config: DiTConfig):
        super().__init__()
        self.repeats = config.repeats
        self.codec_embed = nn.Embedding(config.num_embeds + 1, config.emb_dim)

    def forward(self, codes: torch.Tensor, drop_code: bool = False) -> torch.Tensor:
        if drop_code:  # the unconditional row: every code becomes id 0 (not a zero vector)
            codes = torch.zeros_like(codes)
        return torch.repeat_interleave(self.codec_embed(codes), repeats=self.repeats, dim=1)


class DiTTimestepEmbedding(nn.Module):
    """``DiTTimestepEmbedding`` (+ ``SinusPositionEmbedding``): t ``[R]`` -> ``[R, hidden]``."""

    def __init__(self, hidden_size: int, freq_embed_dim: int = 256):
        super().__init__()
        self.freq_embed_dim = freq_embed_dim
        self.time_mlp = nn.ModuleList(
            [
                PackedLinear(freq_embed_dim, hidden_size),
                nn.SiLU(),
                PackedLinear(hidden_size, hidden_size),
            ]
        )

    def _sinusoids(self, t: torch.Tensor, scale: int = 1000) -> torch.Tensor:
        half = self.freq_embed_dim // 2
        freqs = torch.exp(
            torch.arange(half, device=t.device).float() * -(math.log(10000) / (half - 1))
        )
        emb = scale * t.unsqueeze(1) * freqs.unsqueeze(0)
        return torch.cat((emb.sin(), emb.cos()), dim=-1).type_as(t)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        hidden = self._sinusoids(t).to(t.dtype)
        for layer in self.time_mlp:
            hidden = layer(hidden)
        return hidden


class DiTRotaryEmbedding(nn.Module):
    """``Qwen2_5OmniDiTRotaryEmbedding`` (default rope type): holds ``inv_freq`` (not saved)."""

    def __init__(self, config: DiTConfig):
        super().__init__()
        self.head_dim = config.head_dim
        self.theta = config.rope_theta
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)

    def _inv_freq(self) -> torch.Tensor:
        dim = self.head_dim
        return 1.0 / (self.theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))

    def reset_buffers(self, device: torch.device) -> None:
        """Recompute ``inv_freq`` on ``device`` (after building on the meta device)."""
        self.inv_freq = self._inv_freq().to(device)

    def forward(self, num_frames: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[1, num_frames, head_dim]`` for positions 0..num_frames-1."""
        positions = torch.arange(num_frames, device=self.inv_freq.device)[None, :]
        freqs = positions[..., None].float() * self.inv_freq.to(dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _apply_rope_head0(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> None:
    """In place on head 0 of ``q``, ``k`` ``[R, H, N, head_dim]``: de-interleave (the checkpoint's
    interleaved RoPE layout) then rotate half, as ``DiTAttention.forward``."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    q0 = torch.cat((q[:, :1, ..., 0::2], q[:, :1, ..., 1::2]), dim=-1)
    k0 = torch.cat((k[:, :1, ..., 0::2], k[:, :1, ..., 1::2]), dim=-1)
    q[:, :1], k[:, :1] = (
        (q0 * cos) + (_rotate_half(q0) * sin),
        (k0 * cos) + (_rotate_half(k0) * sin),
    )


class DiTAttention(nn.Module):
    """``DiTAttention``: block-masked SDPA (scale 1/sqrt(head_dim)), RoPE on head 0."""

    def __init__(self, config: DiTConfig):
        super().__init__()
        self.heads = config.num_attention_heads
        self.head_dim = config.head_dim
        inner = config.head_dim * config.num_attention_heads
        self.to_q = PackedLinear(config.hidden_size, inner)
        self.to_k = PackedLinear(config.hidden_size, inner)
        self.to_v = PackedLinear(config.hidden_size, inner)
        self.to_out = nn.ModuleList([PackedLinear(inner, config.hidden_size)])  # [1] was Dropout

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor
    ) -> torch.Tensor:
        """``x`` ``[R, N, hidden]``, ``mask`` bool ``[R, H, N, N]`` (True = attend) -> same as x."""
        r = x.shape[0]
        q = self.to_q(x).view(r, -1, self.heads, self.head_dim).transpose(1, 2)
        k = self.to_k(x).view(r, -1, self.heads, self.head_dim).transpose(1, 2)
        v = self.to_v(x).view(r, -1, self.heads, self.head_dim).transpose(1, 2)
        _apply_rope_head0(q, k, *rope)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0)
        out = out.transpose(1, 2).contiguous().reshape(r, -1, self.heads * self.head_dim)
        return self.to_out[0](out.to(q.dtype))


class AdaLayerNormZero(nn.Module):
    """``Qwen2_5_OmniAdaLayerNormZero``: LayerNorm modulated by the time embedding (6 vectors)."""

    def __init__(self, dim: int):
        super().__init__()
        self.silu = nn.SiLU()
        self.linear = PackedLinear(dim, dim * 6)
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)

    def forward(self, x: torch.Tensor, emb: torch.Tensor) -> tuple[torch.Tensor, ...]:
        emb = self.linear(self.silu(emb))
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = torch.chunk(emb, 6, dim=1)
        x = self.norm(x) * (1 + scale_msa[:, None]) + shift_msa[:, None]
        return x, gate_msa, shift_mlp, scale_mlp, gate_mlp


class AdaLayerNormZeroFinal(nn.Module):
    """``Qwen2_5_OmniAdaLayerNormZero_Final``: LayerNorm with time scale and shift."""

    def __init__(self, dim: int):
        super().__init__()
        self.silu = nn.SiLU()
        self.linear = PackedLinear(dim, dim * 2)
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)

    def forward(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        scale, shift = torch.chunk(self.linear(self.silu(emb)), 2, dim=1)
        return self.norm(x) * (1 + scale)[:, None, :] + shift[:, None, :]


class DiTMLP(nn.Module):
    """``DiTMLP``: Linear -> GELU(tanh) -> Linear; indices 0 and 3 as upstream (2 was Dropout)."""

    def __init__(self, dim: int, mult: int):
        super().__init__()
        inner = int(dim * mult)
        self.ff = nn.ModuleList(
            [
                PackedLinear(dim, inner),
                nn.GELU(approximate="tanh"),
                nn.Identity(),
                PackedLinear(inner, dim),
            ]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.ff:
            x = layer(x)
        return x


class DiTDecoderLayer(nn.Module):
    """``DiTDecoderLayer``: AdaLN-zero attention block then AdaLN-modulated MLP."""

    def __init__(self, config: DiTConfig, look_ahead_block: int, look_backward_block: int):
        super().__init__()
        self.look_ahead_block = look_ahead_block
        self.look_backward_block = look_backward_block
        self.attn_norm = AdaLayerNormZero(config.hidden_size)
        self.attn = DiTAttention(config)
        self.ff_norm = nn.LayerNorm(config.hidden_size, elementwise_affine=False, eps=1e-6)
        self.ff = DiTMLP(config.hidden_size, config.ff_mult)

    def forward(
        self,
        x: torch.Tensor,
        temb: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor,
    ) -> torch.Tensor:
        norm, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.attn_norm(x, emb=temb)
        x = x + gate_msa.unsqueeze(1) * self.attn(norm, rope, mask)
        norm = self.ff_norm(x) * (1 + scale_mlp[:, None]) + shift_mlp[:, None]
        return x + gate_mlp.unsqueeze(1) * self.ff(norm)


# ------------------------------------------------------------------------------------- DiT: ODE


@dataclass(frozen=True)
class ODEState:
    """One request's flow-matching ODE between solver steps (B rows that step together).

    ``ode_step`` returns a new state; nothing here is mutated.
    """

    x: torch.Tensor
    """``[B, frames, mel_dim]`` the ODE value at ``times[step]`` (the initial noise at step 0)."""
    features: torch.Tensor
    """``[G B, frames, cond_features]`` per-frame conditioning, computed once: G = 2 (B
    conditional rows then B unconditional rows) when guided, else 1."""
    times: torch.Tensor
    """``[num_steps]`` the time schedule (model dtype)."""
    guidance_scale: float
    """g of f = c + (c - u) g; the state is guided when g >= 1e-5."""
    step: int = 0
    """Solver steps taken; the next one integrates ``times[step] -> times[step + 1]``."""

    @property
    def batch_size(self) -> int:
        return self.x.shape[0]

    @property
    def num_frames(self) -> int:
        """Mel frames (2 per codec token)."""
        return self.x.shape[1]

    @property
    def guided(self) -> bool:
        return self.guidance_scale >= 1e-5

    @property
    def num_solver_steps(self) -> int:
        """Steps from noise to mel (9 at the default 10 time points)."""
        return self.times.shape[0] - 1

    @property
    def done(self) -> bool:
        return self.step >= self.num_solver_steps

    @property
    def model_rows(self) -> int:
        """DiT rows one velocity evaluation of this state runs (2B guided, B otherwise)."""
        return self.features.shape[0]


@dataclass(frozen=True)
class _StepBatch:
    """What one ``ode_step`` call shares across its 4 velocity evaluations."""

    states: list[ODEState]
    row_ranges: list[tuple[int, int]]  # x rows of each state in the stacked [R, N, mel_dim]
    features: torch.Tensor  # [R_model, N, cond_features], zero-padded to N frames
    masks: list[torch.Tensor]  # per layer, bool [R_model, H, N, N]
    rope: tuple[torch.Tensor, torch.Tensor]  # cos, sin [1, N, head_dim]


class DiT(nn.Module):
    """``Qwen2_5OmniToken2WavDiTModel``: codec tokens -> mel by a flow-matching ODE.

    Use ``initial_state`` once per request, ``ode_step`` (batched over requests) until every
    state is ``done``, then ``finalize``; ``sample`` does all three for one batch. Parameters
    and buffers are named as upstream (``time_embed``, ``text_embed``, ``input_embed``,
    ``rotary_embed``, ``transformer_blocks``, ``norm_out``, ``proj_out``).
    """

    def __init__(self, config: DiTConfig):
        super().__init__()
        c = config
        self.config = config
        self.time_embed = DiTTimestepEmbedding(c.hidden_size)
        self.text_embed = DiTCodecEmbedding(c)
        self.input_embed = DiTInputEmbedding(c)
        self.rotary_embed = DiTRotaryEmbedding(c)
        self.transformer_blocks = nn.ModuleList(
            DiTDecoderLayer(
                c,
                look_ahead_block=1 if i in c.look_ahead_layers else 0,
                look_backward_block=1 if i in c.look_backward_layers else 0,
            )
            for i in range(c.num_hidden_layers)
        )
        self.norm_out = AdaLayerNormZeroFinal(c.hidden_size)
        self.proj_out = PackedLinear(c.hidden_size, c.mel_dim)

    @property
    def dtype(self) -> torch.dtype:
        return self.proj_out.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.proj_out.weight.device

    # -- request setup

    @torch.inference_mode()
    def initial_state(
        self,
        codes: torch.Tensor,
        cond: torch.Tensor,
        ref_mel: torch.Tensor,
        noise: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
        solver: SolverConfig | None = None,
    ) -> ODEState:
        """Noise and conditioning of B rows that will step together (usually one request).

        Args:
            codes: int ``[B, T]`` codec tokens in [0, num_embeds].
            cond: ``[B, enc_emb_dim]`` speaker vector (the voice's ``cond``); ``[1, ...]``
                broadcasts.
            ref_mel: ``[B, L, mel_dim]`` reference log-mel of the voice (any L > the speaker
                encoder's reflect padding); ``[1, ...]`` broadcasts.
            noise: ``[B, T * repeats, mel_dim]`` the ODE's value at t = 0. When None it is
                ``torch.randn`` of that shape (model dtype and device) from ``generator``,
                which is what upstream draws from the global RNG.
            generator: the RNG for ``noise`` (ignored when ``noise`` is given).
            solver: time schedule and guidance (defaults: upstream's).
        """
        solver = solver or SolverConfig()
        codes = self._check_codes(codes)
        b, frames = codes.shape[0], codes.shape[1] * self.config.repeats
        cond = cond.to(self.device, self.dtype).expand(b, -1)
        ref_mel = ref_mel.to(self.device, self.dtype).expand(b, -1, -1)
        shape = (b, frames, self.config.mel_dim)
        if noise is None:
            noise = torch.randn(shape, dtype=self.dtype, device=self.device, generator=generator)
        elif tuple(noise.shape) != shape:
            raise ValueError(f"noise must be {list(shape)}, got {list(noise.shape)}")
        return ODEState(
            x=noise.to(self.device, self.dtype),
            features=self._conditioning(codes, cond, ref_mel, solver.guided),
            times=solver.time_points(self.dtype, self.device),
            guidance_scale=float(solver.guidance_scale),
        )

    def _check_codes(self, codes: torch.Tensor) -> torch.Tensor:
        if codes.dim() != 2 or codes.shape[1] == 0 or codes.is_floating_point():
            raise ValueError(f"codes must be int [batch, tokens >= 1], got {tuple(codes.shape)}")
        frames = codes.shape[1] * self.config.repeats
        if frames > self.config.max_position_embeddings:
            raise ValueError(
                f"{frames} mel frames exceed DiTConfig.max_position_embeddings "
                f"({self.config.max_position_embeddings})"
            )
        if int(codes.min()) < 0 or int(codes.max()) > self.config.num_embeds:
            raise ValueError(f"codes must lie in [0, {self.config.num_embeds}]")
        return codes.to(self.device)

    def _conditioning(
        self, codes: torch.Tensor, cond: torch.Tensor, ref_mel: torch.Tensor, guided: bool
    ) -> torch.Tensor:
        """``[G B, frames, enc_dim + emb_dim + enc_emb_dim]``: voice | codes | speaker, with the
        unconditional rows (ref_mel and cond zeroed, codes -> id 0) after the conditional ones,
        as ``DiTInputEmbedding.forward`` with ``apply_cfg`` builds them."""
        frames = codes.shape[1] * self.config.repeats
        speaker = cond.unsqueeze(1).repeat(1, frames, 1)
        code_embed = self.text_embed(codes)
        if guided:
            ref_mel = torch.cat([ref_mel, torch.zeros_like(ref_mel)], dim=0)
            speaker = torch.cat([speaker, torch.zeros_like(speaker)], dim=0)
            code_embed = torch.cat([code_embed, self.text_embed(codes, drop_code=True)], dim=0)
        voice = self.input_embed.spk_encoder(ref_mel).unsqueeze(1).repeat(1, frames, 1)
        return torch.cat((voice, code_embed, speaker), dim=-1)

    # -- one solver step for a batch of requests

    @torch.inference_mode()
    def ode_step(self, states: Sequence[ODEState]) -> list[ODEState]:
        """One RK4 (3/8 rule) step of every state, all states in the same 4 DiT forwards.

        Each forward runs ``sum(state.model_rows)`` rows (2 per guided request row) of
        ``max(num_frames)`` frames. What may differ between the states:
            - step and schedule: every row carries its own t and dt;
            - guidance: guided and unguided states mix;
            - length: states shorter than the longest are zero-padded with a key-padding mask
              (a valid query never sees a padded key); nothing but attention mixes frames, so
              padding changes float summation order only.
        A scheduler wanting upstream's exact attention shapes batches equal ``num_frames``.
        Results do not depend on the batch beyond float rounding of the batched matmuls
        (~1e-6 on the tiny test model, not bit-identical).

        Returns:
            New states, same order, ``step`` + 1, ``x`` of each state's own length.
        """
        if not states:
            return []
        if any(s.done for s in states):
            raise ValueError("ode_step got a state that has taken all its solver steps")
        batch = self._step_batch(list(states))
        frames = batch.features.shape[1]
        y0 = torch.cat([_pad_frames(s.x, frames) for s in states])  # [R, N, mel_dim]
        t0 = torch.cat([s.times[s.step].expand(s.batch_size) for s in states])  # [R]
        t1 = torch.cat([s.times[s.step + 1].expand(s.batch_size) for s in states])
        dt = t1 - t0
        y1 = y0 + self._rk4_delta(batch, t0, dt, t1, y0)
        return [
            replace(s, x=y1[a:b, : s.num_frames], step=s.step + 1)
            for s, (a, b) in zip(states, batch.row_ranges, strict=True)
        ]

    def _rk4_delta(
        self,
        batch: _StepBatch,
        t0: torch.Tensor,
        dt: torch.Tensor,
        t1: torch.Tensor,
        y0: torch.Tensor,
    ) -> torch.Tensor:
        """``RungeKutta4ODESolver._rk4_step`` with per-row times (same expressions, same order)."""
        third, two_thirds = 1 / 3, 2 / 3
        h = dt[:, None, None]
        k1 = self._velocity(batch, t0, y0)
        k2 = self._velocity(batch, t0 + dt * third, y0 + h * k1 * third)
        k3 = self._velocity(batch, t0 + dt * two_thirds, y0 + h * (k2 - k1 * third))
        k4 = self._velocity(batch, t1, y0 + h * (k1 - k2 + k3))
        return (k1 + 3 * (k2 + k3) + k4) * h / 8

    def _velocity(self, batch: _StepBatch, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Guided velocity ``[R, N, mel_dim]`` at times ``t`` ``[R]`` (the ``ode_function`` of
        upstream's ``sample``): one DiT forward over every state's model rows."""
        inputs, times = [], []
        for s, (a, b) in zip(batch.states, batch.row_ranges, strict=True):
            copies = 2 if s.guided else 1  # upstream: cat([x, x]) and cat([t, t])
            inputs += [y[a:b]] * copies
            times += [t[a:b]] * copies
        out = self.forward(torch.cat(inputs), torch.cat(times), batch)
        result, offset = [], 0
        for s in batch.states:
            part = out[offset : offset + s.model_rows]
            offset += s.model_rows
            if s.guided:
                guided, null = torch.chunk(part, 2, dim=0)
                part = guided + (guided - null) * s.guidance_scale
            result.append(part)
        return torch.cat(result)

    def forward(self, x: torch.Tensor, t: torch.Tensor, batch: _StepBatch) -> torch.Tensor:
        """One DiT evaluation (``Qwen2_5OmniToken2WavDiTModel.forward`` after its embeddings).

        ``x`` ``[R, N, mel_dim]`` noisy mel and ``t`` ``[R]`` times of the rows of
        ``batch.features`` ``[R, N, cond_features]`` -> predicted velocity ``[R, N, mel_dim]``.
        """
        temb = self.time_embed(t)
        h = self.input_embed(x, batch.features)
        for block, mask in zip(self.transformer_blocks, batch.masks, strict=True):
            h = block(h, temb, batch.rope, mask)
        return self.proj_out(self.norm_out(h, temb))

    def _step_batch(self, states: list[ODEState]) -> _StepBatch:
        frames = max(s.num_frames for s in states)
        row_ranges, offset = [], 0
        for s in states:
            row_ranges.append((offset, offset + s.batch_size))
            offset += s.batch_size
        features = torch.cat([_pad_frames(s.features, frames) for s in states])
        lengths = None
        if any(s.num_frames != frames for s in states):
            lengths = torch.tensor(
                [s.num_frames for s in states for _ in range(s.model_rows)], device=self.device
            )
        return _StepBatch(
            states=states,
            row_ranges=row_ranges,
            features=features,
            masks=self._masks(frames, features.shape[0], lengths),
            rope=self.rotary_embed(frames, self.dtype),
        )

    def _masks(self, frames: int, rows: int, lengths: torch.Tensor | None) -> list[torch.Tensor]:
        """Per layer, bool ``[rows, heads, N, N]``: query i may see key j when j's block is at
        most ``look_backward_block`` before and ``look_ahead_block`` after i's
        (``_create_block_diff``); with ``lengths`` also only keys j < length (or j == i, so a
        padded query row is never empty)."""
        blocks = torch.arange(frames, device=self.device) // self.config.block_size
        diff = blocks.unsqueeze(0) - blocks.unsqueeze(1)  # [N, N]: key block - query block
        keep = None
        if lengths is not None:
            valid = torch.arange(frames, device=self.device)[None, :] < lengths[:, None]
            eye = torch.eye(frames, dtype=torch.bool, device=self.device)
            keep = (valid[:, None, :] | eye).unsqueeze(1)  # [rows, 1, N, N]
        cache: dict[tuple[int, int], torch.Tensor] = {}
        masks = []
        for block in self.transformer_blocks:
            key = (block.look_backward_block, block.look_ahead_block)
            if key not in cache:
                mask = (diff >= -float(key[0])) & (diff <= float(key[1]))
                mask = mask[None, None] if keep is None else mask & keep
                cache[key] = mask.expand(rows, self.config.num_attention_heads, frames, frames)
            masks.append(cache[key])
        return masks

    # -- end of the ODE

    @staticmethod
    def finalize(state: ODEState) -> torch.Tensor:
        """Log-mel ``[B, mel_dim, frames]`` of a finished state (upstream's ``permute(0, 2, 1)``
        of the last solution point)."""
        if not state.done:
            raise ValueError(
                f"finalize needs a finished state, this one took {state.step} of "
                f"{state.num_solver_steps} solver steps"
            )
        return state.x.permute(0, 2, 1)

    @torch.inference_mode()
    def sample(
        self,
        codes: torch.Tensor,
        cond: torch.Tensor,
        ref_mel: torch.Tensor,
        noise: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
        solver: SolverConfig | None = None,
    ) -> torch.Tensor:
        """``initial_state``, ``ode_step`` until done, ``finalize``: mel ``[B, mel_dim, 2T]``."""
        state = self.initial_state(codes, cond, ref_mel, noise, generator, solver)
        while not state.done:
            (state,) = self.ode_step([state])
        return self.finalize(state)


def _pad_frames(x: torch.Tensor, frames: int) -> torch.Tensor:
    """Zero-pad ``[rows, n, C]`` to ``[rows, frames, C]`` (no copy when n == frames)."""
    return x if x.shape[1] == frames else F.pad(x, (0, 0, 0, frames - x.shape[1]))


# ---------------------------------------------------------------------------------------- BigVGAN

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


class SnakeBeta(nn.Module):
    """``Qwen2_5OmniSnakeBeta``: x + sin^2(x e^alpha) / (e^beta + 1e-9), per channel."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels))
        self.no_div_by_zero = 0.000000001

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha = torch.exp(self.alpha.unsqueeze(0).unsqueeze(-1))
        beta = torch.exp(self.beta.unsqueeze(0).unsqueeze(-1))
        return x + (1.0 / (beta + self.no_div_by_zero)) * torch.pow(torch.sin(x * alpha), 2)


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


# ------------------------------------------------------------------------------- whole + loading


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
