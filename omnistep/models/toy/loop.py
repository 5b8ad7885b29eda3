"""The ``toy`` card's token loop (AR_DECODE over the ``lm`` component): one token per unit,
each put on the ``token_stream`` channel for the audio loop and streamed as a text delta."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from omnistep.core import (
    ActionRecord,
    Channel,
    Done,
    ExecutionProfile,
    LoopKind,
    LoopResult,
    LoopState,
    ModelInstance,
    ProgramContext,
    Request,
    ResourceRequest,
    ShapeSignature,
    StepResult,
    StreamChunk,
    WorkPlan,
    WorkUnitKind,
)
from omnistep.loops.base import new_state
from omnistep.models.toy.lm import EOS, FAIL_STEP, LATE_FAIL_STEP, TokenUnit


@dataclass
class TokenState(LoopState):
    """State of the token loop."""

    seed: int = 0
    prev_token: int = 0
    temperature: float = 1.0
    min_new_tokens: int = 0
    max_new_tokens: int = 0
    fail_step: int | None = None
    slow: bool = False
    prompt: tuple[int, ...] = ()
    tokens: list[int] = field(default_factory=list)
    finished: bool = False
    channel: Channel = field(default_factory=Channel)


class TokenLoop:
    """AR_DECODE loop over the toy lm; emits each token as a text delta."""

    loop_id = "tokens"
    kind = LoopKind.AR_DECODE

    def init(self, req: Request, model: ModelInstance, ctx: ProgramContext) -> TokenState:
        prompt = ctx.slots["prompt_ids"]
        sp = req.sampling
        return new_state(
            TokenState,
            req,
            self.loop_id,
            channel=ctx.slots["token_stream"],
            seed=int(req.seed or 0),
            prev_token=prompt[-1],
            prompt=tuple(prompt),
            temperature=sp.or_default("temperature", 1.0),
            min_new_tokens=sp.or_default("min_new_tokens", 0),
            max_new_tokens=sp.max_new_tokens or 2 * len(prompt),
            fail_step=fault_step(prompt_text(req)),
            slow="<slow>" in prompt_text(req),
        )

    def next(self, state: TokenState) -> WorkPlan | Done:
        if state.finished or len(state.tokens) >= state.max_new_tokens:
            return Done()
        unit = TokenUnit(
            state.prev_token,
            state.seed,
            state.step,
            state.temperature,
            state.min_new_tokens,
            state.fail_step,
            state.slow,
        )
        return token_plan("lm", unit, f"toy.token{state.step}")

    def advance(self, state: TokenState, result: StepResult) -> TokenState:
        token, logprob, version = result.output
        state.step += 1
        if state.profile is ExecutionProfile.ROLLOUT:
            state.trajectory.append(ActionRecord((token,), (logprob,), (logprob,), version))
        if token == EOS:
            state.finished = True
            return state
        state.tokens.append(token)
        state.channel.put(token)
        state.prev_token = token
        state.outbox.append(StreamChunk.of_text(f"<{token}>"))
        return state

    def finalize(self, state: TokenState) -> LoopResult:
        metrics = {"tokens": float(len(state.tokens))}
        if state.profile is not ExecutionProfile.ROLLOUT:
            return LoopResult(list(state.tokens), metrics)
        stop = "eos" if state.finished else "length"
        info = {"prompt": state.prompt, "stop_reason": stop, "seed": state.seed}
        return LoopResult(list(state.tokens), metrics, state.trajectory, info)

    def score(
        self,
        model: ModelInstance,
        req: Request,
        prompt: Sequence[int],
        tokens: Sequence[Sequence[int]],
        mode: str = "processed",
        match_serving: bool = True,
    ) -> np.ndarray:
        """Recompute recorded log-probs (``ToyLM.score_logprobs``): ``[T, 1]`` float32 numpy,
        no autograd. Both modes give the recorded value (the toy samples its whole, untruncated
        distribution; only the EOS mask of ``min_new_tokens`` applies, in both).

        Raises:
            ValueError: a prompt that is not a non-empty sequence of ids, frames that are not
                one id wide, ids outside the vocab (``ToyLM.score_logprobs``)."""
        if not isinstance(prompt, Sequence) or len(prompt) < 1:
            raise ValueError("the toy's prompt is a sequence of at least one id")
        if any(len(frame) != 1 for frame in tokens):
            raise ValueError("the toy's frames are one id wide")
        ids = [int(frame[0]) for frame in tokens]
        sp = req.sampling
        prev = [int(prompt[-1]), *ids[:-1]]
        lm = model.components["lm"]
        return lm.score_logprobs(  # type: ignore[attr-defined]
            prev, ids, sp.or_default("temperature", 1.0), sp.or_default("min_new_tokens", 0)
        )

    def release(self, state: TokenState) -> None:
        """Nothing outside the state to free."""


def prompt_text(req: Request) -> str:
    """The text the toy reads: the speech input, or the chat messages as ``role: content``
    lines (so the fault markers work in chat requests too)."""
    if req.messages:
        return "\n".join(f"{m.role}: {m.content}" for m in req.messages)
    return req.text


def fault_step(text: str) -> int | None:
    """The lm step at which a request with a fault marker in ``text`` fails, or None."""
    if "<fail>" in text:
        return FAIL_STEP
    return LATE_FAIL_STEP if "<fail-late>" in text else None


def token_plan(component: str, unit: Any, label: str) -> WorkPlan:
    """The plan of one AR_TOKEN unit of a toy card's token loop: one token (shape ``(1,)``)
    of ``component``; ``label``: the unit's trace label."""
    return WorkPlan(
        WorkUnitKind.AR_TOKEN,
        component,
        ShapeSignature(WorkUnitKind.AR_TOKEN, (1,)),
        unit,
        ResourceRequest(num_tokens=1),
        label,
    )
