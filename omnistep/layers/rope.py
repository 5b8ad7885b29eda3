"""Rotary position embeddings, Llama's default rope ("rotate_half" convention). Imports torch only.

Formulas follow transformers' models/llama/modeling_llama.py: ``inv_freq = 1 / theta **
(arange(0, head_dim, 2) / head_dim)`` (``compute_default_rope_parameters``), ``freqs = position *
inv_freq`` and ``emb = cat(freqs, freqs)`` (``LlamaRotaryEmbedding.forward``), ``x * cos +
rotate_half(x) * sin`` (``apply_rotary_pos_emb``). Angles are computed in float32 and the cos/sin
are cast to the activation dtype, as there. ``Llama3RopeScaling`` rescales the inverse
frequencies as Llama 3.1 does (transformers' ``_compute_llama3_parameters`` in
modeling_rope_utils.py; config ``rope_scaling`` / ``rope_parameters``, ``rope_type: "llama3"``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch import nn


@functools.lru_cache(maxsize=32)
def rope_inv_freq(head_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` float32, memoised per (head_dim, theta, device).

    Computed on the CPU (as transformers does at init) and copied to ``device``; the returned
    tensor is shared, so callers must not modify it in place.
    """
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"head_dim must be a positive even number, got {head_dim}")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
    return (1.0 / (theta**exponents)).to(device)


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1's frequency-dependent rope rescaling (config ``rope_type: "llama3"``).

    Wavelengths longer than ``original_max_position_embeddings / low_freq_factor`` are divided
    by ``factor``, shorter than ``.../ high_freq_factor`` kept, and those between interpolated
    smoothly; the attention scale is unchanged (attention factor 1).

    Attributes: the config keys of the same names.
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        if not self.factor > 0 or not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(f"bad llama3 rope scaling {self}")
        if self.original_max_position_embeddings <= 0:
            raise ValueError("original_max_position_embeddings must be > 0")

    def apply(self, inv_freq: torch.Tensor) -> torch.Tensor:
        """Rescaled inverse frequencies ``[head_dim // 2]`` float32 of default ones."""
        old = self.original_max_position_embeddings
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old / self.low_freq_factor, inv_freq / self.factor, inv_freq)
        smooth = (old / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        medium = (wavelen >= old / self.high_freq_factor) & (wavelen <= old / self.low_freq_factor)
        return torch.where(medium, smoothed, scaled)


@dataclass(frozen=True)
class LongRopeScaling:
    """MiniCPM's LongRoPE (config ``rope_scaling`` with ``long_factor`` / ``short_factor``;
    upstream ``voxcpm/modules/minicpm4/model.py: MiniCPMLongRoPE``).

    Each frequency is divided by its extension factor (``long_factor`` when the table covers
    more than ``original_max_position_embeddings`` positions, else ``short_factor``), and cos
    and sin are multiplied by the attention factor ``sqrt(1 + ln(max / original) /
    ln(original))`` (with ``max`` = ``max_position_embeddings``; 1 when they are equal).

    Attributes: the config keys of the same names (``max_position_embeddings`` from the model's
    config, which upstream uses to pick the factors, whatever the sequence length).
    """

    long_factor: tuple[float, ...]
    short_factor: tuple[float, ...]
    original_max_position_embeddings: int
    max_position_embeddings: int

    def __post_init__(self) -> None:
        if len(self.long_factor) != len(self.short_factor):
            raise ValueError("long_factor and short_factor differ in length")
        if min(self.original_max_position_embeddings, self.max_position_embeddings) <= 1:
            raise ValueError(f"bad LongRoPE position counts in {self}")

    @property
    def factors(self) -> tuple[float, ...]:
        long = self.max_position_embeddings > self.original_max_position_embeddings
        return self.long_factor if long else self.short_factor

    @property
    def attention_factor(self) -> float:
        old = self.original_max_position_embeddings
        return math.sqrt(1 + math.log(self.max_position_embeddings / old) / math.log(old))

    def angles(self, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
        """``[N, head_dim // 2]`` angles of float ``positions`` ``[N]``: ``(p / ext) * inv_freq``
        in upstream's order of operations."""
        if len(self.factors) != inv_freq.shape[0]:
            raise ValueError(
                f"LongRoPE has {len(self.factors)} factors for head_dim {2 * inv_freq.shape[0]}"
            )
        ext = torch.tensor(self.factors, dtype=torch.float32, device=inv_freq.device)
        return torch.outer(positions, 1.0 / ext) * inv_freq


def rope_cos_sin(
    positions: torch.Tensor,
    head_dim: int,
    theta: float,
    dtype: torch.dtype,
    device: torch.device | str,
    scaling: Llama3RopeScaling | LongRopeScaling | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of each position's rotation angles.

    Args:
        positions: LongTensor ``[N]`` of absolute token positions.
        scaling: Llama 3.1's rescaling of the frequencies, MiniCPM's LongRoPE (frequencies
            divided by per-dimension factors, cos/sin times its attention factor), or None
            (the default rope).

    Returns:
        ``(cos, sin)``, each ``[N, head_dim]`` in ``dtype``; both halves of the last dimension
        repeat the same ``head_dim // 2`` angles.
    """
    device = torch.device(device)
    inv_freq = rope_inv_freq(head_dim, float(theta), device)
    if isinstance(scaling, LongRopeScaling):
        freqs = scaling.angles(positions.to(device).float(), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        factor = scaling.attention_factor
        return (emb.cos() * factor).to(dtype), (emb.sin() * factor).to(dtype)
    if scaling is not None:
        inv_freq = scaling.apply(inv_freq)
    freqs = positions.to(device)[:, None].float() * inv_freq  # [N, head_dim // 2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [N, head_dim]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` over the halves of the last dimension."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate queries ``[N, H, D]`` and keys ``[N, Hkv, D]`` by per-token cos/sin ``[N, D]``."""
    cos = cos.unsqueeze(1)  # [N, 1, D]: broadcast over heads
    sin = sin.unsqueeze(1)
    q_rotated = (q * cos) + (rotate_half(q) * sin)
    k_rotated = (k * cos) + (rotate_half(k) * sin)
    return q_rotated, k_rotated


class RotaryEmbedding(nn.Module):
    """A precomputed cos/sin table for positions ``[0, max_positions)``, looked up by position.

    The table is a non-persistent float32 buffer (absent from ``state_dict``); it follows the
    module's device. Looking rows up, rather than computing angles per batch, makes a token's
    cos/sin independent of the other tokens in the batch.

    Args:
        head_dim: rotated dimension per head (even).
        theta: rope base.
        max_positions: table length; positions must be below it.
        scaling: Llama 3.1's frequency rescaling, MiniCPM's LongRoPE, or None.
    """

    def __init__(
        self,
        head_dim: int,
        theta: float,
        max_positions: int,
        device: torch.device | str | None = None,
        scaling: Llama3RopeScaling | LongRopeScaling | None = None,
    ):
        super().__init__()
        if max_positions <= 0:
            raise ValueError(f"max_positions must be > 0, got {max_positions}")
        self.head_dim = head_dim
        self.theta = float(theta)
        positions = torch.arange(max_positions)
        cos, sin = rope_cos_sin(positions, head_dim, self.theta, torch.float32, "cpu", scaling)
        self.register_buffer("cos_cached", cos.to(device), persistent=False)
        self.register_buffer("sin_cached", sin.to(device), persistent=False)

    @property
    def max_positions(self) -> int:
        return self.cos_cached.shape[0]

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` ``[N, head_dim]`` in ``dtype`` for LongTensor ``positions`` ``[N]``."""
        cos = self.cos_cached.index_select(0, positions)
        sin = self.sin_cached.index_select(0, positions)
        return cos.to(dtype), sin.to(dtype)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, theta={self.theta}, max_positions={self.max_positions}"


class MRotaryEmbedding(RotaryEmbedding):
    """Multimodal rope (M-RoPE) of Qwen2-VL / Qwen2.5-Omni: the ``head_dim // 2`` frequencies
    are cut by ``mrope_section`` into (temporal, height, width) sections, each taking its angle
    from that row of three-row positions; the layout repeats over both halves of the head
    (transformers' ``Qwen2_5OmniRotaryEmbedding`` + ``apply_multimodal_rotary_pos_emb``).

    Values are looked up in the same table as ``RotaryEmbedding`` (a column of row ``r`` is
    that position's 1-D cos/sin), so three equal rows give exactly the 1-D rope of that
    position: a text-only prompt is bit-identical either way.

    Interleaved (Qwen3-VL / Qwen3-Omni, ``rope_parameters.mrope_interleaved``; transformers'
    ``Qwen3OmniMoeThinkerTextRotaryEmbedding.recomposition_frequencies``): frequency ``j`` takes
    the height row when ``j % 3 == 1`` and ``j < 3 * mrope_section[1]``, the width row when
    ``j % 3 == 2`` and ``j < 3 * mrope_section[2]``, else the temporal row.

    Args:
        mrope_section: frequencies per section, summing to ``head_dim // 2``.
        interleaved: the interleaved layout above instead of contiguous sections.

    Raises:
        ValueError: sections that do not sum to ``head_dim // 2``.
    """

    def __init__(
        self,
        head_dim: int,
        theta: float,
        max_positions: int,
        mrope_section: tuple[int, ...],
        device: torch.device | str | None = None,
        interleaved: bool = False,
    ):
        super().__init__(head_dim, theta, max_positions, device)
        if sum(mrope_section) * 2 != head_dim:
            raise ValueError(
                f"mrope_section={mrope_section} must sum to head_dim/2 = {head_dim // 2}"
            )
        self.mrope_section = tuple(int(s) for s in mrope_section)
        if interleaved:
            rows = torch.zeros(head_dim // 2, dtype=torch.long)
            for row in (1, 2):
                rows[row : 3 * self.mrope_section[row] : 3] = row
        else:
            rows = torch.repeat_interleave(
                torch.arange(len(mrope_section)), torch.tensor(self.mrope_section)
            )
        # column j of cos/sin takes its angle from position row ``section_rows[j]``
        self.register_buffer("section_rows", torch.cat([rows, rows]).to(device), persistent=False)

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` ``[N, head_dim]`` in ``dtype`` for LongTensor positions ``[N]`` (1-D
        rope) or ``[len(mrope_section), N]`` (one row per section)."""
        if positions.ndim == 1:
            return super().forward(positions, dtype)
        num = positions.shape[1]
        index = self.section_rows.view(1, 1, -1).expand(1, num, -1)  # [1, N, head_dim]
        cos = self.cos_cached[positions].gather(0, index)[0]  # [R, N, D] -> [N, D]
        sin = self.sin_cached[positions].gather(0, index)[0]
        return cos.to(dtype), sin.to(dtype)
