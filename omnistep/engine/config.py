"""Engine configuration: one small dataclass, checked on construction."""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULING_POLICIES = ("edf", "fcfs")


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
        scheduling: ``"edf"``: units run earliest playback deadline first, less their
            expected run time (a new request's first audio is due ``first_audio_s`` after it
            is admitted; a stream's next audio when its client runs dry); ``"fcfs"``: in the
            order they became ready (round-robin). See ``engine/deadlines.py``.
        first_audio_s: seconds after admission a request's first audio is due (EDF).
        admission_guard_s: under EDF, a new audio request waits (at most
            ``admission_max_wait_s``) while a started stream holds less than this much
            buffered audio, or while its card's ``max_starting`` admitted requests have no
            audio yet; None admits every request at once.
        admission_max_wait_s: the longest a request waits for admission, seconds; then it
            starts regardless, and if the machine cannot feed it in real time, it and the
            streams beside it run dry. 120 s: Kokoro-82M int8 makes ~6 s of audio per second on
            the 2-core CI machine, so a burst of 16 requests of 24 s of audio needs ~65 s to
            start its last one without a gap; with 30 s, 8 such requests had 1 underrun and 16
            had 77 (``bench/speech.py``). Waiting adds to the time to first audio instead.
        request_timeout: seconds a request may run, from admission to its last chunk; a request
            still unfinished then is aborted with ``RequestTimeoutError`` (HTTP 504) and its
            loops are freed. None: no limit.
    """

    max_batch_size: int = 64
    num_workers: int = 2
    max_queued: int = 256
    retry_after: int = 1
    scheduling: str = "edf"
    first_audio_s: float = 1.0
    admission_guard_s: float | None = 0.5
    admission_max_wait_s: float = 120.0
    request_timeout: float | None = None

    def __post_init__(self) -> None:
        if self.scheduling not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling must be one of {SCHEDULING_POLICIES}, got {self.scheduling!r}"
            )
        if self.first_audio_s < 0 or self.admission_max_wait_s < 0:
            raise ValueError("first_audio_s and admission_max_wait_s must be >= 0")
        if self.admission_guard_s is not None and self.admission_guard_s < 0:
            raise ValueError(f"admission_guard_s must be >= 0, got {self.admission_guard_s}")
        for name in (
            "max_batch_size",
            "num_workers",
            "max_queued",
            "retry_after",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        timeout = self.request_timeout
        if timeout is not None and not 0 < timeout < float("inf"):
            raise ValueError(f"request_timeout must be a positive number of seconds, got {timeout}")
