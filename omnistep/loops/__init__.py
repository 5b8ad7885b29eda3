"""Generic loops shared by model families: AR decode and chunked audio decode.

Imports ``omnistep.core`` only (and numpy); model specifics arrive through payloads and configs.
"""

from omnistep.loops.audio_decode import AudioChunkInput, AudioDecodeConfig, AudioDecodeLoop

__all__ = ["AudioChunkInput", "AudioDecodeConfig", "AudioDecodeLoop"]
