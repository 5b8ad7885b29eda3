"""Qwen2.5-Omni's vision encoder (``thinker.visual.*``): a ViT with 2D rotary positions, window
attention and a 2x2 patch merger, run on many images (or video frames) at once.

Mirrors transformers' ``Qwen2_5OmniVisionEncoder`` (models/qwen2_5_omni/modeling_qwen2_5_omni.py
and ``vision_utils.py``, 5.24). Input: the image processor's flattened patches ``[num_patches,
3 * temporal_patch * patch * patch]`` of all items, concatenated, with each item's grid
``(t, h, w)`` in patches (patches ordered merge-block-major, as the processor writes them).

- ``patch_embed``: a Conv3d whose kernel equals its stride, i.e. one linear map per patch.
- Rotary: axial 2D; ``head_dim / 4`` frequencies ``theta ** (-2i / (head_dim / 2))`` rotate by
  the patch row and column, laid out ``[row | col | row | col]`` over the head (rotate-half).
- Attention: blocks in ``fullatt_block_indexes`` attend within one frame of one item; the others
  within windows of ``window_size / patch / merge`` merged tokens per side. Tokens are permuted
  window-major (at merge-unit granularity) before the blocks and back after the merger.
- Blocks: pre-RMSNorm (eps 1e-6), q/k/v/proj with bias, SiLU-gated MLP with bias.
- Merger: RMSNorm, 4 neighbouring patches concatenated, Linear-GELU-Linear to the thinker width:
  one output row per ``merge ** 2`` patches.

Batching: attention segments (frames, windows) of equal length run as one batched SDPA call
(``layers.segment_attention``).

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
    """``thinker_config.vision_config`` (defaults: transformers' ``Qwen2_5OmniVisionEncoderConfig``;
    ``out_hidden_size`` is the thinker width)."""

    depth: int = 32
    hidden_size: int = 3584
    intermediate_size: int = 3420
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 14
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    window_size: int = 112
    out_hidden_size: int = 3584
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    rope_theta: float = 10000.0

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> VisionEncoderConfig:
        """From ``config.json``, its ``thinker_config`` or the ``vision_config`` itself.

        Raises:
            ValueError: an MLP activation other than SiLU (every published checkpoint's).
        """
        for key in ("thinker_config", "vision_config"):
            raw = raw.get(key, raw)
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"vision hidden_act must be 'silu', got {raw['hidden_act']!r}")
        names = [f.name for f in cls.__dataclass_fields__.values()]
        fields = {k: raw[k] for k in names if raw.get(k) is not None}
        if "fullatt_block_indexes" in fields:
            fields["fullatt_block_indexes"] = tuple(fields["fullatt_block_indexes"])
        theta = (raw.get("rope_parameters") or {}).get("rope_theta", raw.get("rope_theta"))
        if theta is not None:
            fields["rope_theta"] = float(theta)
        return cls(**fields)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[-x2, x1]`` of the two halves of the last dim."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def patch_positions(grid_thw: Sequence[Sequence[int]], merge: int) -> torch.Tensor:
    """``[num_patches, 2]`` (row, column) of every patch in the processor's merge-block-major
    order, frames repeating their grid."""
    out = []
    for t, h, w in grid_thw:
        rows = torch.arange(h)[:, None].expand(h, w)
        cols = torch.arange(w)[None, :].expand(h, w)
        shape = (h // merge, merge, w // merge, merge)
        rows = rows.reshape(shape).transpose(1, 2).flatten()
        cols = cols.reshape(shape).transpose(1, 2).flatten()
        out.append(torch.stack([rows, cols], dim=-1).repeat(t, 1))
    return torch.cat(out)


def window_index(
    grid_thw: Sequence[Sequence[int]], merge: int, window_size: int, patch_size: int
) -> tuple[torch.Tensor, list[int]]:
    """The window-major order of merged tokens (``[num_patches / merge**2]``) and the window
    lengths in patches (transformers' ``get_vision_window_index``; empty windows dropped)."""
    side = window_size // merge // patch_size
    order, lengths, offset = [], [], 0
    for t, h, w in grid_thw:
        gh, gw = h // merge, w // merge
        index = torch.arange(t * gh * gw).reshape(t, gh, gw)
        pad_h, pad_w = side - gh % side, side - gw % side
        padded = F.pad(index, (0, pad_w, 0, pad_h), value=-100)
        nh, nw = (gh + pad_h) // side, (gw + pad_w) // side
        padded = padded.reshape(t, nh, side, nw, side).permute(0, 1, 3, 2, 4)
        padded = padded.reshape(t, nh * nw, side * side)
        sizes = (padded != -100).sum(-1).flatten()
        flat = padded.flatten()
        order.append(flat[flat != -100] + offset)
        lengths.extend(int(s) * merge * merge for s in sizes if s > 0)
        offset += t * gh * gw
    return torch.cat(order), lengths


class _RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class _Block(nn.Module):
    def __init__(self, c: VisionEncoderConfig):
        super().__init__()
        d = c.hidden_size
        self.heads = c.num_heads
        self.norm1, self.norm2 = _RMSNorm(d), _RMSNorm(d)
        self.attn = nn.Module()
        for name in ("q", "k", "v", "proj"):
            setattr(self.attn, name, nn.Linear(d, d))
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(d, c.intermediate_size)
        self.mlp.up_proj = nn.Linear(d, c.intermediate_size)
        self.mlp.down_proj = nn.Linear(c.intermediate_size, d)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: Sequence[int]
    ) -> torch.Tensor:
        """``x`` ``[N, d]``; ``cos``/``sin`` ``[N, head_dim]`` float32."""
        n, d = x.shape
        h = self.norm1(x)
        q, k, v = (getattr(self.attn, p)(h).view(n, self.heads, -1) for p in ("q", "k", "v"))
        c, s = cos[:, None, :], sin[:, None, :]
        q = (q.float() * c + rotate_half(q.float()) * s).to(x.dtype)
        k = (k.float() * c + rotate_half(k.float()) * s).to(x.dtype)
        out = segment_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), lengths)
        x = x + self.attn.proj(out.transpose(0, 1).reshape(n, d))
        h = self.norm2(x)
        m = self.mlp
        return x + m.down_proj(F.silu(m.gate_proj(h)) * m.up_proj(h))


class QwenVisionEncoder(nn.Module):
    """The vision encoder (see module docstring); parameter names are the checkpoint's
    (``patch_embed.proj``, ``blocks.{l}.*``, ``merger.ln_q``, ``merger.mlp.{0,2}``)."""

    def __init__(self, config: VisionEncoderConfig):
        super().__init__()
        c = self.config = config
        kernel = (c.temporal_patch_size, c.patch_size, c.patch_size)
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv3d(
            c.in_channels, c.hidden_size, kernel, stride=kernel, bias=False
        )
        self.blocks = nn.ModuleList(_Block(c) for _ in range(c.depth))
        wide = c.hidden_size * c.spatial_merge_size**2
        self.merger = nn.Module()
        self.merger.ln_q = _RMSNorm(c.hidden_size)
        self.merger.mlp = nn.Sequential(
            nn.Linear(wide, wide), nn.GELU(), nn.Linear(wide, c.out_hidden_size)
        )
        quarter = c.head_dim // 2
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, quarter, 2, dtype=torch.float) / quarter))
        self.register_buffer("inv_freq", inv, persistent=False)

    def _rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq.to(positions.device)  # [N, 2, hd/4]
        hw = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)
        angles = torch.cat([hw, hw], dim=-1)  # [N, head_dim]
        return angles.cos(), angles.sin()

    def forward(self, patches: torch.Tensor, grid_thw: Sequence[Sequence[int]]) -> torch.Tensor:
        """Encode items.

        Args:
            patches: ``[num_patches, in_channels * temporal_patch * patch * patch]`` of every
                item, concatenated, in the module's dtype and device.
            grid_thw: per item ``(t, h, w)`` in patches (``h``, ``w`` multiples of the merge).

        Returns:
            ``[num_patches / merge**2, out_hidden_size]``: item after item, each item's rows in
            the processor's (merge-block-major) order.

        Raises:
            ValueError: ``patches`` rows do not match the grids.
        """
        c = self.config
        grids = [tuple(int(v) for v in g) for g in grid_thw]
        total = sum(t * h * w for t, h, w in grids)
        if patches.shape[0] != total:
            raise ValueError(f"{patches.shape[0]} patches for grids {grids} ({total} expected)")
        unit = c.spatial_merge_size**2
        weight = self.patch_embed.proj.weight
        x = patches.to(weight.dtype) @ weight.view(weight.shape[0], -1).T  # [N, hidden]
        order, windows = window_index(grids, c.spatial_merge_size, c.window_size, c.patch_size)
        order = order.to(x.device)

        def permute(t: torch.Tensor) -> torch.Tensor:
            return t.view(-1, unit, t.shape[-1])[order].reshape(-1, t.shape[-1])

        x = permute(x)
        cos, sin = self._rotary(patch_positions(grids, c.spatial_merge_size).to(x.device))
        cos, sin = permute(cos), permute(sin)
        frames = [h * w for t, h, w in grids for _ in range(t)]
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, frames if i in c.fullatt_block_indexes else windows)
        merged = self.merger.mlp(self.merger.ln_q(x).view(-1, c.hidden_size * unit))
        return merged[torch.argsort(order)]
