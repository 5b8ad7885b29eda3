"""The Higgs Audio v2 tokenizer's decoder: 8-codebook frames (25 frames/s) -> 24 kHz wave.

Our torch implementation of ``HiggsAudioV2TokenizerModel.decode`` (transformers
models/higgs_audio_v2_tokenizer/modeling_higgs_audio_v2_tokenizer.py) and of the DAC decoder it
wraps (models/dac/modeling_dac.py ``DacDecoder``, adjusted as there: every transposed conv's
``output_padding`` is ``stride % 2`` and the final tanh is removed)::

    codes [B, T, Q]   -> sum over q of project_out_q(embed_q[codes_q])   [B, T, hidden]
                      -> fc2                                              [B, T, acoustic hidden]
                      -> conv1 (k 7)      -> per ratio r: Snake, ConvTranspose (k 2r, stride r,
                         padding ceil(r/2)), 3 residual units (Snake, conv k 7 dilation 1/3/9,
                         Snake, conv k 1, + input) -> Snake -> conv2 (k 7) to 1 channel
    wave  [B, T * hop]  hop = prod(upsampling_ratios) (960)

Snake (DAC): ``x + sin(alpha x)^2 / (alpha + 1e-9)``. The decoder is not causal: a sample reads
``context_frames()`` frames on either side, so a chunk decoded with that many frames of left
context and look-ahead equals the whole decode up to float rounding (the receptive field is
covered; only the kernels' batch shapes differ).

Imports: torch, ``omnistep.layers.weight_norm``, ``omnistep.runners.vocoder`` and this family's
loader.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from omnistep.layers.weight_norm import fold_parametrized
from omnistep.models.higgs_audio_v2.loader import (
    HiggsCheckpoint,
    HiggsCheckpointError,
    HiggsCodecConfig,
    take,
)
from omnistep.runners.vocoder import ChunkVocoder


class Snake1d(nn.Module):
    """DAC's Snake activation over ``[B, C, T]`` with a learned ``alpha`` ``[1, C, 1]``."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1, channels, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + (self.alpha + 1e-9).reciprocal() * torch.sin(self.alpha * x).pow(2)


class ResidualUnit(nn.Module):
    """Snake -> conv k 7 (dilated, same padding) -> Snake -> conv k 1, plus the input."""

    def __init__(self, channels: int, dilation: int):
        super().__init__()
        self.snake1 = Snake1d(channels)
        self.conv1 = nn.Conv1d(channels, channels, 7, dilation=dilation, padding=3 * dilation)
        self.snake2 = Snake1d(channels)
        self.conv2 = nn.Conv1d(channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(self.snake2(self.conv1(self.snake1(x))))


class DecoderBlock(nn.Module):
    """Snake -> transposed conv (upsample by ``stride``) -> residual units, dilations 1, 3, 9."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.snake1 = Snake1d(cin)
        self.conv_t1 = nn.ConvTranspose1d(
            cin,
            cout,
            2 * stride,
            stride=stride,
            padding=math.ceil(stride / 2),
            output_padding=stride % 2,
        )
        self.res_unit1 = ResidualUnit(cout, 1)
        self.res_unit2 = ResidualUnit(cout, 3)
        self.res_unit3 = ResidualUnit(cout, 9)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv_t1(self.snake1(x))
        return self.res_unit3(self.res_unit2(self.res_unit1(x)))


class AcousticDecoder(nn.Module):
    """The DAC decoder without its tanh: ``[B, hidden, T]`` -> ``[B, 1, T * hop]``."""

    def __init__(self, config: HiggsCodecConfig):
        super().__init__()
        ch = config.decoder_hidden_size
        self.conv1 = nn.Conv1d(config.acoustic_hidden_size, ch, 7, padding=3)
        self.block = nn.ModuleList(
            DecoderBlock(ch // 2**i, ch // 2 ** (i + 1), r)
            for i, r in enumerate(config.upsampling_ratios)
        )
        last = ch // 2 ** len(config.upsampling_ratios)
        self.snake1 = Snake1d(last)
        self.conv2 = nn.Conv1d(last, 1, 7, padding=3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv1(x)
        for block in self.block:
            x = block(x)
        return self.conv2(self.snake1(x))


class HiggsCodecDecoder(nn.Module):
    """Codes -> wave (see the module docstring); ``num_codebooks`` of the RVQ's quantizers
    are used (the LM's 8)."""

    def __init__(self, config: HiggsCodecConfig, num_codebooks: int):
        super().__init__()
        self.config = config
        self.num_codebooks = num_codebooks
        hidden = config.acoustic_hidden_size + config.semantic_hidden_size
        self.embed = nn.Parameter(
            torch.zeros(num_codebooks, config.codebook_size, config.codebook_dim)
        )
        self.project_out_weight = nn.Parameter(
            torch.zeros(num_codebooks, hidden, config.codebook_dim)
        )
        self.project_out_bias = nn.Parameter(torch.zeros(num_codebooks, hidden))
        self.fc2 = nn.Linear(hidden, config.acoustic_hidden_size)
        self.acoustic_decoder = AcousticDecoder(config)

    @property
    def hop_length(self) -> int:
        return self.config.hop_length

    def context_frames(self) -> int:
        """Frames a sample reads on either side (rounded up): conv1's 3 frames, per block the
        transposed conv's 2 input samples and the residual units' ``3 * (1 + 3 + 9)`` output
        samples, and conv2's 3 samples, each in frames at its rate."""
        reach, rate = 3.0, 1
        for r in self.config.upsampling_ratios:
            reach += 2 / rate + 39 / (rate * r)
            rate *= r
        return math.ceil(reach + 3 / rate)

    def load(self, tensors: dict[str, torch.Tensor], where: object) -> None:
        """Copy the audio tokenizer's tensors in (``quantizer.quantizers.{q}.codebook.embed``,
        ``...project_out.*``, ``fc2.*``, ``acoustic_decoder.*``; weight-normed convs'
        ``parametrizations.weight.original0/1`` are folded: ``layers.weight_norm``).

        Raises:
            HiggsCheckpointError: a missing tensor or one of another shape (named).
            WeightNormError: a weight-norm ``original1`` with an output channel of norm 0.
        """
        try:
            tensors = fold_parametrized(tensors)
        except KeyError as exc:
            raise HiggsCheckpointError(f"{where} has no tensor {exc.args[0]}") from exc
        own = dict(self.named_parameters())
        with torch.no_grad():
            for q in range(self.num_codebooks):
                p = f"quantizer.quantizers.{q}"
                self.embed[q].copy_(
                    take(tensors, f"{p}.codebook.embed", self.embed[q].shape, where)
                )
                self.project_out_weight[q].copy_(
                    take(
                        tensors, f"{p}.project_out.weight", self.project_out_weight[q].shape, where
                    )
                )
                self.project_out_bias[q].copy_(
                    take(tensors, f"{p}.project_out.bias", self.project_out_bias[q].shape, where)
                )
            for name, param in own.items():
                if name.startswith(("fc2.", "acoustic_decoder.")):
                    param.copy_(take(tensors, name, tuple(param.shape), where))

    def quantized(self, codes: torch.Tensor) -> torch.Tensor:
        """``[B, T, Q]`` codes -> ``[B, acoustic hidden, T]`` decoder input."""
        if codes.dim() != 3 or codes.shape[-1] != self.num_codebooks:
            raise ValueError(
                f"codes must be [B, T, {self.num_codebooks}], got {tuple(codes.shape)}"
            )
        total = 0
        for q in range(self.num_codebooks):
            vec = self.embed[q][codes[..., q]]  # [B, T, dim]
            total = total + F.linear(vec, self.project_out_weight[q], self.project_out_bias[q])
        return self.fc2(total).transpose(1, 2)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        """``[B, T, Q]`` long codes in ``[0, codebook_size)`` -> ``[B, T * hop]`` float."""
        return self.acoustic_decoder(self.quantized(codes))[:, 0]

    def decode_chunk(self, window: torch.Tensor, left: int, chunk: int) -> torch.Tensor:
        """``ChunkVocoder``'s call: decode a window ``[B, W, Q]`` and keep the samples of its
        frames ``[left, left + chunk)``: ``[B, chunk * hop]``."""
        hop = self.hop_length
        return self.forward(window.long())[:, left * hop : (left + chunk) * hop]


def codec_from_checkpoint(
    checkpoint: HiggsCheckpoint, device: str | torch.device = "cpu", dtype=torch.float32
) -> HiggsCodecDecoder:
    """The decoder with the folder's audio tokenizer weights.

    Raises:
        HiggsCheckpointError: a missing tensor or one of another shape (named).
    """
    from safetensors.torch import load_file

    path = checkpoint.codec_root / "model.safetensors"
    try:
        tensors = load_file(str(path))
    except OSError as exc:
        raise HiggsCheckpointError(f"{path}: unreadable ({exc})") from exc
    decoder = HiggsCodecDecoder(checkpoint.codec, checkpoint.lm.num_codebooks)
    decoder.load(tensors, path)
    return decoder.to(device=device, dtype=dtype).eval()


def codec_component(decoder: HiggsCodecDecoder, batch_invariant: bool) -> ChunkVocoder:
    """The ``codec`` component: AUDIO_CHUNK units of code frames (``[Q]`` long tensors)."""
    return ChunkVocoder(decoder, "Higgs audio tokenizer decoder", batch_invariant)
