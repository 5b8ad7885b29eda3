"""S3Gen's flow-matching estimator: the velocity of the mel flow.

Matcha-TTS / CosyVoice's 1D U-Net (``ConditionalDecoder``, upstream
``chatterbox/models/s3gen/decoder.py`` with ``S3Token2Mel``'s arguments: causal, one channel
level of 256, 4 transformer blocks per stage, 12 mid stages, 8 heads of 64, GELU feed-forward).
Its input is the state ``x``, the encoder's conditioning ``mu``, the speaker vector repeated over
time and the prompt mel ``cond`` stacked on channels (4 x 80 = 320); the time ``t`` enters
through a sinusoidal embedding (scale 1000) and an MLP added inside every residual block.
Every block is a causal ResNet block (causal conv k=3, LayerNorm over channels, Mish) followed by
pre-norm transformer blocks (diffusers' ``BasicTransformerBlock``: self-attention without biases
on q/k/v, GELU feed-forward x4) over all frames; padded frames are masked. Module names follow
the published ``s3gen.safetensors`` (``flow.decoder.estimator.*``).

Imports torch only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

HEAD_DIM = 64
"""Attention head size (``attention_head_dim``; the tensors give heads x head size only)."""


@dataclass(frozen=True)
class EstimatorConfig:
    """Sizes of the estimator (published values as defaults)."""

    in_channels: int = 320
    """x, mu, speaker and prompt-mel channels stacked (4 x mel_dim)."""
    mel_dim: int = 80
    channels: int = 256
    """Width of the U-Net's one level (upstream ``channels=[256]``)."""
    num_heads: int = 8
    num_blocks: int = 4
    """Transformer blocks per stage (``n_blocks``)."""
    num_mid_blocks: int = 12

    @classmethod
    def from_state_dict(cls, state: dict[str, torch.Tensor], prefix: str) -> EstimatorConfig:
        """Sizes read from the tensors under ``prefix`` (``"flow.decoder.estimator."``).

        Raises:
            KeyError: a tensor the layout needs is missing (its name).
            ValueError: the U-Net has more than one channel level (the published one has one).
        """
        if any(k.startswith(prefix + "down_blocks.1.") for k in state):
            raise ValueError("S3Gen estimators with more than one channel level are not supported")
        conv = state[prefix + "down_blocks.0.0.block1.block.0.weight"]  # [channels, in, 3]
        blocks = {  # the j of down_blocks.0.1.j.*
            k.split(".")[len(prefix.split(".")) + 2]
            for k in state
            if k.startswith(prefix + "down_blocks.0.1.")
        }
        mids = {
            k.split(".")[len(prefix.split("."))]
            for k in state
            if k.startswith(prefix + "mid_blocks.")
        }
        return cls(
            in_channels=conv.shape[1],
            mel_dim=state[prefix + "final_proj.weight"].shape[0],
            channels=conv.shape[0],
            num_heads=state[prefix + "down_blocks.0.1.0.attn1.to_q.weight"].shape[0] // HEAD_DIM,
            num_blocks=len(blocks),
            num_mid_blocks=len(mids),
        )


def timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Matcha's ``SinusoidalPosEmb`` at scale 1000: ``[B]`` -> ``[B, dim]`` (sin then cos over
    ``10000^(-i / (dim/2 - 1))``)."""
    half = dim // 2
    freq = torch.exp(torch.arange(half, device=t.device).float() * -(math.log(10000) / (half - 1)))
    angle = 1000 * t[:, None] * freq[None]
    return torch.cat((angle.sin(), angle.cos()), dim=-1).to(t.dtype)


class CausalConv1d(nn.Conv1d):
    """A stride-1 conv padded ``kernel - 1`` on the left only."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(F.pad(x, (self.kernel_size[0] - 1, 0)))


class ChannelLayerNorm(nn.LayerNorm):
    """LayerNorm over the channels of a ``[B, C, T]`` tensor."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.transpose(1, 2)).transpose(1, 2)


class CausalBlock(nn.Module):
    """``mish(norm(conv(x * mask))) * mask`` (upstream ``CausalBlock1D``; ``block.0`` the conv,
    ``block.2`` the norm, as the published names)."""

    def __init__(self, dim: int, dim_out: int):
        super().__init__()
        self.block = nn.ModuleList(
            [
                CausalConv1d(dim, dim_out, 3),
                nn.Identity(),
                ChannelLayerNorm(dim_out),
                nn.Identity(),
                nn.Mish(),
            ]
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        conv, _, norm, _, act = self.block
        return act(norm(conv(x * mask))) * mask


class ResnetBlock(nn.Module):
    """Two causal blocks with the time embedding added between, plus a 1x1 residual conv."""

    def __init__(self, dim: int, dim_out: int, time_dim: int):
        super().__init__()
        self.mlp = nn.Sequential(nn.Mish(), nn.Linear(time_dim, dim_out))
        self.block1 = CausalBlock(dim, dim_out)
        self.block2 = CausalBlock(dim_out, dim_out)
        self.res_conv = nn.Conv1d(dim, dim_out, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, time: torch.Tensor) -> torch.Tensor:
        h = self.block1(x, mask) + self.mlp(time).unsqueeze(-1)
        return self.block2(h, mask) + self.res_conv(x * mask)


class SelfAttention(nn.Module):
    """diffusers' ``Attention`` as the block configures it: q/k/v without bias, output with."""

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        inner = num_heads * HEAD_DIM
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_k = nn.Linear(dim, inner, bias=False)
        self.to_v = nn.Linear(dim, inner, bias=False)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim)])

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """``x`` ``[B, T, dim]``, ``bias`` ``[B, 1, 1, T]`` additive key mask."""
        batch = x.shape[0]

        def heads(y: torch.Tensor) -> torch.Tensor:
            return y.view(batch, -1, self.num_heads, HEAD_DIM).transpose(1, 2)

        q, k, v = heads(self.to_q(x)), heads(self.to_k(x)), heads(self.to_v(x))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return self.to_out[0](out.transpose(1, 2).reshape(batch, -1, self.num_heads * HEAD_DIM))


class GeluProjection(nn.Module):
    """``gelu(proj(x))`` (diffusers ``GELU``, exact erf form)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.proj = nn.Linear(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.proj(x))


class TransformerBlock(nn.Module):
    """Pre-norm self-attention and GELU feed-forward (x4), each residual (diffusers
    ``BasicTransformerBlock`` with ``layer_norm``; names ``norm1``, ``attn1``, ``norm3``,
    ``ff.net.0.proj``, ``ff.net.2``)."""

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn1 = SelfAttention(dim, num_heads)
        self.norm3 = nn.LayerNorm(dim)
        self.ff = nn.Module()
        self.ff.net = nn.ModuleList(
            [GeluProjection(dim, 4 * dim), nn.Identity(), nn.Linear(4 * dim, dim)]
        )

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        x = x + self.attn1(self.norm1(x), bias)
        h = self.norm3(x)
        for layer in self.ff.net:
            h = layer(h)
        return x + h


class Stage(nn.ModuleList):
    """One U-Net stage: ``[resnet, transformer blocks(, resample conv)]`` as the published
    names index them."""

    def run(self, x: torch.Tensor, mask: torch.Tensor, time: torch.Tensor, bias: torch.Tensor):
        x = self[0](x, mask, time).transpose(1, 2)  # [B, T, C]
        for block in self[1]:
            x = block(x, bias)
        return x.transpose(1, 2)


class S3GenEstimator(nn.Module):
    """The velocity ``u(t, x | mu, speaker, cond)`` ``[B, mel_dim, T]``.

    Args:
        config: sizes (``EstimatorConfig.from_state_dict`` for a checkpoint).
    """

    def __init__(self, config: EstimatorConfig):
        super().__init__()
        self.config = config
        ch, heads, time_dim = config.channels, config.num_heads, 4 * config.channels

        def stage(dim_in: int, resample: bool) -> Stage:
            parts = [ResnetBlock(dim_in, ch, time_dim)]
            parts.append(
                nn.ModuleList(TransformerBlock(ch, heads) for _ in range(config.num_blocks))
            )
            if resample:
                parts.append(CausalConv1d(ch, ch, 3))
            return Stage(parts)

        self.time_mlp = nn.Module()
        self.time_mlp.linear_1 = nn.Linear(config.in_channels, time_dim)
        self.time_mlp.linear_2 = nn.Linear(time_dim, time_dim)
        self.down_blocks = nn.ModuleList([stage(config.in_channels, True)])
        self.mid_blocks = nn.ModuleList(stage(ch, False) for _ in range(config.num_mid_blocks))
        self.up_blocks = nn.ModuleList([stage(2 * ch, True)])
        self.final_block = CausalBlock(ch, ch)
        self.final_proj = nn.Conv1d(ch, config.mel_dim, 1)

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor,
        mu: torch.Tensor,
        t: torch.Tensor,
        speaker: torch.Tensor,
        cond: torch.Tensor,
    ) -> torch.Tensor:
        """``x``, ``mu``, ``cond`` ``[B, mel_dim, T]``; ``mask`` ``[B, 1, T]`` (1 valid, 0
        padding); ``t`` ``[B]``; ``speaker`` ``[B, mel_dim]`` -> velocity ``[B, mel_dim, T]``."""
        time = timestep_embedding(t, self.config.in_channels)
        time = self.time_mlp.linear_2(F.silu(self.time_mlp.linear_1(time)))
        speaker = speaker[:, :, None].expand(-1, -1, x.shape[-1])
        x = torch.cat([x, mu, speaker, cond], dim=1)
        bias = ((1.0 - mask) * -1.0e10)[:, None]  # [B, 1, 1, T]: upstream's mask_to_bias
        down = self.down_blocks[0]
        skip = down.run(x, mask, time, bias)
        x = down[2](skip * mask)
        for stage in self.mid_blocks:
            x = stage.run(x, mask, time, bias)
        up = self.up_blocks[0]
        x = up.run(torch.cat([x[:, :, : skip.shape[-1]], skip], dim=1), mask, time, bias)
        x = up[2](x * mask)
        x = self.final_block(x, mask)
        return self.final_proj(x * mask) * mask
