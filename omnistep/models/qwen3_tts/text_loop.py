"""The talker loop of the Qwen3-TTS card: the request's text as a second track that may stream
into a running request (``TextTrack``), the prompt layout per request (``text_layout``), the
frame cap counted as upstream (``talker_frames``), on the family's ``Qwen3TTSTalkerLoop``.

Imports: ``omnistep.core``, ``omnistep.loops``, ``omnistep.text``, this family's modules.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from omnistep.core import (
    TEXT_INPUT_SLOT,
    Channel,
    Done,
    InvalidRequestError,
    ModelInstance,
    Pending,
    ProgramContext,
    Request,
    WorkPlan,
)
from omnistep.loops.ar_decode import ARDecodeConfig
from omnistep.models.qwen3_tts.frontend import Qwen3TTSVoice
from omnistep.models.qwen3_tts.loader import Qwen3TTSConfig
from omnistep.models.qwen3_tts.prompt import (
    TAIL_IDS,
    TalkerPromptParts,
    build_prompt,
    clone_text_needed,
)
from omnistep.models.qwen3_tts.talker import Qwen3TTSTalkerLoop, Qwen3TTSTalkerState
from omnistep.text.incremental import IncrementalTokenizer

NON_STREAMING_BY_DEFAULT = frozenset({"custom_voice", "voice_design"})
"""Variants whose upstream public call (``generate_custom_voice``, ``generate_voice_design``)
defaults to ``non_streaming_mode=True``; ``generate_voice_clone`` (Base) defaults to False."""


def text_layout(req: Request, tts_model_type: str, default: bool | None = None) -> bool:
    """Whether ``req`` uses the non-streaming layout (whole text in the prompt).

    The request's ``non_streaming_mode`` if set, else the card's ``default``
    (``Qwen3TTSOptions.non_streaming_text``) if set, else: text that streams in
    (``req.text_input``) the streaming layout, a whole text the default of upstream's public
    call for the variant (``NON_STREAMING_BY_DEFAULT``).
    """
    if req.non_streaming_mode is not None:
        return req.non_streaming_mode
    if default is not None:
        return default
    return not req.text_input and tts_model_type in NON_STREAMING_BY_DEFAULT


def talker_frames(max_new_tokens: int) -> int:
    """Most frames a request with this ``max_new_tokens`` gets: ``max_new_tokens - 1``, at
    least 1. Upstream's ``generate`` counts codebook-0 samples; the last one's codebooks
    1..15 come from the forward that would feed it, which never runs, so upstream returns
    one frame fewer than ``max_new_tokens`` (and fails on 1, where omnistep gives 1 frame)."""
    return max(1, max_new_tokens - 1)


class TextTrack:
    """The request's text as talker ids, read lazily from its ``TEXT_INPUT_SLOT`` channel.

    ``first``: the utterance's first text id once final (None before). ``non_streaming``: the
    request's layout (``text_layout``). As a channel of decode step ids (``len``, ``[k]``,
    ``closed``; what ``Qwen3TTSTalkerLoop`` reads): streaming layout: ``head``, then the text
    ids from ``skip`` on as they become final, then ``tts_eos``, closed once the text ended
    (``skip`` 1 and no head, unless ``configure`` set the prompt's); non-streaming layout (or
    a cloned voice's prompt holding the whole text): empty, closed once the text ended (the
    prompt holds it all).
    """

    def __init__(self, source: Channel, backend: Any, eos_id: int, non_streaming: bool):
        self.source = source
        self.tokenizer = IncrementalTokenizer(backend)
        self.eos_id = eos_id
        self.non_streaming = non_streaming
        self.streaming = not non_streaming
        self.skip = 1
        self.head: tuple[int, ...] = ()
        self.ids: list[int] = []  # every final text id
        self._read = 0

    def configure(self, parts: TalkerPromptParts) -> None:
        """Follow the built prompt: the text ids it holds are not fed again."""
        self.streaming = parts.streams_text
        self.skip = parts.consumed
        self.head = parts.head

    def pull(self) -> None:
        """Tokenise the text pieces that arrived since the last call."""
        while self._read < len(self.source):
            self.ids += self.tokenizer.feed(self.source[self._read])
            self._read += 1
        if self.source.closed and not self.tokenizer.finished:
            self.ids += self.tokenizer.finish()

    @property
    def ended(self) -> bool:
        """The text is complete (every id is final)."""
        self.pull()
        return self.tokenizer.finished

    @property
    def closed(self) -> bool:
        return self.ended

    @property
    def first(self) -> int | None:
        self.pull()
        return self.ids[0] if self.ids else None

    def _items(self) -> list[int]:
        if not self.streaming:
            return []
        eos = [self.eos_id] if self.ended and self.ids else []
        return [*self.head, *self.ids[self.skip :], *eos]

    def __len__(self) -> int:
        self.pull()
        return len(self._items())

    def __getitem__(self, index: int) -> int:
        self.pull()
        return self._items()[index]


class TalkerTextLoop(Qwen3TTSTalkerLoop):
    """The talker loop of the card: each request's layout is ``text_layout``'s; its prompt is
    built once the text allows (streaming layout: the first word is final, or with a cloned
    voice ``clone_text_needed`` ids, or the text ended; non-streaming: the text ended), its
    text track is the request's ``TEXT_INPUT_SLOT`` through ``TextTrack``, and it makes at
    most ``talker_frames(max_new_tokens)`` frames."""

    def __init__(
        self,
        config: ARDecodeConfig,
        qwen: Qwen3TTSConfig,
        tokenizer: Any,
        role_ids: Sequence[int],
        non_streaming: bool | None = None,
    ):
        super().__init__(config, track_slot=TEXT_INPUT_SLOT, pad_id=qwen.ids.tts_pad)
        self.qwen = qwen
        self.backend = tokenizer.backend_tokenizer
        self.role_ids = tuple(role_ids)
        self.non_streaming = non_streaming

    def init(self, req: Request, model: ModelInstance, ctx: ProgramContext) -> Qwen3TTSTalkerState:
        state = super().init(req, model, ctx)
        state.max_new_tokens = talker_frames(state.max_new_tokens)
        state.track = TextTrack(  # type: ignore[assignment]
            ctx.slots[TEXT_INPUT_SLOT],
            self.backend,
            self.qwen.ids.tts_eos,
            text_layout(req, self.qwen.tts_model_type, self.non_streaming),
        )
        return state

    def next(self, state: Qwen3TTSTalkerState) -> WorkPlan | Done | Pending:
        if isinstance(state.prompt, Qwen3TTSVoice):
            track: TextTrack = state.track  # type: ignore[assignment]
            voice = state.prompt
            ended = track.ended
            if track.non_streaming:
                ready = ended
            elif voice.clone is not None:
                ready = ended or len(track.ids) >= clone_text_needed(voice.clone, voice.ref_ids)
            else:
                ready = track.first is not None
            if not ready:
                if ended:
                    raise InvalidRequestError("the input text is empty", param="input")
                return Pending("waiting for the text")
            if not track.ids:
                raise InvalidRequestError("the input text is empty", param="input")
            whole = track.non_streaming or voice.clone is not None
            text = track.ids if whole else track.ids[:1]
            parts = build_prompt(
                self.qwen,
                [*self.role_ids, *text, *([0] * TAIL_IDS)],
                voice.speaker,
                voice.language,
                voice.instruct_ids,
                non_streaming=track.non_streaming,
                clone=voice.clone,
                ref_ids=voice.ref_ids,
                text_complete=ended,
            )
            track.configure(parts)
            state.prompt = parts.prompt
        return super().next(state)
