"""Uncompressed encoders: raw pcm and streamed wav.

Imports only numpy and the audio plane's own modules (never torch, never other omnistep planes).
"""

import struct

import numpy as np

from omnistep.audio.encoder import StreamEncoder
from omnistep.audio.formats import OUTPUT_SAMPLE_RATE
from omnistep.audio.pcm import float_to_s16le

WAV_HEADER_BYTES = 44
UNKNOWN_SIZE = 0xFFFFFFFF
"""The RIFF and data chunk sizes a streamed wav header carries: the largest 32-bit size."""


class PcmEncoder(StreamEncoder):
    """Raw 24 kHz mono s16le, no header.

    Output bytes depend only on the concatenated input, not on how it was chunked.
    """

    fmt = "pcm"

    def _encode_output(self, samples: np.ndarray) -> bytes:
        return float_to_s16le(samples)

    def _finish(self) -> bytes:
        return b""


def wav_header(data_bytes: int = UNKNOWN_SIZE) -> bytes:
    """A 44-byte canonical RIFF/WAVE header for 24 kHz mono s16le.

    Args:
        data_bytes: size of the data chunk in bytes; the default `UNKNOWN_SIZE` (0xFFFFFFFF)
            marks a stream of unknown length, and the RIFF size is then 0xFFFFFFFF as well.
    """
    riff_bytes = UNKNOWN_SIZE if data_bytes >= UNKNOWN_SIZE - 36 else data_bytes + 36
    fmt_chunk = struct.pack("<HHIIHH", 1, 1, OUTPUT_SAMPLE_RATE, 2 * OUTPUT_SAMPLE_RATE, 2, 16)
    return (
        b"RIFF"
        + struct.pack("<I", riff_bytes)
        + b"WAVE"
        + b"fmt "
        + struct.pack("<I", len(fmt_chunk))
        + fmt_chunk
        + b"data"
        + struct.pack("<I", min(data_bytes, UNKNOWN_SIZE))
    )


class WavEncoder(StreamEncoder):
    """24 kHz mono s16le wav, streamed: the header first, then frames as they come.

    The header is written before the length is known, so the RIFF and data sizes are both
    0xFFFFFFFF, as ffmpeg and streaming servers write them; soundfile (libsndfile 1.2) and PyAV
    both read such a file to its true number of samples (checked in tests). `with_lengths`
    rewrites them for a complete body. Output bytes depend only on the concatenated input, not
    on how it was chunked.
    """

    fmt = "wav"

    def __init__(self, in_rate: int):
        super().__init__(in_rate)
        self._header = wav_header()

    def _encode_output(self, samples: np.ndarray) -> bytes:
        header, self._header = self._header, b""
        return header + float_to_s16le(samples)

    def _finish(self) -> bytes:
        header, self._header = self._header, b""
        return header

    def with_lengths(self, data: bytes) -> bytes:
        """Return `data` with the RIFF and data sizes set from its length (see the base)."""
        data = super().with_lengths(data)
        return wav_header(len(data) - WAV_HEADER_BYTES) + data[WAV_HEADER_BYTES:]
