"""Qwen3-TTS (12 Hz): talker LM with a code predictor, the speech tokenizer's causal decoder, and
Base voice cloning (``speaker.py``: the ECAPA-TDNN x-vector; ``encoder.py``: the speech
tokenizer's Mimi encoder; ``clone.py``: the prompt computed once per saved voice). Our own torch
code; no run-time dependency on ``qwen-tts``."""
