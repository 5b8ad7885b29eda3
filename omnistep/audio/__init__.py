"""The audio plane: numpy-only encoders (pcm/wav/flac/opus/mp3/aac), resampling and trimming.

Imports only numpy and the audio libraries soundfile, lameenc, av (PyAV) and soxr: never torch,
never another omnistep plane. Every format is delivered mono at `OUTPUT_SAMPLE_RATE` (24 kHz).
"""

from omnistep.audio.encode import encode_all, make_encoder
from omnistep.audio.encoder import StreamEncoder
from omnistep.audio.formats import (
    FILE_EXTENSIONS,
    FORMATS,
    MEDIA_TYPES,
    OUTPUT_SAMPLE_RATE,
    format_for_path,
)
from omnistep.audio.pcm import float_to_s16le, trim_silence
from omnistep.audio.resample import Resampler

__all__ = [
    "FILE_EXTENSIONS",
    "FORMATS",
    "MEDIA_TYPES",
    "OUTPUT_SAMPLE_RATE",
    "Resampler",
    "StreamEncoder",
    "encode_all",
    "float_to_s16le",
    "format_for_path",
    "make_encoder",
    "trim_silence",
]
