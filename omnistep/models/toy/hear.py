"""The ``toy_hear`` card: a toy that hears (``Capability.AUDIO_INPUT``, ``TRANSCRIPTION``),
numpy only, for tests of the endpoints that take audio (transcriptions, realtime).

Its answer is a deterministic function of the conversation (``answer_text``): for the last user
message, ``turn N`` (N: the number of user messages, so history shows), then for each part
``heard D.DD s rms R.RRR`` (an audio part: its duration and RMS at ``MEDIA_SAMPLE_RATE``) or
``read K chars`` (a text part), then ``after A chars`` (A: the characters of all earlier
assistant messages, so a truncated history shows). The transcription prompt's answer is
``heard D.DD s rms R.RRR`` alone (``transcription_messages``).

The ``say`` loop (AR_DECODE) emits the answer one word per AR_TOKEN unit of the ``scribe``
component (which may sleep ``step_seconds`` per batch, to keep answers in flight for barge-in
tests) as a text delta, and puts each word's byte ids on ``token_stream``; with audio output
the ``toy`` card's sine vocoder turns each id into ``SAMPLES_PER_TOKEN`` samples at 8 kHz. While
an answer runs the scribe holds one block per ``BLOCK_TOKENS`` prompt tokens of a pretend KV
cache for it (reported by ``kv_blocks()``, freed when the loop is released: finished, failed or
aborted), so leak tests see what a dropped request would leave.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from omnistep.core import (
    Capability,
    Channel,
    ChatMessage,
    ComponentSpec,
    Done,
    InvalidRequestError,
    KernelNode,
    LoopKind,
    LoopNode,
    LoopResult,
    LoopSpec,
    LoopState,
    MediaItem,
    ModelCard,
    ModelInstance,
    Program,
    ProgramContext,
    Request,
    StepResult,
    StreamChunk,
    WorkPlan,
    WorkUnitKind,
)
from omnistep.loops.base import new_state
from omnistep.models.toy.card import VOICES, check_voice
from omnistep.models.toy.lm import byte_ids
from omnistep.models.toy.loop import token_plan
from omnistep.models.toy.vocoder import SAMPLE_RATE, ToyVocoder, audio_loop_spec, vocode_node

MEDIA_SAMPLE_RATE = 16_000
BLOCK_TOKENS = 16
NUM_BLOCKS = 4096
ASR_SYSTEM = "You are a speech recognition model."
ASR_INSTRUCTION = "Transcribe the audio."


def describe_audio(item: MediaItem) -> str:
    """``heard D.DD s rms R.RRR``: the clip's duration (s) and RMS (float32 samples)."""
    samples = np.asarray(item.data, dtype=np.float64)
    rms = float(np.sqrt(np.mean(samples**2))) if samples.size else 0.0
    return f"heard {item.seconds or 0.0:.2f} s rms {rms:.3f}"


def _describe(part: str | MediaItem) -> str:
    return describe_audio(part) if isinstance(part, MediaItem) else f"read {len(part)} chars"


def answer_text(messages: Sequence[ChatMessage]) -> str:
    """The toy's answer to a conversation (see the module docstring).

    Raises:
        InvalidRequestError: no user message.
    """
    users = [m for m in messages if m.role == "user"]
    if not users:
        raise InvalidRequestError("the conversation has no user message", param="messages")
    if messages[0].role == "system" and messages[0].content == ASR_SYSTEM:
        return " ".join(describe_audio(item) for item in users[-1].media)
    last = users[-1]
    parts = last.parts or ((last.content,) if last.content else ())
    heard = [_describe(p) for p in parts if not (isinstance(p, str) and not p.strip())]
    earlier = sum(len(m.content) for m in messages if m.role == "assistant")
    return " ".join([f"turn {len(users)}", *heard, f"after {earlier} chars"])


def transcription_messages(
    audio: MediaItem, language: str | None, prompt: str | None
) -> tuple[ChatMessage, ...]:
    """The toy's ASR chat: a system prompt, then a user turn of an instruction and the audio
    (the layout of Qwen2.5-Omni's ASR cookbook); ``language`` and ``prompt`` are ignored."""
    return (
        ChatMessage("system", ASR_SYSTEM),
        ChatMessage("user", ASR_INSTRUCTION, (ASR_INSTRUCTION, audio)),
    )


@dataclass(frozen=True, slots=True)
class WordUnit:
    """One AR_TOKEN unit: the answer's words and the index of the one to emit."""

    words: tuple[str, ...]
    step: int


class ToyScribe:
    """Returns the unit's word (with a leading space after the first); sleeps
    ``step_seconds`` per batch; counts the pretend KV blocks of the live answers."""

    def __init__(self, device: str = "cpu", step_seconds: float = 0.0):
        self.step_seconds = step_seconds
        self.held: dict[str, int] = {}  # request id -> blocks
        self.lock = threading.Lock()

    def hold(self, request_id: str, num_tokens: int) -> None:
        """Take the blocks of a ``num_tokens`` prompt for ``request_id``."""
        with self.lock:
            self.held[request_id] = -(-num_tokens // BLOCK_TOKENS)

    def free(self, request_id: str) -> None:
        """Free the blocks of ``request_id`` (none held: nothing happens)."""
        with self.lock:
            self.held.pop(request_id, None)

    def kv_blocks(self) -> tuple[int, int]:
        """(used, free) blocks, as ``omnistep.kv.kv_usage`` reads them."""
        with self.lock:
            used = sum(self.held.values())
        return used, NUM_BLOCKS - used

    def execute(self, kind: WorkUnitKind, payloads: Sequence[WordUnit]) -> list[str]:
        """One word per unit."""
        if kind is not WorkUnitKind.AR_TOKEN:
            raise ValueError(f"toy scribe cannot run {kind}")
        if self.step_seconds:
            time.sleep(self.step_seconds)
        return [(" " if p.step else "") + p.words[p.step] for p in payloads]


@dataclass
class SayState(LoopState):
    """State of the say loop: the answer's words, the text emitted."""

    words: tuple[str, ...] = ()
    scribe: ToyScribe | None = None
    text: list[str] = field(default_factory=list)
    channel: Channel = field(default_factory=Channel)


class SayLoop:
    """AR_DECODE over the scribe: one word per step (see the module docstring)."""

    loop_id = "say"
    kind = LoopKind.AR_DECODE

    def init(self, req: Request, model: ModelInstance, ctx: ProgramContext) -> SayState:
        words = tuple(ctx.slots["answer"].split())
        cap = req.sampling.max_new_tokens
        scribe = model.components["scribe"]
        scribe.hold(req.request_id, max(1, ctx.usage["input_tokens"]))  # type: ignore[attr-defined]
        return new_state(
            SayState,
            req,
            self.loop_id,
            words=words[:cap] if cap else words,
            scribe=scribe,  # type: ignore[arg-type]
            channel=ctx.slots["token_stream"],
        )

    def next(self, state: SayState) -> WorkPlan | Done:
        if state.step >= len(state.words):
            return Done()
        return token_plan("scribe", WordUnit(state.words, state.step), f"toy_hear.word{state.step}")

    def advance(self, state: SayState, result: StepResult) -> SayState:
        word: str = result.output
        state.step += 1
        state.text.append(word)
        for token in byte_ids(word.strip()):
            state.channel.put(token)
        state.outbox.append(StreamChunk.of_text(word))
        return state

    def finalize(self, state: SayState) -> LoopResult:
        return LoopResult("".join(state.text), {"words": float(len(state.text))})

    def release(self, state: SayState) -> None:
        """Free the answer's blocks."""
        if state.scribe is not None:
            state.scribe.free(state.request_id)


def _listen(ctx: ProgramContext) -> None:
    req = ctx.request
    check_voice(req, "toy_hear")
    ctx.slots["answer"] = answer_text(req.messages)
    audio_seconds = sum(item.seconds or 0.0 for item in req.media)
    text_chars = sum(len(m.content) for m in req.messages)
    # input "tokens": a character of text each, and 25 per second of audio (Whisper's rate)
    ctx.usage["input_tokens"] = text_chars + round(25 * audio_seconds)


def _count(ctx: ProgramContext) -> None:
    ctx.usage["output_tokens"] = len(ctx.slots["answer"].split())


def build_card(path: str | None = None, *, step_seconds: float = 0.0) -> ModelCard:
    """The hearing toy. ``path`` is ignored (no weights); ``step_seconds``: the scribe's sleep
    per batch (0: none)."""
    program = Program(
        inputs=("request",),
        nodes=(
            KernelNode("listen", _listen, needs=("request",), binds=("answer",)),
            LoopNode("say", "say", needs=("answer",), binds="text", streams=("token_stream",)),
            vocode_node(),
            KernelNode("count", _count, needs=("text", "samples")),
        ),
    )
    return ModelCard(
        card_id="toy_hear",
        family="toy_hear",
        components=(
            ComponentSpec("scribe", lambda device="cpu": ToyScribe(device, step_seconds)),
            ComponentSpec("vocoder", ToyVocoder),
        ),
        loops=(
            LoopSpec("say", LoopKind.AR_DECODE, (WorkUnitKind.AR_TOKEN,), ("scribe",), SayLoop),
            audio_loop_spec(lookahead=0),
        ),
        program=program,
        capabilities=frozenset(
            {
                Capability.CHAT_TEXT,
                Capability.CHAT_AUDIO,
                Capability.AUDIO_INPUT,
                Capability.TRANSCRIPTION,
            }
        ),
        sample_rate=SAMPLE_RATE,
        voices=VOICES,
        default_voice="default",
        parity=frozenset({"C0", "C1"}),
        description="Deterministic numpy toy that hears: it answers with what it heard.",
        media_sample_rate=MEDIA_SAMPLE_RATE,
        transcription_prompt=transcription_messages,
    )
