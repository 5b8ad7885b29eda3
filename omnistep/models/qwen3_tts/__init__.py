"""Qwen3-TTS (Qwen/Qwen3-TTS-12Hz-*): talker (codec LM with a text track) + code predictor ->
12 Hz speech-tokenizer decoder, on omnistep's layers. ``loader`` reads the published folder;
``codec`` is the speech tokenizer's causal decoder, run as the streamed vocoder; Base voice
cloning: ``clone`` computes a reference clip's prompt once, with ``speaker`` (the ECAPA-TDNN
x-vector) and ``encoder`` (the speech tokenizer's Mimi encoder)."""

from omnistep.models.qwen3_tts.loader import (
    LAYOUT,
    TTS_MODEL_TYPES,
    GenerationDefaults,
    Qwen3TTSCheckpoint,
    Qwen3TTSCheckpointError,
    Qwen3TTSConfig,
    SpeakerEncoderConfig,
    SpeechDecoderConfig,
    SpeechEncoderConfig,
    SpeechTokenizerConfig,
    TalkerCodePredictorConfig,
    TalkerConfig,
    TokenIds,
    parse_config,
)

__all__ = [
    "LAYOUT",
    "TTS_MODEL_TYPES",
    "TalkerCodePredictorConfig",
    "GenerationDefaults",
    "Qwen3TTSCheckpoint",
    "Qwen3TTSCheckpointError",
    "Qwen3TTSConfig",
    "SpeakerEncoderConfig",
    "SpeechDecoderConfig",
    "SpeechEncoderConfig",
    "SpeechTokenizerConfig",
    "TalkerConfig",
    "TokenIds",
    "parse_config",
]
