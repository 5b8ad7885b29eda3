"""VoxCPM2's AudioVAE: the decoder (latents ``[B, C, T]`` at 25 Hz -> 48 kHz audio) and the
encoder (16 kHz audio -> latents, for reference clips).

Encoder (upstream ``CausalEncoder``, ``AudioVAE.encode``): the clip right-padded to a multiple
of ``prod(encoder_rates)`` (640), a k=7 causal conv from one channel, per rate a block of three
causal residual units (depthwise in VoxCPM2), Snake and a strided causal conv (kernel 2s, left
padding s) doubling the channels, then ``fc_mu`` (k=3): the latents are the posterior means.

Upstream ``voxcpm/modules/audiovae/audio_vae_v2.py: CausalDecoder``: a causal (left-padded)
conv stack, depthwise in VoxCPM2 (a k=7 depthwise conv and a 1x1 conv in, then per upsampling
block: Snake, a causal transposed conv of kernel 2s and stride s, three causal residual units
with dilations 1, 3, 9 -- Snake, k=7 conv, Snake, 1x1 conv, plus the input), Snake, a k=7 conv
to one channel and tanh. Before each upsampling block the activations are scaled and shifted
by embeddings of the output-rate bucket (``sr_bin_boundaries``; ``cond_type`` scale_bias).
Weight norm is folded into plain weights at load (``layers.weight_norm``).

Every layer is causal, so the decoder streams exactly: ``decode(z, state)`` keeps each conv's
last inputs (its left padding) and each transposed conv's last input frame in ``state``, and
decoding a latent sequence in any chunking gives the whole decode's samples (up to float
summation order). Samples per latent: ``prod(decoder_rates)`` (1920 for VoxCPM2).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

State = dict[int, torch.Tensor]
"""Per-layer tails of a stream: ``id(layer) -> [B, channels, n]`` last inputs."""


class Snake(nn.Module):
    """``x + sin^2(alpha x) / (alpha + 1e-9)`` per channel (upstream ``Snake1d``; ``alpha``
    ``[1, C, 1]``)."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1, channels, 1))

    def forward(self, x: torch.Tensor, state: State | None = None) -> torch.Tensor:
        return x + (self.alpha + 1e-9).reciprocal() * torch.sin(self.alpha * x).pow(2)


class CausalConv(nn.Conv1d):
    """A conv padded on the left by ``left`` samples (default ``(kernel - 1) * dilation``,
    what upstream's ``CausalConv1d`` pads for every conv of the decoder; the encoder's strided
    convs pad ``stride``); streams through ``state`` (stride 1 only)."""

    def __init__(
        self,
        cin: int,
        cout: int,
        kernel: int,
        dilation: int = 1,
        groups: int = 1,
        stride: int = 1,
        left: int | None = None,
    ):
        super().__init__(cin, cout, kernel, dilation=dilation, groups=groups, stride=stride)
        self.left = (kernel - 1) * dilation if left is None else left

    def forward(self, x: torch.Tensor, state: State | None = None) -> torch.Tensor:
        if self.left == 0:
            return super().forward(x)
        if state is None:
            return super().forward(F.pad(x, (self.left, 0)))
        if self.stride[0] != 1:
            raise ValueError("a strided conv does not stream")
        prev = state.get(id(self))
        if prev is None:
            prev = x.new_zeros(x.shape[0], x.shape[1], self.left)
        full = torch.cat([prev, x], dim=-1)
        state[id(self)] = full[..., -self.left :]
        return super().forward(full)


class CausalTransposeConv(nn.ConvTranspose1d):
    """Kernel ``2 s``, stride ``s``: output sample ``n`` reads input frames ``n // s`` and the
    one before; the last ``s`` outputs of upstream's transposed conv are cut
    (``CausalTransposeConv1d``), so ``T`` frames give ``T s`` samples."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__(cin, cout, 2 * stride, stride=stride)
        self.s = stride

    def forward(self, x: torch.Tensor, state: State | None = None) -> torch.Tensor:
        if state is None:
            return super().forward(x)[..., : -self.s]
        prev = state.get(id(self))
        if prev is None:
            prev = x.new_zeros(x.shape[0], x.shape[1], 1)
        state[id(self)] = x[..., -1:]
        return super().forward(torch.cat([prev, x], dim=-1))[..., self.s : -self.s]


class Chain(nn.Sequential):
    """``nn.Sequential`` whose layers take the stream state."""

    def forward(self, x: torch.Tensor, state: State | None = None) -> torch.Tensor:
        for layer in self:
            x = layer(x, state) if not isinstance(layer, nn.Tanh) else layer(x)
        return x


class ResidualUnit(nn.Module):
    """``x + conv1x1(snake(conv7_dilated(snake(x))))`` (upstream ``CausalResidualUnit``)."""

    def __init__(self, dim: int, dilation: int, groups: int):
        super().__init__()
        self.block = Chain(
            Snake(dim),
            CausalConv(dim, dim, 7, dilation=dilation, groups=groups),
            Snake(dim),
            CausalConv(dim, dim, 1),
        )

    def forward(self, x: torch.Tensor, state: State | None = None) -> torch.Tensor:
        return x + self.block(x, state)


class DecoderBlock(nn.Module):
    """Snake, transposed conv (x ``stride``), three residual units (upstream
    ``CausalDecoderBlock`` without its noise block)."""

    def __init__(self, cin: int, cout: int, stride: int, groups: int):
        super().__init__()
        self.block = Chain(
            Snake(cin),
            CausalTransposeConv(cin, cout, stride),
            *(ResidualUnit(cout, d, groups) for d in (1, 3, 9)),
        )

    def forward(self, x: torch.Tensor, state: State | None = None) -> torch.Tensor:
        return self.block(x, state)


class RateCondition(nn.Module):
    """``x * scale[bucket] + bias[bucket]`` per channel (upstream ``SampleRateConditionLayer``,
    ``cond_type`` scale_bias / scale_bias_init, no out layer)."""

    def __init__(self, channels: int, buckets: int):
        super().__init__()
        self.scale_embed = nn.Embedding(buckets, channels)
        self.bias_embed = nn.Embedding(buckets, channels)

    def forward(self, x: torch.Tensor, bucket: torch.Tensor) -> torch.Tensor:
        return x * self.scale_embed(bucket).unsqueeze(-1) + self.bias_embed(bucket).unsqueeze(-1)


class AudioVAEDecoder(nn.Module):
    """The decoder, parameters named as upstream's ``audio_vae.decoder.*`` with weight norm
    folded (``model.{i}...weight``, ``sr_cond_model.{i}.{scale,bias}_embed.weight``).

    Args:
        config: the ``audio_vae_config`` dict (``VoxCPMConfig.audio_vae``).

    Raises:
        ValueError: a noise block, a conditioning type other than scale_bias(_init), an
            output layer on the conditioning, or no rate buckets (the forms VoxCPM2 does not
            publish).
    """

    def __init__(self, config: dict[str, Any]):
        super().__init__()
        if config["use_noise_block"]:
            raise ValueError("audio_vae_config.use_noise_block=true is not supported")
        if config["cond_type"] not in ("scale_bias", "scale_bias_init"):
            raise ValueError(f"audio_vae_config.cond_type {config['cond_type']!r} not supported")
        if config["cond_out_layer"] or not config["sr_bin_boundaries"]:
            raise ValueError("audio_vae_config: cond_out_layer / no sr_bin_boundaries unsupported")
        latent, channels = int(config["latent_dim"]), int(config["decoder_dim"])
        rates, depthwise = [int(r) for r in config["decoder_rates"]], bool(config["depthwise"])
        self.hop = math.prod(rates)
        self.out_rate = int(config["out_sample_rate"])
        boundaries = torch.tensor(config["sr_bin_boundaries"], dtype=torch.int32)
        self.bucket = int(
            torch.bucketize(torch.tensor([self.out_rate], dtype=torch.int32), boundaries)
        )
        if depthwise:
            layers: list[nn.Module] = [
                CausalConv(latent, latent, 7, groups=latent),
                CausalConv(latent, channels, 1),
            ]
        else:
            layers = [CausalConv(latent, channels, 7)]
        conds: list[nn.Module | None] = [None] * len(layers)
        out = channels
        for i, stride in enumerate(rates):
            cin, out = channels // 2**i, channels // 2 ** (i + 1)
            layers.append(DecoderBlock(cin, out, stride, out if depthwise else 1))
            conds.append(RateCondition(cin, len(config["sr_bin_boundaries"]) + 1))
        layers += [Snake(out), CausalConv(out, 1, 7), nn.Tanh()]
        conds += [None, None, None]
        self.model = nn.ModuleList(layers)
        self.sr_cond_model = nn.ModuleList(c if c is not None else nn.Identity() for c in conds)
        self._conditioned = [c is not None for c in conds]

    @property
    def left_context_frames(self) -> int:
        """Latent frames of left context that make a window's last samples equal the whole
        decode's: the causal receptive field, summed over the layers in latent frames (a
        conv's left padding at its input rate; two input samples for a transposed conv),
        rounded up. 21 for VoxCPM2's rates."""
        frames, rate = 0.0, 1  # samples per latent frame at the current layer's input
        for layer in self.model:
            for mod in layer.modules():
                if isinstance(mod, CausalTransposeConv):
                    frames += 2 / rate
                    rate *= mod.s
                elif isinstance(mod, CausalConv):
                    frames += mod.left / rate
        return math.ceil(frames)

    def init_state(self, batch: int = 1) -> State:
        """A stream's state before its first chunk: zero tails for every layer (what the
        whole decode's left padding holds), ``batch`` rows."""
        state: State = {}
        param = next(self.parameters())
        for mod in self.modules():
            if isinstance(mod, CausalTransposeConv):
                state[id(mod)] = param.new_zeros(batch, mod.in_channels, 1)
            elif isinstance(mod, CausalConv) and mod.left:
                state[id(mod)] = param.new_zeros(batch, mod.in_channels, mod.left)
        return state

    def decode_chunk(self, window: torch.Tensor, left: int, chunk: int) -> torch.Tensor:
        """``ChunkVocoder``'s call: ``window`` ``[B, C, left + chunk]`` latents -> the
        ``chunk`` frames' samples ``[B, chunk * hop]`` (the window decoded from zero state;
        exact when ``left >= left_context_frames`` or the window starts the stream)."""
        return self.decode(window)[:, left * self.hop : (left + chunk) * self.hop]

    def decode(self, z: torch.Tensor, state: State | None = None) -> torch.Tensor:
        """``z`` ``[B, C, T]`` -> ``[B, T * hop]`` samples in [-1, 1]. With ``state`` (a dict,
        empty at a stream's start) the call continues the previous ones of that stream."""
        bucket = torch.full((z.shape[0],), self.bucket, dtype=torch.long, device=z.device)
        x = z
        for layer, cond, on in zip(self.model, self.sr_cond_model, self._conditioned, strict=True):
            if on:
                x = cond(x, bucket)
            x = layer(x) if isinstance(layer, nn.Tanh) else layer(x, state)
        return x[:, 0]


class EncoderBlock(nn.Module):
    """Three residual units, Snake, a strided causal conv doubling the channels (upstream
    ``CausalEncoderBlock``)."""

    def __init__(self, cout: int, stride: int, depthwise: bool):
        super().__init__()
        cin = cout // 2
        groups = cin if depthwise else 1
        self.block = Chain(
            *(ResidualUnit(cin, d, groups) for d in (1, 3, 9)),
            Snake(cin),
            CausalConv(cin, cout, 2 * stride, stride=stride, left=stride),
        )

    def forward(self, x: torch.Tensor, state: State | None = None) -> torch.Tensor:
        return self.block(x)


class AudioVAEEncoder(nn.Module):
    """The encoder, parameters named as upstream's ``audio_vae.encoder.*`` (``block.*``,
    ``fc_mu``; ``fc_logvar`` is not needed at inference and not loaded) with weight norm folded.

    Args:
        config: the ``audio_vae_config`` dict (``VoxCPMConfig.audio_vae``).
    """

    def __init__(self, config: dict[str, Any]):
        super().__init__()
        width, latent = int(config["encoder_dim"]), int(config["latent_dim"])
        rates, depthwise = [int(r) for r in config["encoder_rates"]], bool(config["depthwise"])
        self.hop = math.prod(rates)
        self.sample_rate = int(config["sample_rate"])
        layers: list[nn.Module] = [CausalConv(1, width, 7)]
        for stride in rates:
            width *= 2
            layers.append(EncoderBlock(width, stride, depthwise))
        self.block = Chain(*layers)
        self.fc_mu = CausalConv(width, latent, 3)

    def encode(self, audio: torch.Tensor) -> torch.Tensor:
        """``audio`` ``[B, samples]`` at ``sample_rate`` -> latents ``[B, C, ceil(samples /
        hop)]`` (right-padded with zeros to a multiple of ``hop`` first)."""
        pad = -audio.shape[-1] % self.hop
        x = F.pad(audio, (0, pad)).unsqueeze(1)
        return self.fc_mu(self.block(x))
