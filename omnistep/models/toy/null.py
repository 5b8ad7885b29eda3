"""The ``null`` card: a loop whose component does no work, to measure the engine's own overhead.

Each request runs one ``null`` loop (AR_DECODE) of ``max_new_tokens`` steps (default 20); every
step is one AR_TOKEN WorkUnit of the same ShapeSignature, so units of all requests batch
together. The ``null`` component returns each payload as its output, and the loop checks that it
got back its own step index (a unit folded into the wrong loop fails the request). With
``emit_every = k > 0`` the loop streams a one-character text chunk every k steps; at the end a
kernel node streams the number of steps the loop ran, as text.

Not registered as a family: ``bench/scheduler_overhead.py`` and the tests build it directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from omnistep.core import (
    Capability,
    ComponentSpec,
    Done,
    KernelNode,
    LoopKind,
    LoopNode,
    LoopResult,
    LoopSpec,
    LoopState,
    ModelCard,
    ModelInstance,
    Program,
    ProgramContext,
    Request,
    ShapeSignature,
    StepResult,
    StreamChunk,
    WorkPlan,
    WorkUnitKind,
)
from omnistep.loops.base import new_state

DEFAULT_STEPS = 20
SHAPE = ShapeSignature(WorkUnitKind.AR_TOKEN, (1,))


class NullComponent:
    """Does nothing: one output per payload, the payload itself."""

    def __init__(self, device: str = "cpu"):
        self.calls = 0

    def execute(self, kind: WorkUnitKind, payloads: Sequence[Any]) -> list[Any]:
        """Returns ``list(payloads)``."""
        self.calls += 1
        return list(payloads)


@dataclass
class NullState(LoopState):
    """State of the null loop: ``steps`` units to run, a text chunk every ``emit_every``."""

    steps: int = 0
    emit_every: int = 0


class NullLoop:
    """One AR_TOKEN unit per step, ``steps`` of them; the payload is the step index."""

    loop_id = "null"
    kind = LoopKind.AR_DECODE

    def __init__(self, emit_every: int = 0):
        self.emit_every = emit_every

    def init(self, req: Request, model: ModelInstance, ctx: ProgramContext) -> NullState:
        return new_state(
            NullState,
            req,
            self.loop_id,
            steps=req.sampling.max_new_tokens or DEFAULT_STEPS,
            emit_every=self.emit_every,
        )

    def next(self, state: NullState) -> WorkPlan | Done:
        if state.step >= state.steps:
            return Done()
        return WorkPlan(WorkUnitKind.AR_TOKEN, "null", SHAPE, state.step, label="null.step")

    def advance(self, state: NullState, result: StepResult) -> NullState:
        if result.output != state.step:
            raise RuntimeError(f"step {state.step} got the output of step {result.output}")
        state.step += 1
        if state.emit_every and state.step % state.emit_every == 0:
            state.outbox.append(StreamChunk.of_text("."))
        return state

    def finalize(self, state: NullState) -> LoopResult:
        return LoopResult(state.step, {"steps": float(state.step)})

    def release(self, state: NullState) -> None:
        """Nothing outside the state to free."""


def _report(ctx: ProgramContext) -> None:
    ctx.outbox.append(StreamChunk.of_text(str(ctx.slots["steps"])))


def build_null_card(*, max_batch_size: int = 1024, emit_every: int = 0) -> ModelCard:
    """The null card. ``max_batch_size`` is the component's own cap (the engine's config caps
    batches too); ``emit_every`` > 0 streams a chunk every that many steps."""
    program = Program(
        inputs=("request",),
        nodes=(
            LoopNode("run", "null", needs=("request",), binds="steps"),
            KernelNode("report", _report, needs=("steps",)),
        ),
    )
    return ModelCard(
        card_id="null",
        family="toy",
        components=(ComponentSpec("null", NullComponent, max_batch_size=max_batch_size),),
        loops=(
            LoopSpec(
                "null",
                LoopKind.AR_DECODE,
                (WorkUnitKind.AR_TOKEN,),
                ("null",),
                lambda: NullLoop(emit_every),
            ),
        ),
        program=program,
        capabilities=frozenset({Capability.CHAT_TEXT}),
        sample_rate=8000,
        parity=frozenset({"C0"}),
        description="Does no work: measures scheduler and engine overhead per WorkUnit.",
    )
