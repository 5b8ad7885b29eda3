"""Qwen2.5-Omni: thinker (Qwen2.5 LM) -> talker (codec LM) -> token2wav, on omnistep's layers."""
