"""Encoder factory and one-call encoding.

Imports only numpy and the audio plane's own modules (never torch, never other omnistep planes).
"""

from collections.abc import Iterable

import numpy as np

from omnistep.audio.encoder import StreamEncoder
from omnistep.audio.libav import AacEncoder, FlacEncoder, OggEncoder, OpusEncoder
from omnistep.audio.mp3 import Mp3Encoder
from omnistep.audio.raw import PcmEncoder, WavEncoder

_ENCODERS: dict[str, type[StreamEncoder]] = {
    "mp3": Mp3Encoder,
    "opus": OpusEncoder,
    "aac": AacEncoder,
    "flac": FlacEncoder,
    "wav": WavEncoder,
    "pcm": PcmEncoder,
    "ogg": OggEncoder,  # Ogg Opus: the container's name for the same bytes
}


def make_encoder(fmt: str, in_rate: int) -> StreamEncoder:
    """Build a streaming encoder that turns float32 mono chunks at `in_rate` Hz into `fmt`.

    Args:
        fmt: one of `FORMATS`.
        in_rate: sample rate of the chunks passed to `encode`, in Hz, > 0.

    Raises:
        ValueError: `fmt` is not a known format, or `in_rate` is not positive.
    """
    encoder_class = _ENCODERS.get(fmt)
    if encoder_class is None:
        raise ValueError(f"unknown audio format {fmt!r}; expected one of {sorted(_ENCODERS)}")
    return encoder_class(in_rate)


def encode_all(
    fmt: str, chunks: Iterable[np.ndarray], in_rate: int, exact_lengths: bool = False
) -> bytes:
    """Encode a whole sequence of chunks into one `fmt` body.

    Args:
        fmt: one of `FORMATS`.
        chunks: float32 [n_i] arrays at `in_rate` Hz, in order.
        in_rate: their sample rate in Hz, > 0.
        exact_lengths: fill the header's length fields in (wav, flac) instead of returning
            exactly the bytes a streamed response carries.

    Raises:
        ValueError: unknown `fmt`, non-positive `in_rate` or a chunk that is not [n].
    """
    encoder = make_encoder(fmt, in_rate)
    parts = [encoder.encode(chunk) for chunk in chunks]
    parts.append(encoder.flush())
    data = b"".join(parts)
    return encoder.with_lengths(data) if exact_lengths else data
