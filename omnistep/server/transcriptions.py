"""``POST /v1/audio/transcriptions``: speech to text, served by a card that hears.

Request (OpenAI's multipart form): ``file`` (any audio ``omnistep.audio.decode`` reads: wav,
flac, mp3, ogg, webm, m4a...), ``model`` (a card with ``Capability.TRANSCRIPTION``),
``language`` (ISO-639-1, optional), ``prompt`` (optional), ``response_format`` (``json``
default, ``text``, ``srt``, ``vtt``, ``verbose_json``), ``temperature`` (0..1; the card's
default when absent), ``stream`` (``true``: Server-Sent Events). Other OpenAI fields
(``include[]``, ``timestamp_granularities[]``, ``chunking_strategy``) are accepted and have no
effect.

The clip is decoded, mixed to mono and resampled to the card's ``media_sample_rate`` (as chat
``input_audio`` parts are: ``media.decode_audio_item``), then the card's
``transcription_prompt`` hook builds the chat its authors use for ASR (Qwen2.5-Omni: a system
prompt, a user turn holding the audio and an instruction); the engine runs it text out only
(no talker) and the answer's text is the transcript.

Answers: ``json`` ``{"text", "usage": {"type": "tokens", input_tokens, output_tokens,
total_tokens}}``; ``text`` the bare transcript (``text/plain``); ``verbose_json`` ``{"task",
"language", "duration", "text", "segments", "usage": {"type": "duration", "seconds"}}`` with one
segment spanning the clip (the models served give no timestamps; ``avg_logprob``,
``compression_ratio`` and ``no_speech_prob`` are null); ``srt`` / ``vtt`` one cue spanning the
clip. Streamed (``json`` or ``text`` only): ``data: {"type": "transcript.text.delta", "delta"}``
events as the text is decoded, then ``data: {"type": "transcript.text.done", "text",
"usage"}``; a failure after the stream started sends ``data: {"error": {...}}`` (which the
``openai`` client raises as ``APIError``). Bad input is a 400 naming the field; a model that
cannot transcribe a 400 ``unsupported_model`` listing those that can.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator

from fastapi import APIRouter
from fastapi import Request as HttpRequest
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.datastructures import UploadFile

from omnistep.core import (
    Capability,
    InvalidRequestError,
    MediaItem,
    Modality,
    OmnistepError,
    Request,
    SamplingParams,
)
from omnistep.engine import AsyncEngine, RequestStream
from omnistep.server.disconnect import abort_on_disconnect, log_client_gone
from omnistep.server.errors import api_error, from_exception
from omnistep.server.media import decode_audio_item
from omnistep.server.models import require_capability
from omnistep.server.protocol import control_characters

router = APIRouter()

PATH = "/v1/audio/transcriptions"
RESPONSE_FORMATS = ("json", "text", "srt", "vtt", "verbose_json")
STREAM_FORMATS = ("json", "text")
MAX_PROMPT_CHARS = 4096
LANGUAGE = re.compile(r"[A-Za-z]{2,3}([-_][A-Za-z0-9]{2,8})?")
"""An ISO-639-1 (or -3) code, optionally with a region or script: ``en``, ``yue``, ``zh-TW``."""


def _bad(message: str, param: str, code: str = "invalid_value") -> InvalidRequestError:
    return InvalidRequestError(message, param=param, code=code)


def _text(form: object, name: str) -> str | None:
    """A form field's text; None when absent or empty.

    Raises:
        InvalidRequestError: the field is a file.
    """
    value = form.get(name)  # type: ignore[attr-defined]
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if not isinstance(value, str):
        raise _bad(f"'{name}' must be a text field, not a file", name)
    return value.strip()


class TranscriptionForm:
    """The validated fields of one transcription request (see the module docstring).

    Raises:
        InvalidRequestError: a missing ``file`` or ``model``, an unknown ``response_format``,
            ``temperature`` not a number in [0, 1], ``stream`` not a boolean, ``stream`` with a
            format other than json or text, a bad ``language``, a ``prompt`` over
            ``MAX_PROMPT_CHARS`` or with control characters.
    """

    def __init__(self, form: object):
        model = _text(form, "model")
        if model is None:
            raise _bad("'model' is required", "model", "missing_required_parameter")
        self.model = model
        self.response_format = _text(form, "response_format") or "json"
        if self.response_format not in RESPONSE_FORMATS:
            raise _bad(
                f"'response_format' must be one of {', '.join(RESPONSE_FORMATS)}, got "
                f"'{self.response_format[:40]}'",
                "response_format",
            )
        self.temperature = self._temperature(_text(form, "temperature"))
        self.stream = self._stream(_text(form, "stream"))
        if self.stream and self.response_format not in STREAM_FORMATS:
            raise _bad(
                f"'stream' needs response_format json or text, not '{self.response_format}'",
                "stream",
                "unsupported_value",
            )
        self.language = _text(form, "language")
        if self.language is not None and not LANGUAGE.fullmatch(self.language):
            raise _bad(
                f"'language' must be an ISO-639-1 code such as 'en', got '{self.language[:40]}'",
                "language",
            )
        self.prompt = _text(form, "prompt")
        if self.prompt is not None and (
            len(self.prompt) > MAX_PROMPT_CHARS or control_characters(self.prompt)
        ):
            raise _bad(
                f"'prompt' must be at most {MAX_PROMPT_CHARS} characters without control "
                "characters",
                "prompt",
            )

    @staticmethod
    def _temperature(value: str | None) -> float | None:
        if value is None:
            return None
        try:
            temperature = float(value)
        except ValueError:
            temperature = -1.0
        if not 0 <= temperature <= 1:
            raise _bad(
                f"'temperature' must be a number in [0, 1], got '{value[:40]}'", "temperature"
            )
        return temperature

    @staticmethod
    def _stream(value: str | None) -> bool:
        if value is None or value.lower() in ("false", "0"):
            return False
        if value.lower() in ("true", "1"):
            return True
        raise _bad(f"'stream' must be true or false, got '{value[:40]}'", "stream")


async def _read_form(http: HttpRequest) -> tuple[TranscriptionForm, bytes]:
    """The form's fields and the ``file``'s bytes.

    Raises:
        InvalidRequestError: not a multipart form, no ``file`` or an empty one, bad fields.
    """
    content_type = http.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type != "multipart/form-data":
        raise _bad(
            "send a multipart/form-data body (fields 'file' and 'model')",
            "file",
            "invalid_content_type",
        )
    async with http.form(max_files=1, max_fields=32) as form:
        fields = TranscriptionForm(form)
        upload = form.get("file")
        if not isinstance(upload, UploadFile):
            what = "is required" if upload is None else "must be a file"
            raise _bad(f"'file' {what}", "file", "missing_required_parameter")
        data = await upload.read()
    if not data:
        raise _bad("'file' is an empty file", "file", "invalid_audio")
    return fields, data


def _timestamp(seconds: float, separator: str) -> str:
    ms = round(seconds * 1000)
    hours, ms = divmod(ms, 3_600_000)
    minutes, ms = divmod(ms, 60_000)
    secs, ms = divmod(ms, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{separator}{ms:03d}"


def subtitles(text: str, seconds: float, fmt: str) -> str:
    """One cue spanning ``[0, seconds]`` holding ``text``, as SubRip (``srt``) or WebVTT
    (``vtt``)."""
    if fmt == "srt":
        return f"1\n{_timestamp(0, ',')} --> {_timestamp(seconds, ',')}\n{text}\n\n"
    return f"WEBVTT\n\n{_timestamp(0, '.')} --> {_timestamp(seconds, '.')}\n{text}\n\n"


def _token_usage(stream: RequestStream) -> dict:
    usage = stream.usage
    return {
        "type": "tokens",
        "input_tokens": usage["input_tokens"],
        "output_tokens": usage["output_tokens"],
        "total_tokens": usage["input_tokens"] + usage["output_tokens"],
    }


def _answer(fields: TranscriptionForm, text: str, audio: MediaItem, stream: RequestStream):
    seconds = round(audio.seconds or 0.0, 3)
    headers = {"x-omnistep-seed": str(stream.seed)}
    if fields.response_format == "text":
        return PlainTextResponse(text, headers=headers)
    if fields.response_format in ("srt", "vtt"):
        media = "text/vtt" if fields.response_format == "vtt" else "application/x-subrip"
        return Response(subtitles(text, seconds, fields.response_format), media_type=media)
    if fields.response_format == "json":
        return JSONResponse({"text": text, "usage": _token_usage(stream)}, headers=headers)
    segment = {
        "id": 0,
        "seek": 0,
        "start": 0.0,
        "end": seconds,
        "text": text,
        "tokens": [],
        "temperature": fields.temperature or 0.0,
        "avg_logprob": None,
        "compression_ratio": None,
        "no_speech_prob": None,
    }
    body = {
        "task": "transcribe",
        "language": fields.language or "unknown",
        "duration": seconds,
        "text": text,
        "segments": [segment],
        "usage": {"type": "duration", "seconds": seconds},
    }
    return JSONResponse(body, headers=headers)


def _sse(payload: dict) -> bytes:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


async def _events(stream: RequestStream) -> AsyncIterator[bytes]:
    """``transcript.text.delta`` per text piece, then ``transcript.text.done``; an error event
    when the request fails."""
    ended = False
    text: list[str] = []
    try:
        async for chunk in stream:
            if chunk.modality is Modality.TEXT and chunk.text:
                text.append(chunk.text)
                yield _sse({"type": "transcript.text.delta", "delta": chunk.text})
        ended = True
        done = {"type": "transcript.text.done", "text": "".join(text).strip()}
        yield _sse({**done, "usage": _token_usage(stream)})
    except Exception as exc:  # noqa: BLE001 - the status is sent: report it in the stream
        ended = True
        yield _sse({"error": api_error(exc).to_dict()})
    finally:
        if not ended:
            log_client_gone(stream.request_id)
        stream.cancel()


@router.post(PATH)
async def create_transcription(http: HttpRequest) -> Response:
    """Transcribe an uploaded clip (see the module docstring)."""
    engine: AsyncEngine = http.app.state.engine
    fields, data = await _read_form(http)
    card = require_capability(engine, fields.model, Capability.TRANSCRIPTION).card
    limits = http.app.state.media_limits
    audio = await run_in_threadpool(decode_audio_item, data, "file", limits, card.media_sample_rate)
    assert card.transcription_prompt is not None  # ModelCard.validate: it has the capability
    request = Request(
        model=fields.model,
        messages=card.transcription_prompt(audio, fields.language, fields.prompt),
        sampling=SamplingParams(temperature=fields.temperature),
        output_modalities=frozenset({Modality.TEXT}),
    )
    stream = engine.add_request(request)
    if fields.stream:
        headers = {"x-omnistep-seed": str(stream.seed)}
        return StreamingResponse(_events(stream), media_type="text/event-stream", headers=headers)
    try:
        async with abort_on_disconnect(http, stream):
            text = "".join([c.text async for c in stream if c.modality is Modality.TEXT and c.text])
    except OmnistepError as exc:
        return from_exception(exc)
    finally:
        stream.cancel()
    return _answer(fields, text.strip(), audio, stream)
