"""Generic loops shared by model families: AR decode, chunked audio decode, denoise and media
encoding (``encode.EncodeLoop``).

Imports ``omnistep.core`` only (and numpy); model specifics arrive through payloads and configs.
"""

from omnistep.loops.audio_decode import AudioChunkInput, AudioDecodeConfig, AudioDecodeLoop

__all__ = ["AudioChunkInput", "AudioDecodeConfig", "AudioDecodeLoop"]
