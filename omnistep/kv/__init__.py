"""The KV plane: paged KV-cache bookkeeping (block pool sizing, block tables, preemption).

Pure Python; imports ``omnistep.core`` only. Both ``models/`` (the components that own a KV
cache) and ``engine/`` (which reads their usage for admission, stats and metrics) import it.
"""

from omnistep.kv.blocks import (
    BlockManager,
    FreeRuns,
    KVCacheConfig,
    KVCacheFullError,
    SequenceTable,
    kv_usage,
)

__all__ = [
    "BlockManager",
    "FreeRuns",
    "KVCacheConfig",
    "KVCacheFullError",
    "SequenceTable",
    "kv_usage",
]
