"""Opus, AAC and FLAC encoders, muxed by FFmpeg through PyAV into an in-memory byte sink.

Imports only numpy, av (PyAV) and the audio plane's own modules (never torch, never other
omnistep planes).

Each encoder cuts the 24 kHz signal into frames of exactly the codec's frame size itself (the
last one may be short), stamps them with sample-count timestamps and muxes every packet as soon as
it exists. The muxer writes into a write-only sink, so FFmpeg treats the output as unseekable and
never goes back to patch a header; `flush_packets` makes each packet reach the sink at once. The
`bitexact` flags on container and codec drop the version-stamped encoder tags and fix the Ogg
serial number (to 0), so output bytes are identical run to run; because the codec always sees
the same frames, they are also identical for any chunking of the same input (checked in tests).
"""

from dataclasses import dataclass, field
from fractions import Fraction

import av
import numpy as np

from omnistep.audio.encoder import StreamEncoder
from omnistep.audio.formats import OUTPUT_SAMPLE_RATE
from omnistep.audio.pcm import float_to_s16

OGG_PAGE_DURATION_US = 60_000
"""Audio per Ogg page: an encode() call returns audio only once a page is full; 60 ms is three
Opus frames, ~5% container overhead at 64 kbps (20 ms pages: ~13%, 1 s pages: ~0%)."""
DEFAULT_FRAME_SIZE = 4608
"""Samples per frame for a codec that announces no frame size (all three here announce one)."""


@dataclass(frozen=True)
class LibavSpec:
    """How one format is produced by FFmpeg."""

    container: str
    """FFmpeg muxer name."""
    codec: str
    """FFmpeg encoder name."""
    sample_format: str
    """FFmpeg sample format the encoder takes ("flt", "fltp" or "s16")."""
    bit_rate: int = 0
    """Target bit rate in bits per second; 0 leaves the codec's default (lossless codecs)."""
    container_options: dict[str, str] = field(default_factory=dict)
    """Muxer options on top of `bitexact` and `flush_packets`."""


OPUS_SPEC = LibavSpec("ogg", "libopus", "flt", 64_000, {"page_duration": str(OGG_PAGE_DURATION_US)})
AAC_SPEC = LibavSpec("adts", "aac", "fltp", 64_000)
FLAC_SPEC = LibavSpec("flac", "flac", "s16")

_CONTAINER_OPTIONS = {"fflags": "+bitexact", "flush_packets": "1"}
_CODEC_OPTIONS = {"flags": "+bitexact"}


class _ByteSink:
    """A write-only file object; FFmpeg sees it as an unseekable pipe."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def write(self, data: bytes) -> int:
        self._buffer += data
        return len(data)

    def take(self) -> bytes:
        """Return and forget everything written since the last call."""
        data = bytes(self._buffer)
        self._buffer.clear()
        return data


class LibavEncoder(StreamEncoder):
    """Shared PyAV plumbing: one mono audio stream at 24 kHz in a streaming container.

    Args:
        in_rate: input sample rate in Hz, > 0.
        spec: the container, codec and settings to use.
    """

    def __init__(self, in_rate: int, spec: LibavSpec):
        super().__init__(in_rate)
        self._spec = spec
        self._sink = _ByteSink()
        self._output = av.open(
            self._sink,
            mode="w",
            format=spec.container,
            container_options=_CONTAINER_OPTIONS | spec.container_options,
        )
        self._stream = self._output.add_stream(
            spec.codec, rate=OUTPUT_SAMPLE_RATE, options=_CODEC_OPTIONS
        )
        self._configure(self._stream.codec_context)
        self._output.start_encoding()  # header now, so even an empty stream is a valid file
        self._frame_size = self._stream.codec_context.frame_size or DEFAULT_FRAME_SIZE
        self._pending = np.zeros(0, dtype=np.float32)  # [< frame_size] not yet encoded
        self._pts = 0

    def _configure(self, codec_context: av.AudioCodecContext) -> None:
        codec_context.layout = "mono"
        codec_context.format = self._spec.sample_format
        codec_context.time_base = Fraction(1, OUTPUT_SAMPLE_RATE)
        if self._spec.bit_rate:
            codec_context.bit_rate = self._spec.bit_rate

    def _encode_output(self, samples: np.ndarray) -> bytes:
        pending = np.concatenate([self._pending, samples])
        num_full = pending.shape[0] // self._frame_size * self._frame_size
        for start in range(0, num_full, self._frame_size):
            self._mux(pending[start : start + self._frame_size])
        self._pending = pending[num_full:]
        return self._sink.take()

    def _finish(self) -> bytes:
        if self._pending.shape[0]:
            self._mux(self._pending)  # a short last frame; these codecs accept one
        self._output.mux(self._stream.encode(None))
        self._output.close()  # writes the trailer
        return self._sink.take()

    def _mux(self, samples: np.ndarray) -> None:
        if self._spec.sample_format == "s16":
            samples = float_to_s16(samples)
        frame = av.AudioFrame.from_ndarray(
            samples[np.newaxis, :], format=self._spec.sample_format, layout="mono"
        )
        frame.sample_rate = OUTPUT_SAMPLE_RATE
        frame.time_base = Fraction(1, OUTPUT_SAMPLE_RATE)
        frame.pts = self._pts
        self._pts += samples.shape[0]
        self._output.mux(self._stream.encode(frame))


class OpusEncoder(LibavEncoder):
    """Ogg Opus (libopus, 64 kbps VBR, 20 ms frames) encoded at 24 kHz.

    The OpusHead records a 24 kHz input rate and the encoder's pre-skip, so decoders output
    exactly the input duration, at 48 kHz (libopus decodes at 48 kHz): 1.5 s in, 72000 samples
    out, aligned with the input (no leading delay). Pages hold `OGG_PAGE_DURATION_US` of audio;
    the serial number is 0. No input at all gives the two header pages only, which FFmpeg
    refuses to decode. Deterministic and chunking-invariant (see the module docstring).
    """

    fmt = "opus"

    def __init__(self, in_rate: int):
        super().__init__(in_rate, OPUS_SPEC)


class OggEncoder(OpusEncoder):
    """``ogg``: the same Ogg Opus bytes as ``OpusEncoder``, under the container's name (what
    ``omnistep say -o x.ogg`` writes, for clients that ask for ``response_format: "ogg"``)."""

    fmt = "ogg"


class AacEncoder(LibavEncoder):
    """AAC-LC (FFmpeg's native encoder, 64 kbps) in an ADTS stream at 24 kHz.

    ADTS cannot signal encoder priming or padding, so decoders output 1024 priming samples
    (43 ms) before the audio and pad the end to a 1024-sample frame: 1.5 s in decodes to 37
    frames = 1.579 s. No input at all gives no bytes. Deterministic and chunking-invariant (see
    the module docstring).
    """

    fmt = "aac"

    def __init__(self, in_rate: int):
        super().__init__(in_rate, AAC_SPEC)


class FlacEncoder(LibavEncoder):
    """FLAC (FFmpeg's encoder, 16-bit, compression level 5) at 24 kHz, streamed.

    The STREAMINFO block is written before the length is known: its total-samples and MD5
    fields are 0, which the FLAC format defines as "unknown". FFmpeg/PyAV decode such a stream
    exactly; libsndfile (soundfile) then reports an unbounded frame count, so `soundfile.read`
    of the whole file fails. `with_lengths` fills in the total for a complete body, after which
    soundfile reads it normally. Deterministic and chunking-invariant (see the module
    docstring).
    """

    fmt = "flac"

    def __init__(self, in_rate: int):
        super().__init__(in_rate, FLAC_SPEC)

    def with_lengths(self, data: bytes) -> bytes:
        """Return `data` with STREAMINFO's total-samples field set (see the base)."""
        data = super().with_lengths(data)
        return set_flac_total_samples(data, self.num_samples)


def set_flac_total_samples(data: bytes, num_samples: int) -> bytes:
    """Write `num_samples` into the 36-bit total-samples field of a FLAC stream's STREAMINFO.

    Raises:
        ValueError: `data` does not start with a STREAMINFO block, or the count exceeds 36 bits.
    """
    if data[:4] != b"fLaC" or data[4] & 0x7F != 0:
        raise ValueError("data is not a FLAC stream starting with STREAMINFO")
    if not 0 <= num_samples < 1 << 36:
        raise ValueError(f"num_samples must fit 36 bits, got {num_samples}")
    patched = bytearray(data)
    # STREAMINFO starts at byte 8; the field is the low nibble of byte 21 plus bytes 22..25.
    patched[21] = (patched[21] & 0xF0) | (num_samples >> 32)
    patched[22:26] = (num_samples & 0xFFFFFFFF).to_bytes(4, "big")
    return bytes(patched)
