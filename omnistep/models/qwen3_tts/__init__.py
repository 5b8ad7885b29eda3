"""Qwen3-TTS (12 Hz; CustomVoice, VoiceDesign, Base): talker with its code predictor, prompt
layout, speech-tokenizer decoder. Our own torch code; the ``qwen-tts`` package is only the
parity reference in tests."""
