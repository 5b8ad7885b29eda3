"""hibari's waveform synthesis: network frames (spectral parts + f0) -> 24 kHz float32 audio.

The hibari network predicts, per 12.5 ms frame (hop 300 samples at 24 kHz), five spectral parts
over the 601 bins of a 1200-point FFT and an f0 value. The waveform is one inverse STFT of

    S = exp(lh) e^{i pi tanh(th)} STFT(pulses(f0)) + exp(ln) Z + exp(lr) e^{i phi}

where ``pulses(f0)`` is a band-limited pulse train following f0 (the harmonic branch, filtered
by magnitude ``exp(lh)`` and phase ``pi tanh(th)``), ``Z`` complex Gaussian noise shaped by
``exp(ln)`` (the noise branch) and ``exp(lr) e^{i phi}`` a free-phase residual. Every log
magnitude is clamped at 7 before ``exp``. The STFT and the inverse STFT are those of
``torch.stft`` / ``torch.istft`` with ``n_fft=1200, hop_length=300``, a periodic Hann window,
``center=True`` (reflect padding) and ``length = frames * 300``.

Source of the formula, the constants and the noise draw: ``hibari/dsp.py`` of hibari-tts 0.2.1
(``synth``, ``pulses``, ``stft``, ``ola``, ``ex``). The code here is our own (numpy only; numpy
>= 2 runs float32 FFTs natively); ``tests/test_hibari.py`` checks it against hibari's own
``Hibari.from_phonemes`` on the same phonemes, speed and seed (max abs difference <= 1e-4).

Imports: numpy.
"""

from __future__ import annotations

import functools

import numpy as np

SAMPLE_RATE = 24_000
"""Output samples per second, Hz."""
N_FFT = 1200
"""FFT size of the STFT the network's frames live in (50 ms)."""
HOP = 300
"""Samples per frame (12.5 ms, 80 frames per second)."""
BINS = N_FFT // 2 + 1
"""Frequency bins per frame (601)."""
MAX_LOG_MAGNITUDE = 7.0
"""Log magnitudes are clamped here before ``exp`` (hibari's ``ex``)."""
VOICED_HZ = 40.0
"""Frames (samples) whose f0 is below this are unvoiced: no pulses there."""
MAX_HARMONIC_HZ = 11_000.0
"""The pulse train holds every harmonic of f0 below this frequency."""


@functools.cache
def hann_window() -> np.ndarray:
    """The periodic Hann window of ``N_FFT`` samples (``torch.hann_window(1200)``), float32."""
    n = np.arange(N_FFT, dtype=np.float64)
    return (0.5 - 0.5 * np.cos(2.0 * np.pi * n / N_FFT)).astype(np.float32)


@functools.cache
def _analysis_window() -> np.ndarray:
    """The window the pulse train is analysed with: Hann / (N_FFT / 4), so that a unit cosine
    peaks at 1 in the STFT and ``exp(lh)`` is the magnitude of each harmonic."""
    return hann_window() / np.float32(N_FFT / 4)


@functools.cache
def _interpolation_weights() -> tuple[np.ndarray, np.ndarray]:
    """Weights of frame ``k`` and of its neighbour for the ``HOP`` samples of frame ``k``
    (linear interpolation, ``align_corners=False``): sample ``j`` lies at frame position
    ``k + (j + 0.5) / HOP - 0.5``; the first half of the frame interpolates towards frame
    ``k - 1``, the second half towards ``k + 1``. Returns (own, neighbour), float32 [HOP]."""
    neighbour = (((np.arange(HOP) + 0.5) / HOP - 0.5) % 1.0).astype(np.float32)
    own = (1.0 - neighbour).astype(np.float32)
    # first half: the weight on frame k is `neighbour` (k-1 gets `own`); swap so that
    # `own` is always frame k's weight
    own[: HOP // 2], neighbour[: HOP // 2] = neighbour[: HOP // 2].copy(), own[: HOP // 2].copy()
    return own, neighbour


def upsample_f0(f0: np.ndarray) -> np.ndarray:
    """Per-frame f0 (Hz, [F]) -> per-sample f0 (Hz, float32 [F * HOP]) by linear interpolation
    between frame centres (edges held), as ``torch.nn.functional.interpolate(mode="linear",
    align_corners=False)`` does."""
    f0 = np.asarray(f0, dtype=np.float32).reshape(-1)
    own, neighbour = _interpolation_weights()
    padded = np.pad(f0, 1, mode="edge")
    half = HOP // 2
    out = np.empty((f0.size, HOP), np.float32)
    # first half of each frame: previous frame and this one; second half: this one and the next
    out[:, :half] = padded[:-2, None] * neighbour[:half] + f0[:, None] * own[:half]
    out[:, half:] = f0[:, None] * own[half:] + padded[2:, None] * neighbour[half:]
    return out.reshape(-1)


def pulse_train(f0: np.ndarray) -> np.ndarray:
    """A band-limited pulse train following ``f0``.

    Each voiced sample is ``sum_{h=1..H} cos(h t) = sin((H + 1/2) t) / (2 sin(t / 2)) - 1/2``
    with ``t`` the running phase of f0 (wrapped to [0, 2 pi)) and ``H = floor(11000 / f)`` the
    harmonics below 11 kHz (limit ``H`` where ``|2 sin(t/2)| <= 2e-3``); samples whose f0 is
    below 40 Hz are 0 (their phase runs on at 40 Hz).

    Args:
        f0: per-frame fundamental frequency, Hz, [F].

    Returns:
        float32 [F * HOP] at ``SAMPLE_RATE``.
    """
    freq = upsample_f0(f0)
    voiced = freq > VOICED_HZ
    freq = np.maximum(freq, np.float32(VOICED_HZ))
    cycles = np.cumsum(freq, dtype=np.float64) / SAMPLE_RATE
    phase = ((cycles - np.floor(cycles)) * (2.0 * np.pi)).astype(np.float32)
    harmonics = np.floor(np.float32(MAX_HARMONIC_HZ) / freq) + np.float32(0.5)
    denominator = 2.0 * np.sin(0.5 * phase)
    near_zero = np.abs(denominator) <= 2e-3
    denominator[near_zero] = 1.0
    out = np.sin(harmonics * phase) / denominator
    out[near_zero] = harmonics[near_zero]
    out -= np.float32(0.5)
    out[~voiced] = 0.0
    return out


def stft(signal: np.ndarray, num_frames: int) -> np.ndarray:
    """``torch.stft(center=True, pad_mode="reflect", n_fft=1200, hop=300)`` of ``signal`` with
    the window ``Hann / 300`` (``_analysis_window``): the first ``num_frames`` frames.

    Args:
        signal: float32 [num_samples], num_samples > N_FFT // 2.
        num_frames: frames to keep (<= num_samples // HOP + 1).

    Returns:
        complex64 [BINS, num_frames].
    """
    padded = np.pad(signal, N_FFT // 2, mode="reflect")
    frames = np.lib.stride_tricks.sliding_window_view(padded, N_FFT)[::HOP][:num_frames]
    return np.fft.rfft(frames * _analysis_window(), axis=1).T


@functools.lru_cache(maxsize=16)
def _inverse_window_sum(num_frames: int) -> np.ndarray:
    """1 / (overlap-added squared Hann window) over the ``(num_frames + N_FFT/HOP - 1) * HOP``
    samples of an inverse STFT (torch.istft's envelope; tiny sums are left at 1 / 1e-11)."""
    squared = hann_window() ** 2
    envelope = _overlap_add(np.broadcast_to(squared, (num_frames, N_FFT)))
    return 1.0 / np.maximum(envelope, np.float32(1e-11))


def _overlap_add(frames: np.ndarray) -> np.ndarray:
    """Sum frames [F, N_FFT] placed every HOP samples -> float32 [(F + N_FFT/HOP - 1) * HOP].
    N_FFT is a multiple of HOP, so frame ``f``'s block ``k`` lands on output block ``f + k``."""
    num_frames = frames.shape[0]
    blocks = N_FFT // HOP
    out = np.zeros((num_frames + blocks - 1, HOP), np.float32)
    for k in range(blocks):
        out[k : k + num_frames] += frames[:, k * HOP : (k + 1) * HOP]
    return out.reshape(-1)


def istft(spec: np.ndarray) -> np.ndarray:
    """``torch.istft(spec, n_fft=1200, hop_length=300, window=hann, center=True,
    length=F * 300)``: inverse FFT of each frame, Hann window, overlap-add, division by the
    summed squared window, the first ``N_FFT // 2`` samples (the centre padding) dropped.

    Args:
        spec: complex [BINS, F].

    Returns:
        float32 [F * HOP].
    """
    num_frames = spec.shape[1]
    frames = np.fft.irfft(spec.T, n=N_FFT, axis=1).astype(np.float32, copy=False)
    frames *= hann_window()
    audio = _overlap_add(frames) * _inverse_window_sum(num_frames)
    start = N_FFT // 2
    return audio[start : start + num_frames * HOP]


def _exp(log_magnitude: np.ndarray) -> np.ndarray:
    """``exp(min(x, 7))`` in float32."""
    return np.exp(np.minimum(log_magnitude, np.float32(MAX_LOG_MAGNITUDE)), dtype=np.float32)


def _unit_phasor(angle: np.ndarray) -> np.ndarray:
    """``e^{i angle}`` as complex64."""
    out = np.empty(angle.shape, np.complex64)
    np.cos(angle, out=out.real)
    np.sin(angle, out=out.imag)
    return out


def draw_noise(rng: np.random.Generator, num_frames: int) -> np.ndarray:
    """The noise branch's ``Z``: complex64 [BINS, num_frames] whose real and imaginary parts
    are standard normals, drawn as hibari does (one ``standard_normal((BINS, 2 F), float32)``
    call, adjacent pairs read as (real, imag)), so that the same Generator state gives the same
    noise here and in hibari."""
    noise = rng.standard_normal((BINS, 2 * num_frames), dtype=np.float32)
    return noise.view(np.complex64)


def spectrum(
    lh: np.ndarray,
    th: np.ndarray,
    ln: np.ndarray,
    lr: np.ndarray,
    phi: np.ndarray,
    f0: np.ndarray,
    rng: np.random.Generator,
) -> np.ndarray:
    """The composed spectrum ``S`` (module docstring) of one sentence.

    Args:
        lh, th, ln, lr, phi: the network's outputs without the batch axis, float32 [BINS, F]:
            harmonic log magnitude, harmonic phase (pre-tanh), noise log magnitude, residual
            log magnitude, residual phase (radians).
        f0: fundamental frequency per frame, Hz, float32 [F].
        rng: draws the noise ``Z`` (``draw_noise``).

    Returns:
        complex64 [BINS, F].

    Raises:
        ValueError: the parts do not share the shape [BINS, F] or f0 is not [F].
    """
    shape = np.shape(lh)
    if len(shape) != 2 or shape[0] != BINS:
        raise ValueError(f"lh must be [{BINS}, F], got {shape}")
    for name, part in (("th", th), ("ln", ln), ("lr", lr), ("phi", phi)):
        if np.shape(part) != shape:
            raise ValueError(f"{name} must be {list(shape)} like lh, got {np.shape(part)}")
    if np.shape(f0) != (shape[1],):
        raise ValueError(f"f0 must be [{shape[1]}], got {np.shape(f0)}")
    num_frames = shape[1]
    harmonic = stft(pulse_train(f0), num_frames)
    harmonic *= _unit_phasor(np.float32(np.pi) * np.tanh(th)) * _exp(lh)
    noise = draw_noise(rng, num_frames)
    noise *= _exp(ln)
    residual = _unit_phasor(phi) * _exp(lr)
    return harmonic + noise + residual


def synthesize(
    lh: np.ndarray,
    th: np.ndarray,
    ln: np.ndarray,
    lr: np.ndarray,
    phi: np.ndarray,
    f0: np.ndarray,
    rng: np.random.Generator,
) -> np.ndarray:
    """The waveform of one sentence: ``istft(spectrum(...))``.

    Args: as ``spectrum`` (F frames).

    Returns:
        float32 [F * HOP] at ``SAMPLE_RATE`` Hz (about [-1, 1]; not clipped).

    Raises:
        ValueError: as ``spectrum``.
    """
    if np.shape(lh)[-1] == 0:
        return np.zeros(0, np.float32)
    return istft(spectrum(lh, th, ln, lr, phi, f0, rng))
