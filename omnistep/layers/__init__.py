"""Torch building blocks for step-level serving: RMSNorm, RoPE, attention over a paged KV cache,
batch-invariant row helpers and a Llama decoder stack; ``ecapa_tdnn.SpeakerEncoder``, the
ECAPA-TDNN speaker encoder of Qwen2.5-Omni and Qwen3-TTS; ``snake.SnakeBeta`` and the conv
helpers; ``moe.MoEFeedForward``, the sparse MoE block of Qwen3-MoE and Qwen3-Omni;
``code_predictor.CodePredictor``, the Qwen3 talkers' code predictor; ``codec_decoder``, the
12.5 Hz causal codec decoder (import these from their modules). The paged-KV AR component that
uses them is the runner plane's (``omnistep.runners.paged_ar``).

The blocks import torch and ``omnistep.core`` only: nothing above them (``tests/test_layering``).
"""

from omnistep.layers.batch_invariant import RowChunking, map_row_chunks, map_row_groups
from omnistep.layers.llama import LlamaConfigLite, LlamaDecoderLayer, LlamaModel
from omnistep.layers.norm import RMSNorm
from omnistep.layers.paged_attention import (
    AttentionMetadata,
    PagedKVCache,
    paged_attention,
    write_kv,
)
from omnistep.layers.rope import RotaryEmbedding, apply_rope, rope_cos_sin

__all__ = [
    "AttentionMetadata",
    "LlamaConfigLite",
    "LlamaDecoderLayer",
    "LlamaModel",
    "PagedKVCache",
    "RMSNorm",
    "RotaryEmbedding",
    "RowChunking",
    "apply_rope",
    "map_row_chunks",
    "map_row_groups",
    "paged_attention",
    "rope_cos_sin",
    "write_kv",
]
