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

Under ROLLOUT the stop decisions are recorded as the loop's actions (``ActionRecord``s, the
stop step's included) and the patches as its continuous actions (``FlowPatches`` in
``LoopResult.info["flow"]``, one per recorded step): with ``flow_noise_level`` > 0 each patch's
SDE chain, means, stds and Gaussian log-probs (``ar.SolvedPatch``), else the patches alone.
``score_patches_batch`` recomputes both kinds of log-prob teacher-forced, several samples in
one packed forward (``VoxCPMAR.score_patches_batch``).

Imports: ``omnistep.core``, ``omnistep.loops``, this family's ``ar``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from omnistep.core import (
    ActionRecord,
    Done,
    ExecutionProfile,
    FlowPatches,
    LoopResult,
    ModelInstance,
    ProgramContext,
    Request,
    StepResult,
    WorkPlan,
    local_method,
)
from omnistep.loops.ar_decode import (
    ARDecodeLoop,
    ARDecodeState,
    ARPrefillInput,
    ARStepInput,
    ARStepOutput,
)
from omnistep.models.voxcpm.ar import SolvedPatch, VoxCPMPrompt


@dataclass
class VoxCPMLoopState(ARDecodeState):
    """``ARDecodeState`` plus the patches generated so far (``[P, C]`` float32 each, one per
    kept frame) and the number of patches put on the stream (the stop step's included)."""

    patches: list[torch.Tensor] = field(default_factory=list)
    streamed: int = 0
    solved: list[SolvedPatch | torch.Tensor] = field(default_factory=list)
    """Under ROLLOUT: every recorded step's patch, or its ``SolvedPatch`` (an SDE solve)."""


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
        solved = out.hidden
        patch = solved.patch if isinstance(solved, SolvedPatch) else solved
        patch = torch.as_tensor(patch, dtype=torch.float32)
        if state.profile is ExecutionProfile.ROLLOUT:
            state.trajectory.append(
                ActionRecord(
                    tuple(out.tokens), out.logprobs, out.policy_logprobs, out.weight_version
                )
            )
            state.solved.append(solved)
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

    def finalize(self, state: VoxCPMLoopState) -> LoopResult:  # type: ignore[override]
        """``ARDecodeLoop.finalize``; under ROLLOUT also ``info["flow"]``, the patches'
        ``FlowPatches``, and ``info["prompt"]`` without replay patches."""
        result = super().finalize(state)
        if result.info is not None:
            result.info["prompt"] = dataclasses.replace(state.prompt, patches=())
            result.info["flow"] = flow_patches(state.solved, state.prompt.noise_level)
        return result

    def score_patches(
        self,
        model: ModelInstance,
        req: Request,
        prompt: VoxCPMPrompt,
        tokens: Any,
        flow: FlowPatches,
        mode: str = "processed",
        match_serving: bool = True,
    ) -> tuple[Any, Any]:
        """Recompute a recorded sample's log-probs: ``score_patches_batch`` of one sample,
        ``(stop [T, 1] float32, SDE steps [T, S] float64)``."""
        [out] = self.score_patches_batch(
            model, [req], [prompt], [tokens], [flow], mode, match_serving
        )
        return out

    def score_patches_batch(
        self,
        model: ModelInstance,
        reqs: Sequence[Request],
        prompts: Sequence[VoxCPMPrompt],
        tokens: Sequence[Any],
        flows: Sequence[FlowPatches],
        mode: str = "processed",
        match_serving: bool = True,
    ) -> list[tuple[Any, Any]]:
        """Recompute several recorded samples' log-probs in one packed teacher-forced
        forward (``VoxCPMAR.score_patches_batch``; autograd on a trainer's copy): per sample
        ``(stop [T, 1] float32, SDE steps [T, S] float64)``, each scored with the loop's
        sampling row for its request (the stop temperature it was sampled at).

        Raises:
            NotImplementedError: the component cannot score here (another process).
            ValueError: a flow record that does not match the frames.
        """
        name = self.config.component
        scorer = local_method(model.components[name], "score_patches_batch", name)
        frames_of, chains, levels = [], [], []
        for frames, flow in zip(tokens, flows, strict=True):
            frames = [tuple(int(t) for t in frame) for frame in frames]
            states = torch.as_tensor(np.asarray(flow.states, dtype=np.float32))
            if states.shape[0] != len(frames):
                raise ValueError(f"{len(frames)} frames but {states.shape[0]} recorded patches")
            frames_of.append(frames)
            chains.append(states)
            levels.append(float(flow.noise_level))
        return scorer(
            prompts,
            frames_of,
            [states[:, -1] for states in chains],
            [self.config.make_sampling(req) for req in reqs],
            mode,
            [states if states.shape[1] > 1 else None for states in chains],
            levels,
            match_serving,
        )


def flow_patches(solved: list[SolvedPatch | torch.Tensor], noise_level: float) -> FlowPatches:
    """The ``FlowPatches`` of a rollout's recorded steps (``SolvedPatch``es of SDE solves,
    else plain patches ``[P, C]``)."""
    if not solved:
        empty = np.zeros((0, 1, 0, 0), np.float32)
        return FlowPatches(empty, empty[:, :0], np.zeros(0), np.zeros((0, 0)), noise_level)
    if not isinstance(solved[0], SolvedPatch):
        states = torch.stack([torch.as_tensor(p) for p in solved])[:, None]
        num = states.shape[0]
        means = np.zeros((num, 0, *states.shape[2:]), np.float32)
        return FlowPatches(
            states.float().numpy(), means, np.zeros(0), np.zeros((num, 0)), noise_level
        )
    return FlowPatches(
        torch.stack([s.states for s in solved]).float().numpy(),
        torch.stack([s.means for s in solved]).float().numpy(),
        np.asarray(solved[0].stds, dtype=np.float64),
        torch.stack([s.logprobs for s in solved]).double().numpy(),
        noise_level,
    )
