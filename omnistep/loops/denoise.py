"""A generic denoise loop: one DENOISE_STEP WorkUnit per ODE / diffusion step.

The loop waits until its input Channel is closed (the whole code sequence exists), then asks
the component for one solver step per unit: the first unit carries a ``start`` (codes and
per-request conditioning, from which the component builds the initial state with the request's
own seeded noise), every later unit the state returned by the previous one. Units of different
requests with the same ShapeSignature (same number of frames) step together in one batch. When
the component reports the state done, the result (``[frames, dim]``) is put frame by frame on
the loop's stream Channel for the next stage (a vocoder loop).

Imports: ``omnistep.core`` only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

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
    ShapeSignature,
    StepResult,
    WorkPlan,
    WorkUnitKind,
)


@dataclass(frozen=True, slots=True)
class DenoiseInput:
    """Payload of one DENOISE_STEP unit: exactly one of ``start`` (first step) or ``state``."""

    start: Any = None
    state: Any = None


@dataclass(frozen=True, slots=True)
class DenoiseOutput:
    """What the component returns: the new ``state``; ``result`` ``[frames, dim]`` once done."""

    state: Any
    done: bool = False
    result: Any = None


@dataclass(frozen=True)
class DenoiseConfig:
    """Settings of a DenoiseLoop.

    Attributes:
        loop_id: the loop's id in the card.
        component: the component that runs DENOISE_STEP units.
        in_slot: the input Channel (e.g. codec ids), consumed whole once closed.
        stream_slot: the Channel that receives the result's frames.
        make_start: ``make_start(request, ctx, items) -> start payload`` (codes, speaker,
            seed...), or None when there is nothing to denoise (the loop then ends).
        frames_of: ``frames_of(start or state) -> int``, the batching dimension (frames).
    """

    loop_id: str
    component: str
    in_slot: str
    stream_slot: str
    make_start: Callable[[Request, ProgramContext, list[Any]], Any]
    frames_of: Callable[[Any], int]


@dataclass
class DenoiseState(LoopState):
    """Per-request denoise state."""

    source: Channel = field(default_factory=Channel)
    out: Channel = field(default_factory=Channel)
    ode: Any = None
    frames: int = 0
    finished: bool = False
    request: Request | None = None
    ctx: ProgramContext | None = None


class DenoiseLoop:
    """DENOISE loop (see module docstring)."""

    kind = LoopKind.DENOISE

    def __init__(self, config: DenoiseConfig):
        self.config = config
        self.loop_id = config.loop_id

    def init(self, req: Request, model: ModelInstance, ctx: ProgramContext) -> DenoiseState:
        return DenoiseState(
            request_id=req.request_id,
            loop_id=self.loop_id,
            profile=req.profile,
            source=ctx.slots[self.config.in_slot],
            out=ctx.slots[self.config.stream_slot],
            request=req,
            ctx=ctx,
        )

    def next(self, state: DenoiseState) -> WorkPlan | Done | Pending:
        if state.finished:
            return Done()
        if state.ode is None:
            if not state.source.closed:
                return Pending()
            start = self.config.make_start(state.request, state.ctx, list(state.source[:]))
            if start is None:
                return Done()
            unit = DenoiseInput(start=start)
            frames = self.config.frames_of(start)
        else:
            unit = DenoiseInput(state=state.ode)
            frames = state.frames
        shape = ShapeSignature(WorkUnitKind.DENOISE_STEP, (frames,))
        return WorkPlan(
            WorkUnitKind.DENOISE_STEP,
            self.config.component,
            shape,
            unit,
            label=f"{self.loop_id}.step{state.step}",
        )

    def advance(self, state: DenoiseState, result: StepResult) -> DenoiseState:
        out: DenoiseOutput = result.output
        state.ode = out.state
        state.frames = self.config.frames_of(out.state)
        state.step += 1
        if out.done:
            state.finished = True
            for frame in out.result:
                state.out.put(frame)
        return state

    def finalize(self, state: DenoiseState) -> LoopResult:
        return LoopResult(state.frames, {"ode_steps": float(state.step)})

    def release(self, state: DenoiseState) -> None:
        """Nothing outside the state to free."""
