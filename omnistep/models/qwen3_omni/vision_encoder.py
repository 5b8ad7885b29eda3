"""Qwen3-Omni's vision encoder (``thinker.visual``, Qwen3-VL's): flattened patches -> merged
thinker-width rows plus the deepstack features fed into the first thinker layers.

Follows transformers' ``Qwen3OmniMoeVisionEncoder`` (models/qwen3_omni_moe/
modeling_qwen3_omni_moe.py; written here from its description, weights by its names):

1. ``patch_embed``: a ``Conv3d`` whose kernel equals its stride (``temporal_patch_size x
   patch x patch``), i.e. one linear map of each flattened patch
   ``[3 * temporal_patch_size * patch**2]`` to ``hidden_size``.
2. Learned positions: the ``num_position_embeddings`` table is a square grid (48 x 48
   published), bilinearly resized (``align_corners=True``) to each frame's ``(h, w)`` patch
   grid and added, in the processor's patch order (``merge x merge`` blocks).
3. ``depth`` pre-LayerNorm blocks (eps 1e-6; MLP ``linear_fc1``, tanh-GELU, ``linear_fc2``);
   attention within each frame (``t`` frames of ``h * w`` patches), 2-D rope over the head:
   the first half of the rotated frequencies takes the patch row, the second its column
   (``head_dim / 4`` frequencies each, ``theta`` 10000), laid out rotate-half.
4. ``merger``: LayerNorm per patch, then each ``merge x merge`` block's patches concatenated
   through ``Linear``, GELU, ``Linear`` -> ``out_hidden_size``. After block
   ``deepstack_visual_indexes[k]``, ``merger_list[k]`` (the same, its LayerNorm over the
   concatenated block) gives deepstack feature ``k``, which the thinker adds to the visual
   positions' hidden states after its decoder layer ``k``.

Attention within a frame runs per frame (``layers.segment_attention``, no ``[N, N]`` mask:
a 12.8-megapixel image is 65,536 patches, whose dense mask alone took 4 GiB and its SDPA's
float copy 16 GiB).

Imports torch and ``omnistep.layers``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from omnistep.layers.segment_attention import segment_attention


@dataclass(frozen=True)
class VisionEncoderConfig:
    """``thinker_config.vision_config`` (``Qwen3OmniMoeVisionEncoderConfig``), defaults
    transformers'."""

    depth: int = 27
    hidden_size: int = 1152
    hidden_act: str = "gelu_pytorch_tanh"
    intermediate_size: int = 4304
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 16
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    out_hidden_size: int = 3584
    num_position_embeddings: int = 2304
    deepstack_visual_indexes: tuple[int, ...] = (8, 16, 24)
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"vision_config.hidden_act {self.hidden_act!r} is not supported")
        side = int(self.num_position_embeddings**0.5)
        if side * side != self.num_position_embeddings:
            raise ValueError("vision_config.num_position_embeddings must be a square")

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> VisionEncoderConfig:
        """From ``config.json``, its ``thinker_config`` or the ``vision_config`` itself."""
        raw = raw.get("thinker_config", raw)
        raw = raw.get("vision_config", raw)
        fields = {k: raw[k] for k in cls.__dataclass_fields__ if raw.get(k) is not None}
        fields["deepstack_visual_indexes"] = tuple(
            raw.get("deepstack_visual_indexes", cls.deepstack_visual_indexes)
        )
        rope = raw.get("rope_parameters") or {}
        if "rope_theta" in rope:
            fields["rope_theta"] = float(rope["rope_theta"])
        return cls(**fields)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


ACTIVATIONS = {
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def merge_order(h: int, w: int, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column LongTensors ``[h * w]`` of a frame's patches in the processor's order
    (``merge x merge`` blocks, row-major within and across blocks)."""
    rows = torch.arange(h)[:, None].expand(h, w)
    cols = torch.arange(w)[None, :].expand(h, w)
    shape = (h // merge, merge, w // merge, merge)
    return (
        rows.reshape(shape).transpose(1, 2).flatten(),
        cols.reshape(shape).transpose(1, 2).flatten(),
    )


class _Attention(nn.Module):
    def __init__(self, config: VisionEncoderConfig):
        super().__init__()
        self.heads = config.num_heads
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, frames: Sequence[int]
    ) -> torch.Tensor:
        n, d = x.shape
        q, k, v = self.qkv(x).view(n, 3, self.heads, -1).unbind(1)  # [n, H, hd]
        c, s = cos[:, None].float(), sin[:, None].float()
        q = (q.float() * c + _rotate_half(q.float()) * s).to(x.dtype)
        k = (k.float() * c + _rotate_half(k.float()) * s).to(x.dtype)
        out = segment_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), frames)
        return self.proj(out.transpose(0, 1).reshape(n, d))


class _Mlp(nn.Module):
    def __init__(self, config: VisionEncoderConfig):
        super().__init__()
        self.linear_fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.linear_fc2 = nn.Linear(config.intermediate_size, config.hidden_size)
        self.act = ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class _Block(nn.Module):
    def __init__(self, config: VisionEncoderConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.attn = _Attention(config)
        self.mlp = _Mlp(config)

    def forward(self, x, cos, sin, frames):
        x = x + self.attn(self.norm1(x), cos, sin, frames)
        return x + self.mlp(self.norm2(x))


class _Merger(nn.Module):
    def __init__(self, config: VisionEncoderConfig, postshuffle: bool):
        super().__init__()
        self.width = config.hidden_size * config.spatial_merge_size**2
        self.postshuffle = postshuffle
        self.ln_q = nn.LayerNorm(self.width if postshuffle else config.hidden_size, eps=1e-6)
        self.mlp = nn.ModuleList(
            [
                nn.Linear(self.width, self.width),
                nn.GELU(),
                nn.Linear(self.width, config.out_hidden_size),
            ]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ln_q(x.reshape(-1, self.width)) if self.postshuffle else self.ln_q(x)
        x = x.reshape(-1, self.width)
        for layer in self.mlp:
            x = layer(x)
        return x


class _PatchEmbed(nn.Module):
    def __init__(self, config: VisionEncoderConfig):
        super().__init__()
        kernel = (config.temporal_patch_size, config.patch_size, config.patch_size)
        self.proj = nn.Conv3d(config.in_channels, config.hidden_size, kernel, stride=kernel)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight.reshape(self.proj.weight.shape[0], -1)
        return F.linear(patches.to(weight.dtype), weight, self.proj.bias)


class Qwen3VisionEncoder(nn.Module):
    """The vision tower (module docstring); parameters under transformers' names, so
    ``load_state_dict`` takes the ``thinker.visual.*`` tensors with the prefix removed."""

    def __init__(self, config: VisionEncoderConfig):
        super().__init__()
        self.config = config
        self.patch_embed = _PatchEmbed(config)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size)
        self.blocks = nn.ModuleList(_Block(config) for _ in range(config.depth))
        self.merger = _Merger(config, postshuffle=False)
        self.merger_list = nn.ModuleList(
            _Merger(config, postshuffle=True) for _ in config.deepstack_visual_indexes
        )
        quarter = config.head_dim // 4
        inv = 1.0 / (config.rope_theta ** (torch.arange(0, 2 * quarter, 2).float() / (2 * quarter)))
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(
        self, patches: torch.Tensor, grids: Sequence[tuple[int, int, int]]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Merged rows ``[sum(t * h * w) / merge**2, out_hidden_size]`` and the deepstack
        features (one such tensor per ``deepstack_visual_indexes``) of the items' patches
        ``[sum(t * h * w), 3 * temporal_patch * patch**2]`` (items in order, grids ``(t, h,
        w)``).

        Raises:
            ValueError: patch rows that do not match the grids.
        """
        cfg = self.config
        total = sum(t * h * w for t, h, w in grids)
        if patches.ndim != 2 or patches.shape[0] != total:
            raise ValueError(f"{tuple(patches.shape)} patches for grids {list(grids)}")
        x = self.patch_embed(patches)
        pos, rows, cols = [], [], []
        side = int(cfg.num_position_embeddings**0.5)
        table = self.pos_embed.weight.view(side, side, -1).permute(2, 0, 1)[None]
        for t, h, w in grids:
            grid = F.interpolate(table.float(), size=(h, w), mode="bilinear", align_corners=True)
            r, c = merge_order(h, w, cfg.spatial_merge_size)
            pos.append(grid[0][:, r, c].T.repeat(t, 1))
            rows.append(r.repeat(t))
            cols.append(c.repeat(t))
        x = x + torch.cat(pos).to(x.dtype)
        device = x.device
        r = torch.cat(rows).to(device)[:, None].float() * self.inv_freq
        c = torch.cat(cols).to(device)[:, None].float() * self.inv_freq
        angles = torch.cat([r, c, r, c], dim=-1)
        cos, sin = angles.cos(), angles.sin()
        frames = [h * w for t, h, w in grids for _ in range(t)]  # attention segments
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, frames)
            if i in cfg.deepstack_visual_indexes:
                deepstack.append(self.merger_list[cfg.deepstack_visual_indexes.index(i)](x))
        return self.merger(x), deepstack
