"""S3Gen's speech tokenizer: a 16 kHz clip's 128-bin log mel -> 25 Hz speech tokens (6561 ids).

CosyVoice 2's supervised semantic tokenizer ``speech_tokenizer_v2_25hz`` (Du et al., arXiv
2412.10117) as the ``s3tokenizer`` package's ``S3TokenizerV2`` (0.3.0; published sizes in its
``ModelConfig``: width 1280, 20 heads of 64, 6 blocks) defines it, which Chatterbox subclasses
(``chatterbox/models/s3tokenizer``) and stores under ``tokenizer.`` of ``s3gen.safetensors``:

1. two convolutions (kernel 3, stride 2, padding 1), each followed by GELU: 100 Hz mel frames
   -> 25 Hz;
2. blocks of pre-LayerNorm attention and a GELU MLP (4x). The attention is Whisper's (query and
   value with bias, key without; q and k each scaled by ``head_dim ** -0.25``) with rotary
   positions on q and k (theta 10000 over the 64 dims of a head, the two halves rotated:
   ``x * cos + rotate_half(x) * sin``), plus an FSMN memory: the value rows through a
   depthwise convolution (kernel 31, zero padding 15 each side) plus themselves, added to the
   attention's output projection;
3. finite scalar quantisation: a linear map to 8 dims, ``round(tanh(h) * 0.999) + 1`` in
   {0, 1, 2} per dim, the token ``sum_i d_i 3^i``.

One clip at a time (no padding mask: enrollment tokenizes one reference). Clips over 30 s
(3000 mel frames), which upstream tokenizes in overlapping windows, are refused.

Imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

HEAD_DIM = 64
ROPE_THETA = 10000.0
FSMN_KERNEL = 31
FSQ_DIMS, FSQ_LEVELS = 8, 3
FSQ_SCALE = 0.9990000128746033
MAX_MEL_FRAMES = 3000
"""Upstream's single-window limit (30 s of 100 Hz frames)."""


@dataclass(frozen=True)
class S3TokenizerConfig:
    """Sizes (published: ``ModelConfig`` of ``s3tokenizer.model_v2``).

    Attributes:
        num_mels: log-mel bins (128).
        width: model width (1280).
        num_heads: attention heads (20; heads are 64 wide).
        num_layers: blocks (6).
    """

    num_mels: int = 128
    width: int = 1280
    num_heads: int = 20
    num_layers: int = 6

    @classmethod
    def from_state_dict(cls, state: dict[str, torch.Tensor], prefix: str) -> S3TokenizerConfig:
        """Sizes read from tensors under ``prefix`` (heads = width / 64).

        Raises:
            KeyError: ``encoder.conv1.weight`` is missing (named).
        """
        name = f"{prefix}encoder.conv1.weight"
        if name not in state:
            raise KeyError(f"no tensor {name}")
        width, num_mels, _ = state[name].shape
        blocks = f"{prefix}encoder.blocks."
        layers = {k[len(blocks) :].split(".")[0] for k in state if k.startswith(blocks)}
        return cls(num_mels, width, width // HEAD_DIM, len(layers))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class FSMNAttention(nn.Module):
    """Whisper attention with rotary q/k and the FSMN memory of the values (module docstring)."""

    def __init__(self, width: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.query = nn.Linear(width, width)
        self.key = nn.Linear(width, width, bias=False)
        self.value = nn.Linear(width, width)
        self.out = nn.Linear(width, width)
        self.fsmn_block = nn.Conv1d(width, width, FSMN_KERNEL, groups=width, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x`` ``[B, T, width]``; ``cos``/``sin`` ``[T, 64]`` -> ``[B, T, width]``."""
        b, t, width = x.shape
        q, k, v = (p(x).view(b, t, self.num_heads, -1) for p in (self.query, self.key, self.value))
        cos, sin = cos[None, :, None], sin[None, :, None]
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        pad = (FSMN_KERNEL - 1) // 2
        values = v.reshape(b, t, width)
        memory = self.fsmn_block(F.pad(values.transpose(1, 2), (pad, pad))).transpose(1, 2)
        memory = memory + values
        scale = (width // self.num_heads) ** -0.25
        q = q.permute(0, 2, 1, 3) * scale  # [B, H, T, D]
        k = k.permute(0, 2, 3, 1) * scale  # [B, H, D, T]
        weights = torch.softmax((q @ k).float(), dim=-1).to(q.dtype)
        attended = (weights @ v.permute(0, 2, 1, 3)).permute(0, 2, 1, 3).flatten(2)
        return self.out(attended) + memory


class S3Block(nn.Module):
    """Pre-LayerNorm attention then a GELU MLP, each residual."""

    def __init__(self, width: int, num_heads: int):
        super().__init__()
        self.attn = FSMNAttention(width, num_heads)
        self.attn_ln = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )
        self.mlp_ln = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_ln(x), cos, sin)
        return x + self.mlp(self.mlp_ln(x))


class S3Encoder(nn.Module):
    """The convolutional front and the blocks (``tokenizer.encoder.*``)."""

    def __init__(self, config: S3TokenizerConfig):
        super().__init__()
        self.conv1 = nn.Conv1d(config.num_mels, config.width, 3, stride=2, padding=1)
        self.conv2 = nn.Conv1d(config.width, config.width, 3, stride=2, padding=1)
        self.blocks = nn.ModuleList(
            S3Block(config.width, config.num_heads) for _ in range(config.num_layers)
        )

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        """``mel`` ``[B, num_mels, T]`` -> ``[B, T', width]``, ``T' = ceil(ceil(T / 2) / 2)``."""
        x = F.gelu(self.conv2(F.gelu(self.conv1(mel)))).transpose(1, 2)
        cos, sin = rope_tables(x.shape[1], x.device)
        for block in self.blocks:
            x = block(x, cos.to(x.dtype), sin.to(x.dtype))
        return x


def rope_tables(length: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos``, ``sin`` ``[length, 64]`` float32 of the rotary positions (theta 10000; the
    32 frequencies repeated for the two halves)."""
    freqs = 1.0 / ROPE_THETA ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM)
    angles = torch.outer(torch.arange(length, dtype=torch.float32), freqs)
    angles = torch.cat([angles, angles], dim=-1).to(device)
    return angles.cos(), angles.sin()


class FSQCodebook(nn.Module):
    """``tokenizer.quantizer._codebook``: the projection of finite scalar quantisation."""

    def __init__(self, width: int):
        super().__init__()
        self.project_down = nn.Linear(width, FSQ_DIMS)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[B, T, width]`` -> ``[B, T]`` int64 tokens in ``[0, 3^8)``."""
        h = (torch.tanh(self.project_down(hidden).float()) * FSQ_SCALE).round() + 1
        powers = FSQ_LEVELS ** torch.arange(FSQ_DIMS, device=h.device, dtype=h.dtype)
        return (h * powers).sum(-1).long()


class FSQQuantizer(nn.Module):
    """Holds the codebook under upstream's name (``quantizer._codebook``)."""

    def __init__(self, width: int):
        super().__init__()
        self._codebook = FSQCodebook(width)


class S3Tokenizer(nn.Module):
    """The tokenizer; tensors of ``s3gen.safetensors`` under ``tokenizer.``.

    Args:
        config: sizes (``S3TokenizerConfig.from_state_dict``).
    """

    def __init__(self, config: S3TokenizerConfig | None = None):
        super().__init__()
        self.config = config or S3TokenizerConfig()
        self.encoder = S3Encoder(self.config)
        self.quantizer = FSQQuantizer(self.config.width)

    @torch.inference_mode()
    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        """Tokens ``[T']`` int64 of one clip's log mel ``[num_mels, T]`` (``clip_features.
        s3_log_mel``; ``T' = ceil(ceil(T / 2) / 2)``).

        Raises:
            ValueError: a mel of the wrong shape, or longer than 3000 frames (30 s).
        """
        if mel.ndim != 2 or mel.shape[0] != self.config.num_mels or mel.shape[1] == 0:
            raise ValueError(
                f"the S3 tokenizer takes a [{self.config.num_mels}, T > 0] mel, got "
                f"{tuple(mel.shape)}"
            )
        if mel.shape[1] > MAX_MEL_FRAMES:
            raise ValueError(f"the S3 tokenizer takes at most {MAX_MEL_FRAMES} mel frames (30 s)")
        weight = self.encoder.conv1.weight
        hidden = self.encoder(mel[None].to(device=weight.device, dtype=weight.dtype))
        return self.quantizer._codebook(hidden)[0]
