"""A generic denoise loop: one DENOISE_STEP WorkUnit per ODE / diffusion step, chunk by chunk.

The input Channel (e.g. codec ids, ``frames_per_item`` output frames each) is denoised in
windows the card's schedule gives (``DenoiseConfig.next_window``): each window covers some
left context, the chunk it outputs and some look-ahead, and can start once the items up to its
end exist (or the input is closed). Per window the component builds an initial state from a
``start`` payload (the window's items, per-request conditioning, its noise), then every later
unit carries the state the previous one returned; when the component reports the state done,
the chunk's frames (``[out_start, out_end)`` of the window) go in order onto the stream
Channel for the next stage (a vocoder loop), and the next window starts. The default schedule
(``whole_utterance``) is one window over everything once the input is closed. Units of
different requests with the same ShapeSignature (window frames) step together in one batch.

Under ROLLOUT, a component that records its steps returns each step's record in
``DenoiseOutput.record``; the loop keeps them, in order, as its trajectory, and its result's
``info["prompt"]`` is a ``DenoiseReplay``: what rebuilds the windows' starts (the records'
conditioning) from the items of a complete input (``POST /v1/score`` rebuilds a rollout's
records that way).

Imports: ``omnistep.core`` only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from omnistep.core import (
    Channel,
    Done,
    ExecutionProfile,
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
    WorkPlan,
    WorkUnitKind,
    local_method,
)
from omnistep.loops.base import ConfiguredLoop


@dataclass(frozen=True, slots=True)
class DenoiseInput:
    """Payload of one DENOISE_STEP unit: exactly one of ``start`` (a window's first step) or
    ``state``; ``record``: the component returns the step's record (ROLLOUT)."""

    start: Any = None
    state: Any = None
    record: bool = False


@dataclass(frozen=True, slots=True)
class DenoiseOutput:
    """What the component returns: the new ``state``; ``result`` ``[window frames, dim]`` once
    done; ``record``: the step's record when the input asked for one."""

    state: Any
    done: bool = False
    result: Any = None
    record: Any = None


@dataclass(frozen=True, slots=True)
class Window:
    """Frames ``[start, end)`` are denoised together; ``[out_start, out_end)`` are kept."""

    start: int
    out_start: int
    out_end: int
    end: int

    @property
    def frames(self) -> int:
        return self.end - self.start


def whole_utterance(out_start: int, available: int, complete: bool) -> Window | None:
    """The schedule of one window over the whole input, once it is complete."""
    if not complete or out_start >= available:
        return None
    return Window(0, 0, available, available)


@dataclass(frozen=True)
class DenoiseConfig:
    """Settings of a DenoiseLoop.

    Attributes:
        loop_id: the loop's id in the card.
        component: the component that runs DENOISE_STEP units.
        in_slot: the input Channel (e.g. codec ids).
        stream_slot: the Channel that receives the kept frames.
        make_start: ``make_start(request, ctx, items, window) -> start payload`` for the
            window (``items``: every input item so far), or None when there is nothing to
            denoise (the loop then ends).
        frames_per_item: output frames per input item (Qwen2.5-Omni: 2 mel frames per code).
        keep_item: when given, only the input items it returns True for count (and reach
            ``make_start``): a producer's items that have no frames (Chatterbox: T3's ids
            outside S3Gen's vocabulary, which upstream drops) do not shift the windows.
        next_window: ``next_window(out_start, available, complete) -> window or None``: the
            window of the chunk that starts at output frame ``out_start`` when ``available``
            frames' items exist (``complete``: no more will come), None while it must wait or
            after the last chunk. Any object with ``start``, ``out_start``, ``out_end`` and
            ``end`` is a window. It must depend on frame positions only (not timing), so
            every run of a request denoises the same windows.
    """

    loop_id: str
    component: str
    in_slot: str
    stream_slot: str
    make_start: Callable[[Request, ProgramContext, list[Any], Any], Any]
    frames_per_item: int = 1
    next_window: Callable[[int, int, bool], Any] = whole_utterance
    keep_item: Callable[[Any], bool] | None = None


@dataclass(frozen=True, eq=False)
class DenoiseReplay:
    """What rebuilds a request's window starts: its request, its program context (a copy
    holding only the slots ``make_start`` reads, e.g. the voice) and the loop's config."""

    request: Request
    ctx: ProgramContext
    config: DenoiseConfig

    def starts(self, items: list[Any]) -> list[Any]:
        """The start payload of every window the loop denoises over ``items``, a complete
        input, in the order it runs them (the windows' first steps' conditioning)."""
        cfg, out, emitted = self.config, [], 0
        if cfg.keep_item is not None:
            items = [item for item in items if cfg.keep_item(item)]
        available = len(items) * cfg.frames_per_item
        while (window := cfg.next_window(emitted, available, True)) is not None:
            start = cfg.make_start(self.request, self.ctx, items, window)
            if start is None:
                break
            out.append(start)
            emitted = window.out_end
        return out


@dataclass
class DenoiseState(LoopState):
    """Per-request denoise state: the window in flight and its solver state."""

    source: Channel = field(default_factory=Channel)
    out: Channel = field(default_factory=Channel)
    window: Any = None
    ode: Any = None
    emitted: int = 0
    chunks: int = 0
    kept: list[Any] = field(default_factory=list)
    seen: int = 0
    finished: bool = False
    request: Request | None = None
    ctx: ProgramContext | None = None


class DenoiseLoop(ConfiguredLoop[DenoiseConfig]):
    """DENOISE loop (see module docstring)."""

    kind = LoopKind.DENOISE

    def init(self, req: Request, model: ModelInstance, ctx: ProgramContext) -> DenoiseState:
        return self.new_state(
            DenoiseState,
            req,
            source=ctx.slots[self.config.in_slot],
            out=ctx.slots[self.config.stream_slot],
            request=req,
            ctx=ctx,
        )

    def next(self, state: DenoiseState) -> WorkPlan | Done | Pending:
        if state.finished:
            return Done()
        record = state.profile is ExecutionProfile.ROLLOUT
        if state.ode is None:
            complete = state.source.closed
            window = self.config.next_window(state.emitted, self._available(state), complete)
            if window is None:  # polled after every step of the request: no copy of the items
                return Done() if complete else Pending()
            items = list(state.kept if self.config.keep_item else state.source[:])
            start = self.config.make_start(state.request, state.ctx, items, window)
            if start is None:
                return Done()
            unit = DenoiseInput(start=start, record=record)
        else:
            window = state.window
            unit = DenoiseInput(state=state.ode, record=record)
        frames = window.end - window.start
        shape = ShapeSignature(WorkUnitKind.DENOISE_STEP, (frames,))
        return WorkPlan(
            WorkUnitKind.DENOISE_STEP,
            self.config.component,
            shape,
            unit,
            ResourceRequest(num_tokens=frames),  # the window's frames: what the cost scales with
            label=f"{self.loop_id}.chunk{state.chunks}.step{state.step}",
        )

    def _available(self, state: DenoiseState) -> int:
        """Frames the input items so far make (only the kept ones, scanned once each)."""
        keep = self.config.keep_item
        if keep is None:
            return len(state.source) * self.config.frames_per_item
        if state.seen < len(state.source):
            state.kept += [item for item in state.source[state.seen :] if keep(item)]
            state.seen = len(state.source)
        return len(state.kept) * self.config.frames_per_item

    def advance(self, state: DenoiseState, result: StepResult) -> DenoiseState:
        out: DenoiseOutput = result.output
        if state.window is None:
            # The step began the window ``next`` computed: the same one, as a window depends
            # on its output start only (items that arrived since only let it exist; the end of
            # a complete input cuts it, and once complete stays complete).
            available = self._available(state)
            state.window = self.config.next_window(state.emitted, available, state.source.closed)
        state.ode = out.state
        state.step += 1
        if out.record is not None:
            state.trajectory.append(out.record)
        if out.done:
            w = state.window
            for frame in out.result[w.out_start - w.start : w.out_end - w.start]:
                state.out.put(frame)
            state.emitted = w.out_end
            state.chunks += 1
            state.window = state.ode = None
        return state

    def finalize(self, state: DenoiseState) -> LoopResult:
        metrics = {"ode_steps": float(state.step), "chunks": float(state.chunks)}
        if state.profile is not ExecutionProfile.ROLLOUT:
            return LoopResult(state.emitted, metrics)
        # the slots only: not the outbox's audio, the trajectories or rollout_info (which
        # will hold this replay: no cycle keeping the whole run alive)
        ctx = state.ctx
        slots_only = ProgramContext(ctx.request, ctx.model, ctx.profile, dict(ctx.slots))
        replay = DenoiseReplay(state.request, slots_only, self.config)
        info = {"seed": state.request.seed, "prompt": replay}
        # nothing recorded (an ODE: no policy) is no trajectory
        return LoopResult(state.emitted, metrics, state.trajectory or None, info)

    def score_steps(self, model: ModelInstance, records: list[Any]) -> Any:
        """Recompute the log-probs of SDE steps this loop recorded (``DenoiseStepRecord``)
        with the component's ``score_steps`` (autograd on when the caller's grad mode is).

        Returns:
            The component's log-probs, one per record (a torch float64 ``[S]`` tensor).

        Raises:
            NotImplementedError: the component cannot score here (no ``score_steps``, or a
                stand-in for a component running in another process).
        """
        name = self.config.component
        return local_method(model.components[name], "score_steps", name)(list(records))

    def release(self, state: DenoiseState) -> None:
        """Nothing outside the state to free."""
