"""The driven-loop contract between loops, the scheduler and components.

A ``Loop`` is a state machine the engine drives: ``init`` builds its ``LoopState``, ``next``
describes the next step as a ``WorkPlan`` (or ``Done``), the scheduler batches plans of many
requests that share a component and ``ShapeSignature`` into one ``Component.execute`` call, and
``advance`` folds each output back as a ``StepResult``. All per-request mutable state lives in
the loop state.

Imports: stdlib, numpy and ``omnistep.core`` only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from omnistep.core.enums import ExecutionProfile, LoopKind, Modality, WorkUnitKind

if TYPE_CHECKING:
    from omnistep.core.card import ModelInstance
    from omnistep.core.program import ProgramContext
    from omnistep.core.request import Request


@dataclass(frozen=True, slots=True)
class ShapeSignature:
    """The batching key of a WorkPlan: plans batch together only when kind, dims and tag match.

    Attributes:
        kind: the unit kind.
        dims: shape bucket, e.g. ``(num_tokens,)`` or ``(chunk_frames, context_frames)``.
        tag: extra discriminator; a card that must not batch units sets a unique tag per unit.
    """

    kind: WorkUnitKind
    dims: tuple[int, ...] = ()
    tag: str = ""


@dataclass(frozen=True, slots=True)
class ResourceRequest:
    """What a unit needs beyond compute: used by admission.

    Attributes:
        kv_blocks: KV-cache blocks the unit needs allocated before it runs.
        num_tokens: tokens the unit processes (prefill length, or 1 for a decode step).
        est_seconds: the loop's estimate of the unit's compute time, in seconds.
    """

    kv_blocks: int = 0
    num_tokens: int = 0
    est_seconds: float = 0.0


@dataclass(slots=True)
class WorkPlan:
    """One WorkUnit, described without running it.

    Attributes:
        kind: what kind of step this is; passed to ``Component.execute``.
        component: name of the card component that executes it.
        shape: the batching key.
        payload: the component-specific input for this unit (one element of the batch).
        resources: what admission must reserve.
        label: a human-readable name for logs and traces, e.g. ``"piper.sentence3"``.
    """

    kind: WorkUnitKind
    component: str
    shape: ShapeSignature
    payload: Any
    resources: ResourceRequest = field(default_factory=ResourceRequest)
    label: str = ""


@dataclass(slots=True)
class StepResult:
    """One unit's output, as returned by the component for that element of the batch.

    Attributes:
        output: the component's output for this unit.
        batch_size: how many units ran in the same ``execute`` call.
        seconds: wall time of the whole batch, in seconds.
    """

    output: Any
    batch_size: int = 1
    seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class Done:
    """Returned by ``Loop.next`` when the loop has no more steps."""

    reason: str = "finished"


@dataclass(frozen=True, slots=True)
class Pending:
    """Returned by ``Loop.next`` when the loop waits for input another loop of the same request
    has not produced yet (e.g. a vocoder waiting for the next codec frames on a ``Channel``).

    The engine parks the loop and asks again after any other loop of the request advances.
    """

    reason: str = "waiting for input"


@dataclass(frozen=True, slots=True)
class WordTiming:
    """When one word is spoken in a request's audio.

    Attributes:
        word: the word as read by the card's text front-end (after normalisation, e.g.
            ``"twelve"`` for ``"12"``), without surrounding punctuation.
        start, end: seconds from the start of the request's audio (its first sample is 0.0),
            ``0 <= start <= end``.
    """

    word: str
    start: float
    end: float


@dataclass(slots=True)
class StreamChunk:
    """What a request streams out, in order.

    Attributes:
        modality: AUDIO or TEXT.
        audio: mono float32 samples in [-1, 1], shape ``[num_samples]``; None for text.
        text: a text delta; None for audio.
        sample_rate: samples per second of ``audio`` (Hz); 0 for text.
        seq: 0-based position in the request's stream, set by the engine when published.
        request_id: set by the engine when published.
        words: the words spoken in this chunk's audio, with times in the request's timeline,
            from cards with ``Capability.WORD_TIMESTAMPS``; empty otherwise.
        reasoning: a text delta of the model's reasoning (a thinking model's text before its
            end-of-thinking marker), which the chat API returns as ``reasoning_content``.
    """

    modality: Modality
    audio: np.ndarray | None = None
    text: str | None = None
    sample_rate: int = 0
    seq: int = -1
    request_id: str = ""
    words: tuple[WordTiming, ...] = ()
    reasoning: bool = False

    @classmethod
    def of_audio(
        cls, samples: np.ndarray, sample_rate: int, words: tuple[WordTiming, ...] = ()
    ) -> StreamChunk:
        """An audio chunk; ``samples`` becomes a contiguous float32 ``[num_samples]`` array;
        ``words``: the words it speaks (see ``words``)."""
        arr = np.ascontiguousarray(samples, dtype=np.float32).reshape(-1)
        return cls(Modality.AUDIO, audio=arr, sample_rate=sample_rate, words=words)

    @classmethod
    def of_text(cls, text: str, reasoning: bool = False) -> StreamChunk:
        """A text delta chunk (``reasoning``: of the model's reasoning)."""
        return cls(Modality.TEXT, text=text, reasoning=reasoning)


@dataclass
class LoopState:
    """Base of every loop's per-request state; loops subclass it with typed fields.

    Attributes:
        request_id: the owning request.
        loop_id: the loop's id in the card.
        profile: SERVE, or ROLLOUT to record ``trajectory``.
        step: number of units advanced so far.
        outbox: chunks produced by the last ``advance``; the engine publishes and clears them.
        trajectory: per-step records under ROLLOUT (``ActionRecord`` for AR loops,
            ``DenoiseStepRecord`` for a denoise loop's SDE steps).
    """

    request_id: str
    loop_id: str
    profile: ExecutionProfile = ExecutionProfile.SERVE
    step: int = 0
    outbox: list[StreamChunk] = field(default_factory=list)
    trajectory: list[Any] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class ActionRecord:
    """One sampled step of an AR loop, as recorded under ROLLOUT.

    Attributes:
        tokens: the sampled frame, one id per codebook (ChatTTS: 4; an LM: 1).
        logprobs: per codebook, the log-probability under the distribution actually sampled
            (``processed`` mode: temperature, repetition penalty, top-p/top-k, EOS mask).
        policy_logprobs: per codebook, the log-probability under ``log_softmax(logits /
            temperature)``, no truncation (``policy`` mode: what a PPO/GRPO ratio uses).
        weight_version: the version of the component's weights the step ran under.
        routing: a MoE stack's routing of the step (Rollout Routing Replay): int16 numpy
            ``[sparse layers, k]``, the experts of the row whose output the frame was
            sampled from; None for a dense stack.
    """

    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    policy_logprobs: tuple[float, ...]
    weight_version: int = 0
    routing: Any = None


@dataclass(frozen=True, slots=True, eq=False)
class DenoiseStepRecord:
    """One sampled step of a denoise loop's SDE (a Flow-GRPO policy step), as recorded under
    ROLLOUT when the request asks for SDE noise (``SamplingParams.flow_noise_level``).

    The step is the Gaussian transition ``x_next ~ N(mean, std^2 I)`` of window ``window``
    at solver step ``step``, from time ``t`` to ``t_next`` (0 = noise, 1 = data).

    Attributes:
        step: the solver step within its window.
        t, t_next: the step's times.
        x, mean, x_next: float32 ``[frames, dim]`` (the window's frames): the state before the
            step, the transition's mean, the sampled state after it (numpy arrays).
        std: the transition's standard deviation.
        logprob: ``log N(x_next; mean, std^2 I)`` summed over the window's elements.
        window: ``(start, out_start, out_end, end)`` utterance frames of the step's window.
        weight_version: the version of the component's weights the step ran under.
        conditioning: what a replay of the step needs besides the above (the window's codes
            and voice; the family's own type), for the loop's ``score``.
    """

    step: int
    t: float
    t_next: float
    x: Any
    mean: Any
    std: float
    x_next: Any
    logprob: float
    window: tuple[int, int, int, int]
    weight_version: int = 0
    conditioning: Any = None


@dataclass(frozen=True, eq=False)
class FlowPatches:
    """The continuous actions of an AR loop whose every step also solves a flow for a patch
    of latents (VoxCPM2: the LocDiT's solve inside each AR step), as recorded under ROLLOUT
    (``LoopResult.info["flow"]``).

    Per AR step ``t`` (the stop step's included, as ``ActionRecord``s count them) and per
    SDE step ``s`` of its solve (Flow-GRPO: ``SamplingParams.flow_noise_level`` > 0), the
    Gaussian transition ``states[t, s + 1] ~ N(means[t, s], stds[s]^2 I)``; its log-prob
    ``logprobs[t, s]`` sums over the patch's elements. With no SDE (level 0) ``S`` is 0 and
    only the patches are kept (what a teacher-forced replay of the AR steps reads).

    Attributes:
        states: float32 ``[T, S + 1, *patch]`` (numpy): the state before each SDE step, then
            the step's patch (``states[:, -1]``, what the next AR step reads).
        means: float32 ``[T, S, *patch]``: each SDE step's mean (noise-free).
        stds: float64 ``[S]``: each SDE step's standard deviation (the same for every T).
        logprobs: float64 ``[T, S]``.
        noise_level: the SDE's noise scale a (0: the ODE).
    """

    states: np.ndarray
    means: np.ndarray
    stds: np.ndarray
    logprobs: np.ndarray
    noise_level: float = 0.0

    @property
    def patches(self) -> np.ndarray:
        """float32 ``[T, *patch]``: every step's patch."""
        return self.states[:, -1]


@dataclass(slots=True)
class LoopResult:
    """What a finished loop binds to its program slot.

    Attributes:
        value: the loop's output (token ids, samples, ...).
        metrics: numbers about the run (steps, samples, seconds).
        trajectory: the ROLLOUT record, or None under SERVE.
        info: under ROLLOUT, what replays the loop (an AR loop: ``prompt``, the prompt as its
            component consumed it; ``stop_reason``, ``"eos"`` or ``"length"``; ``seed``, its
            generator's seed); None under SERVE.
    """

    value: Any
    metrics: dict[str, float] = field(default_factory=dict)
    trajectory: list[Any] | None = None
    info: dict[str, Any] | None = None


@runtime_checkable
class Component(Protocol):
    """One expert of a card (a GPT, a vocoder, an ONNX voice): runs batches, touches no queue."""

    def execute(self, kind: WorkUnitKind, payloads: Sequence[Any]) -> list[Any]:
        """Run one batch of units of the same kind and ShapeSignature.

        Args:
            kind: the unit kind of every payload.
            payloads: one payload per unit; a batch of one takes the same path.

        Returns:
            One output per payload, in order.

        Raises:
            Any exception: the engine retries a failed batch unit by unit to find the failing
            request, and fails that request only.
        """
        ...


@runtime_checkable
class Loop(Protocol):
    """A driven state machine over one request's steps (see module docstring)."""

    loop_id: str
    kind: LoopKind

    def init(self, req: Request, model: ModelInstance, ctx: ProgramContext) -> LoopState:
        """Build the request's state from the request and the program's bound slots."""
        ...

    def next(self, state: LoopState) -> WorkPlan | Done | Pending:
        """Describe the next unit, Done, or Pending (waiting on a Channel). Must not mutate
        ``state``."""
        ...

    def advance(self, state: LoopState, result: StepResult) -> LoopState:
        """Fold a unit's output into the state; may append StreamChunks to ``state.outbox``."""
        ...

    def finalize(self, state: LoopState) -> LoopResult:
        """The loop's result, bound to its program slot."""
        ...

    def release(self, state: LoopState) -> None:
        """Free what the state holds outside itself (KV blocks); called on finish and abort."""
        ...
