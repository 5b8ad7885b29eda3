"""The serving options every family with a paged-KV AR component shares.

A family's options dataclass subclasses ``ServingOptions`` and adds its own fields (chunk
sizes, token caps); the KV pool of each AR component is sized by ``kv_config`` from the
component's geometry, so no family re-declares the fields or re-writes the
``KVCacheConfig.from_memory`` call.

Imports: torch (dtypes), ``omnistep.kv``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from omnistep.kv import KVCacheConfig


@dataclass(frozen=True)
class ServingOptions:
    """KV cache and batching options of a card.

    Attributes:
        kv_cache_gb: memory for each AR component's paged KV cache, in GiB (2**30 bytes).
        block_size: tokens per KV block.
        max_batch_size: most units per forward, for each component.
        batch_invariant: bit-identical outputs whatever the batch (slower).
        dtype: compute and KV cache dtype.

    Raises:
        ValueError: ``kv_cache_gb`` not > 0, or ``block_size`` / ``max_batch_size`` not an
            int >= 1 (the field is named).
    """

    kv_cache_gb: float = 2.0
    block_size: int = 16
    max_batch_size: int = 32
    batch_invariant: bool = False
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if not self.kv_cache_gb > 0:
            raise ValueError(f"kv_cache_gb must be > 0, got {self.kv_cache_gb!r}")
        for name in ("block_size", "max_batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")

    def kv_config(self, num_layers: int, num_kv_heads: int, head_dim: int) -> KVCacheConfig:
        """The KV pool of an AR component of this geometry: as many ``block_size`` blocks of
        ``dtype`` K and V as ``kv_cache_gb`` holds (``KVCacheConfig.from_memory``).

        Raises:
            ValueError: a non-positive size, or a budget below one block.
        """
        return KVCacheConfig.from_memory(
            self.kv_cache_gb,
            num_layers,
            num_kv_heads,
            head_dim,
            torch.finfo(self.dtype).bits // 8,
            self.block_size,
        )
