"""Request bodies of the OpenAI-compatible endpoints (pydantic), and their mapping to Requests."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator

from omnistep.audio import FORMATS
from omnistep.core import Request, SamplingParams
from omnistep.core.request import MAX_SEED

ResponseFormat = Literal["mp3", "opus", "aac", "flac", "wav", "pcm", "ogg"]
assert set(ResponseFormat.__args__) == set(FORMATS)  # type: ignore[attr-defined]

WHOLE_BY_DEFAULT = frozenset({"wav", "flac"})
"""Formats sent whole when a request leaves ``stream`` out: their headers hold the length, which
a stream cannot know (a streamed flac says 0 samples, which libsndfile cannot read; a streamed
wav says 2**32-1 bytes, which Python's ``wave`` takes as 2**31-1 frames). The other formats
hold no length, so their streamed bytes are the whole file's bytes: they are always streamed."""


_CONTROL = frozenset(
    chr(c) for c in [*range(0x00, 0x09), 0x0B, 0x0C, *range(0x0E, 0x20), *range(0x7F, 0xA0)]
)
"""C0 controls, DEL and C1 controls, but tab, newline and carriage return (NUL would crash the
phonemizer)."""


def _valid_unicode(value: str) -> bool:
    """False if ``value`` holds a lone surrogate (JSON allows ``"\\ud800"``; UTF-8 does not)."""
    if value.isascii():
        return True
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class OpenAIBody(BaseModel):
    """Base of request bodies and their parts: every string must be valid Unicode.

    pydantic lets a lone surrogate through in some unions (``str | list[...]``), and it would
    fail later when encoded as UTF-8 (a tokenizer, an error message): it is rejected here.
    """

    @field_validator("*")
    @classmethod
    def _no_lone_surrogates(cls, value: object) -> object:
        texts = value if isinstance(value, list) else [value]  # a list of strings too
        if any(isinstance(text, str) and not _valid_unicode(text) for text in texts):
            raise ValueError("string contains a lone surrogate (invalid Unicode)")
        return value


MAX_VOICE_CHARS = 4096
"""Longest ``voice``: a full-size ChatTTS speaker string (768 floats, compressed) is ~850
characters."""


def control_characters(text: str) -> list[str]:
    """The disallowed control characters in ``text`` (C0 and C1 but tab, newline and carriage
    return), as sorted ``U+XXXX`` names; empty when there are none."""
    return sorted({f"U+{ord(c):04X}" for c in text if c in _CONTROL})


class VoiceRef(OpenAIBody):
    """A voice given as an object, as newer OpenAI clients may send: ``{"id": "alloy"}``."""

    id: str = Field(min_length=1, max_length=MAX_VOICE_CHARS)


class NormalizationOptions(OpenAIBody):
    """``normalization_options``: Kokoro-FastAPI's per-request switch of the text front-end.

    ``normalize`` (default true) runs the card's normaliser (numbers, dates, times, money,
    units and abbreviations to words; ``omnistep.text``); false reads the input as given.
    Kokoro-FastAPI's finer switches (``unit_normalization``, ``url_normalization``,
    ``email_normalization``, ``optional_pluralization_normalization``,
    ``phone_normalization``, ``replace_remaining_symbols``) are accepted, type-checked and
    have no effect: omnistep's normaliser has no separate passes for them. Other fields are
    ignored, as Kokoro-FastAPI ignores them.
    """

    model_config = ConfigDict(extra="ignore")

    normalize: StrictBool = True
    unit_normalization: StrictBool | None = None
    url_normalization: StrictBool | None = None
    email_normalization: StrictBool | None = None
    optional_pluralization_normalization: StrictBool | None = None
    phone_normalization: StrictBool | None = None
    replace_remaining_symbols: StrictBool | None = None


class SamplingFields(OpenAIBody):
    """The sampling fields of omnistep's speech and rollout bodies (cards without a sampler
    ignore them); unset ones keep the card's defaults."""

    # strict: JSON numbers only (a bool or a numeric string is a 400, as OpenAI answers)
    temperature: float | None = Field(default=None, ge=0, le=5, allow_inf_nan=False, strict=True)
    top_p: float | None = Field(default=None, gt=0, le=1, allow_inf_nan=False, strict=True)
    top_k: int | None = Field(default=None, ge=0, le=10000, strict=True)
    repetition_penalty: float | None = Field(
        default=None, ge=1, le=10, allow_inf_nan=False, strict=True
    )
    max_new_tokens: int | None = Field(default=None, ge=1, le=8192, strict=True)
    # a sub-stage sampler (Qwen3-TTS's code predictor, codebooks 1..15; upstream's names)
    subtalker_temperature: float | None = Field(
        default=None, ge=0, le=5, allow_inf_nan=False, strict=True
    )
    subtalker_top_p: float | None = Field(
        default=None, gt=0, le=1, allow_inf_nan=False, strict=True
    )
    subtalker_top_k: int | None = Field(default=None, ge=0, le=10000, strict=True)
    # Chatterbox's emotion exaggeration and T3 guidance weight (upstream generate's names)
    exaggeration: float | None = Field(default=None, ge=0, le=2, allow_inf_nan=False, strict=True)
    cfg_weight: float | None = Field(default=None, ge=0, le=2, allow_inf_nan=False, strict=True)

    def sampling(self) -> SamplingParams:
        """The ``SamplingParams`` of the fields that were given."""
        names = (
            "temperature",
            "top_p",
            "top_k",
            "repetition_penalty",
            "max_new_tokens",
            "subtalker_temperature",
            "subtalker_top_p",
            "subtalker_top_k",
            "exaggeration",
            "cfg_weight",
        )
        given = {k: getattr(self, k) for k in names if getattr(self, k) is not None}
        return SamplingParams(**given)


TaskType = Literal["CustomVoice", "VoiceDesign", "Base"]
"""vllm-omni's ``task_type``: a named voice, a voice described by ``instructions``, or a voice
cloned from a clip (Qwen3-TTS's three variants)."""


class ReferenceVoiceFields(OpenAIBody):
    """The peers' voice fields (vllm-omni, SGLang-Omni), on speech and rollout bodies.

    ``ref_audio``: a reference clip to clone inline: base64, a ``data:`` URL, a file path
    (under ``--allowed-local-media-path``) or an http(s) URL (with ``--allow-remote-media``);
    ``ref_text``: its transcript. ``task_type``: ``CustomVoice``, ``VoiceDesign`` or ``Base``,
    checked against the served model (left out: ``Base`` when ``ref_audio`` or ``ref_text`` is
    given, as vllm-omni infers). ``x_vector_only_mode``: accepted when false (true is refused:
    cloning conditions on the transcript). See ``omnistep.server.voice_fields``.
    """

    ref_audio: str | None = Field(default=None, min_length=1)
    ref_text: str | None = Field(default=None, max_length=4096)
    task_type: TaskType | None = None
    x_vector_only_mode: StrictBool | None = None

    @field_validator("ref_text")
    @classmethod
    def _plain_ref_text(cls, value: str | None) -> str | None:
        bad = None if value is None else control_characters(value)
        if bad:
            raise ValueError(f"ref_text contains control characters {', '.join(bad[:5])}")
        return value


class SpeechRequest(SamplingFields, ReferenceVoiceFields):
    """Body of ``POST /v1/audio/speech`` (OpenAI's fields plus omnistep's extras).

    OpenAI fields: ``model``, ``input`` (1..4096 characters), ``voice``, ``instructions``,
    ``response_format`` (default mp3), ``speed`` (0.25..4.0), ``stream_format`` (``audio`` or
    ``sse``). ``input`` must hold something speakable (a letter or a digit) and no control
    characters but tab, newline and carriage return. Unknown fields are ignored. Extras:
    ``stream`` (Kokoro-FastAPI's field; see ``streamed``), ``normalization_options``
    (Kokoro-FastAPI's; see ``NormalizationOptions``), ``seed``, ``language`` (for cards that
    take one, e.g. Qwen3-TTS: ``english``, ``chinese``, ..., or ``auto``), and sampling fields
    used by cards with a sampler and ignored by others (``max_new_tokens`` caps the generated
    frames). ``instructions`` goes to cards that use it (Qwen3-TTS's voice design) and is
    ignored by others. ``return_timestamps``
    (Kokoro-FastAPI's field) asks for word times, ``caption_format`` (``srt`` or ``vtt``) for
    captions made of them (it implies ``return_timestamps``); see ``speech_timestamps``. The
    peers' ``ref_audio``, ``ref_text``, ``task_type``: see ``ReferenceVoiceFields``;
    ``response_format`` ``ogg`` is Ogg Opus, as ``opus``. ``non_streaming_mode``
    (upstream qwen-tts's name; ``Request.non_streaming_mode``) picks Qwen3-TTS's prompt layout:
    true the whole text in the prompt, false the streaming-text layout, unset the card's
    choice; other cards ignore it.
    """

    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1, max_length=200)
    input: str = Field(min_length=1, max_length=4096)
    voice: Annotated[str, Field(min_length=1, max_length=MAX_VOICE_CHARS)] | VoiceRef | None = None
    instructions: str | None = Field(default=None, max_length=4096)
    response_format: ResponseFormat = "mp3"
    speed: float = Field(default=1.0, ge=0.25, le=4.0, allow_inf_nan=False, strict=True)
    stream_format: Literal["audio", "sse"] = "audio"
    stream: StrictBool | None = None
    seed: StrictInt | None = Field(default=None, ge=0, le=MAX_SEED)
    normalization_options: NormalizationOptions | None = None
    language: str | None = Field(default=None, min_length=1, max_length=64)
    return_timestamps: StrictBool = False
    caption_format: Literal["srt", "vtt"] | None = None
    non_streaming_mode: StrictBool | None = None

    @field_validator("input")
    @classmethod
    def _speakable_text(cls, value: str) -> str:
        bad = control_characters(value)
        if bad:
            raise ValueError(f"input contains control characters {', '.join(bad[:5])}")
        if not any(c.isalnum() for c in value):
            raise ValueError("input has nothing to speak (it needs at least one letter or digit)")
        return value

    @field_validator("instructions")
    @classmethod
    def _plain_instructions(cls, value: str | None) -> str | None:
        bad = None if value is None else control_characters(value)
        if bad:
            raise ValueError(f"instructions contain control characters {', '.join(bad[:5])}")
        return value

    def streamed(self) -> bool:
        """Whether the raw audio is sent as it is made: ``stream`` when the request gives it,
        else every format but those in ``WHOLE_BY_DEFAULT`` (sent whole, exact headers).
        ``stream_format: "sse"`` always streams events, whatever this says."""
        if self.stream is not None:
            return self.stream
        return self.response_format not in WHOLE_BY_DEFAULT

    def wants_timestamps(self) -> bool:
        """Whether the answer carries word times (``return_timestamps`` or a
        ``caption_format``)."""
        return self.return_timestamps or self.caption_format is not None

    def voice_name(self) -> str | None:
        """The voice as a plain name."""
        return self.voice.id if isinstance(self.voice, VoiceRef) else self.voice

    def to_request(self, model_id: str) -> Request:
        """The engine request; sampling fields left unset keep ``SamplingParams`` defaults."""
        return Request(
            model=model_id,
            text=self.input,
            voice=self.voice_name(),
            speed=self.speed,
            seed=self.seed,
            sampling=self.sampling(),
            instructions=self.instructions,
            language=self.language,
            normalize_text=self.normalize_text(),
            non_streaming_mode=self.non_streaming_mode,
        )

    def normalize_text(self) -> bool:
        """Whether the card's text front-end runs (``normalization_options.normalize``)."""
        options = self.normalization_options
        return True if options is None else options.normalize


class CaptionedSpeechRequest(SpeechRequest):
    """Body of ``POST /dev/captioned_speech`` (Kokoro-FastAPI's endpoint): the fields of
    ``SpeechRequest``, with ``return_timestamps`` true by default. ``stream`` true (the
    default) answers JSON lines, one per audio piece; false one JSON object."""

    return_timestamps: StrictBool = True
