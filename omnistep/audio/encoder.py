"""The streaming encoder contract shared by every output format.

Imports only numpy and the audio plane's own modules (never torch, never other omnistep planes).

An encoder takes float32 mono chunks at the model's rate, resamples them to 24 kHz with one
streaming `Resampler`, and encodes them keeping its state across calls, so that the bytes of all
`encode` calls followed by the bytes of the single `flush` call form one valid file or stream.
Every format's bytes are the same from run to run and for any chunking of the same input.
"""

from abc import ABC, abstractmethod

import numpy as np

from omnistep.audio.formats import OUTPUT_SAMPLE_RATE
from omnistep.audio.resample import Resampler


class StreamEncoder(ABC):
    """Base of the per-format streaming encoders; build one with `make_encoder`.

    Subclasses implement `_encode_output` (samples already at 24 kHz, clipped to [-1, 1]) and
    `_finish` (the codec's and container's trailing bytes).

    Args:
        in_rate: sample rate of the chunks passed to `encode`, in Hz, > 0.

    Attributes:
        fmt: the format name, one of `FORMATS`.
        in_rate: the input sample rate in Hz.
        num_samples: samples at 24 kHz handed to the codec so far.
    """

    fmt: str = ""

    def __init__(self, in_rate: int):
        self.in_rate = in_rate
        self.num_samples = 0
        self._resampler = Resampler(in_rate, OUTPUT_SAMPLE_RATE)
        self._flushed = False

    def encode(self, samples: np.ndarray) -> bytes:
        """Encode the next chunk and return the bytes that became ready (possibly none).

        Args:
            samples: float32 [n] at `in_rate`; values outside [-1, 1] are clipped.

        Raises:
            ValueError: `samples` is not one-dimensional.
            RuntimeError: called after `flush`.
        """
        self._check_open()
        return self._encode_resampled(self._resampler.process(samples))

    def flush(self) -> bytes:
        """End the stream and return its trailing bytes. Call exactly once, after the last chunk.

        Raises:
            RuntimeError: called twice.
        """
        self._check_open()
        self._flushed = True
        tail = self._encode_resampled(self._resampler.flush())
        return tail + self._finish()

    def with_lengths(self, data: bytes) -> bytes:
        """Return this encoder's complete output with its length fields filled in.

        Streamed headers are written before the length is known; a non-streamed response may
        call this after `flush` on the concatenated bytes to state exact lengths. Formats whose
        headers hold no length return `data` unchanged.

        Raises:
            RuntimeError: called before `flush`.
        """
        if not self._flushed:
            raise RuntimeError("with_lengths needs the complete stream: call flush() first")
        return data

    def _encode_resampled(self, samples: np.ndarray) -> bytes:
        self.num_samples += samples.shape[0]
        return self._encode_output(np.clip(samples, -1.0, 1.0))

    def _check_open(self) -> None:
        if self._flushed:
            raise RuntimeError(f"{self.fmt} encoder was already flushed")

    @abstractmethod
    def _encode_output(self, samples: np.ndarray) -> bytes:
        """Encode float32 [n] samples at 24 kHz in [-1, 1]; return the bytes now ready."""

    @abstractmethod
    def _finish(self) -> bytes:
        """Drain the codec and close the container; return the trailing bytes."""
