"""Sample-level helpers: float to 16-bit PCM conversion and edge-silence trimming.

Imports only numpy and the audio plane's own modules (never torch, never other omnistep planes).
"""

import numpy as np

from omnistep.audio.resample import as_mono_float32

S16_SCALE = 32767.0
"""Full scale of the float -> int16 mapping: 1.0 -> 32767, -1.0 -> -32767."""


def float_to_s16(samples: np.ndarray) -> np.ndarray:
    """Convert float samples to int16.

    Values are clipped to [-1, 1], scaled by 32767 and rounded to nearest (ties to even); NaN
    maps to 0.

    Args:
        samples: float, any shape.

    Returns:
        int16 little endian, the same shape.
    """
    array = np.nan_to_num(np.asarray(samples, dtype=np.float32), nan=0.0)
    return np.rint(np.clip(array, -1.0, 1.0) * S16_SCALE).astype("<i2")


def float_to_s16le(samples: np.ndarray) -> bytes:
    """Convert float samples to 16-bit signed little-endian PCM bytes (see `float_to_s16`).

    Args:
        samples: float [n] (any shape is flattened in C order).

    Returns:
        2 * n bytes.
    """
    return float_to_s16(samples).tobytes()


def trim_silence(samples: np.ndarray, threshold: float = 1e-3, pad: int = 0) -> np.ndarray:
    """Drop the leading and trailing silence of a mono signal, never its interior.

    A sample is silent when |x| <= `threshold`. Everything from `pad` samples before the first
    loud sample to `pad` samples after the last one is kept (clamped to the signal), including
    silent stretches in between.

    Args:
        samples: float [n].
        threshold: silence level in full-scale units, >= 0.
        pad: samples of margin kept on each side, >= 0.

    Returns:
        float32 [m], a view of the input when it already is float32; empty when every sample is
        silent.

    Raises:
        ValueError: `samples` is not one-dimensional, or `threshold` or `pad` is negative.
    """
    if threshold < 0:
        raise ValueError(f"threshold must be >= 0, got {threshold}")
    if pad < 0:
        raise ValueError(f"pad must be >= 0, got {pad}")
    array = as_mono_float32(samples)
    loud = np.flatnonzero(np.abs(array) > threshold)
    if loud.size == 0:
        return array[:0]
    start = max(int(loud[0]) - pad, 0)
    stop = min(int(loud[-1]) + 1 + pad, array.shape[0])
    return array[start:stop]
