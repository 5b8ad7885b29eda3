"""Streaming sample-rate conversion for mono float32 audio.

Imports only numpy and soxr (never torch, never other omnistep planes).

Chunked processing is bit-exact with one-shot processing on the same data: soxr's stream state
carries the filter history across calls, so the output depends only on the concatenated input,
never on where it was cut.
"""

from typing import Literal

import numpy as np
import soxr

Quality = Literal["HQ", "VHQ"]


def as_mono_float32(samples: np.ndarray) -> np.ndarray:
    """Return `samples` as a contiguous float32 array of shape [n].

    Raises:
        ValueError: `samples` is not one-dimensional.
    """
    array = np.ascontiguousarray(samples, dtype=np.float32)
    if array.ndim != 1:
        raise ValueError(f"samples must be mono with shape [n], got shape {array.shape}")
    return array


class Resampler:
    """Converts a mono float32 stream from `in_rate` Hz to `out_rate` Hz, chunk by chunk.

    Wraps `soxr.ResampleStream`. Feeding a signal in one `process` call or in any number of
    uneven chunks, then calling `flush`, yields exactly the same samples (bit-identical, checked
    in tests). When the rates match the samples pass through unchanged (as float32 copies).

    Args:
        in_rate: input sample rate in Hz, > 0.
        out_rate: output sample rate in Hz, > 0.
        quality: soxr quality preset, "HQ" (default) or "VHQ".

    Raises:
        ValueError: a rate is not positive or `quality` is unknown.
    """

    def __init__(self, in_rate: int, out_rate: int, quality: Quality = "HQ"):
        if in_rate <= 0 or out_rate <= 0:
            raise ValueError(f"in_rate and out_rate must be > 0, got {in_rate} and {out_rate}")
        if quality not in ("HQ", "VHQ"):
            raise ValueError(f"quality must be 'HQ' or 'VHQ', got {quality!r}")
        self.in_rate = in_rate
        self.out_rate = out_rate
        self._stream = None
        if in_rate != out_rate:
            self._stream = soxr.ResampleStream(in_rate, out_rate, 1, "float32", quality)
        self._flushed = False

    def process(self, samples: np.ndarray) -> np.ndarray:
        """Resample the next chunk.

        Args:
            samples: float32 [n] at `in_rate` (other float dtypes are converted).

        Returns:
            float32 [m] at `out_rate`; m may be 0 while the filter fills.

        Raises:
            ValueError: `samples` is not one-dimensional.
            RuntimeError: called after `flush`.
        """
        self._check_open()
        array = as_mono_float32(samples)
        if self._stream is None:
            return array.copy()
        return self._stream.resample_chunk(array)

    def flush(self) -> np.ndarray:
        """End the stream and return the samples still held by the filter.

        Returns:
            float32 [m] at `out_rate`.

        Raises:
            RuntimeError: called twice.
        """
        self._check_open()
        self._flushed = True
        if self._stream is None:
            return np.zeros(0, dtype=np.float32)
        return self._stream.resample_chunk(np.zeros(0, dtype=np.float32), last=True)

    def _check_open(self) -> None:
        if self._flushed:
            raise RuntimeError("Resampler was already flushed")
