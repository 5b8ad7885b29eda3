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
    Modality,
    ModelCard,
    Program,
    ProgramContext,
    WorkUnitKind,
)
from omnistep.loops import AudioDecodeConfig, AudioDecodeLoop
from omnistep.models.toy.lm import VOCAB, ToyLM
from omnistep.models.toy.loop import TokenLoop, prompt_text
from omnistep.models.toy.vocoder import SAMPLE_RATE, ToyVocoder

VOICES = ("default",)


def _tokenize(ctx: ProgramContext) -> None:
    req = ctx.request
    text = prompt_text(req)
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
