"""A chunked vocoder loop fed by a Channel: one AUDIO_CHUNK WorkUnit per chunk of frames.

The producer (an AR decode loop) puts one frame per step (a codec frame or a hidden state) on a
``Channel``; this loop cuts the frames into chunks (``first_chunk`` frames, then ``chunk`` frames,
growing by ``chunk_growth`` per chunk up to ``max_chunk``) and decodes every chunk with up to
``left_context`` frames before it and ``lookahead`` frames after it, so a convolutional vocoder
sees (part of) its receptive field across the join.

Growing chunks serve both ends: the first ones are small so audio starts early, later ones are
large so the context recomputed per chunk (``left_context + lookahead``) costs less per frame,
while the audio already sent covers the longer wait. The schedule depends only on the total
number of frames, never on timing: a chunk is cut when its look-ahead has arrived or the channel
is closed, so streamed and non-streamed requests decode the same chunks and give the same
samples.

Stateful vocoders (``AudioDecodeConfig.stream_state``): a component that keeps each request's
decoder state between chunks (a KV cache, the last inputs of its causal convs) needs no left
context: each unit carries only the chunk's new frames, ``left`` 0, and the request's stream id
(``AudioChunkInput.seq_id``, also what the Ray executor routes a request's units by, to the
replica holding its state). The state is the component's, like an AR component's KV blocks: it
is made at the request's first chunk, and ``release`` (called by the engine when the loop
finishes, fails or is aborted) frees it through the component's ``free_sequence(seq_id)`` when
it has one. Components without state ignore ``seq_id``.

Silence trimming touches only the edges: leading samples with ``|x| <= trim_threshold`` are
dropped until the first louder sample; trailing quiet samples are held back until louder audio
follows (then they are interior and emitted) or the stream ends (then they are dropped).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from omnistep.core import (
    Channel,
    Done,
    LoopKind,
    LoopResult,
    LoopState,
    ModelInstance,
    Pending,
    ProgramContext,
    Request,
    ResourceRequest,
    ShapeSignature,
    StepResult,
    StreamChunk,
    WorkPlan,
    WorkUnitKind,
)
from omnistep.loops.base import ConfiguredLoop


@dataclass(frozen=True, slots=True)
class AudioChunkInput:
    """Payload of one AUDIO_CHUNK unit.

    Attributes:
        frames: the window's frames (channel items), ``left + chunk + right`` of them.
        left: frames of left context before the chunk.
        chunk: frames whose samples this unit outputs.
        extras: per-request data the component needs (e.g. a speaker); None if unused.
        seq_id: the request's stream id when the loop runs a stateful component
            (``AudioDecodeConfig.stream_state``): the key of the state the component keeps
            between this request's chunks; None otherwise.
        start: index of ``frames[0]`` in the request's stream of frames (the chunk starts at
            frame ``start + left``).

    The component returns float32 samples for the ``chunk`` frames only.
    """

    frames: tuple[Any, ...]
    left: int
    chunk: int
    extras: Any = None
    seq_id: str | None = None
    start: int = 0

    @property
    def right(self) -> int:
        """Frames of look-ahead after the chunk."""
        return len(self.frames) - self.left - self.chunk


@dataclass(frozen=True)
class AudioDecodeConfig:
    """Settings of an AudioDecodeLoop.

    Attributes:
        loop_id: the loop's id in the card.
        component: the vocoder component's name.
        in_slot: the program slot holding the input Channel.
        sample_rate: Hz of the samples the component returns.
        first_chunk: frames in the first chunk (small: it sets time to first audio).
        chunk: frames in the second chunk.
        chunk_growth: each later chunk is this many times the one before (1.0: all ``chunk``).
        max_chunk: cap on chunk sizes; None means ``chunk`` (no growth).
        left_context: frames of left context given to each chunk.
        lookahead: frames of right context each chunk waits for.
        trim_threshold: edge samples with ``|x| <=`` this are trimmed; None disables trimming.
        extras_slot: a program slot whose value is passed to every unit as ``extras``.
        window_buckets: increasing window lengths (frames); when given, a unit's batching key
            is its chunk size and its window length rounded up to the next bucket (its own
            length past the last), so windows of different lengths batch together. Only for a
            causal component that right-pads the windows of a batch (its samples never depend
            on later frames); needs ``lookahead`` 0. Empty: windows batch only with equal
            shapes. With ``stream_state`` the key is the chunk size rounded up to a bucket (the
            component right-pads chunks of different sizes).
        stream_state: the component keeps each request's state between chunks (see the
            module docstring): units carry only new frames and the request's ``seq_id``, and
            ``release`` frees the state; needs ``left_context`` and ``lookahead`` 0.
        report_frames: each unit reports its input frames as ``num_tokens``, so EDF measures
            the vocoder's cost and a chunk is as urgent as its length makes it. Off: a chunk
            has no cost estimate, waits behind its request's other units and batches with
            other requests' chunks (what TTS cards want); a cascade whose thinker and talker
            would otherwise keep both workers busy (Qwen2.5-Omni) turns it on.
    """

    loop_id: str
    component: str
    in_slot: str
    sample_rate: int
    first_chunk: int = 8
    chunk: int = 32
    chunk_growth: float = 1.0
    max_chunk: int | None = None
    left_context: int = 0
    lookahead: int = 0
    trim_threshold: float | None = None
    extras_slot: str | None = None
    window_buckets: tuple[int, ...] = ()
    stream_state: bool = False
    report_frames: bool = False

    def __post_init__(self) -> None:
        for name in ("first_chunk", "chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("left_context", "lookahead"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not self.chunk_growth >= 1.0:
            raise ValueError(f"chunk_growth must be >= 1.0, got {self.chunk_growth}")
        if self.max_chunk is not None and self.max_chunk < self.chunk:
            raise ValueError(f"max_chunk ({self.max_chunk}) must be >= chunk ({self.chunk})")
        buckets = self.window_buckets
        increasing = all(a < b for a, b in zip(buckets, buckets[1:], strict=False))
        if buckets and (buckets[0] < 1 or not increasing):
            raise ValueError(f"window_buckets must be increasing positive ints, got {buckets}")
        if buckets and self.lookahead:
            raise ValueError("window_buckets need lookahead 0 (a causal component)")
        if self.stream_state and (self.left_context or self.lookahead):
            raise ValueError(
                "stream_state needs left_context 0 and lookahead 0 (the component keeps the "
                f"context), got {self.left_context} and {self.lookahead}"
            )

    def window_bucket(self, frames: int) -> int:
        """The smallest of ``window_buckets`` >= ``frames``, or ``frames`` past the last."""
        return next((b for b in self.window_buckets if b >= frames), frames)

    def chunk_size(self, index: int) -> int:
        """Frames in chunk ``index`` (0-based): ``first_chunk``, then ``chunk`` growing by
        ``chunk_growth`` per chunk, capped at ``max_chunk``."""
        if index == 0:
            return self.first_chunk
        cap = self.chunk if self.max_chunk is None else self.max_chunk
        return min(cap, int(self.chunk * self.chunk_growth ** min(index - 1, 64)))


@dataclass
class AudioDecodeState(LoopState):
    """Per-request state: the input channel and how far decoding has got."""

    channel: Channel = field(default_factory=Channel)
    decoded: int = 0
    num_samples: int = 0
    started: bool = False
    held: list[np.ndarray] = field(default_factory=list)
    extras: Any = None
    seq_id: str | None = None
    owner: Any = None


class AudioDecodeLoop(ConfiguredLoop[AudioDecodeConfig]):
    """AUDIO_DECODE loop (see module docstring)."""

    kind = LoopKind.AUDIO_DECODE

    def init(self, req: Request, model: ModelInstance, ctx: ProgramContext) -> AudioDecodeState:
        stateful = self.config.stream_state
        return self.new_state(
            AudioDecodeState,
            req,
            channel=ctx.slots[self.config.in_slot],
            extras=ctx.slots.get(self.config.extras_slot or ""),
            seq_id=f"{req.request_id}/{self.loop_id}" if stateful else None,
            owner=model.components[self.config.component] if stateful else None,
        )

    def chunk_bounds(
        self, index: int, decoded: int, available: int, closed: bool
    ) -> tuple[int, int] | None:
        """(chunk end, window end) of chunk ``index`` starting at frame ``decoded``, or None
        when it must wait."""
        cfg = self.config
        end = decoded + cfg.chunk_size(index)
        if available >= end + cfg.lookahead:
            return end, end + cfg.lookahead
        if closed and available > decoded:
            return min(end, available), available
        return None

    def next(self, state: AudioDecodeState) -> WorkPlan | Done | Pending:
        channel = state.channel
        bounds = self.chunk_bounds(state.step, state.decoded, len(channel), channel.closed)
        if bounds is None:
            return Done() if channel.closed else Pending()
        end, window_end = bounds
        start = max(0, state.decoded - self.config.left_context)
        unit = AudioChunkInput(
            tuple(channel[start:window_end]),
            state.decoded - start,
            end - state.decoded,
            state.extras,
            state.seq_id,
            start,
        )
        dims: tuple[int, ...] = (len(unit.frames), unit.left, unit.chunk)
        if self.config.stream_state:
            dims = (self.config.window_bucket(unit.chunk),)
        elif self.config.window_buckets:
            dims = (unit.chunk, self.config.window_bucket(len(unit.frames)))
        return WorkPlan(
            WorkUnitKind.AUDIO_CHUNK,
            self.config.component,
            ShapeSignature(WorkUnitKind.AUDIO_CHUNK, dims),
            unit,
            ResourceRequest(num_tokens=len(unit.frames) if self.config.report_frames else 0),
            label=f"{self.loop_id}.chunk{state.step}",
        )

    def advance(self, state: AudioDecodeState, result: StepResult) -> AudioDecodeState:
        state.decoded += self._planned_chunk(state)
        state.step += 1
        samples = np.asarray(result.output, dtype=np.float32).reshape(-1)
        for piece in self._trim(state, samples):
            state.num_samples += piece.size
            state.outbox.append(StreamChunk.of_audio(piece, self.config.sample_rate))
        return state

    def _planned_chunk(self, state: AudioDecodeState) -> int:
        """Frames the unit just run covered. The channel may have grown (or closed) since the
        plan was made, but the schedule gives the same chunk end: a plan is only made once the
        chunk's frames exist, and a closed channel does not grow."""
        bounds = self.chunk_bounds(state.step, state.decoded, len(state.channel), True)
        assert bounds is not None
        return bounds[0] - state.decoded

    def _trim(self, state: AudioDecodeState, samples: np.ndarray) -> list[np.ndarray]:
        threshold = self.config.trim_threshold
        if threshold is None:
            return [samples] if samples.size else []
        loud = np.flatnonzero(np.abs(samples) > threshold)
        if loud.size == 0:
            if state.started:
                state.held.append(samples)
            return []
        first = 0 if state.started else int(loud[0])
        last = int(loud[-1]) + 1
        out = [*state.held, samples[first:last]] if state.started else [samples[first:last]]
        state.started = True
        state.held = [samples[last:]] if last < samples.size else []
        return [p for p in out if p.size]

    def finalize(self, state: AudioDecodeState) -> LoopResult:
        return LoopResult(
            state.num_samples, {"chunks": float(state.step), "samples": float(state.num_samples)}
        )

    def release(self, state: AudioDecodeState) -> None:
        """Free the request's state in a stateful component (``stream_state``); idempotent.
        A stateless loop holds nothing outside its state."""
        free = getattr(state.owner, "free_sequence", None)
        if free is not None and state.seq_id is not None:
            free(state.seq_id)
            state.owner = None
