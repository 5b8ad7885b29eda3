"""Engine configuration: one small dataclass, checked on construction."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Settings of the AsyncEngine.

    Attributes:
        max_batch_size: upper bound on units per ``execute`` call, for every component
            (a component's own ``ComponentSpec.max_batch_size`` may be lower).
        num_workers: batches that may run at once (executor threads). Batches of different
            components overlap (a GPT step beside a vocoder chunk); a component runs at most
            ``ComponentSpec.max_concurrency`` batches at once.
    """

    max_batch_size: int = 64
    num_workers: int = 2

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "num_workers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
