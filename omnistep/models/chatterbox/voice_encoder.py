"""Chatterbox's voice encoder: a 16 kHz clip -> T3's 256-d speaker embedding.

Upstream ``chatterbox/models/voice_encoder`` (``VoiceEncoder.embeds_from_wavs`` as
``ChatterboxTTS.prepare_conditionals`` calls it; config ``VoiceEncConfig``), a GE2E-style
speaker encoder (Wan et al., arXiv 1710.10467):

1. silence trimmed at both ends (librosa ``effects.trim``, top_db 20: frames of 2048 samples,
   hop 512, whose power is within 20 dB of the loudest frame's are kept);
2. a 40-bin power mel spectrogram (n_fft 400, hop 160, Hann window, centred with reflect
   padding; Slaney mel filters 0-8000 Hz, the ``librosa.filters.mel`` default, through
   transformers' ``mel_filter_bank``), not log-compressed;
3. partial windows of 160 frames every 77 frames (``rate`` 1.3: ``round(16000 / 1.3 / 160)``),
   the last kept when it covers at least 80 % (zero padded);
4. each window through a 3-layer LSTM (256), a linear projection and ReLU, L2-normalised;
   the windows' mean, L2-normalised, is the embedding.

Module names follow ``ve.safetensors`` (``lstm.*``, ``proj.*``).

Imports torch, numpy, transformers (``audio_utils.mel_filter_bank``).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

SAMPLE_RATE = 16000
NUM_MELS, N_FFT, HOP = 40, 400, 160
PARTIAL_FRAMES = 160
RATE, MIN_COVERAGE = 1.3, 0.8
TRIM_TOP_DB, TRIM_FRAME, TRIM_HOP = 20.0, 2048, 512


def trim_silence(wav: np.ndarray) -> np.ndarray:
    """``wav`` without its leading and trailing silence (librosa ``effects.trim`` with top_db
    20, frame 2048, hop 512: a frame's mean power, centred with zero padding, against the
    loudest frame's, in dB with floor 1e-10)."""
    pad = TRIM_FRAME // 2
    padded = np.pad(wav.astype(np.float64), (pad, pad))
    frames = 1 + (len(padded) - TRIM_FRAME) // TRIM_HOP
    index = np.arange(TRIM_FRAME)[None, :] + TRIM_HOP * np.arange(frames)[:, None]
    power = np.mean(np.abs(padded[index]) ** 2, axis=1)
    db = 10 * np.log10(np.maximum(1e-10, power)) - 10 * np.log10(max(1e-10, power.max()))
    loud = np.flatnonzero(db > -TRIM_TOP_DB)
    if loud.size == 0:
        return wav[:0]
    start = int(loud[0]) * TRIM_HOP
    end = min(len(wav), (int(loud[-1]) + 1) * TRIM_HOP)
    return wav[start:end]


def mel_filters() -> torch.Tensor:
    """``[40, 201]`` float32 Slaney mel filters (``librosa.filters.mel(sr=16000, n_fft=400,
    n_mels=40, fmax=8000)``)."""
    from transformers.audio_utils import mel_filter_bank

    bank = mel_filter_bank(
        num_frequency_bins=N_FFT // 2 + 1,
        num_mel_filters=NUM_MELS,
        min_frequency=0.0,
        max_frequency=8000.0,
        sampling_rate=SAMPLE_RATE,
        norm="slaney",
        mel_scale="slaney",
    )
    return torch.from_numpy(bank.T.astype(np.float32))


def partial_starts(num_frames: int) -> tuple[list[int], int]:
    """The partial windows' first frames and the frames they need (upstream ``get_num_wins``
    with step ``round(16000 / 1.3 / 160)``: a last window covering >= 80 % is kept)."""
    step = int(np.round((SAMPLE_RATE / RATE) / PARTIAL_FRAMES))
    count, remainder = divmod(max(num_frames - PARTIAL_FRAMES + step, 0), step)
    if count == 0 or (remainder + (PARTIAL_FRAMES - step)) / PARTIAL_FRAMES >= MIN_COVERAGE:
        count += 1
    return [i * step for i in range(count)], PARTIAL_FRAMES + step * (count - 1)


class VoiceEncoder(nn.Module):
    """The speaker encoder; tensors of ``ve.safetensors``.

    Args:
        hidden: LSTM width (256).
        embed_dim: embedding width (256).
    """

    def __init__(self, hidden: int = 256, embed_dim: int = 256):
        super().__init__()
        self.lstm = nn.LSTM(NUM_MELS, hidden, num_layers=3, batch_first=True)
        self.proj = nn.Linear(hidden, embed_dim)
        self.register_buffer("mel_basis", mel_filters(), persistent=False)
        window = torch.hann_window(N_FFT, periodic=True, dtype=torch.float64).float()
        self.register_buffer("window", window, persistent=False)

    def mel(self, wav: torch.Tensor) -> torch.Tensor:
        """``[L]`` float32 16 kHz -> ``[frames, 40]`` power mel (``1 + L // 160`` frames)."""
        spec = torch.stft(
            wav,
            N_FFT,
            HOP,
            N_FFT,
            window=self.window,
            center=True,
            pad_mode="reflect",
            return_complex=True,
        )
        return (self.mel_basis @ spec.abs().pow(2)).transpose(0, 1)

    @torch.inference_mode()
    def forward(self, wav: np.ndarray) -> torch.Tensor:
        """The embedding ``[embed_dim]`` float32 of a 16 kHz mono clip (float samples).

        Raises:
            ValueError: the clip is silent or empty (nothing left after trimming).
        """
        trimmed = trim_silence(np.asarray(wav, dtype=np.float32))
        if trimmed.size == 0:
            raise ValueError("the reference clip is silent")
        device = self.proj.weight.device
        mel = self.mel(torch.from_numpy(np.ascontiguousarray(trimmed)).to(device))
        starts, needed = partial_starts(mel.shape[0])
        mel = F.pad(mel, (0, 0, 0, max(0, needed - mel.shape[0])))
        partials = torch.stack([mel[s : s + PARTIAL_FRAMES] for s in starts])
        _, (hidden, _) = self.lstm(partials)
        embeds = F.relu(self.proj(hidden[-1]))
        embeds = embeds / torch.linalg.norm(embeds, dim=1, keepdim=True)
        mean = embeds.mean(dim=0)
        return mean / torch.linalg.norm(mean)
