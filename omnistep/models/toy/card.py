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
``lm.SLOW_STEP_SECONDS`` (to keep requests in flight, e.g. for admission tests).

Files: ``lm.py`` (the ``lm`` component), ``vocoder.py`` (the ``vocoder`` component),
``loop.py`` (the token loop); this module declares the card.

Voices: ``default`` only (None means it); any other name is rejected with ``unknown_voice``.
"""

from __future__ import annotations

from omnistep.core import (
    Capability,
    ComponentSpec,
    InvalidRequestError,
    KernelNode,
    LoopKind,
    LoopNode,
    LoopSpec,
    ModelCard,
    Program,
    ProgramContext,
    Request,
    WorkUnitKind,
)
from omnistep.models.toy.lm import ToyLM, byte_ids
from omnistep.models.toy.loop import TokenLoop, prompt_text
from omnistep.models.toy.vocoder import SAMPLE_RATE, ToyVocoder, audio_loop_spec, vocode_node

VOICES = ("default",)


def check_voice(req: Request, card_id: str) -> None:
    """Reject a voice other than those of ``VOICES`` (None means ``default``).

    Raises:
        InvalidRequestError: an unknown voice (param ``voice``, code ``unknown_voice``).
    """
    if req.voice is not None and req.voice not in VOICES:
        raise InvalidRequestError(
            f"unknown voice '{req.voice}' for model '{card_id}'; choose one of {', '.join(VOICES)}",
            param="voice",
            code="unknown_voice",
        )


def _tokenize(ctx: ProgramContext) -> None:
    req = ctx.request
    text = prompt_text(req)
    if not text.strip():
        raise InvalidRequestError("input must not be empty", param="input")
    check_voice(req, "toy")
    ctx.slots["prompt_ids"] = byte_ids(text)
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
    program = Program(
        inputs=("request",),
        nodes=(
            KernelNode("tokenize", _tokenize, needs=("request",), binds=("prompt_ids",)),
            LoopNode(
                "decode", "tokens", needs=("prompt_ids",), binds="tokens", streams=("token_stream",)
            ),
            vocode_node(),
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
            audio_loop_spec(
                first_chunk=first_chunk,
                chunk=chunk_tokens,
                lookahead=lookahead,
                extras_slot="toy_flags",
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
