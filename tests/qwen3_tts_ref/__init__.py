"""Qwen3-TTS reference harness: tiny checkpoints in the published layout, and the upstream
``qwen-tts`` package run in a subprocess (its pinned transformers 4.57.3 differs from ours)."""
