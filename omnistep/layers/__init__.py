"""Torch building blocks for step-level serving: RMSNorm, RoPE, attention over a paged KV cache,
batch-invariant row helpers and a Llama decoder stack; ``ecapa_tdnn.SpeakerEncoder``, the
ECAPA-TDNN speaker encoder of Qwen2.5-Omni and Qwen3-TTS; and ``paged_ar.PagedARModel``, the one
paged-KV autoregressive component every AR family configures (import these two from their
modules).

The blocks import torch and ``omnistep.core`` only; ``paged_ar`` also imports ``omnistep.kv``,
the AR loop's payload types and ``omnistep.sampling``. Never ``engine``, ``models`` or ``server``.
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
