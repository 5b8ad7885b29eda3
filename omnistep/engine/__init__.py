"""The engine plane: AsyncEngine, Scheduler, executors. Imports ``omnistep.core`` and
``omnistep.kv`` (KV usage of the components)."""

from omnistep.engine.config import EngineConfig
from omnistep.engine.deadlines import PlaybackClock
from omnistep.engine.engine import AsyncEngine
from omnistep.engine.executor import Executor, InProcessExecutor
from omnistep.engine.scheduler import Batch, LiveLoop, Scheduler
from omnistep.engine.stream import RequestStream
from omnistep.engine.weights import WeightUpdate

__all__ = [
    "AsyncEngine",
    "Batch",
    "EngineConfig",
    "Executor",
    "InProcessExecutor",
    "LiveLoop",
    "PlaybackClock",
    "RequestStream",
    "Scheduler",
    "WeightUpdate",
]
