"""Higgs Audio v2 (Boson AI): a Llama-3.2-3B backbone with a DualFFN audio adapter generating
8-codebook frames of its 25 frames/s audio tokenizer with a codebook delay pattern, and the
tokenizer's DAC decoder as the streamed vocoder. See docs/models/higgs_audio_v2.md.

Modules: ``loader`` (the folder), ``lm`` (backbone on the paged AR component), ``codec`` (the
audio tokenizer's decoder), ``prompt`` (ChatML prompt), ``card``, ``tiny`` (test checkpoints).
"""
