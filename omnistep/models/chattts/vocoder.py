"""ChatTTS vocoder: per-token GPT hidden states -> Decoder -> 100-bin log-mel -> Vocos -> wave.

This is ChatTTS's default vocoding path (``Chat._decode_to_wavs`` with ``use_decoder=True``,
``ChatTTS/core.py`` of chattts 0.2.5), written without ``chattts``, ``vocos`` or ``torchaudio``:

    hidden  [B, T, 768]     float, one row per generated token (the GPT's last hidden state)
      -> Decoder             ``ChatTTS/model/dvae.py`` ``DVAE`` built with the ``Decoder`` config
                             and no encoder / VQ (file ``asset/Decoder.safetensors``):
                             token t's 768 channels are split into mel frames 2t (channels
                             0..383) and 2t+1 (channels 384..767); ``conv_in`` -> 12 ConvNeXt
                             blocks (kernel 7, dilation 2) -> ``conv_out`` -> ``out_conv`` (k 3),
                             then multiplied by ``coef`` [1, 100, 1] (upstream does this on
                             this path too: ``DVAE.forward`` ends in ``mul(dec_out, coef)``)
    log-mel [B, 100, 2T]     float, 2 mel frames per token
      -> Vocos               ``vocos/pretrained.py`` ``Vocos.decode`` with the ChatTTS config
                             (``ChatTTS/config/config.py``; file ``asset/Vocos.safetensors``):
                             ``VocosBackbone`` (``vocos/models.py``: embed conv k 7, 8 ConvNeXt
                             blocks k 7) -> ``ISTFTHead`` (``vocos/heads.py``: linear to
                             n_fft + 2, exp(mag) clipped at 100, phase -> complex spectrum)
                             -> ``torch.istft`` (``vocos/spectral_ops.py`` with padding
                             "center": n_fft 1024, hop 256, periodic Hann window, center=True)
    wave    [B, 512 T]       float32, 24 kHz: 1 token -> 2 mel frames -> 512 samples

Length: upstream ``torch.istft`` is called without ``length``, which for M = 2T frames gives
``hop * (M - 1)`` = 512 T - 256 samples. Here the ISTFT is asked for ``hop * M`` samples so that
every token owns exactly 512 of them; the first 512 T - 256 samples are upstream's output
(bit-for-bit the same ISTFT call) and the last 256 are the same normalised overlap-add continued
over frames M - 2 and M - 1.

Sample ownership and chunk alignment (hop h = 256, n_fft N = 1024, center=True):
    ``torch.istft(center=True)`` trims N/2 samples from the overlap-added signal, so output
    sample s sits at padded position s + N/2 and frame j spans padded [j h, j h + N). Frame m
    owns samples [m h, (m + 1) h) (its centre onwards); those samples are the normalised sum over
    frames m - 1 .. m + 2 (frames j with j h <= s + N/2 < j h + N): ISTFT context is
    ``floor((N/2 - 1) / h)`` = 1 frame left and ``floor((h - 1 + N/2) / h)`` = 2 frames right.
    Token t owns frames 2t, 2t+1, hence samples [512 t, 512 (t + 1)).
    ``decode_chunk`` runs the convolutional stack over its whole window of W tokens, keeps the
    backbone frames [lo, hi) with lo = max(2 left - 1, 0), hi = min(2 (left + chunk) + 2, 2 W),
    calls the same ``torch.istft`` on them with length h (hi - lo), and returns output samples
    [h (2 left - lo), h (2 left - lo) + 512 chunk): window sample 512 left is output sample
    h (2 left - lo) because the ISTFT of frames [lo, hi) starts at the centre of frame lo. Every
    returned sample has all four of its frames inside [lo, hi) (or beyond the window edge, where
    the whole decode has no frame either), and the envelope normalisation sums the same frames,
    so the chunk is the whole-utterance decode's samples whenever those frames are.

Receptive field (one-sided; analytic, confirmed by perturbation in tests/test_chattts_vocoder.py):
    Decoder: conv_in 1 + 1, 12 blocks x dilation 2 x 3, out_conv 1 = 75 mel frames.
    Vocos backbone: embed 3 + 8 blocks x 3 = 27 mel frames.  Stack: 102 mel frames each side.
    With the ISTFT, a sample owned by frame m depends on Decoder input frames m - 103 .. m + 104,
    i.e. a sample of token t depends on tokens t - 52 .. t + 52 (52 tokens ~ 1.11 s each side).
    Chunked decoding is exact (up to float summation order) when the window holds
    ``left_context_tokens`` (52) tokens before the chunk and ``lookahead_tokens`` (52) after it,
    or reaches the utterance start / end on that side: every convolution zero-pads at the window
    edges exactly as the whole decode does at the utterance edges. A shorter look-ahead is an
    approximation whose error sits in the chunk's last tokens and falls fast with the look-ahead;
    how fast depends on the weights (full-size random weights: 16 tokens gave -43 to -77 dB
    error-to-signal in the last token, 32 tokens float rounding), so measure it on real weights.

Imports: torch, safetensors.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

import torch
from torch import nn

from omnistep.core import ModelFilesError
from omnistep.layers.linear import PackedLinear

DECODER_FILE = "Decoder.safetensors"
VOCOS_FILE = "Vocos.safetensors"
FRAMES_PER_TOKEN = 2
"""Mel frames per GPT token: the Decoder splits each hidden state into two frames."""


def _check_positive(config: object) -> None:
    for f in fields(config):  # type: ignore[arg-type]
        value = getattr(config, f.name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            name = f"{type(config).__name__}.{f.name}"
            raise ValueError(f"{name} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class DecoderConfig:
    """The hidden-state Decoder; defaults are the official sizes (``config.py`` ``Decoder``).

    Upstream builds it as ``DVAE(decoder_config=asdict(Decoder()), dim=Decoder.idim)``, whose
    ``out_conv`` takes ``dim`` = ``idim`` channels; the decoder stack emits ``odim``, so upstream
    needs ``idim == odim`` (true for the official 384/384). Here ``out_conv`` takes ``out_dim``.
    """

    frame_dim: int = 384
    """Channels per mel frame at the input (upstream ``idim``); hidden_size = 2 * frame_dim."""
    out_dim: int = 384
    """Channels out of the ConvNeXt stack's ``conv_out`` (upstream ``odim``)."""
    hidden_dim: int = 512
    """ConvNeXt width (upstream ``hidden``); blocks widen to 4 * hidden_dim inside."""
    num_layers: int = 12
    """ConvNeXt blocks (upstream ``n_layer``)."""
    bottleneck_dim: int = 128
    """Width between the two ``conv_in`` convolutions (upstream ``bn_dim``)."""
    kernel_size: int = 7
    """Depthwise kernel of each block (upstream ``kernel``, DVAEDecoder default)."""
    dilation: int = 2
    """Depthwise dilation of each block (upstream ``dilation``, DVAEDecoder default)."""
    num_mels: int = 100
    """Log-mel bins out of ``out_conv`` (hard-coded 100 upstream)."""

    def __post_init__(self) -> None:
        _check_positive(self)
        if self.kernel_size % 2 == 0:
            raise ValueError(f"DecoderConfig.kernel_size must be odd, got {self.kernel_size}")

    @property
    def hidden_size(self) -> int:
        """Channels of one input token (the GPT hidden size, 768 officially)."""
        return FRAMES_PER_TOKEN * self.frame_dim

    @property
    def receptive_field_frames(self) -> int:
        """One-sided receptive field in mel frames: conv_in 2 + blocks + out_conv 1 (75)."""
        return 2 + self.num_layers * self.dilation * (self.kernel_size // 2) + 1

    @classmethod
    def tiny(cls) -> DecoderConfig:
        """A small config for tests (hidden_size 32)."""
        return cls(frame_dim=16, out_dim=16, hidden_dim=24, num_layers=3, bottleneck_dim=8)


@dataclass(frozen=True)
class VocosConfig:
    """Vocos as ChatTTS builds it; defaults are the official sizes (``config.py`` ``Vocos``)."""

    num_mels: int = 100
    """Input channels of the backbone (``BackboneInitArgs.input_channels``)."""
    dim: int = 512
    """Backbone width (``BackboneInitArgs.dim``, ``FourierHeadInitArgs.dim``)."""
    intermediate_dim: int = 1536
    """ConvNeXt inner width (``BackboneInitArgs.intermediate_dim``)."""
    num_layers: int = 8
    """ConvNeXt blocks (``BackboneInitArgs.num_layers``)."""
    n_fft: int = 1024
    """ISTFT size and Hann window length (``FourierHeadInitArgs.n_fft``)."""
    hop_length: int = 256
    """Samples per mel frame (``FourierHeadInitArgs.hop_length``)."""
    sample_rate: int = 24000
    """Hz (``FeatureExtractorInitArgs.sample_rate``)."""

    def __post_init__(self) -> None:
        _check_positive(self)
        if self.n_fft % 2 or self.hop_length > self.n_fft // 2:
            raise ValueError(
                f"VocosConfig.n_fft must be even and hop_length <= n_fft // 2 (overlap-add "
                f"must cover every sample), got n_fft={self.n_fft}, hop_length={self.hop_length}"
            )

    @property
    def receptive_field_frames(self) -> int:
        """One-sided receptive field of the backbone in mel frames: embed 3 + 3 per block (27)."""
        return 3 + 3 * self.num_layers

    @property
    def istft_context_frames(self) -> tuple[int, int]:
        """(left, right) neighbour frames whose overlap-add reaches a frame's own samples."""
        half = self.n_fft // 2
        return (half - 1) // self.hop_length, (self.hop_length - 1 + half) // self.hop_length

    @classmethod
    def tiny(cls) -> VocosConfig:
        """A small config for tests (official STFT geometry, narrow backbone)."""
        return cls(dim=32, intermediate_dim=48, num_layers=2)


class ConvNeXtBlock(nn.Module):
    """1-D ConvNeXt block: depthwise conv -> LayerNorm -> Linear -> GELU -> Linear -> scale, + x.

    Mirrors ``ChatTTS/model/dvae.py`` ``ConvNeXtBlock`` (layer scale named ``weight``, dilated)
    and ``vocos/modules.py`` ``ConvNeXtBlock`` (layer scale named ``gamma``, dilation 1); the two
    compute the same function. ``x``: ``[B, dim, frames]`` -> same shape.
    """

    def __init__(
        self,
        dim: int,
        intermediate_dim: int,
        kernel_size: int,
        dilation: int,
        layer_scale_name: str,
        layer_scale_init: float,
    ):
        super().__init__()
        self.dwconv = nn.Conv1d(
            dim,
            dim,
            kernel_size,
            padding=dilation * (kernel_size // 2),
            dilation=dilation,
            groups=dim,
        )
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = PackedLinear(dim, intermediate_dim)
        self.act = nn.GELU()
        self.pwconv2 = PackedLinear(intermediate_dim, dim)
        scale = nn.Parameter(torch.full((dim,), layer_scale_init))
        self.register_parameter(layer_scale_name, scale)
        self.layer_scale_name = layer_scale_name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.dwconv(x).transpose(1, 2)  # [B, frames, dim]
        y = self.pwconv2(self.act(self.pwconv1(self.norm(y))))
        y = y * getattr(self, self.layer_scale_name)
        return x + y.transpose(1, 2)


class _DecoderStack(nn.Module):
    """``ChatTTS/model/dvae.py`` ``DVAEDecoder``: ``[B, frame_dim, M]`` -> ``[B, out_dim, M]``."""

    def __init__(self, config: DecoderConfig):
        super().__init__()
        c = config
        self.conv_in = nn.Sequential(
            nn.Conv1d(c.frame_dim, c.bottleneck_dim, 3, 1, 1),
            nn.GELU(),
            nn.Conv1d(c.bottleneck_dim, c.hidden_dim, 3, 1, 1),
        )
        self.decoder_block = nn.ModuleList(
            ConvNeXtBlock(c.hidden_dim, 4 * c.hidden_dim, c.kernel_size, c.dilation, "weight", 1e-6)
            for _ in range(c.num_layers)
        )
        self.conv_out = nn.Conv1d(c.hidden_dim, c.out_dim, kernel_size=1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv_in(x)
        for block in self.decoder_block:
            x = block(x)
        return self.conv_out(x)


class Decoder(nn.Module):
    """Hidden states -> log-mel; ``ChatTTS/model/dvae.py`` ``DVAE`` without encoder and VQ.

    State dict names equal ``asset/Decoder.safetensors``: ``coef`` [1, num_mels, 1],
    ``decoder.conv_in.{0,2}.*``, ``decoder.decoder_block.{i}.{weight,dwconv,norm,pwconv1,
    pwconv2}.*``, ``decoder.conv_out.weight``, ``out_conv.weight``.
    """

    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.config = config
        self.register_buffer("coef", torch.ones(1, config.num_mels, 1))
        self.decoder = _DecoderStack(config)
        self.out_conv = nn.Conv1d(config.out_dim, config.num_mels, 3, 1, 1, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden`` ``[B, T, 2 * frame_dim]`` -> log-mel ``[B, num_mels, 2 T]`` (frames).

        Frame 2t holds channels [0, frame_dim) of token t, frame 2t+1 channels [frame_dim,
        2 frame_dim): upstream's ``view(B, 2, idim, T).permute(0, 2, 3, 1).flatten(2)`` on the
        ``[B, hidden, T]`` batch that ``_decode_to_wavs`` builds.
        """
        b, t, _ = hidden.shape
        x = hidden.reshape(b, t, FRAMES_PER_TOKEN, self.config.frame_dim)
        x = x.permute(0, 3, 1, 2).reshape(b, self.config.frame_dim, FRAMES_PER_TOKEN * t)
        return self.out_conv(self.decoder(x)) * self.coef


class _Buffers(nn.Module):
    """Holds named buffers only (state-dict layout of an upstream module we never run)."""

    def __init__(self, **buffers: torch.Tensor):
        super().__init__()
        for name, value in buffers.items():
            self.register_buffer(name, value)


class _MelFeatureBuffers(nn.Module):
    """The buffers of ``vocos.feature_extractors.MelSpectrogramFeatures`` (torchaudio inside).

    ``Vocos.safetensors`` stores them (``mel_spec.spectrogram.window`` [n_fft],
    ``mel_spec.mel_scale.fb`` [n_fft // 2 + 1, num_mels]) because ChatTTS builds the full
    ``Vocos`` and loads strictly. Decoding never uses them; the filterbank starts as zeros and is
    whatever the file holds.
    """

    def __init__(self, config: VocosConfig):
        super().__init__()
        self.mel_spec = nn.Module()
        self.mel_spec.spectrogram = _Buffers(window=torch.hann_window(config.n_fft))
        self.mel_spec.mel_scale = _Buffers(fb=torch.zeros(config.n_fft // 2 + 1, config.num_mels))


class VocosBackbone(nn.Module):
    """``vocos/models.py`` ``VocosBackbone`` (no AdaLayerNorm).

    ``mel`` ``[B, num_mels, M]`` -> ``[B, M, dim]`` (final LayerNorm applied).
    """

    def __init__(self, config: VocosConfig):
        super().__init__()
        c = config
        self.embed = nn.Conv1d(c.num_mels, c.dim, kernel_size=7, padding=3)
        self.norm = nn.LayerNorm(c.dim, eps=1e-6)
        self.convnext = nn.ModuleList(
            ConvNeXtBlock(c.dim, c.intermediate_dim, 7, 1, "gamma", 1.0 / c.num_layers)
            for _ in range(c.num_layers)
        )
        self.final_layer_norm = nn.LayerNorm(c.dim, eps=1e-6)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        x = self.norm(self.embed(mel).transpose(1, 2)).transpose(1, 2)
        for block in self.convnext:
            x = block(x)
        return self.final_layer_norm(x.transpose(1, 2))


class ISTFT(nn.Module):
    """``vocos/spectral_ops.py`` ``ISTFT`` with padding "center": ``torch.istft(center=True)``."""

    def __init__(self, config: VocosConfig):
        super().__init__()
        self.n_fft = config.n_fft
        self.hop_length = config.hop_length
        self.register_buffer("window", torch.hann_window(config.n_fft))

    def forward(self, spec: torch.Tensor, num_samples: int) -> torch.Tensor:
        """Complex ``[B, n_fft // 2 + 1, frames]`` -> real ``[B, num_samples]`` (spec's precision).

        Output sample s is centred-frame time: frame j's centre is sample ``j * hop_length``.
        """
        return torch.istft(
            spec,
            self.n_fft,
            self.hop_length,
            self.n_fft,
            self.window.to(spec.real.dtype),
            center=True,
            length=num_samples,
        )


class ISTFTHead(nn.Module):
    """``vocos/heads.py`` ``ISTFTHead``: per-frame linear -> complex spectrum (-> ISTFT)."""

    def __init__(self, config: VocosConfig):
        super().__init__()
        self.out = PackedLinear(config.dim, config.n_fft + 2)
        self.istft = ISTFT(config)

    def spectrum(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[B, M, dim]`` -> complex ``[B, n_fft // 2 + 1, M]``.

        ``mag = min(exp(a), 100)``, ``S = mag * (cos p + i sin p)``, computed in float32
        (complex64) for float32 / half / bfloat16 models and in float64 for float64 models.
        """
        a = self.out(x)
        a = a.to(torch.promote_types(a.dtype, torch.float32))
        mag, phase = a.transpose(1, 2).chunk(2, dim=1)
        mag = torch.clip(torch.exp(mag), max=1e2)
        return torch.complex(mag * torch.cos(phase), mag * torch.sin(phase))


class Vocos(nn.Module):
    """``vocos/pretrained.py`` ``Vocos`` as ChatTTS builds it (``Chat._load``); decode only.

    State dict names equal ``asset/Vocos.safetensors``: ``feature_extractor.mel_spec.*`` (unused
    buffers), ``backbone.{embed,norm,convnext.{i}.*,final_layer_norm}.*``,
    ``head.out.{weight,bias}``, ``head.istft.window``.
    """

    def __init__(self, config: VocosConfig):
        super().__init__()
        self.config = config
        self.feature_extractor = _MelFeatureBuffers(config)
        self.backbone = VocosBackbone(config)
        self.head = ISTFTHead(config)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        """Log-mel ``[B, num_mels, M]`` -> float32 wave ``[B, M * hop_length]``."""
        spec = self.head.spectrum(self.backbone(mel))
        return self.head.istft(spec, mel.shape[-1] * self.config.hop_length)


class ChatTTSVocoder(nn.Module):
    """Decoder + Vocos: GPT hidden states -> 24 kHz float32 wave, whole or in exact chunks.

    ``decode`` is ``decode_chunk`` over the whole utterance (one inference path). See the module
    docstring for the alignment math and the receptive field. Waves are float32 for float32,
    float16 and bfloat16 models (exp, sin/cos and the ISTFT run in float32) and float64 for a
    float64 model.
    """

    def __init__(self, decoder_config: DecoderConfig, vocos_config: VocosConfig):
        super().__init__()
        if decoder_config.num_mels != vocos_config.num_mels:
            raise ValueError(
                f"DecoderConfig.num_mels ({decoder_config.num_mels}) must equal "
                f"VocosConfig.num_mels ({vocos_config.num_mels})"
            )
        self.decoder = Decoder(decoder_config)
        self.vocos = Vocos(vocos_config)

    @property
    def hidden_size(self) -> int:
        return self.decoder.config.hidden_size

    @property
    def sample_rate(self) -> int:
        return self.vocos.config.sample_rate

    @property
    def samples_per_token(self) -> int:
        """512 officially: 2 mel frames of hop 256."""
        return FRAMES_PER_TOKEN * self.vocos.config.hop_length

    @property
    def receptive_field_frames(self) -> int:
        """One-sided mel-frame receptive field of Decoder + Vocos backbone (102 officially)."""
        return self.decoder.config.receptive_field_frames + self.vocos.config.receptive_field_frames

    @property
    def left_context_tokens(self) -> int:
        """Tokens before a chunk that exact chunked decoding needs (52 officially)."""
        frames = self.receptive_field_frames + self.vocos.config.istft_context_frames[0]
        return -(-frames // FRAMES_PER_TOKEN)

    @property
    def lookahead_tokens(self) -> int:
        """Tokens after a chunk that exact chunked decoding needs (52 officially)."""
        frames = self.receptive_field_frames + self.vocos.config.istft_context_frames[1]
        return (FRAMES_PER_TOKEN - 1 + frames) // FRAMES_PER_TOKEN

    @torch.inference_mode()
    def decode(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden`` ``[B, T, hidden_size]`` -> float32 ``[B, T * samples_per_token]``.

        Upstream (``Chat._decode_to_wavs``) returns the first ``T * samples_per_token -
        hop_length`` of these samples.
        """
        self._check_hidden(hidden)
        if hidden.shape[1] == 0:
            dtype = torch.promote_types(self.decoder.coef.dtype, torch.float32)
            return hidden.new_zeros(hidden.shape[0], 0, dtype=dtype)
        return self.decode_chunk(hidden, 0, hidden.shape[1])

    @torch.inference_mode()
    def decode_chunk(self, hidden: torch.Tensor, left: int, chunk: int) -> torch.Tensor:
        """Samples of tokens [left, left + chunk) of a window of W tokens.

        Args:
            hidden: ``[B, W, hidden_size]`` = left context + chunk + look-ahead tokens; the
                window edges act as utterance edges (zero padding). Rows of a batch are
                independent windows of equal shape.
            left: tokens of left context at the window start.
            chunk: tokens whose samples are returned (>= 1).

        Returns:
            float32 ``[B, chunk * samples_per_token]``. Equal (within float rounding) to
            ``decode(utterance)[:, 512 a : 512 (a + chunk)]`` for the chunk's start a when each
            side holds ``left_context_tokens`` / ``lookahead_tokens`` tokens or reaches the
            utterance edge.
        """
        self._check_hidden(hidden)
        width = hidden.shape[1]
        if left < 0 or chunk < 1 or left + chunk > width:
            raise ValueError(
                f"need 0 <= left and 1 <= chunk and left + chunk <= window tokens, got "
                f"left={left}, chunk={chunk}, window tokens={width}"
            )
        mel = self.decoder(hidden.to(self.decoder.coef.dtype))  # [B, num_mels, 2W]
        hop = self.vocos.config.hop_length
        before, after = self.vocos.config.istft_context_frames
        first, stop = FRAMES_PER_TOKEN * left, FRAMES_PER_TOKEN * (left + chunk)
        lo, hi = max(first - before, 0), min(stop + after, FRAMES_PER_TOKEN * width)
        frames = self.vocos.backbone(mel)[:, lo:hi]  # [B, hi - lo, dim]
        wave = self.vocos.head.istft(self.vocos.head.spectrum(frames), hop * (hi - lo))
        start = hop * (first - lo)  # window sample hop * first is output sample hop * (first - lo)
        return wave[:, start : start + hop * (stop - first)]

    def _check_hidden(self, hidden: torch.Tensor) -> None:
        if hidden.dim() != 3 or hidden.shape[-1] != self.hidden_size:
            raise ValueError(
                f"hidden must be [batch, tokens, {self.hidden_size}], got {tuple(hidden.shape)}"
            )


def configs_from_state(
    decoder_state: dict[str, torch.Tensor], vocos_state: dict[str, torch.Tensor]
) -> tuple[DecoderConfig, VocosConfig]:
    """Sizes read off the tensor shapes of the two files (the official layout stores no config
    for them): conv_in ``[bn, frame, 3]`` and ``[hidden, bn, 3]``, conv_out ``[out, hidden, 1]``,
    out_conv ``[mels, out, 3]``, block count; Vocos embed ``[dim, mels, 7]``, pwconv1
    ``[intermediate, dim]``, layer count, ISTFT window ``[n_fft]``. ``hop_length`` and the sample
    rate keep the official values (no tensor carries them)."""

    def count(state: dict[str, torch.Tensor], prefix: str) -> int:
        return len({k[len(prefix) :].split(".")[0] for k in state if k.startswith(prefix)})

    bn, frame, _ = decoder_state["decoder.conv_in.0.weight"].shape
    hidden = decoder_state["decoder.conv_in.2.weight"].shape[0]
    out = decoder_state["decoder.conv_out.weight"].shape[0]
    mels, _, kernel = (
        decoder_state["out_conv.weight"].shape[0],
        None,
        decoder_state["decoder.decoder_block.0.dwconv.weight"].shape[-1],
    )
    decoder = DecoderConfig(
        frame_dim=frame,
        out_dim=out,
        hidden_dim=hidden,
        num_layers=count(decoder_state, "decoder.decoder_block."),
        bottleneck_dim=bn,
        kernel_size=kernel,
        num_mels=mels,
    )
    dim, vocos_mels, _ = vocos_state["backbone.embed.weight"].shape
    vocos = VocosConfig(
        num_mels=vocos_mels,
        dim=dim,
        intermediate_dim=vocos_state["backbone.convnext.0.pwconv1.weight"].shape[0],
        num_layers=count(vocos_state, "backbone.convnext."),
        n_fft=vocos_state["head.istft.window"].shape[0],
    )
    return decoder, vocos


def load_vocoder(
    asset_dir: Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    decoder_config: DecoderConfig | None = None,
    vocos_config: VocosConfig | None = None,
) -> ChatTTSVocoder:
    """Build the vocoder from ``asset_dir/Decoder.safetensors`` and ``asset_dir/Vocos.safetensors``.

    Both files load strictly (every tensor name and shape must match). Configs default to the
    sizes read off the files (``configs_from_state``). Raises ``ModelFilesError`` (a
    ``FileNotFoundError``) naming each missing file.
    """
    from safetensors.torch import load_file

    asset_dir = Path(asset_dir)
    paths = [asset_dir / DECODER_FILE, asset_dir / VOCOS_FILE]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise ModelFilesError(f"ChatTTS vocoder weights missing: {', '.join(missing)}")
    decoder_state, vocos_state = load_file(paths[0]), load_file(paths[1])
    inferred = configs_from_state(decoder_state, vocos_state)
    with torch.device("meta"):
        model = ChatTTSVocoder(decoder_config or inferred[0], vocos_config or inferred[1])
    # Every parameter and buffer is in the files (strict), so assign=True replaces all meta tensors.
    model.decoder.load_state_dict(decoder_state, strict=True, assign=True)
    model.vocos.load_state_dict(vocos_state, strict=True, assign=True)
    return model.to(device=device, dtype=dtype).eval()
