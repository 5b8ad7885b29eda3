"""``POST /v1/chat/completions``: chat with text and, optionally, audio output.

Request: OpenAI's ``messages`` (text, and media parts: ``omnistep.server.media``),
``modalities`` (``["text"]`` or ``["text", "audio"]``), ``audio``
(``{voice, format}``; wav, mp3, flac, opus, pcm16), ``stream``, sampling fields, ``seed``,
``use_audio_in_video`` / ``mm_processor_kwargs`` (``MediaOptions``).
Non-streamed: ``choices[0].message.content`` and ``message.audio`` = ``{id, data (base64),
transcript, expires_at}``. Streamed: ``chat.completion.chunk`` events whose ``delta`` carries the
text in ``content`` and the audio in ``audio`` = ``{id, data, transcript}``, then a chunk with the
``finish_reason``, a chunk with ``usage``, then ``[DONE]``. Audio deltas are pieces of one
stream of the chosen format (one stateful encoder), so their concatenation is one valid file.
A thinking model's reasoning (``StreamChunk.reasoning`` text) goes to ``reasoning_content``, as
vLLM returns it (``message.reasoning_content``; streamed, ``delta.reasoning_content``).
"""

from __future__ import annotations

import base64
import json
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Literal

from fastapi import APIRouter
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ConfigDict, Field, StrictInt

from omnistep.audio import StreamEncoder, make_encoder
from omnistep.core import (
    Capability,
    ChatMessage,
    InvalidRequestError,
    MediaItem,
    Modality,
    ModelCard,
    OmnistepError,
    Request,
    SamplingParams,
    StreamChunk,
)
from omnistep.core.request import MAX_SEED
from omnistep.engine import AsyncEngine, RequestStream
from omnistep.server.disconnect import abort_on_disconnect, log_client_gone
from omnistep.server.errors import api_error, from_exception
from omnistep.server.media import (
    ContentPart,
    MediaLimits,
    MediaPart,
    TextPart,
    check_media_parts,
    decode_part,
    part_param,
)
from omnistep.server.models import require_capability
from omnistep.server.protocol import MAX_VOICE_CHARS, OpenAIBody
from omnistep.server.voices import resolve_voice

router = APIRouter()

AUDIO_FORMATS = {"wav": "wav", "mp3": "mp3", "flac": "flac", "opus": "opus", "pcm16": "pcm"}
AUDIO_TTL_SECONDS = 3600


class Message(OpenAIBody):
    """One message; ``content`` is a string or a list of parts: text, and the media parts of
    ``omnistep.server.media`` (``input_audio``, ``image_url``, ``audio_url``, ``video_url``)
    in any order."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        """The message's text: the string, or its text parts joined."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if isinstance(part, TextPart))

    def chat_message(self, media: Mapping[tuple[int, int], MediaItem], index: int) -> ChatMessage:
        """The core message; ``media`` holds the decoded items by (message, part) index."""
        if not isinstance(self.content, list) or all(isinstance(p, TextPart) for p in self.content):
            return ChatMessage(self.role, self.text())
        parts = tuple(
            p.text if isinstance(p, TextPart) else media[(index, j)]
            for j, p in enumerate(self.content)
        )
        return ChatMessage(self.role, self.text(), parts)


class AudioOutput(OpenAIBody):
    """``audio``: the voice and the format of the spoken reply."""

    voice: str = Field(min_length=1, max_length=MAX_VOICE_CHARS)
    format: Literal["wav", "mp3", "flac", "opus", "pcm16"] = "wav"


class ProcessorKwargs(OpenAIBody):
    """``mm_processor_kwargs`` (vLLM's and vllm-omni's field): ``use_audio_in_video`` is
    read; other processor settings are accepted and ignored."""

    model_config = ConfigDict(extra="ignore")

    use_audio_in_video: bool = Field(default=False, strict=True)


class MediaOptions(OpenAIBody):
    """How media parts are read: ``use_audio_in_video`` (SGLang-Omni's top-level field) or
    ``mm_processor_kwargs.use_audio_in_video`` (vLLM / vllm-omni): a video part's audio track
    goes into the prompt with its frames (Qwen2.5-Omni: interleaved in 2-second chunks); a
    video without one is then a 400 naming the part."""

    use_audio_in_video: bool | None = Field(default=None, strict=True)
    mm_processor_kwargs: ProcessorKwargs | None = None

    @property
    def audio_in_video(self) -> bool:
        """Whether either field asks for the videos' audio."""
        nested = (
            self.mm_processor_kwargs is not None and self.mm_processor_kwargs.use_audio_in_video
        )
        return bool(self.use_audio_in_video) or nested


class StreamOptions(OpenAIBody):
    """``stream_options``: accepted for compatibility (the usage chunk is always sent)."""

    include_usage: bool = False


class ChatCompletionRequest(MediaOptions):
    """Body of ``POST /v1/chat/completions`` (the fields omnistep uses; others are ignored)."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1, max_length=200)
    messages: list[Message] = Field(min_length=1, max_length=256)
    modalities: list[Literal["text", "audio"]] = Field(default_factory=lambda: ["text"])
    audio: AudioOutput | None = None
    stream: bool = Field(default=False, strict=True)
    stream_options: StreamOptions | None = None
    # strict: JSON numbers only (a bool or a numeric string is a 400, as OpenAI answers)
    temperature: float | None = Field(default=None, ge=0, le=2, allow_inf_nan=False, strict=True)
    top_p: float | None = Field(default=None, gt=0, le=1, allow_inf_nan=False, strict=True)
    max_tokens: int | None = Field(default=None, ge=1, le=32768, strict=True)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=32768, strict=True)
    seed: StrictInt | None = Field(default=None, ge=0, le=MAX_SEED)
    n: int = Field(default=1, ge=1, le=1)

    @property
    def wants_audio(self) -> bool:
        return "audio" in self.modalities

    def to_request(self, messages: tuple[ChatMessage, ...] | None = None) -> Request:
        """The engine request over the decoded ``messages`` (``decode_messages``; None: the
        body's text only); raises InvalidRequestError for an inconsistent body."""
        if messages is None:
            messages = tuple(ChatMessage(m.role, m.text()) for m in self.messages)
        if self.wants_audio and self.audio is None:
            raise InvalidRequestError(
                "'audio' ({voice, format}) is required when modalities include 'audio'",
                param="audio",
                code="missing_audio",
            )
        if not any(m.media for m in messages) and not any(m.content.strip() for m in messages):
            raise InvalidRequestError("messages have no text", param="messages")
        outputs = {Modality.TEXT} | ({Modality.AUDIO} if self.wants_audio else set())
        sampling = SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            max_new_tokens=self.max_completion_tokens or self.max_tokens,
        )
        return Request(
            model=self.model,
            messages=messages,
            voice=self.audio.voice if self.audio else None,
            seed=self.seed,
            sampling=sampling,
            output_modalities=frozenset(outputs),
        )


class _Reply:
    """Builds the OpenAI response objects of one completion."""

    def __init__(
        self, body: ChatCompletionRequest, stream: RequestStream, encoder: StreamEncoder | None
    ):
        self.body = body
        self.stream = stream
        self.encoder = encoder
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.audio_id = f"audio_{uuid.uuid4().hex}"
        self.created = int(time.time())

    def usage(self) -> dict[str, int]:
        prompt, completion = self.stream.usage["input_tokens"], self.stream.usage["output_tokens"]
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": self.stream.usage.get("cached_tokens", 0)},
        }

    def finish_reason(self) -> str:
        cap = self.stream.request.sampling.max_new_tokens
        return "length" if cap is not None and self.stream.usage["output_tokens"] >= cap else "stop"

    def encode(self, chunk: StreamChunk) -> bytes:
        assert self.encoder is not None and chunk.audio is not None
        return self.encoder.encode(chunk.audio)

    def chunk(self, delta: dict, finish_reason: str | None = None) -> bytes:
        payload = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.body.model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
        }
        return _sse(payload)

    def audio_delta(self, data: bytes, transcript: str) -> dict:
        return {
            "audio": {
                "id": self.audio_id,
                "data": base64.b64encode(data).decode(),
                "transcript": transcript,
            }
        }


def _sse(payload: dict) -> bytes:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


async def _collect(reply: _Reply) -> dict:
    text, audio, reasoning = [], [], []
    async for chunk in reply.stream:
        if chunk.modality is Modality.TEXT and chunk.text:
            (reasoning if chunk.reasoning else text).append(chunk.text)
        elif reply.encoder is not None and chunk.audio is not None:
            audio.append(reply.encode(chunk))
    content = "".join(text)
    message: dict = {"role": "assistant", "content": content}
    if reasoning:  # vLLM's field for a reasoning model's thinking
        message["reasoning_content"] = "".join(reasoning)
    if reply.encoder is not None:
        data = reply.encoder.with_lengths(b"".join(audio) + reply.encoder.flush())
        message["audio"] = {
            "id": reply.audio_id,
            "data": base64.b64encode(data).decode(),
            "transcript": content,
            "expires_at": reply.created + AUDIO_TTL_SECONDS,
        }
    return {
        "id": reply.id,
        "object": "chat.completion",
        "created": reply.created,
        "model": reply.body.model,
        "choices": [{"index": 0, "message": message, "finish_reason": reply.finish_reason()}],
        "usage": reply.usage(),
    }


async def _events(reply: _Reply) -> AsyncIterator[bytes]:
    """The streamed reply's SSE events; a failure sends ``{"error": {...}}`` (OpenAI's error
    object, which the ``openai`` client raises as ``APIError``), then ``[DONE]``."""
    ended = False
    try:
        yield reply.chunk({"role": "assistant", "content": ""})
        async for chunk in reply.stream:
            if chunk.modality is Modality.TEXT and chunk.text and chunk.reasoning:
                yield reply.chunk({"reasoning_content": chunk.text})
            elif chunk.modality is Modality.TEXT and chunk.text:
                yield reply.chunk({"content": chunk.text})
                if reply.encoder is not None:  # the transcript grows with the text
                    yield reply.chunk(reply.audio_delta(b"", chunk.text))
            elif reply.encoder is not None and chunk.audio is not None:
                data = reply.encode(chunk)
                if data:
                    yield reply.chunk(reply.audio_delta(data, ""))
        if reply.encoder is not None:
            tail = reply.encoder.flush()
            if tail:
                yield reply.chunk(reply.audio_delta(tail, ""))
        yield reply.chunk({}, reply.finish_reason())
        final = {
            "id": reply.id,
            "object": "chat.completion.chunk",
            "created": reply.created,
            "model": reply.body.model,
            "choices": [],
            "usage": reply.usage(),
        }
        ended = True
        yield _sse(final)
    except Exception as exc:  # noqa: BLE001 - the status is sent: report it in the stream
        ended = True
        yield _sse({"error": api_error(exc).to_dict()})
    finally:
        if not ended:
            log_client_gone(reply.stream.request_id)
        reply.stream.cancel()
    yield b"data: [DONE]\n\n"


def media_parts(messages: list[Message]) -> list[tuple[tuple[int, int], MediaPart]]:
    """``((message index, part index), part)`` of every media part, in order."""
    return [
        ((i, j), part)
        for i, m in enumerate(messages)
        if isinstance(m.content, list)
        for j, part in enumerate(m.content)
        if not isinstance(part, TextPart)
    ]


async def decode_messages(
    messages: list[Message],
    card: ModelCard,
    http: HttpRequest,
    use_audio_in_video: bool = False,
    prefix: str = "messages",
) -> tuple[ChatMessage, ...]:
    """The core messages of a chat's ``messages``, media parts decoded (the one parser of
    ``/v1/chat/completions`` and ``/v1/rollouts``); a 400 naming the part (``prefix[i]
    .content[j]``) for a kind the card cannot take, too many parts, or a part that cannot be
    read or decoded."""
    found = media_parts(messages)
    media: dict[tuple[int, int], MediaItem] = {}
    if found:
        limits: MediaLimits = http.app.state.media_limits
        check_media_parts([(part_param(*key, prefix), part) for key, part in found], card, limits)
        policy = http.app.state.media_policy
        for key, part in found:  # one at a time: a request's decoding takes one worker thread
            param = part_param(*key, prefix)
            media[key] = await decode_part(part, param, card, policy, limits, use_audio_in_video)
    return tuple(m.chat_message(media, i) for i, m in enumerate(messages))


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, http: HttpRequest) -> Response:
    """Chat completion with text and optional audio output (see module docstring)."""
    engine: AsyncEngine = http.app.state.engine
    needed = Capability.CHAT_AUDIO if body.wants_audio else Capability.CHAT_TEXT
    model = require_capability(engine, body.model, needed)
    messages = await decode_messages(body.messages, model.card, http, body.audio_in_video)
    request = body.to_request(messages)
    stream = engine.add_request(await resolve_voice(http.app, model.card, request))
    encoder = (
        make_encoder(AUDIO_FORMATS[body.audio.format], model.card.sample_rate)
        if body.wants_audio and body.audio
        else None
    )
    reply = _Reply(body, stream, encoder)
    if body.stream:
        return StreamingResponse(
            _events(reply),
            media_type="text/event-stream",
            headers={"x-omnistep-seed": str(stream.seed)},
        )
    try:
        async with abort_on_disconnect(http, stream):
            result = await _collect(reply)
    except OmnistepError as exc:
        return from_exception(exc)
    finally:
        stream.cancel()
    return JSONResponse(result, headers={"x-omnistep-seed": str(stream.seed)})
