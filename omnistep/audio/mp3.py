"""MP3 encoder (LAME through lameenc).

Imports only numpy, lameenc and the audio plane's own modules (never torch, never other omnistep
planes).
"""

import lameenc
import numpy as np

from omnistep.audio.encoder import StreamEncoder
from omnistep.audio.formats import OUTPUT_SAMPLE_RATE
from omnistep.audio.pcm import float_to_s16le

MP3_BITRATE_KBPS = 64
MP3_QUALITY = 2
"""LAME's algorithm quality, 2 (best) .. 7 (fastest); 2 costs ~1 ms per second of audio."""


class Mp3Encoder(StreamEncoder):
    """24 kHz mono MPEG-2 Layer III, 64 kbps CBR, as a bare frame stream.

    No Xing/LAME tag is written (it needs the length up front), so decoders also output LAME's
    delay and padding: ffmpeg puts 1105 samples (46 ms) before the audio and pads the end to a
    576-sample granule, decoding 1.5 s of input to 1.56 s. Output bytes are identical for any
    chunking of the same input and from run to run (checked in tests). No input at all gives
    no bytes.
    """

    fmt = "mp3"

    def __init__(self, in_rate: int):
        super().__init__(in_rate)
        self._lame = lameenc.Encoder()
        self._lame.set_channels(1)
        self._lame.set_in_sample_rate(OUTPUT_SAMPLE_RATE)
        self._lame.set_out_sample_rate(OUTPUT_SAMPLE_RATE)
        self._lame.set_bit_rate(MP3_BITRATE_KBPS)
        self._lame.set_quality(MP3_QUALITY)

    def _encode_output(self, samples: np.ndarray) -> bytes:
        if samples.shape[0] == 0:
            return b""
        return bytes(self._lame.encode(float_to_s16le(samples)))

    def _finish(self) -> bytes:
        if self.num_samples == 0:
            return b""  # LAME refuses to flush before any input; no input, no frames
        return bytes(self._lame.flush())
