"""Playback deadlines and admission for deadline-aware (EDF) scheduling. Pure; no asyncio.

A streaming client starts playing at its first audio chunk and then plays in real time, so a
request that has sent ``a`` seconds of audio, the first of it at ``t0``, runs dry at
``t0 + a``: that is the deadline of every unit the request runs next (its AR tokens feed its
next chunk as much as the vocoder does). A request with no audio yet has the deadline
``arrival + first_audio_s``: a new request is urgent at once, while a stream with seconds of
audio buffered can wait, which puts first chunks of new requests ahead of chunks for streams
with plenty of buffer. Text-only requests never send audio and keep their arrival deadline, so
among themselves they run first come, first served.

A unit's priority is that deadline less the unit's expected run time (``UnitCostMeter``: least
laxity first), so a long unit starts early enough to finish by its deadline. A request that
waited for admission is due its first audio ``first_audio_s`` after it was admitted, not after
it arrived: otherwise it would be long overdue and run ahead of every playing stream, draining
the buffers that admission had judged safe.

Admission (``may_admit``): a new request costs every admitted stream the time of its first
chunk, and once playing it needs audio as fast as the others. It is admitted while every started
stream has at least ``guard_s`` of audio buffered beyond the expected run time of its next unit
(``leads``: a Kokoro sentence takes seconds, so a bare ``guard_s`` of 0.5 s let newcomers in
while streams were already too short to get their next sentence in time: 5 underruns in a
burst of 8 on the 2-core CI machine) and, where its card sets ``max_starting``,
fewer than that many admitted requests still wait for their first audio; otherwise it waits,
for at most ``max_wait_s``. Requests that do not ask for audio neither wait nor hold others.
Above all, each admitted audio request needs audio as fast as it plays, so for such cards
(units that gain nothing from batching, whose capacity is a number of streams) and a measured
production rate (``CapacityMeter``: audio seconds per busy second) a newcomer waits while the
admitted audio requests already number ``utilization * rate`` or more (a lone request is always
admitted). Batched models make audio faster per stream the more streams share a batch, so the
engine passes no rate for them. A
burst is thus started a few at a time, each group once the previous one has audio to spare,
and when streams run low (more streams than the machine can feed in real time) newcomers wait
in the queue until streams finish, instead of making the admitted streams underrun.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass
class PlaybackClock:
    """Where one request's stream stands, on the engine's monotonic clock (seconds).

    Attributes:
        arrival: when the request was added.
        first_audio_s: how soon after arrival its first audio is due.
        first_audio_at: when its first audio chunk was published; None before.
        audio_sent_s: seconds of audio published so far.
    """

    arrival: float
    first_audio_s: float
    first_audio_at: float | None = None
    audio_sent_s: float = 0.0

    def on_audio(self, now: float, seconds: float) -> None:
        """Record ``seconds`` (>= 0) of audio published at ``now``."""
        if seconds <= 0.0:
            return
        if self.first_audio_at is None:
            self.first_audio_at = now
        self.audio_sent_s += seconds

    @property
    def started(self) -> bool:
        """Whether audio has been published (the client is playing)."""
        return self.first_audio_at is not None

    def deadline(self) -> float:
        """When the client runs out of audio (before the first chunk: when it is due)."""
        if self.first_audio_at is None:
            return self.arrival + self.first_audio_s
        return self.first_audio_at + self.audio_sent_s

    def buffered(self, now: float) -> float:
        """Seconds of audio the client still holds at ``now`` (negative: it ran dry that long
        ago); 0.0 before the first chunk."""
        if self.first_audio_at is None:
            return 0.0
        return self.deadline() - now


@dataclass(frozen=True)
class AdmissionPolicy:
    """When a waiting request may start (see module docstring).

    Attributes:
        guard_s: buffered audio every started stream must hold for a newcomer to start.
        max_wait_s: the longest a request waits for admission; then it starts regardless.
        utilization: the share of the measured production rate that admitted streams may
            claim (1.0: all of it). 0.65: on the 2-core CI machine the embedded voice makes
            about 14.5 s of audio per second; at 0.8 (11-12 streams) a burst of 16 had up to
            12 underruns per run, at 0.65 (9 streams) none in 5 runs, while a burst of 8 still
            starts at once.
    """

    guard_s: float = 0.5
    max_wait_s: float = 120.0
    utilization: float = 0.65

    def __post_init__(self) -> None:
        if self.guard_s < 0 or self.max_wait_s < 0 or not 0 < self.utilization <= 1:
            raise ValueError(f"need guard_s, max_wait_s >= 0 and 0 < utilization <= 1: {self}")

    def may_admit(
        self,
        now: float,
        waiting_since: float,
        streams: Iterable[PlaybackClock],
        max_starting: int | None = None,
        rate: float | None = None,
        leads: Iterable[float] | None = None,
    ) -> bool:
        """Whether a request waiting since ``waiting_since`` may start, given the clocks of the
        admitted unfinished audio requests, its card's ``max_starting`` (None: no limit), the
        measured production ``rate`` (audio seconds per busy second; None: not known yet) and
        ``leads``: per stream, in the order of ``streams``, the expected seconds its next unit
        takes, which it must have buffered on top of ``guard_s`` (None: 0 each)."""
        if now - waiting_since >= self.max_wait_s:
            return True
        streams = list(streams)
        if rate is not None and streams and len(streams) + 1 > self.utilization * rate:
            return False
        starting = 0
        leads = [0.0] * len(streams) if leads is None else list(leads)
        for clock, lead in zip(streams, leads, strict=True):
            if not clock.started:
                starting += 1
                if max_starting is not None and starting >= max_starting:
                    return False
            elif clock.buffered(now) < self.guard_s + lead:
                return False
        return True


@dataclass
class CapacityMeter:
    """How many seconds of audio the engine makes per second with all its workers busy.

    Audio seconds published, worker-busy seconds (wall time times the number of batches
    running) and busy wall seconds (time with at least one batch running) are summed with
    exponential decay (``half_life_s``), so the rate follows the recent mix of requests. Their
    ratio ``busy / wall`` is the concurrency the figures were measured at. ``rate(parallel)``
    is the measured audio per busy wall second, plus, for the batches that could run at once
    but were not seen running together, the audio per worker-second scaled by
    ``unseen_credit``: measuring per worker keeps the figure right while a burst is starting
    and few batches run (a wall-clock rate alone understated capacity by up to the worker
    count, and admission held back requests the machine could serve), but a batch that ran
    alone had the machine to itself, and two at once make less than twice as much: measured on
    the 2-core CI machine, Kokoro-82M int8 made 3.35 s of audio per second alone and 5.4 with two
    sentences at once (0.61 of a second lone worker's rate for the second), piper 23 alone and
    40 at once (0.7). Crediting unseen workers in full made admission start one Kokoro stream
    too many right after a lone request (a 36 ms underrun in a burst of 16). Once batches have
    run together the measured figure takes over.

    Attributes:
        half_life_s: seconds after which old figures count half.
        min_busy_s: worker-busy seconds needed before ``rate`` gives a number.
        unseen_credit: the share of a lone worker's rate credited to each worker that was not
            seen running beside the others, in (0, 1].
    """

    half_life_s: float = 10.0
    min_busy_s: float = 0.5
    unseen_credit: float = 0.6
    audio_s: float = 0.0
    busy_s: float = 0.0
    wall_s: float = 0.0
    running: int = 0
    last: float | None = None

    def __post_init__(self) -> None:
        if not 0 < self.unseen_credit <= 1:
            raise ValueError(f"unseen_credit must be in (0, 1], got {self.unseen_credit}")

    def _decay(self, now: float) -> None:
        if self.last is not None and now > self.last:
            factor = 0.5 ** ((now - self.last) / self.half_life_s)
            self.audio_s *= factor
            self.busy_s *= factor
            self.wall_s *= factor
            if self.running:  # busy since ``last``: its seconds decay as they accrue
                accrued = (now - self.last) * (1.0 + factor) / 2.0
                self.busy_s += self.running * accrued
                self.wall_s += accrued
        self.last = now

    def batch_started(self, now: float) -> None:
        """A batch began executing at ``now``."""
        self._decay(now)
        self.running += 1

    def batch_finished(self, now: float) -> None:
        """A batch finished at ``now``."""
        self._decay(now)
        self.running = max(0, self.running - 1)

    def on_audio(self, now: float, seconds: float) -> None:
        """``seconds`` of audio were published at ``now``."""
        self._decay(now)
        self.audio_s += seconds

    def rate(self, parallel: int = 1) -> float | None:
        """Audio seconds per second with ``parallel`` batches running, or None before
        ``min_busy_s`` worker-seconds of work were seen: ``audio / wall`` plus
        ``unseen_credit * audio / busy`` for each of the ``parallel - busy / wall`` workers
        not seen busy together (audio per worker-second times ``parallel`` when more ran at
        once than ``parallel``)."""
        if self.busy_s < self.min_busy_s:
            return None
        seen = self.busy_s / self.wall_s  # >= 1: batches running at once, on average
        per_worker = self.audio_s / self.busy_s
        return per_worker * (min(seen, parallel) + self.unseen_credit * max(0.0, parallel - seen))


@dataclass
class UnitCostMeter:
    """Seconds a unit takes per token it processes, per (model, component, unit kind).

    The EDF priority of a unit is its request's playback deadline minus this estimate of its
    run time (least laxity first): of two streams due at the same moment, the one whose next
    unit is longer (a long sentence) starts first, so both can finish in time. Kept as an
    exponential moving average of ``batch seconds / batch tokens`` over observed batches
    (``alpha`` the weight of the newest); wall seconds include the contention of batches that
    ran beside it, which is what a unit will meet again.

    Attributes:
        alpha: weight of each new observation, in (0, 1].
    """

    alpha: float = 0.2
    per_token: dict = field(default_factory=dict)

    def observe(self, key: object, tokens: int, seconds: float) -> None:
        """A batch of ``tokens`` tokens (> 0; other batches are ignored) took ``seconds``."""
        if tokens <= 0 or seconds < 0:
            return
        value = seconds / tokens
        old = self.per_token.get(key)
        self.per_token[key] = value if old is None else old + self.alpha * (value - old)

    def known(self, key: object) -> bool:
        """Whether a batch of ``key`` was observed."""
        return key in self.per_token

    def estimate(self, key: object, tokens: int) -> float:
        """Expected seconds for a unit of ``tokens`` tokens; 0.0 before any observation."""
        return self.per_token.get(key, 0.0) * max(tokens, 0)
