"""Qwen3-TTS Base's speaker encoder: 24 kHz audio -> log-mel -> ECAPA-TDNN -> x-vector.

Upstream (``qwen_tts`` 0.1.1, ``core/models/modeling_qwen3_tts.py``):
``Qwen3TTSForConditionalGeneration.extract_speaker_embedding(audio, sr=24000)`` computes
``mel_spectrogram(audio, n_fft=1024, num_mels=128, sampling_rate=24000, hop_size=256,
win_size=1024, fmin=0, fmax=12000)`` (frames first) and runs ``Qwen3TTSSpeakerEncoder`` on it.
That encoder is the ECAPA-TDNN of ``omnistep.layers.ecapa_tdnn`` (the same blocks as
Qwen2.5-Omni's; see there), sized by ``speaker_encoder_config``; its tensors are
``speaker_encoder.*`` of ``model.safetensors`` (Base checkpoints only). The embedding
(``enc_dim`` = the talker's hidden size) takes one position of the talker's codec prefix in
place of a CustomVoice speaker id's embedding.

The mel filter bank is librosa's ``filters.mel`` default (Slaney mel scale, Slaney area
normalisation), here from ``transformers.audio_utils.mel_filter_bank`` (librosa is not a
dependency): the two matrices agree within 2e-9 (checked against librosa in the tests).

Imports: numpy, torch, transformers.audio_utils.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from omnistep.layers.ecapa_tdnn import EcapaConfig, SpeakerEncoder

SAMPLE_RATE = 24000
"""Input rate of ``extract_speaker_embedding`` (upstream asserts it)."""
N_FFT = 1024
HOP_LENGTH = 256
WIN_LENGTH = 1024
N_MELS = 128
F_MIN = 0.0
F_MAX = 12000.0
MIN_SAMPLES = N_FFT + 4 * HOP_LENGTH - 2 * ((N_FFT - HOP_LENGTH) // 2)
"""Fewest samples giving the 5 mel frames the ECAPA's widest reflect padding (4) needs (1280)."""
TENSOR_PREFIX = "speaker_encoder."
"""Name prefix of the speaker encoder's tensors in ``model.safetensors``."""


def mel_filter_bank(
    sample_rate: int = SAMPLE_RATE,
    n_fft: int = N_FFT,
    n_mels: int = N_MELS,
    f_min: float = F_MIN,
    f_max: float = F_MAX,
) -> np.ndarray:
    """librosa's ``filters.mel(sr, n_fft, n_mels, fmin, fmax)`` with its defaults
    (``htk=False``: Slaney mel scale; ``norm="slaney"``: each triangle divided by its width in Hz
    / 2), computed by ``transformers.audio_utils.mel_filter_bank``.

    Returns:
        float32 ``[n_mels, n_fft // 2 + 1]``.
    """
    from transformers.audio_utils import mel_filter_bank as _mel

    bank = _mel(
        num_frequency_bins=n_fft // 2 + 1,
        num_mel_filters=n_mels,
        min_frequency=float(f_min),
        max_frequency=float(f_max),
        sampling_rate=sample_rate,
        norm="slaney",
        mel_scale="slaney",
    )
    return np.ascontiguousarray(bank.T, dtype=np.float32)


def log_mel_spectrogram(
    audio: torch.Tensor,
    filters: torch.Tensor,
    window: torch.Tensor,
    n_fft: int = N_FFT,
    hop_length: int = HOP_LENGTH,
) -> torch.Tensor:
    """Upstream ``mel_spectrogram`` (``center=False``): reflect-pad ``(n_fft - hop) // 2`` on
    both sides, STFT with ``window``, magnitude ``sqrt(re^2 + im^2 + 1e-9)``, ``filters @ mag``,
    ``log(clamp(mel, 1e-5))``. (Upstream only prints a warning for samples outside [-1, 1].)

    Args:
        audio: float ``[B, N]``; N > (n_fft - hop_length) // 2 (reflect padding).
        filters: float32 ``[n_mels, n_fft // 2 + 1]`` (``mel_filter_bank``).
        window: float32 ``[win_length]`` (a periodic Hann window upstream).

    Returns:
        float32 ``[B, n_mels, frames]``, ``frames = (N + 2 * pad - n_fft) // hop_length + 1``.
    """
    pad = (n_fft - hop_length) // 2
    x = torch.nn.functional.pad(audio.float().unsqueeze(1), (pad, pad), mode="reflect").squeeze(1)
    spec = torch.stft(
        x,
        n_fft,
        hop_length=hop_length,
        win_length=window.shape[0],
        window=window,
        center=False,
        normalized=False,
        onesided=True,
        return_complex=True,
    )
    magnitude = torch.sqrt(torch.view_as_real(spec).pow(2).sum(-1) + 1e-9)
    return torch.log(torch.clamp(torch.matmul(filters, magnitude), min=1e-5))


class Qwen3TTSSpeakerEncoder(SpeakerEncoder):
    """The ECAPA-TDNN with upstream's mel front end: 24 kHz audio -> ``[enc_dim]``.

    State-dict names are upstream's without the ``speaker_encoder.`` prefix (the mel filters and
    the window are non-persistent buffers).

    Args:
        config: the ECAPA sizes (``speaker_encoder_config``: ``mel_dim`` must be 128, the mel
            bins upstream computes).

    Raises:
        ValueError: ``config.mel_dim`` is not ``N_MELS``.
    """

    def __init__(self, config: EcapaConfig):
        if config.mel_dim != N_MELS:
            raise ValueError(
                f"speaker_encoder_config.mel_dim must be {N_MELS} (upstream's mel bins), "
                f"got {config.mel_dim}"
            )
        super().__init__(config)
        self.enc_dim = config.enc_dim
        self.register_buffer("mel_filters", torch.from_numpy(mel_filter_bank()), persistent=False)
        self.register_buffer("window", torch.hann_window(WIN_LENGTH), persistent=False)

    @classmethod
    def from_tensors(
        cls,
        config: EcapaConfig,
        tensors: Mapping[str, torch.Tensor],
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> Qwen3TTSSpeakerEncoder:
        """Build from ``config`` and load ``speaker_encoder.*`` of ``tensors`` (official names;
        other names are ignored), cast to ``dtype`` (float32 by default: the published bf16
        weights upcast exactly; upstream runs it in the model's dtype).

        Raises:
            ValueError: a tensor is missing or misshapen (named); ``RuntimeError`` from
                ``load_state_dict`` for an unexpected ``speaker_encoder.*`` name.
        """
        model = cls(config)
        state = {
            name[len(TENSOR_PREFIX) :]: tensor
            for name, tensor in tensors.items()
            if name.startswith(TENSOR_PREFIX)
        }
        for name, want in model.state_dict().items():
            if name not in state:
                raise ValueError(f"tensor {TENSOR_PREFIX}{name} is missing")
            if tuple(state[name].shape) != tuple(want.shape):
                raise ValueError(
                    f"tensor {TENSOR_PREFIX}{name} has shape {list(state[name].shape)}, "
                    f"expected {list(want.shape)}"
                )
        model.load_state_dict(state, strict=True)
        model = model.to(device=device, dtype=dtype).eval()
        # the mel front end stays float32 whatever the encoder's dtype
        model.mel_filters = torch.from_numpy(mel_filter_bank()).to(device)
        model.window = torch.hann_window(WIN_LENGTH, device=device)
        return model

    def mel(self, audio: torch.Tensor) -> torch.Tensor:
        """Upstream's speaker-encoder mel of 24 kHz ``audio`` float ``[B, N]`` -> float32
        ``[B, frames, 128]`` (frames first, as the encoder takes it)."""
        mel = log_mel_spectrogram(audio.to(self.mel_filters.device), self.mel_filters, self.window)
        return mel.transpose(1, 2)

    @torch.inference_mode()
    def embed(self, audio: torch.Tensor | np.ndarray) -> torch.Tensor:
        """``extract_speaker_embedding``: 24 kHz mono ``audio`` ``[N]`` -> float32 ``[enc_dim]``.

        The mel is computed in float32 and the encoder runs in its parameters' dtype.

        Raises:
            ValueError: ``audio`` is not one-dimensional, or shorter than ``MIN_SAMPLES`` (the
                encoder's reflect padding needs 5 mel frames; clips are checked for >= 1 s
                before this).
        """
        x = torch.as_tensor(audio, dtype=torch.float32)
        if x.ndim != 1:
            raise ValueError(f"audio must be [N] mono, got shape {tuple(x.shape)}")
        if x.shape[0] < MIN_SAMPLES:
            raise ValueError(f"audio of {x.shape[0]} samples is shorter than {MIN_SAMPLES}")
        dtype = self.fc.weight.dtype
        return self(self.mel(x.unsqueeze(0)).to(dtype))[0].float()
