"""Decode an uploaded audio file (bytes) to float32 samples: WAV, FLAC, OGG/Vorbis/Opus, MP3
through libsndfile (``soundfile``), anything else FFmpeg reads (WebM, M4A/AAC, MP3 where
libsndfile has no MP3) through PyAV.

Decoding stops past ``max_seconds`` (a small compressed file may hold hours of audio): the
result then says ``truncated``. Channels are averaged to mono. Imports numpy, soundfile, av.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
import soundfile as sf

BLOCK_FRAMES = 1 << 16
"""Frames soundfile reads per block."""


class AudioDecodeError(ValueError):
    """The bytes are not audio either decoder reads (or hold no samples)."""


@dataclass(frozen=True)
class DecodedAudio:
    """Mono float32 ``samples`` ``[N]`` at ``sample_rate`` Hz; ``truncated``: decoding stopped
    at ``max_seconds`` (the file is longer)."""

    samples: np.ndarray
    sample_rate: int
    truncated: bool = False

    @property
    def seconds(self) -> float:
        """Duration of ``samples``."""
        return self.samples.shape[0] / self.sample_rate


def decode_audio(data: bytes, max_seconds: float | None = None) -> DecodedAudio:
    """Decode ``data`` (a whole audio file) to mono float32.

    Args:
        data: the file's bytes.
        max_seconds: stop after this much audio (then ``truncated`` is True and the samples
            are cut there); None decodes everything.

    Raises:
        AudioDecodeError: empty input, not audio, no audio stream, no samples, or NaN or
            infinite samples (a float WAV may hold them).
    """
    if not data:
        raise AudioDecodeError("the file is empty")
    try:
        return _decode_soundfile(data, max_seconds)
    except (sf.LibsndfileError, RuntimeError, TypeError):
        pass  # not a format libsndfile reads (or not audio): try FFmpeg
    return _decode_av(data, max_seconds)


def _limit(sample_rate: int, max_seconds: float | None) -> int | None:
    return None if max_seconds is None else int(np.ceil(max_seconds * sample_rate))


def _decode_soundfile(data: bytes, max_seconds: float | None) -> DecodedAudio:
    with sf.SoundFile(io.BytesIO(data)) as f:
        rate = int(f.samplerate)
        limit = _limit(rate, max_seconds)
        parts, total = [], 0
        for block in f.blocks(blocksize=BLOCK_FRAMES, dtype="float32", always_2d=True):
            parts.append(block.mean(axis=1, dtype=np.float32))
            total += block.shape[0]
            if limit is not None and total > limit:
                break
    return _result(parts, rate, limit)


def _decode_av(data: bytes, max_seconds: float | None) -> DecodedAudio:
    import av

    try:
        container = av.open(io.BytesIO(data), mode="r")
    except (av.FFmpegError, ValueError, OSError):
        raise AudioDecodeError(
            "not an audio file this server reads (wav, flac, mp3, ogg, webm, m4a, ...)"
        ) from None
    with container:
        stream = next((s for s in container.streams if s.type == "audio"), None)
        if stream is None:
            raise AudioDecodeError("the file has no audio stream")
        rate = int(stream.rate or stream.codec_context.sample_rate or 0)
        if rate <= 0:
            raise AudioDecodeError("the audio stream has no sample rate")
        limit = _limit(rate, max_seconds)
        resampler = av.AudioResampler(format="fltp", layout=None, rate=rate)
        parts, total = [], 0
        try:
            for frame in container.decode(stream):
                for out in resampler.resample(frame):
                    planes = out.to_ndarray()  # [channels, n] float32 (planar)
                    parts.append(planes.mean(axis=0, dtype=np.float32))
                    total += planes.shape[1]
                if limit is not None and total > limit:
                    break
            else:
                for out in resampler.resample(None):  # flush
                    parts.append(out.to_ndarray().mean(axis=0, dtype=np.float32))
        except (av.FFmpegError, ValueError):
            if not parts:
                raise AudioDecodeError("the audio stream could not be decoded") from None
    return _result(parts, rate, limit)


def _result(parts: list[np.ndarray], rate: int, limit: int | None) -> DecodedAudio:
    samples = np.concatenate(parts) if parts else np.zeros(0, np.float32)
    truncated = limit is not None and samples.shape[0] > limit
    if truncated:
        samples = samples[:limit]
    if not samples.size:
        raise AudioDecodeError("the file holds no audio samples")
    if not np.isfinite(samples).all():  # float WAVs can hold them; encoders would turn to NaN
        raise AudioDecodeError("the file holds NaN or infinite samples")
    return DecodedAudio(np.ascontiguousarray(samples, dtype=np.float32), rate, truncated)
