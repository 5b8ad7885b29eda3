"""The first-audio hold (``ModelCard.first_audio_alone``): while a request's first audio chunk
is being made, its AR decode plans wait, so that chunk runs without them.

Under EDF, a card whose AR decode competes with its own audio stages for the same device
(Qwen3-TTS: the talker feeds the codec directly) gets its first chunk out sooner when the
request's AR steps stand aside until it is out. The hold is per request: other requests' AR
steps run as usual. Imports ``omnistep.core`` and the engine's scheduler and stream types only.
"""

from __future__ import annotations

from collections.abc import Callable

from omnistep.core import LoopKind
from omnistep.engine.scheduler import LiveLoop, Scheduler
from omnistep.engine.stream import RequestRun

AUDIO_STAGES = (LoopKind.DENOISE, LoopKind.AUDIO_DECODE)
"""Loop kinds that turn a request's codes into audio (``ModelCard.first_audio_alone``)."""


class FirstAudioHold:
    """Holds a request's AR plans (in ``RequestRun.held_for_audio``) while its first audio is
    pending, and queues them again once it is out.

    Args:
        scheduler: the engine's scheduler (plans leave and rejoin its queue).
        priority: the engine's scheduler priority of a loop's next unit (``AsyncEngine``'s EDF
            priority), used when a held plan is queued again.
        wake: wakes the engine's step loop (a plan was queued).
        enabled: whether the engine schedules by deadline (EDF); under FCFS nothing is held.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        priority: Callable[[RequestRun, LiveLoop], float | None],
        wake: Callable[[], None],
        enabled: bool,
    ):
        self._scheduler = scheduler
        self._priority = priority
        self._wake = wake
        self._enabled = enabled

    def pending(self, run: RequestRun) -> bool:
        """Whether the run's AR units wait (``ModelCard.first_audio_alone``): EDF, no audio
        published yet, and a unit of one of its audio stages queued or running."""
        return (
            self._enabled
            and run.model.card.first_audio_alone
            and run.clock is not None
            and not run.clock.started
            and any(
                (live.queued or live.in_flight) and live.loop.kind in AUDIO_STAGES
                for live in run.live.values()
            )
        )

    def hold(self, run: RequestRun, live: LiveLoop) -> bool:
        """Keep ``live``'s new plan back when it is an AR decode plan and the run's first audio
        is pending; True when it was held (the caller does not queue it)."""
        if live.loop.kind is LoopKind.AR_DECODE and self.pending(run):
            run.held_for_audio.append(live)
            return True
        return False

    def update(self, run: RequestRun) -> None:
        """Hold or release the run's AR plans for its first audio (``first_audio_alone``):
        queue the AR plans that waited for the first audio, once it is out or no audio
        stage has a unit queued or running (it waits for their output). While it is pending,
        AR plans queued before the audio unit (in the fold whose codes made the audio unit
        ready: Qwen3-TTS's talker feeds its codec directly) leave the queue for the held list,
        so that the first chunk runs without them."""
        if run.finished:
            return
        if self.pending(run):
            for live in run.live.values():
                if live.queued and live.loop.kind is LoopKind.AR_DECODE:
                    self._scheduler.remove(live)
                    run.held_for_audio.append(live)
            return
        if not run.held_for_audio:
            return
        held, run.held_for_audio = run.held_for_audio, []
        for live in held:
            self._scheduler.enqueue(live, self._priority(run, live))
        self._wake()
