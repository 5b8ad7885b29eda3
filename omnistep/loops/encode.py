"""The media-encoder loop: one ENCODE unit per media item of a request.

A request's media items (a program slot holding ``MediaItem``s, in prompt order) become ENCODE
units of the encoder component, one after another; the scheduler batches each with other
requests' units of the same kind (the ``ShapeSignature`` tag is the item's kind: the towers
pack items of different sizes into one forward, so size is no batching key). The loop's
result is the component's outputs, in the items' order; a program node that needs it (the
thinker's prompt) runs once every item is encoded, while other requests keep decoding.

Imports ``omnistep.core`` only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omnistep.core import (
    Done,
    ExecutionProfile,
    LoopKind,
    LoopResult,
    LoopState,
    MediaItem,
    ModelInstance,
    ProgramContext,
    Request,
    ResourceRequest,
    ShapeSignature,
    StepResult,
    WorkPlan,
    WorkUnitKind,
)
from omnistep.loops.base import ConfiguredLoop


@dataclass(frozen=True)
class EncodeConfig:
    """Settings of an ``EncodeLoop``.

    Attributes:
        loop_id: the loop's id in the card.
        component: the encoder component's name (e.g. a ``runners.encoder.MediaEncoderRunner``).
        media_slot: the program slot holding the request's ``MediaItem``s, in order.
    """

    loop_id: str
    component: str
    media_slot: str


@dataclass
class EncodeState(LoopState):
    """Per-request state: the items and the outputs so far."""

    items: tuple[MediaItem, ...] = ()
    outputs: list[Any] = field(default_factory=list)


class EncodeLoop(ConfiguredLoop[EncodeConfig]):
    """ENCODE loop (see module docstring)."""

    kind = LoopKind.ENCODE

    def init(self, req: Request, model: ModelInstance, ctx: ProgramContext) -> EncodeState:
        return self.new_state(
            EncodeState,
            req,
            items=tuple(ctx.slots[self.config.media_slot] or ()),
        )

    def next(self, state: EncodeState) -> WorkPlan | Done:
        index = len(state.outputs)
        if index >= len(state.items):
            return Done()
        item = state.items[index]
        shape = ShapeSignature(WorkUnitKind.ENCODE, tag=str(item.kind))
        return WorkPlan(
            WorkUnitKind.ENCODE,
            self.config.component,
            shape,
            item,
            ResourceRequest(),
            f"{self.loop_id}.{item.kind}{index}",
        )

    def advance(self, state: EncodeState, result: StepResult) -> EncodeState:
        state.outputs.append(result.output)
        state.step += 1
        return state

    def finalize(self, state: EncodeState) -> LoopResult:
        """The outputs in item order; under ROLLOUT ``info["media"]`` holds the items'
        ``sha256`` (what the encoders saw)."""
        info = None
        if state.profile is ExecutionProfile.ROLLOUT:
            info = {"media": tuple(item.sha256 for item in state.items)}
        return LoopResult(list(state.outputs), {"items": float(len(state.items))}, None, info)

    def release(self, state: EncodeState) -> None:
        """Nothing held outside the state (the component's cache belongs to no request)."""
