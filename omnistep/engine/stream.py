"""A request as the engine holds it: its ``RequestStream`` (what the caller iterates) and its
``RequestRun`` (the engine's bookkeeping: live, parked and held loops, playback clock, timer).

Imports ``omnistep.core`` and the engine's scheduler and deadline types only.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from omnistep.core import ModelInstance, ProgramContext, Request, StreamChunk
from omnistep.engine.deadlines import PlaybackClock
from omnistep.engine.scheduler import LiveLoop

if TYPE_CHECKING:
    from omnistep.engine.engine import AsyncEngine


@dataclass(frozen=True, slots=True)
class StreamEnd:
    """The last item of a stream's queue: the request ended, with ``error`` unless it finished."""

    error: BaseException | None = None


class RequestStream:
    """The async iterator of one request's StreamChunks, returned by ``AsyncEngine.add_request``.

    Iteration ends normally when the request finishes; raises ``RequestFailedError`` if a step
    failed, ``RequestAbortedError`` if it was aborted. ``cancel()`` aborts the request.
    """

    def __init__(
        self, request: Request, engine: AsyncEngine, ctx: ProgramContext, clock: PlaybackClock
    ):
        self.request = request
        self._engine = engine
        self._ctx = ctx
        self._queue: asyncio.Queue[StreamChunk | StreamEnd] = asyncio.Queue()
        self.finished = False
        self.clock = clock
        """The playback clock the request's deadlines follow (shared when it was given one)."""

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def seed(self) -> int:
        """The request's seed (drawn by the engine when the request gave none)."""
        assert self.request.seed is not None
        return self.request.seed

    @property
    def trajectories(self) -> dict[str, list]:
        """ROLLOUT records of the request's finished loops, by program node name."""
        return self._ctx.trajectories

    @property
    def rollout_info(self) -> dict[str, dict]:
        """ROLLOUT replay information of the request's finished loops (prompt, stop reason,
        seed), by program node name."""
        return self._ctx.rollout_info

    @property
    def usage(self) -> dict[str, int]:
        """Token counts reported by the card: ``input_tokens``, ``output_tokens``."""
        return self._ctx.usage

    @property
    def text_ids(self) -> tuple[int, ...] | None:
        """The generated text's token ids once the request finished, when its card binds
        them to a ``text_ids`` slot (a chat LM's reply: the Qwen thinker's frames, EOS not
        included); None otherwise (not finished, cancelled, or a card without one)."""
        frames = self._ctx.slots.get("text_ids")
        if not self.finished or not isinstance(frames, list | tuple):
            return None
        return tuple(int(f[0]) if isinstance(f, tuple | list) else int(f) for f in frames)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> StreamChunk:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, StreamEnd):
            self.finished = True
            if item.error is not None:
                raise item.error
            raise StopAsyncIteration
        return item

    def cancel(self) -> None:
        """Abort the request if it is still running (e.g. the client went away)."""
        if not self.finished:
            self._engine.abort(self.request_id)

    def append_text(self, text: str) -> None:
        """Add ``text`` to the input of a request made with ``text_input=True``
        (``AsyncEngine.append_text``). Must be called on the event loop."""
        self._engine.append_text(self.request_id, text)

    def end_text(self) -> None:
        """No more text comes (``AsyncEngine.end_text``). Must be called on the event loop."""
        self._engine.end_text(self.request_id)

    def put(self, item: StreamChunk | StreamEnd) -> None:
        """Queue a chunk, or the end, for the iterating caller (the engine's side)."""
        self._queue.put_nowait(item)


@dataclass(eq=False)
class RequestRun:
    """Engine-side bookkeeping of one request.

    Attributes:
        model: the model instance serving it.
        ctx: its program context (slots, usage, trajectories).
        stream: what its caller iterates.
        started, done: names of the program nodes started and finished.
        live: its running loops by program node name; ``parked``: those waiting (``Pending``).
        clock: the playback clock its deadlines follow, maybe shared with other runs.
        held: plans of a request waiting for admission (EDF admission, a weight drain); None
            once it runs.
        held_for_audio: AR plans held back while its first audio is made
            (``FirstAudioHold``).
        waiting_since: ``time.monotonic()`` when it was added (admission's max wait and the
            time-to-first-audio count from here).
        audio_s: seconds of audio it published (its own, for the metrics).
        next_seq: the sequence number of its next chunk.
        finished: ended (finished, failed or aborted).
        timer: aborts it at ``EngineConfig.request_timeout``.
    """

    model: ModelInstance
    ctx: ProgramContext
    stream: RequestStream
    started: set[str] = field(default_factory=set)
    done: set[str] = field(default_factory=set)
    live: dict[str, LiveLoop] = field(default_factory=dict)
    parked: list[LiveLoop] = field(default_factory=list)
    clock: PlaybackClock | None = None
    held: list[LiveLoop] | None = None
    held_for_audio: list[LiveLoop] = field(default_factory=list)
    waiting_since: float = 0.0
    audio_s: float = 0.0
    next_seq: int = 0
    finished: bool = False
    timer: asyncio.TimerHandle | None = None

    @property
    def card_id(self) -> str:
        """The card id of the model serving it."""
        return self.model.card.card_id
