"""The ``toy`` card: a token loop feeding a chunk loop, numpy only, for runtime tests.

``tokenize`` turns the text into byte ids; the ``tokens`` loop (AR_DECODE) samples one token per
AR_TOKEN unit from the ``lm`` component and puts it on the ``token_stream`` Channel; the generic
``audio`` loop (AUDIO_DECODE) starts at once and turns chunks of tokens into sine segments with
the ``vocoder`` component while decoding goes on (stage overlap). Both components
compute each row of a batch independently (table lookups, no reductions across rows), and each
step's randomness is a pure function of (seed, step), so outputs do not depend on batching.

Fault injection for tests (markers in the speech input or in a chat message): ``<fail>``
raises inside the ``lm`` component at step 3; ``<fail-late>`` raises there at step 20, after
the first audio chunks (a failure in the middle of a stream); ``<fail-vocoder>`` raises inside
the vocoder. ``<slow>`` makes each ``lm`` batch holding one of the request's steps sleep
``SLOW_STEP_SECONDS`` (to keep requests in flight, e.g. for admission tests).

Voices: ``default`` only (None means it); any other name is rejected with ``unknown_voice``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from omnistep.core import (
    ActionRecord,
    Capability,
    Channel,
    ComponentSpec,
    Done,
    ExecutionProfile,
    InvalidRequestError,
    KernelNode,
    LoopKind,
    LoopNode,
    LoopResult,
    LoopSpec,
    LoopState,
    Modality,
    ModelCard,
    ModelInstance,
    Program,
    ProgramContext,
    Request,
    ResourceRequest,
    ShapeSignature,
    StepResult,
    StreamChunk,
    WorkPlan,
    WorkUnitKind,
)
from omnistep.loops import AudioChunkInput, AudioDecodeConfig, AudioDecodeLoop

VOCAB = 64
EOS = 0
SAMPLE_RATE = 8000
SAMPLES_PER_TOKEN = 80
FAIL_STEP = 3
LATE_FAIL_STEP = 20
SLOW_STEP_SECONDS = 0.02
VOICES = ("default",)


@dataclass(frozen=True, slots=True)
class TokenUnit:
    """One AR_TOKEN unit: the previous token, the step's seed material and sampling settings;
    ``fail_step``: the step at which the lm raises (fault injection), or None."""

    prev_token: int
    seed: int
    step: int
    temperature: float
    min_new_tokens: int
    fail_step: int | None = None
    slow: bool = False


class ToyLM:
    """A bigram "language model": logits are a fixed random table row ``[VOCAB]`` float64."""

    def __init__(self, device: str = "cpu"):
        self.table = np.random.default_rng(1234).normal(size=(VOCAB, VOCAB)) * 2.0
        self.table[:, EOS] -= 3.0  # EOS is rare, so outputs run to a length tests can predict
        self.weight_version = 0

    def weight_specs(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """The one weight: ``table`` ``[VOCAB, VOCAB]`` float64 (row = previous token)."""
        return {"table": (self.table.shape, str(self.table.dtype))}

    def update_weights(self, tensors: dict[str, np.ndarray]) -> None:
        """Copy a new ``table`` in place (checked by ``ModelInstance.check_weights``)."""
        self.table[...] = np.asarray(tensors["table"])

    def execute(
        self, kind: WorkUnitKind, payloads: Sequence[TokenUnit]
    ) -> list[tuple[int, float, int]]:
        """Sample one token per unit; returns (token id, log-prob, weight version) per unit."""
        if kind is not WorkUnitKind.AR_TOKEN:
            raise ValueError(f"toy lm cannot run {kind}")
        if any(p.step == p.fail_step for p in payloads):
            raise RuntimeError("injected fault in toy lm")
        if any(p.slow for p in payloads):
            time.sleep(SLOW_STEP_SECONDS)
        logits = self.table[[p.prev_token for p in payloads]]  # [batch, VOCAB]
        out = []
        for row, unit in zip(logits, payloads, strict=True):
            row = _masked(row, unit.step, unit.min_new_tokens)
            out.append((*_sample(row, unit), self.weight_version))
        return out

    def score_logprobs(
        self,
        prev_tokens: Sequence[int],
        tokens: Sequence[int],
        temperature: float,
        min_new_tokens: int,
    ) -> np.ndarray:
        """Log-probs of recorded tokens, recomputed: ``[T, 1]`` float32 (numpy, no autograd),
        equal to what ``execute`` recorded for step ``i`` fed ``prev_tokens[i]`` (the same
        float64 arithmetic per row, then the float32 of ``LoopActions``).

        Raises:
            ValueError: the two sequences differ in length, or an id outside the vocab.
        """
        if len(prev_tokens) != len(tokens):
            raise ValueError(f"{len(prev_tokens)} previous tokens for {len(tokens)} tokens")
        if any(not 0 <= int(t) < VOCAB for t in [*prev_tokens, *tokens]):
            raise ValueError(f"token ids must be in [0, {VOCAB})")
        out = np.empty((len(tokens), 1), dtype=np.float32)
        for step, (prev, token) in enumerate(zip(prev_tokens, tokens, strict=True)):
            row = _masked(self.table[int(prev)], step, min_new_tokens)
            out[step, 0] = _logprobs(row, temperature)[int(token)]
        return out


def _masked(row: np.ndarray, step: int, min_new_tokens: int) -> np.ndarray:
    """A copy of a logits row with EOS at -inf while ``step < min_new_tokens``."""
    row = row.copy()
    if step < min_new_tokens:
        row[EOS] = -np.inf
    return row


def _logprobs(logits: np.ndarray, temperature: float) -> np.ndarray:
    """``log_softmax(logits / temperature)`` float64; temperature 0 counts as 1."""
    scaled = logits / (temperature or 1.0)
    return scaled - np.logaddexp.reduce(scaled)


def _sample(logits: np.ndarray, unit: TokenUnit) -> tuple[int, float]:
    """Gumbel-max sampling, noise from ``default_rng([seed, step])``; greedy at temperature 0.
    Returns the token and its log-prob under ``log_softmax(logits / temperature)`` (the
    distribution sampled; with no truncation it is the policy's too; temperature 0 counts as 1).
    """
    logp = _logprobs(logits, unit.temperature)
    if unit.temperature == 0:
        token = int(np.argmax(logp))
    else:
        gumbel = np.random.default_rng([unit.seed, unit.step]).gumbel(size=logits.shape)
        token = int(np.argmax(logp + gumbel))
    return token, float(logp[token])


class ToyVocoder:
    """Each token becomes ``SAMPLES_PER_TOKEN`` samples of a sine at ``200 + 20 * token`` Hz."""

    def __init__(self, device: str = "cpu"):
        self.t = np.arange(SAMPLES_PER_TOKEN) / SAMPLE_RATE

    def execute(self, kind: WorkUnitKind, payloads: Sequence[AudioChunkInput]) -> list[np.ndarray]:
        """Returns float32 ``[chunk * SAMPLES_PER_TOKEN]`` per unit (context frames unused)."""
        if any(p.extras and p.extras.get("fail_vocoder") for p in payloads):
            raise RuntimeError("injected fault in toy vocoder")
        tokens = np.array([p.frames[p.left : p.left + p.chunk] for p in payloads])  # [batch, chunk]
        freqs = 200.0 + 20.0 * tokens
        wave = 0.3 * np.sin(2 * np.pi * freqs[..., None] * self.t)  # [batch, chunk, samples]
        return [w.reshape(-1).astype(np.float32) for w in wave]


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
        return TokenState(
            channel=ctx.slots["token_stream"],
            request_id=req.request_id,
            loop_id=self.loop_id,
            profile=req.profile,
            seed=int(req.seed or 0),
            prev_token=prompt[-1],
            prompt=tuple(prompt),
            temperature=sp.or_default("temperature", 1.0),
            min_new_tokens=sp.or_default("min_new_tokens", 0),
            max_new_tokens=sp.max_new_tokens or 2 * len(prompt),
            fail_step=_fail_step(_prompt_text(req)),
            slow="<slow>" in _prompt_text(req),
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
        return WorkPlan(
            WorkUnitKind.AR_TOKEN,
            "lm",
            ShapeSignature(WorkUnitKind.AR_TOKEN, (1,)),
            unit,
            ResourceRequest(num_tokens=1),
            f"toy.token{state.step}",
        )

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
        distribution; only the EOS mask of ``min_new_tokens`` applies, in both)."""
        ids = [int(frame[0]) for frame in tokens]
        sp = req.sampling
        prev = [int(prompt[-1]), *ids[:-1]]
        lm = model.components["lm"]
        return lm.score_logprobs(  # type: ignore[attr-defined]
            prev, ids, sp.or_default("temperature", 1.0), sp.or_default("min_new_tokens", 0)
        )

    def release(self, state: TokenState) -> None:
        """Nothing outside the state to free."""


def _prompt_text(req: Request) -> str:
    """The text the toy reads: the speech input, or the chat messages as ``role: content``
    lines (so the fault markers work in chat requests too)."""
    if req.messages:
        return "\n".join(f"{m.role}: {m.content}" for m in req.messages)
    return req.text


def _fail_step(text: str) -> int | None:
    """The lm step at which a request with a fault marker in ``text`` fails, or None."""
    if "<fail>" in text:
        return FAIL_STEP
    return LATE_FAIL_STEP if "<fail-late>" in text else None


def _tokenize(ctx: ProgramContext) -> None:
    req = ctx.request
    text = _prompt_text(req)
    if not text.strip():
        raise InvalidRequestError("input must not be empty", param="input")
    if req.voice is not None and req.voice not in VOICES:
        raise InvalidRequestError(
            f"unknown voice '{req.voice}' for model 'toy'; choose one of {', '.join(VOICES)}",
            param="voice",
            code="unknown_voice",
        )
    ctx.slots["prompt_ids"] = [1 + b % (VOCAB - 1) for b in text.encode()]
    ctx.slots["toy_flags"] = {"fail_vocoder": "<fail-vocoder>" in text}
    ctx.usage["input_tokens"] = len(ctx.slots["prompt_ids"])


def _count(ctx: ProgramContext) -> None:
    ctx.usage["output_tokens"] = len(ctx.slots["tokens"])


def build_card(
    path: str | None = None,
    *,
    first_chunk: int = 2,
    chunk_tokens: int = 4,
    lookahead: int = 1,
    max_batch_size: int = 8,
) -> ModelCard:
    """The toy card. ``path`` is ignored (the toy has no weights)."""
    audio = AudioDecodeConfig(
        loop_id="audio",
        component="vocoder",
        in_slot="token_stream",
        sample_rate=SAMPLE_RATE,
        first_chunk=first_chunk,
        chunk=chunk_tokens,
        left_context=1,
        lookahead=lookahead,
        extras_slot="toy_flags",
    )
    program = Program(
        inputs=("request",),
        nodes=(
            KernelNode("tokenize", _tokenize, needs=("request",), binds=("prompt_ids",)),
            LoopNode(
                "decode", "tokens", needs=("prompt_ids",), binds="tokens", streams=("token_stream",)
            ),
            LoopNode(
                "vocode",
                "audio",
                needs=("token_stream",),
                binds="samples",
                when=lambda req: Modality.AUDIO in req.output_modalities,
            ),
            KernelNode("count", _count, needs=("tokens", "samples")),
        ),
    )
    return ModelCard(
        card_id="toy",
        family="toy",
        components=(
            ComponentSpec("lm", ToyLM, max_batch_size=max_batch_size),
            ComponentSpec("vocoder", ToyVocoder, max_batch_size=max_batch_size),
        ),
        loops=(
            LoopSpec("tokens", LoopKind.AR_DECODE, (WorkUnitKind.AR_TOKEN,), ("lm",), TokenLoop),
            LoopSpec(
                "audio",
                LoopKind.AUDIO_DECODE,
                (WorkUnitKind.AUDIO_CHUNK,),
                ("vocoder",),
                lambda: AudioDecodeLoop(audio),
            ),
        ),
        program=program,
        capabilities=frozenset(
            {Capability.TEXT_TO_SPEECH, Capability.CHAT_TEXT, Capability.CHAT_AUDIO}
        ),
        sample_rate=SAMPLE_RATE,
        aliases=("toy-tts",),
        voices=VOICES,
        default_voice="default",
        parity=frozenset({"C0", "C1", "C2", "C3", "stream"}),
        description="Deterministic numpy toy: a token loop streaming into a chunk loop.",
    )
