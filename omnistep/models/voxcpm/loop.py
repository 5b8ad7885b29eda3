"""The AR loop around ``VoxCPMAR``: the shared ``ARDecodeLoop`` with each step's patch fed back.

Every step of ``VoxCPMAR`` returns the stop decision as its frame (``(0,)`` continue, ``(1,)``
stop) and the patch it solved (``ARStepOutput.hidden``, ``[P, C]`` float32). ``VoxCPMLoop``:

- keeps the patches (``VoxCPMLoopState.patches``): the last one is the next step's
  ``ARStepInput.extra``; after a preemption the replayed prefill's prompt lists them all
  (``VoxCPMPrompt.patches``, one per replayed frame);
- applies the stop rule: upstream's ``_inference`` keeps the patch of the step whose stop
  logits say stop, then ends (``if i > min_len and stop_flag == 1: break`` after appending the
  patch), so the stop step's patch is streamed too, and the frame is not kept (as any EOS);
  the cap is ``min(request/card cap, VoxCPMPrompt.max_len)`` patches (upstream's
  ``min(int(text_len * 6 + 10), max_len)``, which the frontend puts in the prompt);
- puts every patch's ``P`` latent frames (``[C]`` float32 each) on the stream slot, in order,
  for the AudioVAE vocoder loop (``AudioDecodeLoop`` with ``stream_state``; a first chunk of
  ``P`` frames gives audio after the first patch).

Under ROLLOUT the stop decisions are recorded as the loop's actions (the patches are not yet:
the SDE log-probs of the inner solve are not built).

Imports: ``omnistep.core``, ``omnistep.loops``, this family's ``ar``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from omnistep.core import (
    ActionRecord,
    Done,
    ExecutionProfile,
    ModelInstance,
    ProgramContext,
    Request,
    StepResult,
    WorkPlan,
)
from omnistep.loops.ar_decode import (
    ARDecodeLoop,
    ARDecodeState,
    ARPrefillInput,
    ARStepInput,
    ARStepOutput,
)
from omnistep.models.voxcpm.ar import VoxCPMPrompt


@dataclass
class VoxCPMLoopState(ARDecodeState):
    """``ARDecodeState`` plus the patches generated so far (``[P, C]`` float32 each, one per
    kept frame) and the number of patches put on the stream (the stop step's included)."""

    patches: list[torch.Tensor] = field(default_factory=list)
    streamed: int = 0


class VoxCPMLoop(ARDecodeLoop):
    """The AR_DECODE loop of the VoxCPM2 card (see the module docstring). Its config's
    ``stream_slot`` receives latent frames; ``stream_hidden`` and ``stream_on_eos`` are not
    read (every patch, the stop step's included, is streamed frame by frame)."""

    def init(self, req: Request, model: ModelInstance, ctx: ProgramContext) -> VoxCPMLoopState:
        base = super().init(req, model, ctx)
        prompt = base.prompt
        if not isinstance(prompt, VoxCPMPrompt):
            raise TypeError(f"the VoxCPM loop needs a VoxCPMPrompt, got {type(prompt).__name__}")
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
        state = VoxCPMLoopState(**fields)
        if prompt.max_len is not None:
            state.max_new_tokens = min(state.max_new_tokens, prompt.max_len)
        return state

    def next(self, state: VoxCPMLoopState) -> WorkPlan | Done:  # type: ignore[override]
        plan = super().next(state)
        if isinstance(plan, Done):
            return plan
        unit = plan.payload
        if isinstance(unit, ARPrefillInput):
            prompt = dataclasses.replace(state.prompt, patches=tuple(state.patches))
            unit = dataclasses.replace(unit, prompt=prompt)
        elif isinstance(unit, ARStepInput):
            unit = dataclasses.replace(unit, extra=state.patches[-1])
        return dataclasses.replace(plan, payload=unit)

    def advance(self, state: VoxCPMLoopState, result: StepResult) -> VoxCPMLoopState:  # type: ignore[override]
        out: ARStepOutput = result.output
        if out.preempted:
            state.needs_prefill = True
            state.num_preemptions += 1
            return state
        state.needs_prefill = False
        state.step += 1
        if state.profile is ExecutionProfile.ROLLOUT:
            state.trajectory.append(
                ActionRecord(
                    tuple(out.tokens), out.logprobs, out.policy_logprobs, out.weight_version
                )
            )
        patch = torch.as_tensor(out.hidden, dtype=torch.float32)
        if state.stream is not None:
            for frame in patch:  # [P, C] -> P latent frames [C]
                state.stream.put(frame.clone())
            state.streamed += 1
        if self._is_eos(out.tokens):
            state.finished = True
            return state
        state.frames.append(tuple(out.tokens))
        state.patches.append(patch)
        return state
