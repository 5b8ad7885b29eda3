"""Output formats of the audio plane: names, media types and the delivery sample rate.

Imports nothing (stdlib only). The audio plane as a whole imports only numpy and the audio
libraries soundfile, lameenc, av (PyAV) and soxr: never torch, never another omnistep plane.
"""

import os

FORMATS: tuple[str, ...] = ("mp3", "opus", "aac", "flac", "wav", "pcm", "ogg")
"""Every `response_format` the speech endpoint accepts: OpenAI's names, and ``ogg`` (the same
Ogg Opus bytes as ``opus``, for clients that name the container)."""

MEDIA_TYPES: dict[str, str] = {
    "mp3": "audio/mpeg",
    "opus": "audio/ogg",  # Ogg Opus
    "aac": "audio/aac",  # ADTS stream
    "flac": "audio/flac",
    "wav": "audio/wav",
    "pcm": "audio/pcm",  # raw s16le mono, no header
    "ogg": "audio/ogg",  # Ogg Opus, as "opus"
}
"""The Content-Type of each format's body."""

OUTPUT_SAMPLE_RATE: int = 24000
"""Every format is delivered mono at this rate in Hz (OpenAI's rate; pcm is 24 kHz s16le mono)."""

FILE_EXTENSIONS: dict[str, str] = {
    ".mp3": "mp3",
    ".opus": "opus",
    ".ogg": "opus",  # the opus format is Ogg Opus
    ".oga": "opus",
    ".aac": "aac",  # ADTS, not MP4: .m4a is not written
    ".adts": "aac",
    ".flac": "flac",
    ".wav": "wav",
    ".wave": "wav",
    ".pcm": "pcm",
    ".raw": "pcm",
}
"""File name extension (lower case, with the dot) -> the format whose bytes such a file holds."""


def format_for_path(path: str) -> str | None:
    """The format a file named ``path`` holds, from its extension (any case): ``x.ogg`` ->
    ``opus``; None for an unknown extension or none.

    >>> format_for_path("out/Hello.OGG"), format_for_path("x.m4a")
    ('opus', None)
    """
    return FILE_EXTENSIONS.get(os.path.splitext(path)[1].lower())
