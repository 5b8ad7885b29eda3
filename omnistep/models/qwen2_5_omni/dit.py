"""Qwen2.5-Omni token2wav's DiT: the flow-matching ODE that turns codec tokens into a log-mel.

Our torch implementation of transformers' ``Qwen2_5OmniToken2WavDiTModel`` (transformers 5.24,
``models/qwen2_5_omni/modeling_qwen2_5_omni.py``), cut into the pieces a step-level runtime
schedules: every solver step of the ODE is one call (``DiT.ode_step``) that batches any number of
requests::

    codes   [B, T]            int64 codec tokens (talker output, ids < num_embeds + 1)
      -> DiT.initial_state     noise [B, 2T, mel_dim] + conditioning computed once per request:
                               speaker encoder (ECAPA-TDNN, layers/ecapa_tdnn.py) of ref_mel,
                               codec embedding (each token -> ``repeats`` = 2 mel frames),
                               speaker vector ``cond``
      -> DiT.ode_step x 9      one fixed-step RK4 (3/8 rule) step of the flow-matching ODE,
                               4 velocity evaluations, each a DiT forward on the cond row and
                               the unconditional row (classifier-free guidance)
      -> DiT.finalize          log-mel [B, mel_dim, 2T], 100 frames per second

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

State-dict names equal upstream's ``code2wav_dit_model.*`` (without that prefix).

The solver math (time schedule, the RK4 3/8 step, guidance, the SDE step and its log-prob,
the noise draws) is the runner plane's ``omnistep.runners.flow_matching``; this module holds
the DiT that evaluates the velocity, its ODE state and batching.

Imports: torch, ``omnistep.layers``, ``omnistep.loops.denoise`` (``Window``),
``omnistep.runners.flow_matching`` (no transformers at run time).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from omnistep.core.config_fields import check_positive_ints, known_fields
from omnistep.layers.ecapa_tdnn import SpeakerEncoder
from omnistep.layers.linear import PackedLinear
from omnistep.loops.denoise import Window
from omnistep.runners.flow_matching import (
    FlowStep,
    SolverConfig,
    gaussian_logprob,
    guided_velocity,
    rk4_38_delta,
    sde_mean,
    sde_noise,
    sde_terms,
)

DEFAULT_ROPE_THETA = 10000.0

# ----------------------------------------------------------------------------------------- config


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
        check_positive_ints(
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
        values = known_fields(cls, raw)
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


ChunkWindow = Window
"""One chunk of streamed token2wav, in utterance mel frames (``repeats`` per code): the DiT
integrates the whole ODE on ``[start, end)`` (left context, the chunk, look-ahead) and keeps
``[out_start, out_end)``; ``start`` and ``out_start`` lie on the block grid. The denoise loop's
``Window``."""


CHUNK_FRAMES = 144
"""Mel frames of a streamed DiT chunk by default (1.44 s: 6 official blocks of 24)."""


@dataclass(frozen=True)
class DiTChunking:
    """The chunk schedule of streamed token2wav, in whole DiT attention blocks.

    Chunk ``k`` outputs frames ``[s_k, s_k + n_k)`` with ``n_0 = first_chunk_blocks`` blocks
    (None: see ``covering``) and ``n_k = chunk_blocks`` after (None: ``CHUNK_FRAMES``' worth;
    the last chunk ends with the utterance); the DiT runs the whole ODE on the chunk plus
    ``left_context_blocks`` before it and ``lookahead_blocks`` after it (cut at the utterance's
    ends) and keeps the chunk. The schedule depends on frame positions only, never on timing, so
    streamed and non-streamed responses run the same windows. A chunk can start once the codes
    up to its window's end exist (or the codes are complete).

    One DiT forward reaches ``len(look_backward_layers)`` blocks back and
    ``len(look_ahead_layers)`` ahead (one each per such layer, ``DiTAttention``'s block mask);
    an RK4 step evaluates the DiT 4 times in sequence and the solver takes ``num_steps - 1``
    steps, so the output of a frame depends on inputs up to ``4 (num_steps - 1)`` times those
    reaches away: ``exact`` gives that setting, at which chunked equals whole up to float
    rounding (72 blocks back, 36 ahead for the official model: 17 s and 8.6 s). Smaller
    settings trade exactness for latency. The defaults, from ``bench/dit_joins.py`` (a
    full-width DiT with random weights, 150 codes): 2 blocks of past and 1 of future
    (upstream's streaming ``Qwen2Code2wav``; less of either costs 30-55 dB), the first chunk
    sized for BigVGAN's first chunk and look-ahead (20 + 34 frames: 3 official blocks, 48 codes
    before the first audio), later chunks of ``CHUNK_FRAMES`` (6 official blocks: the same
    error per join as 3, DiT work 1.48x the whole decode's instead of 1.92x; sized in frames so
    a checkpoint with small blocks does not run many tiny windows): near joins max 2.9e-4 in a
    mel of std 1.8, elsewhere 2e-6, 96-98 dB SNR in the wave.
    """

    first_chunk_blocks: int | None = None
    """None: ``chunk_blocks``, or, in the card, the fewest blocks that hold the vocoder's first
    chunk and its look-ahead (``covering``), so the first DiT chunk alone makes first audio."""
    chunk_blocks: int | None = None
    """None: the fewest blocks holding ``CHUNK_FRAMES`` (1.44 s; 6 official blocks)."""
    left_context_blocks: int = 2
    lookahead_blocks: int = 1

    def __post_init__(self) -> None:
        for name in ("first_chunk_blocks", "chunk_blocks"):
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"DiTChunking.{name} must be an int >= 1, got {value!r}")
        for name in ("left_context_blocks", "lookahead_blocks"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"DiTChunking.{name} must be an int >= 0, got {value!r}")

    @classmethod
    def exact(
        cls, config: DiTConfig, solver: SolverConfig | None = None, chunk_blocks: int = 3
    ) -> DiTChunking:
        """The context and look-ahead at which chunks equal the whole decode up to rounding:
        the ODE's whole receptive field (see the class docstring)."""
        solver = solver or SolverConfig()
        layers = range(config.num_hidden_layers)
        evaluations = 4 * (solver.num_steps - 1)
        back = sum(1 for i in config.look_backward_layers if i in layers)
        ahead = sum(1 for i in config.look_ahead_layers if i in layers)
        return cls(chunk_blocks, chunk_blocks, evaluations * back, evaluations * ahead)

    def covering(self, frames: int, block_size: int) -> DiTChunking:
        """This schedule for blocks of ``block_size`` frames, every size set: a None
        ``first_chunk_blocks`` becomes the fewest blocks holding ``frames`` mel frames (at
        least one; a vocoder that needs ``frames`` frames for its first chunk, BigVGAN's first
        chunk plus its look-ahead, then starts on the first DiT chunk), a None
        ``chunk_blocks`` the fewest holding ``CHUNK_FRAMES``."""
        first = self.first_chunk_blocks or max(1, -(-frames // block_size))
        return replace(self, first_chunk_blocks=first, chunk_blocks=self.chunk_size(block_size))

    def chunk_size(self, block_size: int) -> int:
        """Blocks of every chunk after the first (``chunk_blocks``, or ``CHUNK_FRAMES``'s)."""
        return self.chunk_blocks or max(1, -(-CHUNK_FRAMES // block_size))

    def next_window(
        self, out_start: int, available: int, complete: bool, block_size: int
    ) -> ChunkWindow | None:
        """The window of the chunk that outputs from frame ``out_start`` (a chunk boundary),
        or None while its codes are missing (``available`` frames exist; ``complete``: no more
        will come) or when ``out_start`` is the end of a complete utterance."""
        if complete and out_start >= available:
            return None
        chunk = self.chunk_size(block_size)
        blocks = (self.first_chunk_blocks or chunk) if out_start == 0 else chunk
        out_end = out_start + blocks * block_size
        end = out_end + self.lookahead_blocks * block_size
        if complete:
            out_end, end = min(out_end, available), min(end, available)
        elif end > available:
            return None
        start = max(0, out_start - self.left_context_blocks * block_size)
        return ChunkWindow(start, out_start, out_end, end)

    def windows(self, frames: int, block_size: int) -> list[ChunkWindow]:
        """Every window of a complete utterance of ``frames`` mel frames, in order."""
        out, start = [], 0
        while (window := self.next_window(start, frames, True, block_size)) is not None:
            out.append(window)
            start = window.out_end
        return out


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

    def forward(
        self, num_frames: int, dtype: torch.dtype, offset: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[1, num_frames, head_dim]`` for positions offset..offset+num_frames-1."""
        positions = torch.arange(offset, offset + num_frames, device=self.inv_freq.device)[None, :]
        freqs = positions[..., None].float() * self.inv_freq.to(dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _apply_rope_head0(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q``, ``k`` ``[R, H, N, head_dim]`` with head 0 de-interleaved (the checkpoint's
    interleaved RoPE layout) and rotated half, as ``DiTAttention.forward``; the other heads
    as they are. New tensors (not in place), so autograd can run through it (``score``)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    q0 = torch.cat((q[:, :1, ..., 0::2], q[:, :1, ..., 1::2]), dim=-1)
    k0 = torch.cat((k[:, :1, ..., 0::2], k[:, :1, ..., 1::2]), dim=-1)
    q = torch.cat(((q0 * cos) + (_rotate_half(q0) * sin), q[:, 1:]), dim=1)
    k = torch.cat(((k0 * cos) + (_rotate_half(k0) * sin), k[:, 1:]), dim=1)
    return q, k


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
        """``x`` ``[R, N, hidden]``, ``mask`` ``[R, H, N, N]``, bool (True = attend) or
        additive float (0 or -inf; the same result, and SDPA skips converting it) -> same
        shape as x."""
        r = x.shape[0]
        q = self.to_q(x).view(r, -1, self.heads, self.head_dim).transpose(1, 2)
        k = self.to_k(x).view(r, -1, self.heads, self.head_dim).transpose(1, 2)
        v = self.to_v(x).view(r, -1, self.heads, self.head_dim).transpose(1, 2)
        q, k = _apply_rope_head0(q, k, *rope)
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

    def time_input(self, emb: torch.Tensor) -> torch.Tensor:
        """Time embedding ``emb`` ``[R, dim]`` -> ``linear(silu(emb))`` ``[R, 6 * dim]`` (it
        depends on the time only: ``DiT.time_conditioning`` keeps it)."""
        return self.linear(self.silu(emb))

    def forward(self, x: torch.Tensor, mod: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``x`` ``[R, N, dim]``, ``mod`` = ``time_input(emb)`` ``[R, 6 * dim]`` (upstream
        computes it inside: the same expressions)."""
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = torch.chunk(mod, 6, dim=1)
        x = self.norm(x) * (1 + scale_msa[:, None]) + shift_msa[:, None]
        return x, gate_msa, shift_mlp, scale_mlp, gate_mlp


class AdaLayerNormZeroFinal(nn.Module):
    """``Qwen2_5_OmniAdaLayerNormZero_Final``: LayerNorm with time scale and shift."""

    def __init__(self, dim: int):
        super().__init__()
        self.silu = nn.SiLU()
        self.linear = PackedLinear(dim, dim * 2)
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)

    def time_input(self, emb: torch.Tensor) -> torch.Tensor:
        """Time embedding ``emb`` ``[R, dim]`` -> ``linear(silu(emb))`` ``[R, 2 * dim]``."""
        return self.linear(self.silu(emb))

    def forward(self, x: torch.Tensor, mod: torch.Tensor) -> torch.Tensor:
        """``x`` ``[R, N, dim]``, ``mod`` = ``time_input(emb)`` ``[R, 2 * dim]``."""
        scale, shift = torch.chunk(mod, 2, dim=1)
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
        mod: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """``x`` ``[R, N, hidden]``; ``mod`` ``[R, 6 * hidden]``: ``attn_norm.linear`` of
        SiLU(time embedding) (``DiT.time_conditioning``); ``mask``: additive float
        ``[R, H, N, N]`` (0 = attend, -inf = not)."""
        norm, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.attn_norm(x, mod)
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
    offset: int = 0
    """Utterance frame index of ``x[:, 0]``: 0 for a whole utterance, a chunk window's first
    frame (a multiple of ``block_size``) when streaming; RoPE positions start there."""
    noise_level: float = 0.0
    """The SDE's noise scale ``a`` (``FlowSDE``); 0 integrates the ODE."""
    sde_seed: int = 0
    """Seeds the SDE's noise (``sde_noise``)."""
    last: FlowStep | None = None
    """The SDE transition that made this state (None at the start and for the ODE)."""

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
    masks: list[torch.Tensor]  # per layer, additive float [R_model, H, N, N]
    rope: tuple[torch.Tensor, torch.Tensor]  # cos, sin [1 or R_model, N, head_dim]


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
        offset: int = 0,
        noise_level: float = 0.0,
        sde_seed: int = 0,
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
            offset: the utterance frame of ``codes[:, 0]``'s first mel frame when ``codes`` is
                a chunk window (``DiTChunking``): a multiple of ``block_size``, so the window's
                attention blocks are the utterance's; RoPE positions start there.
            noise_level: the SDE's ``a`` (``sde_terms``; each step then records a
                ``FlowStep`` in the new state's ``last``); 0 integrates the ODE.
            sde_seed: seeds the SDE noise (``sde_noise``; row ``i`` of B uses
                ``sde_seed + i``).

        Raises:
            ValueError: bad codes, noise shape, or an offset off the block grid.
        """
        solver = solver or SolverConfig()
        if offset < 0 or offset % self.config.block_size:
            raise ValueError(
                f"offset must be a non-negative multiple of block_size "
                f"({self.config.block_size}), got {offset}"
            )
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
            offset=offset,
            noise_level=float(noise_level),
            sde_seed=int(sde_seed),
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
        means = self._step_means(list(states))
        out = []
        for s, mean in zip(states, means, strict=True):
            if s.noise_level <= 0:
                out.append(replace(s, x=mean, step=s.step + 1, last=None))
                continue
            _, std = sde_terms(s.times, s.step, s.noise_level)
            end = s.offset + s.num_frames
            eps = torch.stack(
                [
                    sde_noise(
                        s.sde_seed + row,
                        s.step,
                        s.offset,
                        end,
                        self.config.block_size,
                        self.config.mel_dim,
                    )
                    for row in range(s.batch_size)
                ]
            ).to(mean.device, mean.dtype)
            x_next = mean + std * eps
            record = FlowStep(
                step=s.step,
                t=float(s.times[s.step]),
                t_next=float(s.times[s.step + 1]),
                x=s.x.float().cpu(),
                mean=mean.float().cpu(),
                std=std,
                x_next=x_next.float().cpu(),
                logprob=gaussian_logprob(x_next, mean, std).cpu(),
                offset=s.offset,
            )
            out.append(replace(s, x=x_next, step=s.step + 1, last=record))
        return out

    def _step_means(self, states: list[ODEState]) -> list[torch.Tensor]:
        """Each state's next ODE value (noise level 0) or SDE transition mean, ``[B, frames,
        mel_dim]``; differentiable when called with grad enabled (``step_logprob``)."""
        batch = self._step_batch(states)
        frames = batch.features.shape[1]
        y0 = torch.cat([_pad_frames(s.x, frames) for s in states])  # [R, N, mel_dim]
        t0 = torch.cat([s.times[s.step].expand(s.batch_size) for s in states])  # [R]
        t1 = torch.cat([s.times[s.step + 1].expand(s.batch_size) for s in states])
        dt = t1 - t0
        delta, k1 = self._rk4_delta(batch, t0, dt, t1, y0)
        y1 = y0 + delta
        means = []
        for s, (a, b) in zip(states, batch.row_ranges, strict=True):
            mean = y1[a:b, : s.num_frames]
            if s.noise_level > 0:  # the SDE's drift correction (``sde_terms``)
                drift, _ = sde_terms(s.times, s.step, s.noise_level)
                t, k, x = s.times[s.step], k1[a:b, : s.num_frames], y0[a:b, : s.num_frames]
                mean = sde_mean(mean, drift, t, k, x)
            means.append(mean)
        return means

    def step_logprob(
        self,
        codes: torch.Tensor,
        cond: torch.Tensor,
        ref_mel: torch.Tensor,
        record: FlowStep,
        noise_level: float,
        solver: SolverConfig | None = None,
    ) -> torch.Tensor:
        """A recorded SDE step's log-prob recomputed (train = serve): the window's
        conditioning and the step's mean by the same code as serving (``_step_means``), with
        autograd on when the caller's grad mode is (no ``inference_mode``), then
        ``gaussian_logprob(record.x_next; mean, record.std)``.

        Args:
            codes: int ``[B, n]`` the window's codec ids; ``cond``, ``ref_mel``: the voice, as
                ``initial_state`` takes them.
            record: the ``FlowStep`` serving recorded.
            noise_level: the request's ``a``.
            solver: the schedule serving used.

        Returns:
            float64 ``[B]``, with a graph to the DiT's weights when grad is enabled.
        """
        solver = solver or SolverConfig()
        codes = self._check_codes(codes)
        b = codes.shape[0]
        cond = cond.to(self.device, self.dtype).expand(b, -1)
        ref_mel = ref_mel.to(self.device, self.dtype).expand(b, -1, -1)
        state = ODEState(
            x=record.x.to(self.device, self.dtype),
            features=self._conditioning(codes, cond, ref_mel, solver.guided),
            times=solver.time_points(self.dtype, self.device),
            guidance_scale=float(solver.guidance_scale),
            step=record.step,
            offset=record.offset,
            noise_level=noise_level,
        )
        (mean,) = self._step_means([state])
        return gaussian_logprob(record.x_next.to(self.device), mean, record.std)

    def _rk4_delta(
        self,
        batch: _StepBatch,
        t0: torch.Tensor,
        dt: torch.Tensor,
        t1: torch.Tensor,
        y0: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``RungeKutta4ODESolver._rk4_step`` with per-row times (same expressions, same order):
        the step's increment and ``k1``, the velocity at its start."""
        return rk4_38_delta(lambda t, y: self._velocity(batch, t, y), t0, dt, t1, y0)

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
                part = guided_velocity(*torch.chunk(part, 2, dim=0), s.guidance_scale)
            result.append(part)
        return torch.cat(result)

    def forward(self, x: torch.Tensor, t: torch.Tensor, batch: _StepBatch) -> torch.Tensor:
        """One DiT evaluation (``Qwen2_5OmniToken2WavDiTModel.forward`` after its embeddings).

        ``x`` ``[R, N, mel_dim]`` noisy mel and ``t`` ``[R]`` times of the rows of
        ``batch.features`` ``[R, N, cond_features]`` -> predicted velocity ``[R, N, mel_dim]``.
        """
        mods, final = self.time_conditioning(t)
        h = self.input_embed(x, batch.features)
        for block, mod, mask in zip(self.transformer_blocks, mods, batch.masks, strict=True):
            h = block(h, mod, batch.rope, mask)
        return self.proj_out(self.norm_out(h, final))

    def time_conditioning(self, t: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        """What the times ``t`` ``[R]`` feed into the blocks: per block its AdaLN-zero input
        ``attn_norm.linear(silu(time_embed(t)))`` ``[R, 6 * hidden]``, and ``norm_out``'s
        ``[R, 2 * hidden]``. They depend on t alone, so they are computed once per distinct
        time (a 1-row batch each, whatever R, so a row's values never depend on the batch)
        and, without autograd, kept until a weight they read changes (``PackedLinear``
        version keys): an RK4 solve of 10 points evaluates 36 times, the same for every
        request, and this was 7 GEMMs and ~25 small ops of each of its DiT forwards. With
        autograd on (``step_logprob``) the same per-time values are recomputed, with a graph.
        """
        values = t.tolist()
        distinct = list(dict.fromkeys(values))
        cache = None if torch.is_grad_enabled() else self._time_cache()
        per_time = []
        for value in distinct:
            got = None if cache is None else cache.get(value)
            if got is None:
                one = torch.tensor([value], dtype=t.dtype, device=t.device)
                temb = self.time_embed(one)
                got = [b.attn_norm.time_input(temb) for b in self.transformer_blocks]
                got.append(self.norm_out.time_input(temb))
                if cache is not None:
                    cache[value] = got
            per_time.append(got)
        rows = len(values)
        if len(distinct) == 1:
            out = [m.expand(rows, -1) for m in per_time[0]]
        else:
            index = torch.tensor([distinct.index(v) for v in values], device=t.device)
            out = [
                torch.cat([p[i] for p in per_time]).index_select(0, index)
                for i in range(len(per_time[0]))
            ]
        return out[:-1], out[-1]

    def _time_cache(self) -> dict[float, list[torch.Tensor]]:
        """``time_conditioning``'s kept values, emptied when a weight they read changed (its
        version key: the tensor, its storage, its in-place version) or after 256 times."""
        linears = [self.time_embed.time_mlp[0], self.time_embed.time_mlp[2], self.norm_out.linear]
        linears += [b.attn_norm.linear for b in self.transformer_blocks]
        key = tuple(m.version_key() for m in linears)
        cache = self.__dict__.get("_time_values")
        if cache is None or cache[0] != key or len(cache[1]) > 256:
            cache = (key, {})
            self.__dict__["_time_values"] = cache
        return cache[1]

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
        offsets = {s.offset for s in states}
        if len(offsets) == 1:
            rope = self.rotary_embed(frames, self.dtype, offsets.pop())
        else:  # chunk windows at different places: each row its own positions
            per_state = [self.rotary_embed(frames, self.dtype, s.offset) for s in states]
            rope = tuple(
                torch.cat(
                    [
                        part[i].expand(s.model_rows, -1, -1)
                        for part, s in zip(per_state, states, strict=True)
                    ]
                )
                for i in (0, 1)
            )
        return _StepBatch(
            states=states,
            row_ranges=row_ranges,
            features=features,
            masks=self._masks(frames, features.shape[0], lengths),
            rope=rope,
        )

    def _masks(self, frames: int, rows: int, lengths: torch.Tensor | None) -> list[torch.Tensor]:
        """Per layer, additive float ``[rows, heads, N, N]`` (0 where query i may see key j,
        -inf elsewhere): query i may see key j when j's block is at
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
                # Additive, made once per step: SDPA would turn a bool mask into this in each
                # of its 4 x layers calls (bit-identical results either way).
                additive = torch.zeros(mask.shape, dtype=self.dtype, device=self.device)
                additive.masked_fill_(~mask, float("-inf"))
                cache[key] = additive.expand(rows, self.config.num_attention_heads, frames, frames)
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
        noise_level: float = 0.0,
        sde_seed: int = 0,
    ) -> torch.Tensor:
        """``initial_state``, ``ode_step`` until done, ``finalize``: mel ``[B, mel_dim, 2T]``
        (``noise_level`` > 0: the SDE sampler, see ``initial_state``)."""
        state = self.initial_state(
            codes, cond, ref_mel, noise, generator, solver, 0, noise_level, sde_seed
        )
        while not state.done:
            (state,) = self.ode_step([state])
        return self.finalize(state)

    @torch.inference_mode()
    def sample_chunked(
        self,
        codes: torch.Tensor,
        cond: torch.Tensor,
        ref_mel: torch.Tensor,
        noise: torch.Tensor,
        chunking: DiTChunking,
        solver: SolverConfig | None = None,
        noise_level: float = 0.0,
        sde_seed: int = 0,
    ) -> torch.Tensor:
        """The streamed decode offline: each ``chunking`` window's ODE alone, in order, and the
        chunks' frames concatenated: mel ``[B, mel_dim, 2T]``, what the ``qwen2_5_omni``
        card streams (``DiTComponent``). ``noise`` ``[B, 2T, mel_dim]`` is the utterance's
        (each window takes its rows)."""
        codes = self._check_codes(codes)
        repeats, block = self.config.repeats, self.config.block_size
        if block % repeats:
            raise ValueError(f"block_size ({block}) must be a multiple of repeats ({repeats})")
        frames = codes.shape[1] * repeats
        pieces = []
        for w in chunking.windows(frames, block):
            state = self.initial_state(
                codes[:, w.start // repeats : w.end // repeats],
                cond,
                ref_mel,
                noise[:, w.start : w.end],
                solver=solver,
                offset=w.start,
                noise_level=noise_level,
                sde_seed=sde_seed,
            )
            while not state.done:
                (state,) = self.ode_step([state])
            pieces.append(state.x[:, w.out_start - w.start : w.out_end - w.start])
        return torch.cat(pieces, dim=1).permute(0, 2, 1)


def _pad_frames(x: torch.Tensor, frames: int) -> torch.Tensor:
    """Zero-pad ``[rows, n, C]`` to ``[rows, frames, C]`` (no copy when n == frames)."""
    return x if x.shape[1] == frames else F.pad(x, (0, 0, 0, frames - x.shape[1]))
