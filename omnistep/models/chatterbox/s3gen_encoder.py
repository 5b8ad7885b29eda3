"""S3Gen's token encoder: speech-token embeddings -> 50 Hz conditioning rows.

CosyVoice 2's ``UpsampleConformerEncoder`` as Chatterbox configures it (upstream
``chatterbox/models/s3gen/transformer/upsample_encoder.py`` with ``S3Token2Mel``'s arguments):
a linear input layer (Linear + LayerNorm, scaled by sqrt(width)) with ESPnet relative positional
encodings, a pre-lookahead residual conv (3 tokens ahead), 6 pre-norm Conformer layers
(relative-position self-attention, Transformer-XL's u/v biases, arXiv 1901.02860; SiLU
feed-forward; no macaron, no conv module), nearest-neighbour upsampling x2 with a causal conv
(kernel 5), a second linear input layer and 4 more Conformer layers, then a final LayerNorm.
Module names follow the published ``s3gen.safetensors`` (``flow.encoder.*``), so its tensors
load by name. Widths are read from the tensors (the published model: 512, 8 heads, FF 2048).

Imports torch only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class EncoderConfig:
    """Sizes of the token encoder (published values as defaults)."""

    width: int = 512
    """Model width (``output_size``; upstream also fixes its lookahead and upsampling at 512)."""
    num_heads: int = 8
    ffn_dim: int = 2048
    """Feed-forward hidden units (``linear_units``)."""
    num_blocks: int = 6
    """Conformer layers before the upsampling."""
    num_up_blocks: int = 4
    """Conformer layers after it."""
    lookahead: int = 3
    """Tokens the pre-lookahead conv sees ahead (``pre_lookahead_len``)."""
    upsample: int = 2
    """Output rows per token (25 Hz tokens -> 50 Hz mel frames)."""

    @classmethod
    def from_state_dict(cls, state: dict[str, torch.Tensor], prefix: str) -> EncoderConfig:
        """Sizes read from the tensors under ``prefix`` (``"flow.encoder."``); heads from
        ``pos_bias_u`` ``[heads, head_dim]``.

        Raises:
            KeyError: a tensor the layout needs is missing (its name).
        """

        def count(group: str) -> int:
            layers = {
                k[len(prefix + group) :].split(".")[0]
                for k in state
                if k.startswith(prefix + group)
            }
            return len(layers)

        bias_u = state[prefix + "encoders.0.self_attn.pos_bias_u"]
        return cls(
            width=state[prefix + "after_norm.weight"].shape[0],
            num_heads=bias_u.shape[0],
            ffn_dim=state[prefix + "encoders.0.feed_forward.w_1.weight"].shape[0],
            num_blocks=count("encoders."),
            num_up_blocks=count("up_encoders."),
            lookahead=state[prefix + "pre_lookahead_layer.conv1.weight"].shape[-1] - 1,
        )


def relative_positions(length: int, width: int) -> torch.Tensor:
    """ESPnet's relative positional encoding (``EspnetRelPositionalEncoding``), float32
    ``[2 * length - 1, width]``: row ``k`` encodes the relative position ``length - 1 - k``
    (positive to the left), ``sin``/``cos`` interleaved over ``10000^(-2i/width)``."""
    position = torch.arange(0, length, dtype=torch.float32).unsqueeze(1)
    freq = torch.exp(torch.arange(0, width, 2, dtype=torch.float32) * -(math.log(10000.0) / width))
    positive = torch.zeros(length, width)
    negative = torch.zeros(length, width)
    positive[:, 0::2] = torch.sin(position * freq)
    positive[:, 1::2] = torch.cos(position * freq)
    negative[:, 0::2] = torch.sin(-1 * position * freq)
    negative[:, 1::2] = torch.cos(-1 * position * freq)
    return torch.cat([torch.flip(positive, [0]), negative[1:]])


class LinearInput(nn.Module):
    """Linear + LayerNorm input layer, then the rows scaled by sqrt(width) (``LinearNoSubsampling``
    with its positional encoding; the encoding itself goes to the attention)."""

    def __init__(self, width: int):
        super().__init__()
        self.out = nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width, eps=1e-5))
        self.scale = math.sqrt(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(x) * self.scale


class RelPositionAttention(nn.Module):
    """Self-attention with relative positions (Transformer-XL; upstream
    ``RelPositionMultiHeadedAttention``): scores ``((q + u) k^T + shift((q + v) p^T)) / sqrt(d)``
    with ``p`` the projected relative encodings; padded keys masked."""

    def __init__(self, width: int, num_heads: int):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, width // num_heads
        self.linear_q = nn.Linear(width, width)
        self.linear_k = nn.Linear(width, width)
        self.linear_v = nn.Linear(width, width)
        self.linear_out = nn.Linear(width, width)
        self.linear_pos = nn.Linear(width, width, bias=False)
        self.pos_bias_u = nn.Parameter(torch.zeros(num_heads, self.head_dim))
        self.pos_bias_v = nn.Parameter(torch.zeros(num_heads, self.head_dim))

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(x.shape[0], -1, self.num_heads, self.head_dim)  # [B, T, H, D]

    def forward(self, x: torch.Tensor, keep: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """``x`` ``[B, T, width]``, ``keep`` ``[B, T]`` bool (False: padding), ``pos``
        ``[2T - 1, width]`` -> ``[B, T, width]``."""
        length = x.shape[1]
        q = self._heads(self.linear_q(x))
        k = self._heads(self.linear_k(x)).transpose(1, 2)
        v = self._heads(self.linear_v(x)).transpose(1, 2)
        p = self._heads(self.linear_pos(pos[None])).transpose(1, 2)  # [1, H, 2T-1, D]
        content = torch.matmul((q + self.pos_bias_u).transpose(1, 2), k.transpose(-2, -1))
        position = torch.matmul((q + self.pos_bias_v).transpose(1, 2), p.transpose(-2, -1))
        # column j of query i reads relative position i - j, at encoding row T - 1 - i + j
        rows = torch.arange(length, device=x.device)
        index = (length - 1 - rows[:, None] + rows[None, :]).expand(*position.shape[:2], -1, -1)
        position = torch.gather(position, -1, index)
        scores = (content + position) / math.sqrt(self.head_dim)  # [B, H, T, T]
        masked = ~keep[:, None, None, :]
        attn = torch.softmax(scores.masked_fill(masked, -float("inf")), dim=-1).masked_fill(
            masked, 0.0
        )
        out = torch.matmul(attn, v).transpose(1, 2).reshape(x.shape)
        return self.linear_out(out)


class FeedForward(nn.Module):
    """``w_2(silu(w_1 x))`` (upstream ``PositionwiseFeedForward`` with ``swish``)."""

    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.w_1 = nn.Linear(width, hidden)
        self.w_2 = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_2(F.silu(self.w_1(x)))


class ConformerLayer(nn.Module):
    """Pre-norm attention then feed-forward, each residual (LayerNorm eps 1e-12, upstream
    ``ConformerEncoderLayer`` without macaron or conv module)."""

    def __init__(self, config: EncoderConfig):
        super().__init__()
        self.self_attn = RelPositionAttention(config.width, config.num_heads)
        self.feed_forward = FeedForward(config.width, config.ffn_dim)
        self.norm_mha = nn.LayerNorm(config.width, eps=1e-12)
        self.norm_ff = nn.LayerNorm(config.width, eps=1e-12)

    def forward(self, x: torch.Tensor, keep: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.norm_mha(x), keep, pos)
        return x + self.feed_forward(self.norm_ff(x))


class PreLookahead(nn.Module):
    """Residual ``conv2(pad_left_2(leaky_relu(conv1(pad_right_L(x)))))``: each token sees
    ``L`` tokens ahead (upstream ``PreLookaheadLayer``)."""

    def __init__(self, width: int, lookahead: int):
        super().__init__()
        self.lookahead = lookahead
        self.conv1 = nn.Conv1d(width, width, lookahead + 1)
        self.conv2 = nn.Conv1d(width, width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.pad(x.transpose(1, 2), (0, self.lookahead))  # [B, width, T + L]
        y = self.conv2(F.pad(F.leaky_relu(self.conv1(y)), (2, 0)))
        return y.transpose(1, 2) + x


class Upsample(nn.Module):
    """Nearest-neighbour upsampling by ``stride``, left-padded by ``2 stride``, then a conv of
    kernel ``2 stride + 1`` (upstream ``upsample_encoder.Upsample1D``)."""

    def __init__(self, width: int, stride: int):
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv1d(width, width, 2 * stride + 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, width, T]`` -> ``[B, width, stride T]``."""
        y = F.interpolate(x, scale_factor=float(self.stride), mode="nearest")
        return self.conv(F.pad(y, (2 * self.stride, 0)))


class S3GenEncoder(nn.Module):
    """Token embeddings ``[B, T, width]`` -> conditioning rows ``[B, 2T, width]``.

    Args:
        config: sizes (``EncoderConfig.from_state_dict`` for a checkpoint).
    """

    def __init__(self, config: EncoderConfig):
        super().__init__()
        self.config = config
        self.embed = LinearInput(config.width)
        self.pre_lookahead_layer = PreLookahead(config.width, config.lookahead)
        self.encoders = nn.ModuleList(ConformerLayer(config) for _ in range(config.num_blocks))
        self.up_layer = Upsample(config.width, config.upsample)
        self.up_embed = LinearInput(config.width)
        self.up_encoders = nn.ModuleList(
            ConformerLayer(config) for _ in range(config.num_up_blocks)
        )
        self.after_norm = nn.LayerNorm(config.width, eps=1e-5)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """``x`` ``[B, T, width]`` token embeddings (zero past each row's length), ``lengths``
        ``[B]`` int64 -> ``[B, upsample T, width]`` (rows past ``upsample * length`` are
        padding)."""
        width, length = self.config.width, x.shape[1]
        steps = torch.arange(length, device=x.device)
        keep = steps[None, :] < lengths[:, None]
        pos = relative_positions(length, width).to(x)
        x = self.pre_lookahead_layer(self.embed(x))
        for layer in self.encoders:
            x = layer(x, keep, pos)
        x = self.up_layer(x.transpose(1, 2)).transpose(1, 2)
        length *= self.config.upsample
        steps = torch.arange(length, device=x.device)
        keep = steps[None, :] < lengths[:, None] * self.config.upsample
        pos = relative_positions(length, width).to(x)
        x = self.up_embed(x)
        for layer in self.up_encoders:
            x = layer(x, keep, pos)
        return self.after_norm(x)
