"""The KV plane: paged KV-cache bookkeeping (block pool sizing, block tables, preemption) and
the protocol through which the scheduler admits units by a component's pool (``KVPool``).

Pure Python; imports ``omnistep.core`` only. Both ``models/`` (the components that own a KV
cache) and ``engine/`` (which admits units by their pools and reads their usage for stats and
metrics) import it.
"""

from omnistep.kv.blocks import (
    BlockManager,
    FreeRuns,
    KVCacheConfig,
    KVCacheFullError,
    SequenceTable,
    chain_hashes,
    kv_usage,
)
from omnistep.kv.pool import KVPool, kv_pool

__all__ = [
    "BlockManager",
    "FreeRuns",
    "KVCacheConfig",
    "KVCacheFullError",
    "KVPool",
    "SequenceTable",
    "chain_hashes",
    "kv_pool",
    "kv_usage",
]
