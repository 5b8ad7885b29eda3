"""The features Chatterbox computes from a reference clip, without torchaudio.

Upstream (``chatterbox-tts`` 0.1.7, ``ChatterboxTTS.prepare_conditionals`` and
``S3Token2Mel.embed_ref``) computes them with torchaudio and librosa; these are torch
functions of the same definitions:

- ``resample_sinc``: torchaudio's ``transforms.Resample`` default (``sinc_interp_hann``,
  ``lowpass_filter_width`` 6, ``rolloff`` 0.99): a windowed-sinc polyphase filter, the window
  ``cos(pi t / (2 * 6))^2`` over 6 zero crossings of the low-pass at ``0.99 * min(rates) / 2``;
  ``embed_ref`` uses it to take the 24 kHz clip to 16 kHz.
- ``kaldi_fbank``: Kaldi's ``compute-fbank-feats`` as ``torchaudio.compliance.kaldi.fbank``
  runs it with ``num_mel_bins=80`` and its other defaults (25 ms Povey windows every 10 ms,
  ``snip_edges``, DC offset removed, pre-emphasis 0.97, FFT of 512, power spectrum, 80
  triangular mel bins from 20 Hz to Nyquist on the ``1127 ln(1 + f / 700)`` mel scale, log with
  a floor of float32's epsilon, no dither): CAMPPlus's input (``xvector.extract_feature``
  subtracts its mean over time).
- ``s3_log_mel``: the S3 tokenizer's 128-bin log mel (``s3tokenizer.S3Tokenizer.
  log_mel_spectrogram``, Whisper's recipe): 16 kHz, centred STFT (n_fft 400, hop 160, periodic
  Hann, reflect padding), the last frame dropped, power through librosa's Slaney mel filters
  (``librosa.filters.mel(sr=16000, n_fft=400, n_mels=128)``), ``log10`` floored at 1e-10,
  clipped to 8 below its maximum, then ``(x + 4) / 4``.
- ``s3gen_mel``: S3Gen's prompt mel (``s3gen/utils/mel.py``, Matcha-TTS's
  ``mel_spectrogram`` with CosyVoice's settings): 24 kHz, reflect padding of 720 samples each
  side, STFT n_fft 1920, hop 480, periodic Hann of 1920, not centred, magnitude
  ``sqrt(power + 1e-9)``, 80 Slaney mel filters 0-8000 Hz, natural log floored at 1e-5.

Mel filters come from transformers' ``audio_utils.mel_filter_bank`` (librosa's Slaney filters).

Imports torch, numpy and transformers.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch
import torch.nn.functional as F

S3_RATE = 16000
"""The S3 tokenizer's and CAMPPlus's sample rate (Hz)."""
S3GEN_RATE = 24000
"""S3Gen's sample rate (Hz)."""


@functools.lru_cache(maxsize=8)
def slaney_mel_filters(
    sample_rate: int, n_fft: int, num_mels: int, fmax: float | None = None
) -> torch.Tensor:
    """``[num_mels, n_fft // 2 + 1]`` float32: ``librosa.filters.mel(sr, n_fft, n_mels,
    fmin=0, fmax)`` (Slaney scale and area norm; ``fmax`` None is Nyquist)."""
    from transformers.audio_utils import mel_filter_bank

    bank = mel_filter_bank(
        num_frequency_bins=n_fft // 2 + 1,
        num_mel_filters=num_mels,
        min_frequency=0.0,
        max_frequency=float(sample_rate / 2 if fmax is None else fmax),
        sampling_rate=sample_rate,
        norm="slaney",
        mel_scale="slaney",
    )
    return torch.from_numpy(np.ascontiguousarray(bank.T, dtype=np.float32))


# ----------------------------------------------------------------------------- resampling


@functools.lru_cache(maxsize=8)
def _sinc_kernel(orig: int, new: int, zeros: int = 6, rolloff: float = 0.99):
    """The polyphase windowed-sinc filter ``[new, 1, taps]`` float32 (in float64 first) and its
    half width, for rates already divided by their gcd."""
    cutoff = min(orig, new) * rolloff
    width = math.ceil(zeros * orig / cutoff)
    # input offsets (in output periods) each of the `new` phases sees
    taps = torch.arange(-width, width + orig, dtype=torch.float64) / orig
    phase = -torch.arange(new, dtype=torch.float64)[:, None] / new
    t = ((phase + taps[None, :]) * cutoff).clamp(-zeros, zeros)
    window = torch.cos(t * math.pi / zeros / 2) ** 2
    arg = t * math.pi
    sinc = torch.where(arg == 0, torch.ones_like(arg), torch.sin(arg) / arg)
    kernel = sinc * window * (cutoff / orig)
    return kernel[:, None, :].to(torch.float32), width


def resample_sinc(wav: torch.Tensor, orig_rate: int, new_rate: int) -> torch.Tensor:
    """``wav`` ``[..., L]`` float resampled from ``orig_rate`` to ``new_rate`` Hz with
    torchaudio's default windowed-sinc filter (``ceil(new * L / orig)`` samples)."""
    if orig_rate == new_rate:
        return wav
    g = math.gcd(int(orig_rate), int(new_rate))
    orig, new = orig_rate // g, new_rate // g
    kernel, width = _sinc_kernel(orig, new)
    shape, length = wav.shape[:-1], wav.shape[-1]
    x = F.pad(wav.reshape(-1, 1, length), (width, width + orig))
    y = F.conv1d(x, kernel.to(device=wav.device, dtype=wav.dtype), stride=orig)
    y = y.transpose(1, 2).reshape(*shape, -1)
    return y[..., : math.ceil(new * length / orig)]


# ----------------------------------------------------------------------------- Kaldi fbank

FBANK_WINDOW, FBANK_SHIFT, FBANK_FFT = 400, 160, 512
"""Kaldi's 25 ms / 10 ms frames at 16 kHz and the FFT size (the window rounded to a power of 2)."""
FBANK_LOW_HZ, PREEMPHASIS = 20.0, 0.97


@functools.lru_cache(maxsize=4)
def kaldi_mel_banks(num_bins: int = 80, rate: int = S3_RATE) -> torch.Tensor:
    """``[num_bins, FBANK_FFT // 2 + 1]`` float32 Kaldi mel triangles (``MelBanks``: mel
    ``1127 ln(1 + f / 700)``, bins evenly spaced in mel from 20 Hz to Nyquist, each triangle
    evaluated at the FFT bins' frequencies; the Nyquist bin's weight is 0)."""

    half = FBANK_FFT // 2
    # the edges in float64 (Kaldi's scalar mel), the FFT bins' mels in float32
    low, high = (1127.0 * math.log(1.0 + f / 700.0) for f in (FBANK_LOW_HZ, rate / 2.0))
    delta = (high - low) / (num_bins + 1)
    edges = low + delta * torch.arange(num_bins + 2, dtype=torch.float32)
    left, center, right = edges[:-2, None], edges[1:-1, None], edges[2:, None]
    freqs = torch.arange(half, dtype=torch.float32) * (rate / FBANK_FFT)
    bins = (1127.0 * (1.0 + freqs / 700.0).log())[None, :]
    up, down = (bins - left) / (center - left), (right - bins) / (right - center)
    weights = torch.clamp(torch.minimum(up, down), min=0.0)
    return F.pad(weights, (0, 1))


def kaldi_fbank(wav: torch.Tensor, num_bins: int = 80) -> torch.Tensor:
    """Kaldi log mel filterbank energies of a 16 kHz clip ``[L]`` float: ``[frames, num_bins]``
    float32, ``frames = 1 + (L - 400) // 160`` (0 for a clip under 25 ms)."""
    wav = wav.reshape(-1).float()
    if wav.numel() < FBANK_WINDOW:
        return wav.new_zeros(0, num_bins)
    frames = wav.unfold(0, FBANK_WINDOW, FBANK_SHIFT)  # [F, 400]
    frames = frames - frames.mean(dim=1, keepdim=True)
    previous = torch.cat([frames[:, :1], frames[:, :-1]], dim=1)
    frames = frames - PREEMPHASIS * previous
    povey = torch.hann_window(FBANK_WINDOW, periodic=False, device=wav.device).pow(0.85)
    frames = F.pad(frames * povey, (0, FBANK_FFT - FBANK_WINDOW))
    power = torch.fft.rfft(frames).abs().pow(2)  # [F, 257]
    energies = power @ kaldi_mel_banks(num_bins).to(wav.device).T
    return torch.clamp(energies, min=torch.finfo(torch.float32).eps).log()


# ----------------------------------------------------------------------------- log mels

S3_FFT, S3_HOP, S3_MELS = 400, 160, 128


def s3_log_mel(wav: torch.Tensor) -> torch.Tensor:
    """The S3 tokenizer's log mel of a 16 kHz clip ``[L]`` float: ``[128, L // 160]`` float32."""
    wav = wav.reshape(-1).float()
    window = torch.hann_window(S3_FFT, device=wav.device)
    stft = torch.stft(wav, S3_FFT, S3_HOP, window=window, return_complex=True)
    power = stft[..., :-1].abs() ** 2
    mel = slaney_mel_filters(S3_RATE, S3_FFT, S3_MELS).to(wav.device) @ power
    log = torch.clamp(mel, min=1e-10).log10()
    log = torch.maximum(log, log.max() - 8.0)
    return (log + 4.0) / 4.0


MEL_FFT, MEL_HOP, MEL_BINS, MEL_FMAX = 1920, 480, 80, 8000.0


def s3gen_mel(wav: torch.Tensor) -> torch.Tensor:
    """S3Gen's prompt mel of a 24 kHz clip ``[L]`` float: ``[frames, 80]`` float32 (50 Hz,
    ``frames = (L + 1440 - 1920) // 480 + 1``; needs ``L > 720``, reflect padding).

    Raises:
        ValueError: a clip too short for the reflect padding (720 samples or fewer).
    """
    wav = wav.reshape(1, -1).float()
    pad = (MEL_FFT - MEL_HOP) // 2
    if wav.shape[-1] <= pad:
        raise ValueError(f"a clip of {wav.shape[-1]} samples is too short for S3Gen's mel")
    wav = F.pad(wav[:, None], (pad, pad), mode="reflect")[:, 0]
    window = torch.hann_window(MEL_FFT, device=wav.device)
    spec = torch.stft(
        wav, MEL_FFT, MEL_HOP, MEL_FFT, window=window, center=False, return_complex=True
    )
    magnitude = torch.sqrt(torch.view_as_real(spec).pow(2).sum(-1) + 1e-9)
    mel = slaney_mel_filters(S3GEN_RATE, MEL_FFT, MEL_BINS, MEL_FMAX).to(wav.device) @ magnitude
    return torch.log(torch.clamp(mel, min=1e-5))[0].transpose(0, 1)
