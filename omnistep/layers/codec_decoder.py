"""The causal codec decoder of Qwen3-TTS's 12 Hz speech tokenizer (a block Qwen3-Omni's
code2wav shares): codes ``[B, T, 16]`` -> 24 kHz wave, whole or in exact causal chunks.

Our torch implementation of ``Qwen3TTSTokenizerV2Decoder`` (``qwen-tts`` 0.1.1,
``qwen_tts/core/tokenizer_12hz/modeling_qwen3_tts_tokenizer_v2.py``; config class
``Qwen3TTSTokenizerV2DecoderConfig`` in ``configuration_qwen3_tts_tokenizer_v2.py``)::

    codes    [B, T, Q]       int64, Q = num_quantizers (16) codebooks per 12.5 Hz frame
      -> quantizer            split RVQ: codebook vectors ``embedding_sum / cluster_usage``
                              (usage clamped at 1e-5); codebook 0 (``rvq_first``) and the sum of
                              codebooks 1..Q-1 (``rvq_rest``), each group through its 1x1
                              ``output_proj`` -> [B, T, codebook_dim]
      -> pre_conv             causal conv, kernel 3 -> [B, T, latent_dim]
      -> pre_transformer      input_proj -> layers of (RMSNorm, attention with RoPE over a
                              sliding window of ``sliding_window`` frames, LayerScale; RMSNorm,
                              SwiGLU MLP, LayerScale) -> RMSNorm -> output_proj
      -> upsample             per ratio r of ``upsampling_ratios`` (2, 2): causal transposed conv
                              (kernel r, stride r) and a ConvNeXt block (causal depthwise k 7)
      -> decoder              causal conv k 7 to decoder_dim; per rate r of ``upsample_rates``
                              (8, 5, 4, 3): SnakeBeta, causal transposed conv (kernel 2r,
                              stride r), 3 residual units (SnakeBeta, causal conv k 7 with
                              dilation 1 / 3 / 9, SnakeBeta, conv k 1); SnakeBeta; causal conv k 7
                              to 1 channel; clamp to [-1, 1]
    wave     [B, T * hop]     float32, hop = prod(upsampling_ratios + upsample_rates) = 1920

Causality (checked against upstream's padding code): every ``Qwen3TTSTokenizerV2CausalConvNet``
pads ``(kernel - 1) * dilation`` zeros on the left only (all decoder convs have stride 1, so its
"extra padding" is 0); every ``Qwen3TTSTokenizerV2CausalTransConvNet`` pads nothing and trims
``kernel - stride`` samples on the right, so output o reads inputs i with
``o - kernel < i * stride <= o``; attention is causal within its window. Nothing reads a later
frame: a sample never depends on frames after its own, so there is no look-ahead, and a window
right-padded with any frames gives the same samples for its real frames.

Left receptive field (``CodecDecoderConfig.left_context_frames``), from the geometry alone: the
first sample of frame s depends on transformer outputs from frame ``s - conv_context_frames``
on (the conv stack: each causal conv reaches ``(kernel - 1) * dilation`` samples back at its own
rate, each transposed conv one input sample; walked back exactly, with the rounding, from sample
``s * hop``), those on transformer inputs ``num_hidden_layers * (sliding_window - 1)`` frames
further back (a window of w frames holds the frame and w - 1 before it), and those on codes 2
frames further back (pre_conv). Published config (12 Hz tokenizer: 8 layers, window 72, rates
8 5 4 3, ratios 2 2): 10 + 568 + 2 = 580 frames (46.4 s). ``decode_chunk`` given that much left
context returns the whole-utterance decode's samples; it runs the cheap transformer over the
full context but the expensive conv stack only over ``conv_context_frames`` before the chunk.
Upstream's own ``chunked_decode`` keeps 25 frames of left context, an approximation.

Streams (``decode_stream``, what the serving component runs): instead of re-reading its left
context, a stream keeps what its next chunk reads, as an AR model keeps its KV cache: every
transformer layer's keys (after RoPE) and values of its last ``sliding_window - 1`` positions,
positions continuing from the stream's first frame as in the whole decode; pre_conv's and
every causal conv's last ``(kernel - 1) * dilation`` inputs (the whole decode's zero padding
at the start); every overlapping transposed conv's last input. A chunk then computes only its
own frames, and its samples are the whole decode's within float rounding.

Qwen3-Omni's code2wav (``Qwen3OmniMoeCode2Wav``, transformers ``models/qwen3_omni_moe``) is
this decoder with ``CodecDecoderConfig.code_embedding`` (``from_code2wav``): codes enter as the
mean over codebooks of one embedding table (no quantizer, pre_conv or transformer
projections), and its transposed convs trim ``kernel - stride`` outputs on the left as well as
on the right. That left trim only delays the wave: frame s's samples start at
``s * hop - output_shift`` (555 for rates 8 5 4 3) and T frames give ``T * hop -
output_shift`` samples; it stays causal, and every reach above is walked in the trimmed
coordinates. A stream's first chunk is ``output_shift`` samples short (``StreamPass.lost``),
later chunks are ``chunk * hop``.

The conv stack (upsample, decoder) keeps its activations time-major, ``[B, T, C]``, as the
transformer does: ``layers.conv.conv1d_nwc`` runs its convs on pre-packed weights over them
without layout copies, kernel-1 convs and transposed convs are GEMMs over the ``B T`` rows, and
SnakeBeta broadcasts over the last dim (module docstring of ``layers/conv.py`` for figures).

State-dict names equal the ``decoder.*`` tensors of ``speech_tokenizer/model.safetensors``
without that prefix (``load_codec_decoder`` takes the file's names as they are). The quantizers'
``input_proj`` weights (encoder side, never used to decode) are not held.

Imports: torch, ``omnistep.core`` and ``omnistep.layers`` only (the serving component is
``runners/codec_vocoder.py``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from omnistep.core import ModelFilesError
from omnistep.core.config_fields import check_positive_ints, known_fields
from omnistep.layers.conv import conv1d_nwc
from omnistep.layers.linear import PACK_ROWS, PackedLinear, derived_copy, packs_on_cpu
from omnistep.layers.norm import RMSNorm
from omnistep.layers.rope import apply_rope, rope_cos_sin
from omnistep.layers.snake import SnakeBeta

SAMPLE_RATE = 24000
"""Hz of the decoder output (``output_sample_rate`` of the published tokenizer config)."""
PRE_CONV_KERNEL = 3
CONVNEXT_KERNEL = 7
DECODER_KERNEL = 7
"""Kernel of the decoder's first and last convs and of every residual unit's dilated conv."""
RESIDUAL_DILATIONS = (1, 3, 9)
CONV_PIECE_ROW_FRAMES = 16
"""Most frames x rows of a batch that run through the conv stack at once (``decode_stream``):
a batch of B chunks runs in pieces of ``max(1, 16 // B)`` frames, so the output-rate
activations (``[B, 1920 frames, 96]`` float32: 12 MB at 16) stay in cache. Published size, 2
threads, chunks 2, 8, 16 frames, ms per frame: B = 8 24 (2-frame pieces) vs 42 (32-frame
pieces); B = 4 24 vs 29; B = 1 28 either way (16 or 32)."""
CODEBOOK_EPS = 1e-5
"""``EuclideanCodebook.epsilon``: cluster usage is clamped at this before dividing."""
UNUSED_TENSORS = ("quantizer.rvq_first.input_proj.weight", "quantizer.rvq_rest.input_proj.weight")
"""Decoder tensors of the checkpoint that decoding never reads (the quantizers' input sides)."""

_ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu}


@dataclass(frozen=True)
class CodecDecoderConfig:
    """``decoder_config`` of ``speech_tokenizer/config.json``; defaults are upstream's
    ``Qwen3TTSTokenizerV2DecoderConfig`` defaults, except ``codebook_dim`` (upstream has none;
    512 is the published value). The published file differs from the defaults in
    ``hidden_size`` 512, ``intermediate_size`` 1024 and ``head_dim`` 64 (``PUBLISHED_DECODER``).
    """

    codebook_size: int = 2048
    """Entries per codebook."""
    codebook_dim: int = 512
    """Quantizer output channels (each codebook vector has codebook_dim // 2)."""
    hidden_size: int = 1024
    """Transformer width."""
    latent_dim: int = 1024
    """Channels between pre_conv, transformer (in/out projections) and the upsamplers."""
    max_position_embeddings: int = 8000
    """Upstream's RoPE table size; windows here restart at position 0, so only a bound."""
    rope_theta: float = 10000.0
    num_attention_heads: int = 16
    num_key_value_heads: int = 16
    head_dim: int | None = None
    """None: hidden_size // num_attention_heads (as upstream's ``getattr`` default)."""
    attention_bias: bool = False
    sliding_window: int = 72
    """Frames a query sees: itself and the sliding_window - 1 before it."""
    intermediate_size: int = 3072
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-5
    num_hidden_layers: int = 8
    num_quantizers: int = 16
    upsample_rates: tuple[int, ...] = (8, 5, 4, 3)
    """Strides of the decoder blocks' transposed convs (channels halve at each)."""
    upsampling_ratios: tuple[int, ...] = (2, 2)
    """Strides of the ConvNeXt upsamplers before the decoder."""
    decoder_dim: int = 1536
    rope_scaling: Mapping[str, Any] | None = field(default=None, compare=False)
    """Only None / ``{"rope_type": "default"}`` is supported."""
    code_embedding: bool = False
    """Qwen3-Omni's code2wav (``Qwen3OmniMoeCode2Wav``) instead of the speech tokenizer's
    decoder: the input is one table ``code_embedding`` ``[codebook_size * Q, hidden_size]``
    (codebook q's code c at row ``q * codebook_size + c``) averaged over the Q codebooks, fed
    to the transformer as it is (no quantizer, no pre_conv, no input/output projections:
    ``latent_dim`` must equal ``hidden_size``); and every transposed conv trims its
    ``kernel - stride`` extra outputs on both sides (``Qwen3OmniMoeCausalTransConvNet``), not
    on the right only, so the wave starts ``output_shift`` samples later (module docstring).
    ``from_code2wav`` sets it."""

    def __post_init__(self) -> None:
        check_positive_ints(
            self,
            [
                "codebook_size", "codebook_dim", "hidden_size", "latent_dim",
                "num_attention_heads", "num_key_value_heads", "sliding_window",
                "intermediate_size", "num_hidden_layers", "num_quantizers", "decoder_dim",
            ],
        )  # fmt: skip
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        check_positive_ints(self, ["head_dim"])
        if self.num_quantizers < 2:
            raise ValueError(
                f"CodecDecoderConfig.num_quantizers must be >= 2 (1 semantic + acoustic "
                f"codebooks), got {self.num_quantizers}"
            )
        if self.codebook_dim % 2:
            raise ValueError(
                f"CodecDecoderConfig.codebook_dim must be even, got {self.codebook_dim}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                "CodecDecoderConfig.num_attention_heads must be a multiple of num_key_value_heads, "
                f"got {self.num_attention_heads} and {self.num_key_value_heads}"
            )
        for name in ("upsample_rates", "upsampling_ratios"):
            rates = getattr(self, name)
            if not rates or any(
                not isinstance(r, int) or isinstance(r, bool) or r < 1 for r in rates
            ):
                raise ValueError(f"CodecDecoderConfig.{name} must be positive ints, got {rates!r}")
        if self.decoder_dim % 2 ** len(self.upsample_rates):
            raise ValueError(
                "CodecDecoderConfig.decoder_dim must be divisible by 2 ** len(upsample_rates), got "
                f"{self.decoder_dim}"
            )
        if self.hidden_act not in _ACTIVATIONS:
            raise ValueError(
                f"CodecDecoderConfig.hidden_act must be one of {sorted(_ACTIVATIONS)}, got "
                f"{self.hidden_act!r}"
            )
        scaling = self.rope_scaling or {}
        if scaling.get("rope_type", scaling.get("type", "default")) != "default":
            raise ValueError(f"CodecDecoderConfig.rope_scaling is not supported: {scaling!r}")
        if self.code_embedding and self.latent_dim != self.hidden_size:
            raise ValueError(
                "CodecDecoderConfig.latent_dim must equal hidden_size with code_embedding, got "
                f"{self.latent_dim} and {self.hidden_size}"
            )

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> CodecDecoderConfig:
        """From ``decoder_config`` (or a whole speech tokenizer ``config.json`` dict holding
        one); keys this decoder does not use are ignored."""
        raw = raw.get("decoder_config", raw)
        return cls(**known_fields(cls, raw))

    @classmethod
    def from_code2wav(cls, raw: Mapping[str, Any]) -> CodecDecoderConfig:
        """From Qwen3-Omni's ``code2wav_config`` (``Qwen3OmniMoeCode2WavConfig``): the same
        field names, ``code_embedding`` set, ``latent_dim`` = ``hidden_size``; RoPE from
        ``rope_parameters`` (transformers 5) or ``rope_theta`` / ``rope_scaling`` (4.x).

        Raises:
            ValueError: bad or unsupported values (named), as the constructor.
        """
        fields = known_fields(cls, raw)
        rope = raw.get("rope_parameters") or {}
        if "rope_theta" in rope:
            fields["rope_theta"] = rope["rope_theta"]
        if rope and "rope_scaling" not in fields:
            fields["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
        fields.update(code_embedding=True, latent_dim=fields.get("hidden_size", cls.hidden_size))
        return cls(**fields)

    @classmethod
    def of(cls, config: Any) -> CodecDecoderConfig:
        """``config`` as a CodecDecoderConfig: itself, a dict (``from_dict``), or a dataclass
        with the same field names (the loader's ``SpeechDecoderConfig``)."""
        if isinstance(config, cls):
            return config
        if dataclasses.is_dataclass(config) and not isinstance(config, type):
            return cls.from_dict(dataclasses.asdict(config))
        return cls.from_dict(config)

    @property
    def hop_length(self) -> int:
        """Samples per frame: ``prod(upsampling_ratios) * prod(upsample_rates)`` (1920)."""
        return math.prod(self.upsampling_ratios) * math.prod(self.upsample_rates)

    @property
    def output_shift(self) -> int:
        """Samples the wave starts later than frame 0's first sample: 0, or with
        ``code_embedding`` the outputs every transposed conv trims on its left, carried to the
        output rate (555 for rates 8 5 4 3: 8 * 60 + 5 * 12 + 4 * 3 + 3). Frame s's samples
        are ``[s * hop - output_shift, (s + 1) * hop - output_shift)`` of the wave (from 0),
        and T frames give ``T * hop - output_shift`` samples."""
        if not self.code_embedding:
            return 0
        shift = 0
        for rate in self.upsample_rates:  # the upsampling ratios' kernels equal their strides
            shift = shift * rate + rate  # trim = kernel - stride = 2 rate - rate
        return shift

    @property
    def conv_context_frames(self) -> int:
        """Transformer-output frames before a frame that its first sample depends on: the
        conv stack walked back from the frame's first sample, ``s * hop - output_shift`` (10
        for the published geometry of both decoders)."""
        big = 1 << 20  # any frame index far from 0 (the reach does not depend on it)
        trim = self.code_embedding
        lo = _conv_reach(big * self.hop_length - self.output_shift, DECODER_KERNEL)
        for rate in reversed(self.upsample_rates):
            for dilation in reversed(RESIDUAL_DILATIONS):
                lo = _conv_reach(lo, DECODER_KERNEL, dilation)
            lo = _transposed_conv_reach(lo, 2 * rate, rate, rate if trim else 0)
        lo = _conv_reach(lo, DECODER_KERNEL)  # decoder.0
        for ratio in reversed(self.upsampling_ratios):
            lo = _conv_reach(lo, CONVNEXT_KERNEL)
            lo = _transposed_conv_reach(lo, ratio, ratio)
        return big - lo

    @property
    def transformer_context_frames(self) -> int:
        """Code frames before a transformer output that it depends on: the window per layer
        plus pre_conv (570 published; 568 with ``code_embedding``, which has no pre_conv)."""
        pre_conv = 0 if self.code_embedding else PRE_CONV_KERNEL - 1
        return self.num_hidden_layers * (self.sliding_window - 1) + pre_conv

    @property
    def left_context_frames(self) -> int:
        """Code frames before a chunk that exact chunked decoding needs (580 published)."""
        return self.conv_context_frames + self.transformer_context_frames


PUBLISHED_DECODER = {
    "attention_bias": False, "latent_dim": 1024, "codebook_dim": 512, "codebook_size": 2048,
    "decoder_dim": 1536, "hidden_act": "silu", "hidden_size": 512, "intermediate_size": 1024,
    "layer_scale_initial_scale": 0.01, "max_position_embeddings": 8000, "head_dim": 64,
    "num_attention_heads": 16, "num_hidden_layers": 8, "num_key_value_heads": 16,
    "num_quantizers": 16, "rms_norm_eps": 1e-05, "rope_theta": 10000, "sliding_window": 72,
    "upsample_rates": [8, 5, 4, 3], "upsampling_ratios": [2, 2],
}  # fmt: skip
"""``decoder_config`` of the published ``Qwen3-TTS-Tokenizer-12Hz`` / ``speech_tokenizer``
``config.json`` (as quoted by two independent ports; not read from the Hub here)."""


def _conv_reach(lo: int, kernel: int, dilation: int = 1) -> int:
    """First input a causal conv's outputs from ``lo`` on read."""
    return lo - (kernel - 1) * dilation


def _transposed_conv_reach(lo: int, kernel: int, stride: int, left_trim: int = 0) -> int:
    """First input a trimmed transposed conv's outputs from ``lo`` on read: output o is the
    untrimmed output ``u = o + left_trim``, which reads inputs from
    ``ceil((u - kernel + 1) / stride)``."""
    return -((kernel - 1 - lo - left_trim) // stride)


class StreamPass:
    """The carried state of one batched forward over chunks of streams
    (``CodecDecoder.decode_stream``).

    Each stateful op (a causal conv's padding, a transposed conv's overlap, an attention
    layer's keys and values) calls ``carry`` once per pass, in forward order: the same order
    in every pass, so the i-th ``carry`` of a pass reads what the i-th of the stream's previous
    pass saved. Rows are right-padded to the longest chunk (``frames[i]`` real frames in row
    i); along time, ``x`` holds ``max(frames) * rate`` steps at the op's rate.

    Args:
        frames: real frames of each row's chunk (0 keeps a row's state as it is; the
            largest >= 1).
        states: each row's saved tensors (``DecoderStream``), or None for a stream's first
            chunk (the carried inputs are then zeros: the whole decode's causal padding).
    """

    def __init__(self, frames: Sequence[int], states: Sequence[Sequence[torch.Tensor] | None]):
        self.frames = list(frames)
        self.max_frames = max(self.frames)
        self.states = list(states)
        self.saved: list[torch.Tensor] = []
        self.lost = [0] * len(self.frames)
        """Steps each row lacks at the current rate: a stream's first pass through
        left-trimmed transposed convs (``CodecDecoderConfig.code_embedding``) loses their
        trimmed outputs, so row i holds ``frames[i] * rate - lost[i]`` real steps."""

    def carry(self, x: torch.Tensor, n: int, dim: int = 2) -> torch.Tensor:
        """``x`` ``[B, ..., T, ...]`` with each row's saved last ``n`` steps before it along
        ``dim`` (``n + T`` steps); saves each row's last ``n`` real steps for the next pass."""
        if n == 0:
            return x
        index = len(self.saved)
        shape = (*x.shape[1:dim], n, *x.shape[dim + 1 :])
        past = [x.new_zeros(shape) if s is None else s[index] for s in self.states]
        xs = torch.cat([torch.stack(past), x], dim)
        rate = x.shape[dim] // self.max_frames
        ends = [f * rate - lost for f, lost in zip(self.frames, self.lost, strict=True)]
        if len(set(ends)) == 1:
            self.saved.append(xs.narrow(dim, ends[0], n))
        else:
            self.saved.append(
                torch.stack([xs[i].narrow(dim - 1, e, n) for i, e in enumerate(ends)])
            )
        return xs

    def rows(self) -> list[tuple[torch.Tensor, ...]]:
        """Each row's saved tensors (own copies, not views of the batch)."""
        return [tuple(t[i].clone() for t in self.saved) for i in range(len(self.frames))]


def _run(layer: nn.Module, x: torch.Tensor, sp: StreamPass | None) -> torch.Tensor:
    """``layer(x)``, or its ``stream(x, sp)`` on a chunk when it carries state."""
    stream = getattr(layer, "stream", None)
    return layer(x) if sp is None or stream is None else stream(x, sp)


@dataclass(frozen=True, eq=False)
class DecoderStream:
    """One stream's decoder state between chunks (what ``CodecDecoder.decode_stream`` reads
    and returns); the per-request cache of the vocoder component.

    Attributes:
        frames: code frames the stream has decoded (its next frame's RoPE position).
        latents: pre_conv's last ``PRE_CONV_KERNEL - 1`` inputs, then every layer's last
            ``sliding_window - 1`` keys (after RoPE) and values ``[kv_heads, window - 1,
            head_dim]``; None before the first chunk.
        waves: the conv stack's carried inputs (each causal conv's last ``(kernel - 1) *
            dilation`` inputs, each overlapping transposed conv's last input); None before
            the first chunk.
    """

    frames: int = 0
    latents: tuple[torch.Tensor, ...] | None = None
    waves: tuple[torch.Tensor, ...] | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of tensors held (about 5 MB at the published size in float32)."""
        return sum(
            t.numel() * t.element_size() for t in (*(self.latents or ()), *(self.waves or ()))
        )


class CausalConv1d(nn.Module):
    """``Qwen3TTSTokenizerV2CausalConvNet`` at stride 1: ``(kernel - 1) * dilation`` zeros on
    the left, none on the right; time-major ``[B, T, C_in]`` -> ``[B, T, C_out]`` (the conv
    stack keeps its activations time-major: ``layers.conv.conv1d_nwc``)."""

    def __init__(self, c_in: int, c_out: int, kernel: int, dilation: int = 1, groups: int = 1):
        super().__init__()
        self.conv = nn.Conv1d(c_in, c_out, kernel, dilation=dilation, groups=groups)
        self.pad = (kernel - 1) * dilation

    def _conv(self, x: torch.Tensor) -> torch.Tensor:
        c = self.conv
        return conv1d_nwc(x, c.weight, c.bias, c.dilation[0], c.groups)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._conv(F.pad(x, (0, 0, self.pad, 0)))

    def stream(self, x: torch.Tensor, sp: StreamPass) -> torch.Tensor:
        """The same on a chunk: the stream's last ``pad`` inputs replace the zero padding."""
        return self._conv(sp.carry(x, self.pad, dim=1))


class CausalConvTranspose1d(nn.Module):
    """``Qwen3TTSTokenizerV2CausalTransConvNet``: transposed conv, the last ``kernel - stride``
    outputs trimmed; time-major ``[B, T, C_in]`` -> ``[B, stride * T, C_out]``."""

    def __init__(self, c_in: int, c_out: int, kernel: int, stride: int, trim_left: bool = False):
        super().__init__()
        self.conv = nn.ConvTranspose1d(c_in, c_out, kernel, stride=stride)
        self.trim = kernel - stride
        self.left_trim = self.trim if trim_left else 0
        """Outputs trimmed on the left too (``Qwen3OmniMoeCausalTransConvNet``: ``T * stride -
        left_trim`` outputs then)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._transposed(x)
        return y[:, self.left_trim : y.shape[1] - self.trim] if self.trim else y

    def _transposed(self, x: torch.Tensor) -> torch.Tensor:
        """The untrimmed transposed conv: ``[B, T, C_in]`` -> ``[B, stride (T - 1) + kernel,
        C_out]``.

        On CPU float32 without autograd, and when the kernel is a multiple m of the stride s
        (every transposed conv of this decoder: kernel 2 s, or s), it runs as one GEMM over
        the ``B T`` input steps on a pre-packed weight ``[kernel C_out, C_in]`` (the conv
        weight permuted; a ``derived_copy``) and an overlap-add of its m blocks of s output
        steps: the same sums in another order (within float32 rounding, 5e-6 here). oneDNN
        would otherwise reorder the weight on every call (75 MB for the 1536 -> 768
        upsampler: 48 of a 98 ms 1-frame chunk; as a GEMM 1.6 ms at B = 1, 7.9 instead of
        49 at B = 8), and the time-major activations need no transposes.
        """
        conv = self.conv
        kernel, stride = conv.kernel_size[0], conv.stride[0]
        w = conv.weight
        if (
            not packs_on_cpu(x, w)
            or kernel % stride
            or conv.groups != 1
            or (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))
        ):
            return conv(x.transpose(1, 2)).transpose(1, 2)
        c_in, c_out, _ = w.shape
        try:
            packed = derived_copy(
                w,
                "transposed-nwc",
                lambda t: torch.ops.mkldnn._reorder_linear_weight(
                    t.permute(2, 1, 0).reshape(kernel * c_out, c_in).contiguous(), PACK_ROWS
                ),
            )
        except RuntimeError:  # a CPU without the kernels: the conv itself
            return conv(x.transpose(1, 2)).transpose(1, 2)
        batch, steps, _ = x.shape
        m = kernel // stride
        z = torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, None, "none", [], "")
        z = z.view(batch, steps, m, stride, c_out)  # [B, T, m, s, C_out]
        out = x.new_zeros(batch, (steps + m - 1) * stride, c_out)
        blocks = out.view(batch, steps + m - 1, stride, c_out)
        for j in range(m):
            blocks[:, j : j + steps] += z[:, :, j]
        if conv.bias is not None:
            out += conv.bias.detach()
        return out

    def stream(self, x: torch.Tensor, sp: StreamPass) -> torch.Tensor:
        """The same on a chunk: outputs of the chunk's inputs also read the ``ceil(trim /
        stride)`` inputs before them (the overlap), carried from the previous chunk."""
        stride = self.conv.stride[0]
        carried = -(-self.trim // stride)
        y = self._transposed(sp.carry(x, carried, dim=1))
        start, steps = carried * stride, x.shape[1] * stride
        # a stream's first pass drops the left-trimmed outputs: those rows start left_trim
        # later (their last left_trim steps are padding), as the whole decode does
        shifts = [self.left_trim if s is None else 0 for s in sp.states]
        sp.lost = [lost * stride + shift for lost, shift in zip(sp.lost, shifts, strict=True)]
        if len(set(shifts)) == 1:
            return y[:, start + shifts[0] : start + shifts[0] + steps]
        return torch.stack([y[i, start + d : start + d + steps] for i, d in enumerate(shifts)])


class ConvNeXtBlock(nn.Module):
    """``Qwen3TTSTokenizerV2ConvNeXtBlock``: x + gamma * pw2(gelu(pw1(LN(causal dwconv(x)))));
    time-major ``[B, T, dim]`` -> same."""

    def __init__(self, dim: int):
        super().__init__()
        self.dwconv = CausalConv1d(dim, dim, CONVNEXT_KERNEL, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = PackedLinear(dim, 4 * dim)
        self.act = nn.GELU()
        self.pwconv2 = PackedLinear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 1e-6))

    def forward(self, x: torch.Tensor, sp: StreamPass | None = None) -> torch.Tensor:
        y = self.dwconv(x) if sp is None else self.dwconv.stream(x, sp)
        y = self.pwconv2(self.act(self.pwconv1(self.norm(y))))  # [B, T, dim]
        return x + self.gamma * y

    stream = forward


class LayerScale(nn.Module):
    """``Qwen3TTSTokenizerV2DecoderLayerScale``: per-channel ``scale * x``."""

    def __init__(self, dim: int):
        super().__init__()
        self.scale = nn.Parameter(torch.full((dim,), 0.01))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x


class SlidingAttention(nn.Module):
    """``Qwen3TTSTokenizerV2DecoderAttention``: RoPE (rotate-half) attention, GQA, causal within
    a window of ``sliding_window`` frames; ``[B, T, hidden]`` -> same."""

    def __init__(self, config: CodecDecoderConfig):
        super().__init__()
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = (
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
        )
        self.q_proj = PackedLinear(
            c.hidden_size, c.num_attention_heads * c.head_dim, c.attention_bias
        )
        self.k_proj = PackedLinear(
            c.hidden_size, c.num_key_value_heads * c.head_dim, c.attention_bias
        )
        self.v_proj = PackedLinear(
            c.hidden_size, c.num_key_value_heads * c.head_dim, c.attention_bias
        )
        self.o_proj = PackedLinear(
            c.num_attention_heads * c.head_dim, c.hidden_size, c.attention_bias
        )
        self.cached = c.sliding_window - 1
        """Key/value positions a stream keeps per layer between chunks."""

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
        sp: StreamPass | None = None,
    ) -> torch.Tensor:
        """``cos``/``sin`` ``[1 or B, T, head_dim]``; ``mask`` bool, True where a query may
        attend: ``[T, T]``, or with ``sp`` (a chunk of a stream) ``[B, 1, T, window - 1 + T]``
        over the stream's cached keys (the last ``sliding_window - 1`` positions, after RoPE)
        and the chunk's own."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, k, cos, sin)  # [B, heads, T, D]; cos [B|1, 1, T, D] there
        if sp is not None:
            k, v = sp.carry(k, self.cached), sp.carry(v, self.cached)
        if self.num_kv_heads != self.num_heads:
            repeat = self.num_heads // self.num_kv_heads
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.head_dim**-0.5)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))


class GatedMLP(nn.Module):
    """``Qwen3TTSTokenizerV2DecoderMlp``: ``down(act(gate(x)) * up(x))``."""

    def __init__(self, config: CodecDecoderConfig):
        super().__init__()
        self.gate_proj = PackedLinear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = PackedLinear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = PackedLinear(config.intermediate_size, config.hidden_size, bias=False)
        self.act = _ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class TransformerLayer(nn.Module):
    """``Qwen3TTSTokenizerV2DecoderTransformerLayer`` (pre-norm, LayerScale on both branches)."""

    def __init__(self, config: CodecDecoderConfig):
        super().__init__()
        self.self_attn = SlidingAttention(config)
        self.mlp = GatedMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn_layer_scale = LayerScale(config.hidden_size)
        self.mlp_layer_scale = LayerScale(config.hidden_size)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
        sp: StreamPass | None = None,
    ) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), cos, sin, mask, sp)
        x = x + self.self_attn_layer_scale(attn)
        return x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))


class CodecTransformer(nn.Module):
    """``Qwen3TTSTokenizerV2DecoderTransformerModel``: ``[B, T, latent]`` -> same; positions
    0..T-1 in a whole call, as upstream's (a window cut from an utterance may restart at 0:
    RoPE sees only offsets), or continuing a stream's positions (``stream``)."""

    def __init__(self, config: CodecDecoderConfig):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(
            TransformerLayer(config) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.input_proj: nn.Module = nn.Identity()
        self.output_proj: nn.Module = nn.Identity()
        if not config.code_embedding:  # Qwen3-Omni's code2wav has no projections
            self.input_proj = PackedLinear(config.latent_dim, config.hidden_size)
            self.output_proj = PackedLinear(config.hidden_size, config.latent_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        h = self.input_proj(x)
        positions = torch.arange(h.shape[1], device=h.device)
        cos, sin = rope_cos_sin(positions, c.head_dim, c.rope_theta, h.dtype, h.device)
        offset = positions[:, None] - positions[None, :]  # query - key
        mask = (offset >= 0) & (offset < c.sliding_window)
        for layer in self.layers:
            h = layer(h, cos[None], sin[None], mask)
        return self.output_proj(self.norm(h))

    def stream(self, x: torch.Tensor, start: torch.Tensor, sp: StreamPass) -> torch.Tensor:
        """A chunk of each row's stream: ``x`` ``[B, T, latent]`` (rows right-padded),
        ``start`` int64 ``[B]`` the position of each row's first frame (frames the stream has
        seen before); every layer attends to the stream's cached keys and values (``sp``)."""
        c = self.config
        h = self.input_proj(x)
        b, t = h.shape[:2]
        steps = torch.arange(t, device=h.device)
        positions = start[:, None] + steps  # [B, T]
        cos, sin = rope_cos_sin(positions.reshape(-1), c.head_dim, c.rope_theta, h.dtype, h.device)
        cos, sin = cos.view(b, t, -1), sin.view(b, t, -1)
        cached = c.sliding_window - 1
        keys = start[:, None] - cached + torch.arange(cached + t, device=h.device)  # [B, S]
        offset = positions[:, :, None] - keys[:, None, :]  # [B, T, S]: query - key
        mask = (keys[:, None, :] >= 0) & (offset >= 0) & (offset < c.sliding_window)
        for layer in self.layers:
            h = layer(h, cos, sin, mask[:, None], sp)
        return self.output_proj(self.norm(h))


class ResidualUnit(nn.Module):
    """``Qwen3TTSTokenizerV2DecoderDecoderResidualUnit``:
    ``x + conv1x1(snake(dilated conv(snake(x))))``, time-major ``[B, T, dim]``."""

    def __init__(self, dim: int, dilation: int):
        super().__init__()
        self.act1 = SnakeBeta(dim, channels_last=True)
        self.conv1 = CausalConv1d(dim, dim, DECODER_KERNEL, dilation=dilation)
        self.act2 = SnakeBeta(dim, channels_last=True)
        self.conv2 = CausalConv1d(dim, dim, 1)

    def forward(self, x: torch.Tensor, sp: StreamPass | None = None) -> torch.Tensor:
        y = self.act1(x)
        y = self.conv1(y) if sp is None else self.conv1.stream(y, sp)
        return x + self.conv2(self.act2(y))

    stream = forward


class DecoderBlock(nn.Module):
    """``Qwen3TTSTokenizerV2DecoderDecoderBlock``: SnakeBeta, transposed conv x rate (channels
    halve), residual units at dilations 1, 3, 9; parameters under ``block.{0..4}``;
    time-major ``[B, T, c_in]`` -> ``[B, rate T, c_out]``."""

    def __init__(self, c_in: int, c_out: int, rate: int, trim_left: bool = False):
        super().__init__()
        self.block = nn.ModuleList(
            [
                SnakeBeta(c_in, channels_last=True),
                CausalConvTranspose1d(c_in, c_out, 2 * rate, rate, trim_left),
                *(ResidualUnit(c_out, d) for d in RESIDUAL_DILATIONS),
            ]
        )

    def forward(self, x: torch.Tensor, sp: StreamPass | None = None) -> torch.Tensor:
        for layer in self.block:
            x = _run(layer, x, sp)
        return x

    stream = forward


class _Codebook(nn.Module):
    """``EuclideanCodebook`` (decode side): vectors are ``embedding_sum / cluster_usage``."""

    def __init__(self, size: int, dim: int):
        super().__init__()
        self.cluster_usage = nn.Parameter(torch.ones(size))
        self.embedding_sum = nn.Parameter(torch.zeros(size, dim))

    def lookup(self, codes: torch.Tensor) -> torch.Tensor:
        """``codes`` ``[...]`` -> ``[..., dim]``; the same division as upstream's table, done
        only for the rows looked up."""
        usage = self.cluster_usage.clamp(min=CODEBOOK_EPS)[codes]
        return F.embedding(codes, self.embedding_sum) / usage.unsqueeze(-1)


class _ResidualQuantizer(nn.Module):
    """``ResidualVectorQuantizer`` (decode side): summed codebook vectors through the 1x1
    ``output_proj``; parameters ``vq.layers.{i}._codebook.*`` and ``output_proj.weight``."""

    def __init__(self, num_codebooks: int, size: int, dim: int, out_dim: int):
        super().__init__()
        self.vq = nn.Module()
        self.vq.layers = nn.ModuleList(nn.Module() for _ in range(num_codebooks))
        for layer in self.vq.layers:
            layer._codebook = _Codebook(size, dim)
        self.output_proj = nn.Conv1d(dim, out_dim, 1, bias=False)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """``codes`` ``[B, T, n]`` -> ``[B, T, out_dim]``."""
        total = self.vq.layers[0]._codebook.lookup(codes[..., 0])
        for i in range(1, codes.shape[-1]):
            total = total + self.vq.layers[i]._codebook.lookup(codes[..., i])
        return F.linear(total, self.output_proj.weight[:, :, 0])


class _SplitQuantizer(nn.Module):
    """``SplitResidualVectorQuantizer``: codebook 0 (``rvq_first``) plus codebooks 1..Q-1
    (``rvq_rest``)."""

    def __init__(self, config: CodecDecoderConfig):
        super().__init__()
        c = config
        dim = c.codebook_dim // 2
        self.rvq_first = _ResidualQuantizer(1, c.codebook_size, dim, c.codebook_dim)
        self.rvq_rest = _ResidualQuantizer(
            c.num_quantizers - 1, c.codebook_size, dim, c.codebook_dim
        )

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """``codes`` ``[B, T, Q]`` -> ``[B, T, codebook_dim]``."""
        return self.rvq_first.decode(codes[..., :1]) + self.rvq_rest.decode(codes[..., 1:])


@dataclass(frozen=True, slots=True)
class DecodeRow:
    """One window to decode: ``codes`` int64 ``[W, Q]`` (any device), of which frames
    ``[left, left + chunk)`` are returned; frames before are context, frames after ignored."""

    codes: torch.Tensor
    left: int
    chunk: int


class CodecDecoder(nn.Module):
    """``Qwen3TTSTokenizerV2Decoder``: codes ``[B, T, Q]`` -> float32 wave ``[B, T * hop]``;
    with ``config.code_embedding`` Qwen3-Omni's ``Qwen3OmniMoeCode2Wav`` (``[B, T * hop -
    output_shift]``: parameters ``code_embedding.weight``, ``pre_transformer.*``,
    ``upsample.*``, ``decoder.*``).

    ``decode`` is the whole utterance; ``decode_chunk`` / ``decode_rows`` decode windows exactly
    (module docstring); ``chunked_decode`` runs a chunk schedule. All outputs are clamped to
    [-1, 1] as upstream's ``forward``. Codes must lie in ``[0, codebook_size)`` (upstream's
    ``decode`` maps its -1 padding to 0 and cuts the padded samples; here windows simply end).
    """

    def __init__(self, config: CodecDecoderConfig):
        super().__init__()
        c = config
        self.config = config
        self.quantizer: _SplitQuantizer | None = None
        self.pre_conv: CausalConv1d | None = None
        self.code_embedding: nn.Embedding | None = None
        if c.code_embedding:
            self.code_embedding = nn.Embedding(c.codebook_size * c.num_quantizers, c.hidden_size)
        else:
            self.quantizer = _SplitQuantizer(c)
            self.pre_conv = CausalConv1d(c.codebook_dim, c.latent_dim, PRE_CONV_KERNEL)
        self.pre_transformer = CodecTransformer(c)
        self.upsample = nn.ModuleList(
            nn.ModuleList(
                [
                    CausalConvTranspose1d(c.latent_dim, c.latent_dim, r, r),
                    ConvNeXtBlock(c.latent_dim),
                ]
            )
            for r in c.upsampling_ratios
        )
        dims = [c.decoder_dim // 2**i for i in range(len(c.upsample_rates) + 1)]
        self.decoder = nn.ModuleList(
            [
                CausalConv1d(c.latent_dim, c.decoder_dim, DECODER_KERNEL),
                *(
                    DecoderBlock(dims[i], dims[i + 1], r, c.code_embedding)
                    for i, r in enumerate(c.upsample_rates)
                ),
                SnakeBeta(dims[-1], channels_last=True),
                CausalConv1d(dims[-1], 1, DECODER_KERNEL),
            ]
        )

    @property
    def hop_length(self) -> int:
        """Samples per frame (1920)."""
        return self.config.hop_length

    @property
    def left_context_frames(self) -> int:
        """Frames of left context exact chunks need (``CodecDecoderConfig.left_context_frames``)."""
        return self.config.left_context_frames

    @property
    def device(self) -> torch.device:
        """Where the parameters are."""
        return self.decoder[0].conv.weight.device

    def embed(self, codes: torch.Tensor) -> torch.Tensor:
        """The transformer's input before pre_conv: codes ``[B, T, Q]`` -> the split RVQ's
        ``[B, T, codebook_dim]``, or with ``code_embedding`` the mean over codebooks of
        ``code_embedding[q * codebook_size + code]``, ``[B, T, hidden_size]``."""
        if self.code_embedding is not None:
            c = self.config
            offsets = torch.arange(c.num_quantizers, device=codes.device) * c.codebook_size
            return self.code_embedding(codes + offsets).mean(dim=2)
        assert self.quantizer is not None
        return self.quantizer.decode(codes)

    def latents(self, codes: torch.Tensor) -> torch.Tensor:
        """Input (``embed``), pre_conv and transformer: codes ``[B, T, Q]`` -> ``[B, T,
        latent_dim]``."""
        x = self.embed(codes)
        if self.pre_conv is not None:
            x = self.pre_conv(x)
        return self.pre_transformer(x)

    def waveform(self, latents: torch.Tensor, sp: StreamPass | None = None) -> torch.Tensor:
        """Upsamplers and decoder: ``[B, T, latent_dim]`` -> ``[B, T * hop]`` in [-1, 1], float32
        (float64 for a float64 model). With ``sp``, chunks continuing their streams. The conv
        stack runs time-major (``[B, T, C]``; ``layers.conv``)."""
        x = latents
        for up, block in self.upsample:
            x = block(_run(up, x, sp), sp)
        for layer in self.decoder:
            x = _run(layer, x, sp)
        return x[..., 0].clamp(-1.0, 1.0).to(torch.promote_types(x.dtype, torch.float32))

    def _stream_latents(
        self, codes: torch.Tensor, frames: Sequence[int], streams: Sequence[DecoderStream]
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, ...]]]:
        """``latents`` of chunks continuing ``streams``: codes ``[B, T, Q]`` (row i's first
        ``frames[i]`` real) -> ``[B, T, latent_dim]`` and each row's new ``latents`` state."""
        sp = StreamPass(frames, [s.latents for s in streams])
        x = self.embed(codes)
        if self.pre_conv is not None:
            x = self.pre_conv.stream(x, sp)
        start = torch.tensor([s.frames for s in streams], device=codes.device)
        return self.pre_transformer.stream(x, start, sp), sp.rows()

    @torch.inference_mode()
    def decode_stream(
        self, chunks: Sequence[torch.Tensor], streams: Sequence[DecoderStream]
    ) -> tuple[list[torch.Tensor], list[DecoderStream]]:
        """Decode the next chunk of each stream, all in one batch.

        Each stream keeps what its next chunk reads (``DecoderStream``): the last
        ``sliding_window - 1`` keys and values of every layer, positions continuing from the
        stream's first frame, and the last inputs of every causal conv; so a chunk costs its
        own frames only, and consecutive chunks give the whole decode's samples (within float
        rounding: 1e-5 in float32). Rows are right-padded to the longest chunk (causal: padding
        never reaches a real sample); a row's samples equal its decode alone within rounding.

        The conv stack runs over pieces of ``CONV_PIECE_ROW_FRAMES // B`` frames (at least 1;
        exact, the state carries across): on a CPU its activations then stay in cache (see
        there; one row, one thread: 45 ms per frame in 32-frame pieces, 62 in 64-frame ones).

        Args:
            chunks: each stream's next codes, int ``[frames, Q]`` (>= 1 frame, any device).
            streams: each stream's state (``DecoderStream()`` for a new stream); not changed.

        Returns:
            Each chunk's samples, float32 ``[frames * hop]`` on the model's device, and each
            stream's state after its chunk.

        Raises:
            ValueError: bad shapes or codes out of range, or ``chunks`` and ``streams`` of
                different lengths.
        """
        if len(chunks) != len(streams):
            raise ValueError(f"{len(chunks)} chunks for {len(streams)} streams")
        if not chunks:
            return [], []
        codes, frames = self._stack_chunks(chunks)
        latents, latent_states = self._stream_latents(codes, frames, streams)
        conv_states: list[Sequence[torch.Tensor] | None] = [s.waves for s in streams]
        hop = self.hop_length
        pieces: list[list[torch.Tensor]] = [[] for _ in frames]
        piece = max(1, CONV_PIECE_ROW_FRAMES // len(frames))
        for lo in range(0, max(frames), piece):  # a row may have 0 frames left
            part = [min(max(n - lo, 0), piece) for n in frames]
            sp = StreamPass(part, conv_states)
            wave = self.waveform(latents[:, lo : lo + max(part)], sp)  # [B, max(part) * hop]
            for i, n in enumerate(part):  # a stream's first piece is output_shift shorter
                pieces[i].append(wave[i, : n * hop - sp.lost[i]])
            conv_states = sp.rows()  # type: ignore[assignment]
        new = [
            DecoderStream(s.frames + n, lat, conv)
            for s, n, lat, conv in zip(streams, frames, latent_states, conv_states, strict=True)
        ]
        return [torch.cat(row) for row in pieces], new

    @torch.inference_mode()
    def prime_stream(self, codes: torch.Tensor) -> DecoderStream:
        """A new stream's state after ``codes`` ``[P, Q]`` decoded as context only (voice
        cloning's reference codes), without producing their samples: the transformer runs over
        the last ``left_context_frames`` of them, the conv stack over the last
        ``conv_context_frames`` (the receptive field of what the next chunk reads), so the
        stream's next samples equal those of the whole decode of ``codes`` + the stream's
        codes (within float rounding).

        Raises:
            ValueError: bad shape or codes out of range.
        """
        if codes.dim() != 2 or codes.shape[0] == 0:
            raise ValueError(f"prefix codes must be [frames >= 1, Q], got {tuple(codes.shape)}")
        codes, frames = self._stack_chunks([codes[-self.left_context_frames :]])
        latents, (latent_state,) = self._stream_latents(codes, frames, [DecoderStream()])
        tail = latents[:, -self.config.conv_context_frames :]
        sp = StreamPass([tail.shape[1]], [None])
        self.waveform(tail, sp)
        (conv_state,) = sp.rows()
        return DecoderStream(frames[0], latent_state, conv_state)

    def _stack_chunks(self, chunks: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
        """Chunks ``[frames_i, Q]`` as one right-padded int64 batch on the model's device."""
        device = self.device
        q = self.config.num_quantizers
        for chunk in chunks:
            if chunk.dim() != 2 or chunk.shape[1] != q or chunk.shape[0] == 0:
                raise ValueError(
                    f"a chunk's codes must be [frames >= 1, {q}], got {tuple(chunk.shape)}"
                )
            self._check_codes(chunk[None])
        frames = [int(chunk.shape[0]) for chunk in chunks]
        codes = torch.zeros(len(chunks), max(frames), q, dtype=torch.long, device=device)
        for i, chunk in enumerate(chunks):
            codes[i, : frames[i]] = chunk
        return codes, frames

    @torch.inference_mode()
    def streamed_decode(self, codes: torch.Tensor, chunks: int | Sequence[int]) -> torch.Tensor:
        """The whole decode done chunk by chunk through ``decode_stream`` (one stream per
        row): codes ``[B, T, Q]`` -> float32 ``[B, T * hop]``.

        Args:
            chunks: frames per chunk: one size for all, or a schedule whose last size repeats.
        """
        self._check_codes(codes)
        streams = [DecoderStream() for _ in range(codes.shape[0])]
        pieces = []
        for start, end in _schedule(codes.shape[1], chunks):
            waves, streams = self.decode_stream(list(codes[:, start:end]), streams)
            pieces.append(torch.stack(waves))
        if not pieces:
            return torch.zeros(codes.shape[0], 0, device=codes.device)
        return torch.cat(pieces, dim=1)

    @torch.inference_mode()
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """Whole utterances: codes ``[B, T, Q]`` -> float32 ``[B, T * hop]``."""
        self._check_codes(codes)
        if codes.shape[1] == 0:
            return torch.zeros(codes.shape[0], 0, device=codes.device)
        return self.decode_chunk(codes, 0, codes.shape[1])

    forward = decode

    @torch.inference_mode()
    def decode_chunk(self, codes: torch.Tensor, left: int, chunk: int) -> torch.Tensor:
        """Samples of frames ``[left, left + chunk)`` of windows ``codes`` ``[B, W, Q]``.

        Returns float32 ``[B, chunk * hop]``: the whole decode's samples of those frames when
        the window holds ``left_context_frames`` frames before them or starts at the
        utterance start (within float rounding: 1e-5 in float32).

        Raises:
            ValueError: bad shapes, codes out of range, or not ``0 <= left``, ``1 <= chunk``,
                ``left + chunk <= W``.
        """
        self._check_codes(codes)
        rows = [DecodeRow(row, left, chunk) for row in codes]
        return torch.stack(self.decode_rows(rows))

    @torch.inference_mode()
    def decode_rows(self, rows: Sequence[DecodeRow]) -> list[torch.Tensor]:
        """Decode windows of any lengths in one batch: each row's samples, float32
        ``[chunk * hop]``, on the model's device.

        Rows are cut to the context they need (``left_context_frames`` of codes for the
        transformer, ``conv_context_frames`` of latents for the conv stack) and right-padded to
        the longest (causal: padding never reaches a real frame's samples), so a row's samples
        equal its decode alone within float rounding.
        """
        if not rows:
            return []
        device = self.device
        hop, q = self.hop_length, self.config.num_quantizers
        spans = []
        for row in rows:
            width = row.codes.shape[0] if row.codes.dim() == 2 else -1
            if row.codes.dim() != 2 or row.codes.shape[1] != q:
                raise ValueError(
                    f"a row's codes must be [frames, {q}], got {tuple(row.codes.shape)}"
                )
            if row.left < 0 or row.chunk < 1 or row.left + row.chunk > width:
                raise ValueError(
                    "need 0 <= left, 1 <= chunk, left + chunk <= window frames; got "
                    f"left={row.left}, chunk={row.chunk}, frames={width}"
                )
            spans.append((max(0, row.left - self.left_context_frames), row.left + row.chunk))
        length = max(end - start for start, end in spans)
        codes = torch.zeros(len(rows), length, q, dtype=torch.long, device=device)
        for i, (row, (start, end)) in enumerate(zip(rows, spans, strict=True)):
            self._check_codes(row.codes[None])
            codes[i, : end - start] = row.codes[start:end]
        latents = self.latents(codes)  # [B, length, latent_dim]
        conv_spans = []
        for row, (start, _) in zip(rows, spans, strict=True):
            left = row.left - start
            conv_spans.append((max(0, left - self.config.conv_context_frames), left, row.chunk))
        conv_len = max(left + chunk - first for first, left, chunk in conv_spans)
        if len(rows) == 1 and conv_spans[0][0] == 0 and conv_len == length:
            conv_in = latents
        else:
            conv_in = latents.new_zeros(len(rows), conv_len, latents.shape[-1])
            for i, (first, left, chunk) in enumerate(conv_spans):
                conv_in[i, : left + chunk - first] = latents[i, first : left + chunk]
        wave = self.waveform(conv_in)  # [B, conv_len * hop - output_shift]
        shift = self.config.output_shift  # frame f's samples start at f * hop - shift
        return [
            wave[i, max(0, (left - first) * hop - shift) : (left - first + chunk) * hop - shift]
            for i, (first, left, chunk) in enumerate(conv_spans)
        ]

    @torch.inference_mode()
    def chunked_decode(
        self, codes: torch.Tensor, chunks: int | Sequence[int], left_context: int | None = None
    ) -> torch.Tensor:
        """The whole decode done chunk by chunk: codes ``[B, T, Q]`` -> float32 ``[B, T * hop]``.

        Args:
            chunks: frames per chunk: one size for all, or a schedule whose last size repeats.
            left_context: frames of context per chunk; None: ``left_context_frames`` (exact).
        """
        self._check_codes(codes)
        context = self.left_context_frames if left_context is None else left_context
        pieces = []
        for start, end in _schedule(codes.shape[1], chunks):
            first = max(0, start - context)
            pieces.append(self.decode_chunk(codes[:, first:end], start - first, end - start))
        if not pieces:
            return torch.zeros(codes.shape[0], 0, device=codes.device)
        return torch.cat(pieces, dim=1)

    def _check_codes(self, codes: torch.Tensor) -> None:
        c = self.config
        if codes.dim() != 3 or codes.shape[-1] != c.num_quantizers:
            raise ValueError(
                f"codes must be [batch, frames, {c.num_quantizers}], got {tuple(codes.shape)}"
            )
        if codes.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"codes must be int64 or int32, got {codes.dtype}")
        if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= c.codebook_size):
            raise ValueError(
                f"codes must lie in [0, {c.codebook_size}), got values in "
                f"[{int(codes.min())}, {int(codes.max())}]"
            )


def _schedule(frames: int, chunks: int | Sequence[int]) -> list[tuple[int, int]]:
    """(start, end) of each chunk of a schedule over ``frames`` frames: one size for all, or
    sizes whose last repeats. Raises ValueError for sizes < 1."""
    sizes = [chunks] if isinstance(chunks, int) else list(chunks)
    if not sizes or any(s < 1 for s in sizes):
        raise ValueError(f"chunk sizes must be >= 1, got {chunks!r}")
    bounds, start = [], 0
    while start < frames:
        end = min(frames, start + sizes[min(len(bounds), len(sizes) - 1)])
        bounds.append((start, end))
        start = end
    return bounds


def load_codec_decoder(
    tensors: Mapping[str, torch.Tensor],
    config: Any,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    source: str = "speech_tokenizer/model.safetensors",
    prefix: str = "decoder.",
) -> CodecDecoder:
    """Build the decoder from the speech tokenizer's tensors, strictly.

    Args:
        tensors: ``speech_tokenizer/model.safetensors`` by official names: the ``decoder.*``
            ones are used (``encoder.*`` and others ignored); every parameter must be there
            with its shape.
        config: ``decoder_config`` (or the whole speech tokenizer ``config.json`` dict), a
            ``CodecDecoderConfig``, or the loader's ``SpeechDecoderConfig``.
        device, dtype: where and how it runs (upstream's file is float32).
        source: the file named in errors.
        prefix: the decoder's tensors' prefix in ``tensors`` (``"code2wav."`` for
            Qwen3-Omni's checkpoint, with a ``code_embedding`` config).

    Raises:
        ModelFilesError: tensors missing, unexpected or of the wrong shape (named).
    """
    config = CodecDecoderConfig.of(config)
    state = {
        k[len(prefix) :]: v
        for k, v in tensors.items()
        if k.startswith(prefix) and k[len(prefix) :] not in UNUSED_TENSORS
    }
    with torch.device("meta"):
        model = CodecDecoder(config)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    problems = [f"missing {prefix}{k}" for k in expected if k not in state]
    problems += [f"unexpected {prefix}{k}" for k in state if k not in expected]
    problems += [
        f"{prefix}{k}: shape {tuple(v.shape)}, expected {expected[k]}"
        for k, v in state.items()
        if k in expected and tuple(v.shape) != expected[k]
    ]
    if problems:
        shown = "; ".join(problems[:8]) + (
            f"; and {len(problems) - 8} more" if len(problems) > 8 else ""
        )
        raise ModelFilesError(
            f"{source}: codec decoder tensors ({prefix}*) do not match the config: {shown}"
        )
    model.load_state_dict(state, strict=True, assign=True)
    return model.to(device=device, dtype=dtype).eval()
