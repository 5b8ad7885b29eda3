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
        max_queued: requests admitted but not finished (running or waiting for a step); one
            more is refused with ``EngineOverloadedError`` (HTTP 429) instead of queueing
            without bound.
        retry_after: seconds an overloaded engine tells clients to wait (``Retry-After``).
        request_timeout: seconds a request may run, from admission to its last chunk; a request
            still unfinished then is aborted with ``RequestTimeoutError`` (HTTP 504) and its
            loops are freed. None: no limit.
    """

    max_batch_size: int = 64
    num_workers: int = 2
    max_queued: int = 256
    retry_after: int = 1
    request_timeout: float | None = None

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "num_workers", "max_queued", "retry_after"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        timeout = self.request_timeout
        if timeout is not None and not 0 < timeout < float("inf"):
            raise ValueError(f"request_timeout must be a positive number of seconds, got {timeout}")
