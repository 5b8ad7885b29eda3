"""Qwen3-TTS (12 Hz): talker LM with a code predictor, and the speech tokenizer's causal decoder
(``codec.py``) as the streamed vocoder. Our own torch code; no run-time dependency on
``qwen-tts``."""
