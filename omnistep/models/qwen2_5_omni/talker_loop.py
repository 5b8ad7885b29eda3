"""The talker's decode loop of Qwen2.5-Omni: AR decode of codec ids conditioned on the
thinker's rows as they stream (``TalkerLoop``), on the shared ``ARDecodeLoop``.

A media prompt's TMRoPE positions (the thinker's ``ThinkerPrompt``) go into the talker's prompt.

Imports: torch, ``omnistep.core``, ``omnistep.loops``, this family's ``talker`` and ``thinker``
(prompt types).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from omnistep.core import (
    Channel,
    Done,
    ExecutionProfile,
    LoopResult,
    ModelInstance,
    Pending,
    ProgramContext,
    Request,
    WorkPlan,
)
from omnistep.loops.ar_decode import ARDecodeConfig, ARDecodeLoop, ARDecodeState, ARPrefillInput
from omnistep.models.qwen2_5_omni.talker import TalkerPrompt, condition_for_step
from omnistep.models.qwen2_5_omni.thinker import ThinkerPrompt


@dataclass
class TalkerState(ARDecodeState):
    """The talker's decode state plus its view of the thinker's rows."""

    rows: Channel = field(default_factory=Channel)
    speaker_bos_id: int | None = None
    positions: Any = None
    rope_delta: int = 0


class TalkerLoop(ARDecodeLoop):
    """AR decode of codec ids conditioned on the thinker's streamed rows.

    ``thinker_rows`` holds the prompt rows ``[L, E]`` first, then one reply row per thinker
    step (``r_0, r_1, ...``, the EOS step's included). The PREFILL waits for ``r_0``; decode
    step ``t`` waits for ``r_t`` until the thinker is done (then TEXT_EOS, then TEXT_PAD).
    """

    def __init__(self, config: ARDecodeConfig, rows_slot: str = "thinker_rows"):
        super().__init__(config)
        self.rows_slot = rows_slot

    def init(self, req: Request, model: ModelInstance, ctx: ProgramContext) -> TalkerState:
        base = super().init(req, model, ctx)
        fields_ = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
        thinker_prompt = ctx.slots.get(self.config.prompt_slot)
        media = isinstance(thinker_prompt, ThinkerPrompt)
        return TalkerState(
            **fields_,
            rows=ctx.slots[self.rows_slot],
            speaker_bos_id=ctx.slots["speaker"]["bos_token"],
            positions=torch.from_numpy(thinker_prompt.positions) if media else None,
            rope_delta=thinker_prompt.rope_delta if media else 0,
        )

    @staticmethod
    def _prompt(state: TalkerState, replay: list) -> TalkerPrompt:
        rows = state.rows
        return TalkerPrompt(
            rows[0],
            rows[1],
            state.speaker_bos_id,
            tuple(replay),
            state.positions,
            state.rope_delta,
        )

    def next(self, state: TalkerState) -> WorkPlan | Done | Pending:
        rows = state.rows
        if len(rows) < 2:  # prompt rows and r_0
            return Done() if rows.closed else Pending()
        plan = super().next(state)
        if isinstance(plan, Done):
            return plan
        replies = rows[1:]
        if isinstance(plan.payload, ARPrefillInput):
            replay = []
            for t in range(1, len(state.frames) + 1):
                cond = condition_for_step(t, replies, rows.closed)
                if cond is None:
                    return Pending()
                replay.append(cond)
            prompt = self._prompt(state, replay)
            plan.payload = dataclasses.replace(plan.payload, prompt=prompt)
            return plan
        cond = condition_for_step(len(state.frames), replies, rows.closed)
        if cond is None:
            return Pending()
        plan.payload = dataclasses.replace(plan.payload, extra=cond)
        return plan

    def finalize(self, state: TalkerState) -> LoopResult:
        """Under ROLLOUT the recorded prompt is the ``TalkerPrompt`` a replay of the whole
        trajectory needs: the thinker's prompt rows, ``r_0``, the speaker bos id, and the
        condition of every decode step that ran (``T - 1`` for ``T`` recorded frames)."""
        result = super().finalize(state)
        rows = state.rows
        if state.profile is ExecutionProfile.ROLLOUT and len(rows) >= 2:
            replies = rows[1:]
            replay = []
            for t in range(1, len(state.trajectory)):
                # a step ran only once its condition existed, and conditions never change
                cond = condition_for_step(t, replies, rows.closed)
                if cond is None:
                    raise RuntimeError(f"talker step {t} ran without its thinker condition")
                replay.append(cond)
            result.info["prompt"] = self._prompt(state, replay)
        return result
