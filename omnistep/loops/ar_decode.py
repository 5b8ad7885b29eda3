"""A generic autoregressive decode loop: a PREFILL unit, then one AR_TOKEN unit per step.

The loop owns no tensors: it describes steps, and the component (which owns the weights, the paged
KV cache and the sampler) runs them batched across requests. Each step produces a frame of
``num_vq`` token ids (1 for an ordinary LM, 4 for ChatTTS's codebooks), their log-probs and
optionally the step's hidden state, which the loop puts on a stream Channel for the next stage.

Preemption by recompute: when a decode batch's next tokens do not fit the component's KV pool,
the scheduler preempts its least urgent sequences (``omnistep.kv.KVPool``) and the component
answers their steps with ``preempted=True``; the loop then asks for a new PREFILL over the
prompt plus the frames generated so far, which the scheduler admits once its blocks are free,
and decoding resumes where it stopped (the step's random draw was not taken, so the request's
generator is where it was).

Under the ROLLOUT profile every step is recorded in the trajectory as an ``ActionRecord``: its
frame, the log-probs of each codebook in both modes (processed, policy) and the weight version.
Imports: ``omnistep.core`` and ``omnistep.sampling`` (for the per-request generator).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

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
    local_method,
)
from omnistep.loops.base import ConfiguredLoop
from omnistep.sampling import make_generator

Frame = tuple[int, ...]


class SequenceOwner(Protocol):
    """A component that keeps per-sequence state (KV blocks) and frees it on request."""

    def free_sequence(self, seq_id: str) -> None:
        """Free everything held for ``seq_id`` (idempotent)."""
        ...


@dataclass(frozen=True, slots=True)
class ARPrefillInput:
    """PREFILL payload: run the prompt (plus already generated frames, after a preemption),
    then sample the next frame.

    Attributes:
        seq_id: the KV sequence id (unique per request and loop).
        prompt: the component-specific prompt (token ids, embeddings spec...).
        generated: frames generated before a preemption, replayed after the prompt.
        history: the last ``penalty_window`` generated frames (repetition penalty).
        sampling: the component's per-request sampling settings.
        generator: the request's random generator (a ``torch.Generator``).
        share_group: the request's sample group (``Request.group``): a component may start
            this sequence on the KV blocks of an equal prompt of the same group instead of
            computing it again; None computes it.
        record: the step is recorded (ROLLOUT): its output carries the policy log-probs too.
        cache_salt: the request's prefix-caching scope (``Request.cache_salt``): a component
            with prefix caching starts the sequence on the longest cached prefix of its rows
            under this salt, and keeps its blocks cached when it ends; None reuses nothing.
    """

    seq_id: str
    prompt: Any
    generated: tuple[Frame, ...]
    history: tuple[Frame, ...]
    sampling: Any
    generator: Any
    share_group: str | None = None
    record: bool = False
    cache_salt: str | None = None


@dataclass(frozen=True, slots=True)
class ARStepInput:
    """AR_TOKEN payload: feed the last frame, sample the next.

    Attributes:
        seq_id: the KV sequence id.
        last: the previous frame, ``num_vq`` ids.
        num_generated: frames generated so far (``last`` included).
        history: the last ``penalty_window`` generated frames.
        sampling, generator, record: as in ARPrefillInput.
        extra: what the family's component needs besides the last frame for this step, set by
            its loop's ``plan`` (Qwen2.5-Omni's talker: the step's ``TalkerCondition``;
            Qwen3-TTS: the text-track id added to the step's input); None for the others.
    """

    seq_id: str
    last: Frame
    num_generated: int
    history: tuple[Frame, ...]
    sampling: Any
    generator: Any
    record: bool = False
    extra: Any = None


@dataclass(frozen=True, slots=True)
class ARStepOutput:
    """What the component returns for a PREFILL or AR_TOKEN unit.

    Attributes:
        tokens: the sampled frame, ``num_vq`` ids.
        logprobs: log-probs of those ids under the processed distribution.
        hidden: the step's hidden state (e.g. a ``[hidden]`` tensor) when the card streams it.
        preempted: the KV pool ran out; nothing was sampled and the sequence was freed.
        policy_logprobs: log-probs of those ids under ``log_softmax(logits / temperature)``,
            when the unit was recorded (``record``); else empty.
        weight_version: the version of the weights the step ran under.
        cached_rows: PREFILL only: prompt rows taken from the prefix cache rather than computed
            (``Request.cache_salt``), reported as the request's ``cached_tokens``.
        routing: a recorded unit's MoE routing (a MoE stack's, else None): int16 numpy
            ``[sparse layers, k]``, the experts of the row whose output this step sampled
            from (most probable first).
        prompt_routing: a recorded PREFILL's routing of its sequence's other rows (the
            prompt's rows but the last; after a preemption also the replayed frames' rows),
            int16 ``[rows - 1, sparse layers, k]``; rows taken from a cached or kept prefix
            carry the routing recorded when they were computed. None when some row's
            routing is unknown or the stack is dense.
    """

    tokens: Frame = ()
    logprobs: tuple[float, ...] = ()
    hidden: Any = None
    preempted: bool = False
    policy_logprobs: tuple[float, ...] = ()
    weight_version: int = 0
    cached_rows: int = 0
    routing: Any = None
    prompt_routing: Any = None


@dataclass(frozen=True)
class ARDecodeConfig:
    """Settings of an ARDecodeLoop.

    Attributes:
        loop_id: the loop's id in the card.
        component: the component that runs PREFILL and AR_TOKEN units.
        prompt_slot: the program slot holding the prompt (so chained AR loops don't collide).
        make_sampling: ``make_sampling(request) -> sampling settings`` for the component.
        max_new_tokens: default cap on generated frames (a request's own cap wins if lower).
        eos_token_ids: a frame containing any of them ends generation and is not output.
        eos_codebooks: the positions of a frame the EOS check reads (Qwen3-TTS: ``(0,)``, its
            other codebooks share ids with EOS); None reads every id.
        stream_slot: a stream slot (see ``LoopNode.streams``) that receives each frame's
            ``hidden`` (``stream_hidden``) or its tokens; None streams nothing.
        stream_hidden: put hidden states rather than token frames on the stream.
        penalty_window: generated frames passed as ``history``.
        seed_offset: added to the request seed, so chained AR loops draw different numbers.
        shape_tag: ShapeSignature tag of the loop's units, so loops on one component that must
            not share a forward (e.g. text vs code steps) batch apart.
        stream_on_eos: also stream the EOS step's ``hidden`` (when a row belongs to the step's
            input token, as the Qwen thinker's talker conditioning does; ChatTTS's belongs to
            the sampled frame, which EOS drops).
        detokenize: ``detokenize(token_ids) -> text``; when set, the loop emits the growing
            text as TEXT deltas (held back while it ends in an incomplete character).
        eos_all_codebooks: a frame ends generation only when every position ``eos_codebooks``
            names (all when None) holds an EOS id (a delay pattern's end cascade,
            ``omnistep.sampling.delay``); False: any one does.
        stream_delay: a codebook delay pattern (``omnistep.sampling.delay.DelayPattern``):
            the stream receives the undelayed audio frames (``[num_codebooks]`` long tensors,
            ``DelayPattern.undelay``) as soon as each is complete, instead of the sampled
            (delayed) frames; the loop's result and a rollout's records stay the sampled
            (delayed) steps, its ``mask`` marks the pattern's forced ids as no actions, and
            ``info["delay"]`` holds the pattern (``in_frame_order`` maps records to frames).
        honor_request_cap: the request's ``max_new_tokens`` caps this loop too (False for a
            stage the caller does not count, e.g. a talker behind a chat's ``max_tokens``).
    """

    loop_id: str
    component: str
    prompt_slot: str
    make_sampling: Callable[[Request], Any]
    max_new_tokens: int = 2048
    eos_token_ids: tuple[int, ...] = ()
    eos_codebooks: tuple[int, ...] | None = None
    stream_slot: str | None = None
    stream_hidden: bool = False
    penalty_window: int = 16
    seed_offset: int = 0
    shape_tag: str = ""
    stream_on_eos: bool = False
    detokenize: Callable[[list[int]], str] | None = None
    honor_request_cap: bool = True
    eos_all_codebooks: bool = False
    stream_delay: Any = None


@dataclass
class ARDecodeState(LoopState):
    """Per-request decode state."""

    seq_id: str = ""
    prompt: Any = None
    sampling: Any = None
    generator: Any = None
    owner: SequenceOwner | None = None
    frames: list[Frame] = field(default_factory=list)
    max_new_tokens: int = 0
    needs_prefill: bool = True
    finished: bool = False
    num_preemptions: int = 0
    stream: Channel | None = None
    text_emitted: int = 0
    share_group: str | None = None
    seed: int = 0
    cache_salt: str | None = None
    cached_rows: int = 0
    prompt_routing: Any = None


class ARDecodeLoop(ConfiguredLoop[ARDecodeConfig]):
    """AR_DECODE loop (see module docstring)."""

    kind = LoopKind.AR_DECODE

    def init(self, req: Request, model: ModelInstance, ctx: ProgramContext) -> ARDecodeState:
        cfg = self.config
        cap = (req.sampling.max_new_tokens if cfg.honor_request_cap else None) or cfg.max_new_tokens
        seed = (int(req.seed or 0) + cfg.seed_offset) % 2**63
        return self.new_state(
            ARDecodeState,
            req,
            seq_id=f"{req.request_id}/{self.loop_id}",
            prompt=ctx.slots[cfg.prompt_slot],
            sampling=cfg.make_sampling(req),
            generator=make_generator(seed, model.device),
            owner=model.components[cfg.component],  # type: ignore[arg-type]
            max_new_tokens=min(cap, cfg.max_new_tokens),
            stream=ctx.slots[cfg.stream_slot] if cfg.stream_slot else None,
            share_group=req.group,
            seed=seed,
            cache_salt=req.cache_salt,
        )

    def next(self, state: ARDecodeState) -> WorkPlan | Done:
        if state.finished or len(state.frames) >= state.max_new_tokens:
            return Done()
        history = tuple(state.frames[-self.config.penalty_window :])
        if state.needs_prefill:
            unit: Any = ARPrefillInput(
                state.seq_id,
                state.prompt,
                tuple(state.frames),
                history,
                state.sampling,
                state.generator,
                state.share_group,
                state.profile is ExecutionProfile.ROLLOUT,
                state.cache_salt,
            )
            kind, label = WorkUnitKind.PREFILL, f"{self.loop_id}.prefill"
            resources = ResourceRequest(num_tokens=len(state.frames) + 1)
        else:
            unit = ARStepInput(
                state.seq_id,
                state.frames[-1],
                len(state.frames),
                history,
                state.sampling,
                state.generator,
                state.profile is ExecutionProfile.ROLLOUT,
            )
            kind, label = WorkUnitKind.AR_TOKEN, f"{self.loop_id}.step{state.step}"
            resources = ResourceRequest(num_tokens=1)
        shape = ShapeSignature(kind, tag=self.config.shape_tag)
        return WorkPlan(kind, self.config.component, shape, unit, resources, label)

    def advance(self, state: ARDecodeState, result: StepResult) -> ARDecodeState:
        out: ARStepOutput = result.output
        if out.preempted:
            state.needs_prefill = True
            state.num_preemptions += 1
            return state
        state.needs_prefill = False
        state.step += 1
        state.cached_rows += out.cached_rows
        if state.profile is ExecutionProfile.ROLLOUT:
            if not state.trajectory and out.routing is not None:  # the first prefill's
                state.prompt_routing = out.prompt_routing
            record = ActionRecord(
                tuple(out.tokens),
                out.logprobs,
                out.policy_logprobs,
                out.weight_version,
                out.routing,
            )
            state.trajectory.append(record)
        if self._is_eos(out.tokens):
            state.finished = True
            if self.config.stream_on_eos and state.stream is not None:
                state.stream.put(out.hidden)
            return state
        state.frames.append(tuple(out.tokens))
        if state.stream is not None and self.config.stream_delay is not None:
            delay = self.config.stream_delay  # the frame that just became complete, if any
            n = len(state.frames)
            for f in range(delay.num_ready(n - 1), delay.num_ready(n)):
                state.stream.put(delay.undelay(state.frames, f, f + 1)[0])
        elif state.stream is not None:
            state.stream.put(out.hidden if self.config.stream_hidden else tuple(out.tokens))
        if self.config.detokenize is not None:
            self._emit_text(state)
        return state

    def _is_eos(self, frame: Frame) -> bool:
        """Whether the frame holds an EOS id at a position ``eos_codebooks`` names."""
        positions = self.config.eos_codebooks
        ids = frame if positions is None else [frame[i] for i in positions]
        hits = (t in self.config.eos_token_ids for t in ids)
        return all(hits) if self.config.eos_all_codebooks else any(hits)

    def _emit_text(self, state: ARDecodeState) -> None:
        """Emit the text decoded so far beyond what was emitted (whole characters only)."""
        text = self.config.detokenize([frame[0] for frame in state.frames])
        if text.endswith("\ufffd") or len(text) <= state.text_emitted:
            return
        state.outbox.append(StreamChunk.of_text(text[state.text_emitted :]))
        state.text_emitted = len(text)

    def finalize(self, state: ARDecodeState) -> LoopResult:
        metrics = {
            "tokens": float(len(state.frames)),
            "preemptions": float(state.num_preemptions),
            "cached_tokens": float(state.cached_rows),
        }
        if state.profile is not ExecutionProfile.ROLLOUT:
            return LoopResult(list(state.frames), metrics)
        info = {
            "prompt": state.prompt,
            "stop_reason": "eos" if state.finished else "length",
            "seed": state.seed,
            "mask": self.sampled_mask([r.tokens for r in state.trajectory]),
        }
        if state.prompt_routing is not None:
            info["prompt_routing"] = state.prompt_routing
        if self.config.stream_delay is not None:  # forced BOS/EOS ids are no actions
            info["mask"] = self.config.stream_delay.forced_mask(
                [r.tokens for r in state.trajectory]
            )
            info["delay"] = self.config.stream_delay
        return LoopResult(list(state.frames), metrics, state.trajectory, info)

    def score(
        self,
        model: ModelInstance,
        req: Request,
        prompt: Any,
        tokens: Any,
        mode: str = "processed",
        match_serving: bool = True,
    ) -> Any:
        """Recompute the log-probs of frames this loop recorded, with the component's
        teacher-forced forward (``score_logprobs``, e.g. ``PagedARModel.score_logprobs``):
        autograd on, no KV cache.

        Args:
            model: the loaded card.
            req: a request with the sample's ``SamplingParams`` (its sampling row is
                ``make_sampling(req)``, as the loop built it).
            prompt: the prompt the loop recorded (``LoopResult.info["prompt"]``).
            tokens: ``[T, num_vq]`` ids (an array or nested sequences), the last frame
                included.
            mode: ``"processed"`` or ``"policy"``.
            match_serving: the serving path's kernel shapes (see ``score_logits``).

        Returns:
            The component's log-probs, ``[T, num_vq]`` float32 (a torch tensor with grad).

        Raises:
            NotImplementedError: the component has no ``score_logprobs`` (another family, or
                a stand-in for a component running in another process).
        """
        name = self.config.component
        scorer = local_method(model.components[name], "score_logprobs", name)
        frames = [tuple(int(t) for t in frame) for frame in tokens]
        row = self.config.make_sampling(req)
        return scorer(prompt, frames, row, mode, self.config.penalty_window, match_serving)

    def score_batch(
        self,
        model: ModelInstance,
        reqs: Sequence[Request],
        prompts: Sequence[Any],
        tokens: Sequence[Any],
        mode: str = "processed",
        match_serving: bool = True,
        entropy: bool = False,
        routing: Sequence[Any] | None = None,
    ) -> list[tuple[Any, Any]]:
        """``score`` of several recorded trajectories in one packed teacher-forced forward
        (the component's ``score_batch``, e.g. ``PagedARModel.score_batch``).

        Args:
            reqs: per trajectory a request with the sample's ``SamplingParams``.
            prompts, tokens: per trajectory, as in ``score``.
            entropy: also each step's entropy per codebook of the scored distribution.
            routing: Rollout Routing Replay (a MoE component): per trajectory the experts
                of every row of its forward, ``[prompt rows + T - 1, MoE layers, k]``
                (``LoopActions.replay_routing()``); None: the router chooses.

        Returns:
            Per trajectory ``(log-probs [T, num_vq], entropy [T, num_vq] or None)``.

        Raises:
            NotImplementedError: the component has no ``score_batch``.
        """
        name = self.config.component
        scorer = local_method(model.components[name], "score_batch", name)
        frames = [[tuple(int(t) for t in frame) for frame in tok] for tok in tokens]
        rows = [self.config.make_sampling(req) for req in reqs]
        window = self.config.penalty_window
        if routing is None:
            return scorer(prompts, frames, rows, mode, window, match_serving, entropy)
        return scorer(prompts, frames, rows, mode, window, match_serving, entropy, routing=routing)

    def sampled_mask(self, frames: Sequence[Frame]) -> list[tuple[bool, ...]]:
        """Which ids of recorded frames were sampled actions: all of a frame, except in an
        EOS frame (the last when the loop stopped on EOS), where only the codebooks holding
        the EOS id at an ``eos_codebooks`` position are (the frame is dropped from the
        output, so its other codebooks' ids act on nothing; Qwen3-TTS does not even sample
        codebooks 1..15 there)."""
        out = []
        for frame in frames:
            if not self._is_eos(frame):
                out.append((True,) * len(frame))
                continue
            positions = self.config.eos_codebooks
            eos = self.config.eos_token_ids
            out.append(
                tuple(
                    t in eos and (positions is None or j in positions) for j, t in enumerate(frame)
                )
            )
        return out

    def release(self, state: ARDecodeState) -> None:
        """Free the sequence's KV blocks in the component."""
        if state.owner is not None:
            state.owner.free_sequence(state.seq_id)
