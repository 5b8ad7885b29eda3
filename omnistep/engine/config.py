"""Engine configuration: one small dataclass, checked on construction."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Settings of the AsyncEngine.

    Attributes:
        max_batch_size: upper bound on units per ``execute`` call, for every component
            (a component's own ``ComponentSpec.max_batch_size`` may be lower).
    """

    max_batch_size: int = 64

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
