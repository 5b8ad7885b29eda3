"""The ``toy_stream`` card: a toy whose text streams into the running request, as Qwen3-TTS's
text track does (``Capability.STREAMING_TEXT_INPUT``), numpy only, for runtime tests.

The ``track`` loop (AR_DECODE) consumes one input byte per step: step ``k`` feeds the lm
``(previous token + byte k) mod VOCAB`` (byte ids as the ``toy`` card's: ``1 + b % 63``), and
after the text ends a pad (0) for ``TAIL_STEPS`` more steps. It reads the bytes from the
request's ``TEXT_INPUT_SLOT`` channel and returns ``Pending`` while byte ``k`` has not arrived
and the text is still open, so a request runs as far as its text allows and nothing runs while
it waits; the request ends ``TAIL_STEPS`` after the text's last byte (or at the request's
``max_new_tokens``). Tokens go on
``token_stream`` to the ``toy`` card's sine vocoder. The same text
(whole, or in any pieces) and seed give the same tokens and audio.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from omnistep.core import (
    TEXT_INPUT_SLOT,
    Capability,
    Channel,
    ComponentSpec,
    Done,
    InvalidRequestError,
    KernelNode,
    LoopKind,
    LoopNode,
    LoopResult,
    LoopSpec,
    LoopState,
    ModelCard,
    ModelInstance,
    Pending,
    Program,
    ProgramContext,
    Request,
    StepResult,
    StreamChunk,
    WorkPlan,
    WorkUnitKind,
)
from omnistep.loops.base import new_state
from omnistep.models.toy.lm import VOCAB, TokenUnit, ToyLM, byte_ids
from omnistep.models.toy.loop import token_plan
from omnistep.models.toy.vocoder import SAMPLE_RATE, ToyVocoder, audio_loop_spec, vocode_node

TAIL_STEPS = 4
"""Steps fed the pad id after the text's last byte."""
NO_EOS = 2**31
"""``min_new_tokens`` of every unit: the lm never ends a request; the text's end does."""


@dataclass
class TrackState(LoopState):
    """State of the track loop: the text channel, how much of it is read, the tokens so far."""

    seed: int = 0
    temperature: float = 1.0
    max_new_tokens: int | None = None
    text: Channel = field(default_factory=Channel)
    read: int = 0  # channel pieces consumed into ``ids``
    ids: list[int] = field(default_factory=list)
    prev_token: int = 0
    tokens: list[int] = field(default_factory=list)
    out: Channel = field(default_factory=Channel)


class TrackLoop:
    """AR_DECODE over the toy lm with a streamed text track (see the module docstring)."""

    loop_id = "track"
    kind = LoopKind.AR_DECODE

    def init(self, req: Request, model: ModelInstance, ctx: ProgramContext) -> TrackState:
        """Raises InvalidRequestError: the text ended empty (nothing to speak)."""
        text: Channel = ctx.slots[TEXT_INPUT_SLOT]
        if text.closed and not "".join(text[:]).strip():
            raise InvalidRequestError("input must not be empty", param="input")
        return new_state(
            TrackState,
            req,
            self.loop_id,
            seed=int(req.seed or 0),
            temperature=req.sampling.or_default("temperature", 1.0),
            max_new_tokens=req.sampling.max_new_tokens,
            text=text,
            out=ctx.slots["token_stream"],
        )

    def next(self, state: TrackState) -> WorkPlan | Done | Pending:
        while state.read < len(state.text):
            state.ids.extend(byte_ids(state.text[state.read]))
            state.read += 1
        step = state.step
        if state.max_new_tokens is not None and step >= state.max_new_tokens:
            return Done()
        if step < len(state.ids):
            text_id = state.ids[step]
        elif not state.text.closed:
            return Pending("waiting for text")
        elif step < len(state.ids) + TAIL_STEPS:
            text_id = 0
        else:
            return Done()
        prev = (state.prev_token + text_id) % VOCAB
        unit = TokenUnit(prev, state.seed, step, state.temperature, NO_EOS)
        return token_plan("lm", unit, f"toy_stream.token{step}")

    def advance(self, state: TrackState, result: StepResult) -> TrackState:
        token, _logprob, _version = result.output
        state.step += 1
        state.tokens.append(token)
        state.out.put(token)
        state.prev_token = token
        state.outbox.append(StreamChunk.of_text(f"<{token}>"))
        return state

    def finalize(self, state: TrackState) -> LoopResult:
        return LoopResult(list(state.tokens), {"tokens": float(len(state.tokens))})

    def release(self, state: TrackState) -> None:
        """Nothing outside the state to free."""


def _count(ctx: ProgramContext) -> None:
    ctx.usage["input_tokens"] = len(byte_ids("".join(ctx.slots[TEXT_INPUT_SLOT][:])))
    ctx.usage["output_tokens"] = len(ctx.slots["tokens"])


def build_card(path: str | None = None, *, max_batch_size: int = 8) -> ModelCard:
    """The toy_stream card. ``path`` is ignored (no weights)."""
    program = Program(
        inputs=("request", TEXT_INPUT_SLOT),
        nodes=(
            LoopNode(
                "decode",
                "track",
                needs=(TEXT_INPUT_SLOT,),
                binds="tokens",
                streams=("token_stream",),
            ),
            vocode_node(when_audio_out=False),
            KernelNode("count", _count, needs=("tokens", "samples")),
        ),
    )
    return ModelCard(
        card_id="toy_stream",
        family="toy_stream",
        components=(
            ComponentSpec("lm", ToyLM, max_batch_size=max_batch_size),
            ComponentSpec("vocoder", ToyVocoder, max_batch_size=max_batch_size),
        ),
        loops=(
            LoopSpec("track", LoopKind.AR_DECODE, (WorkUnitKind.AR_TOKEN,), ("lm",), TrackLoop),
            audio_loop_spec(lookahead=1),
        ),
        program=program,
        capabilities=frozenset({Capability.TEXT_TO_SPEECH, Capability.STREAMING_TEXT_INPUT}),
        sample_rate=SAMPLE_RATE,
        voices=("default",),
        default_voice="default",
        parity=frozenset({"C0", "C1", "C3", "stream"}),
        description="Numpy toy whose text streams into the running request (a text track).",
    )
