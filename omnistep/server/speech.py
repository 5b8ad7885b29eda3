"""``POST /v1/audio/speech``: text to speech, streamed as encoded bytes or as SSE events.

Streamed and non-streamed responses consume the same engine stream through the same stateful
encoder, so they carry the same samples; streaming changes when the bytes are sent and, for wav
and flac, whether the header states the length (a whole file's does; streamed headers say
"unknown", which libsndfile cannot read for flac). All other formats are byte-identical. A
request without ``stream`` (OpenAI's client sends none) gets wav and flac whole and the other
formats streamed (``SpeechRequest.streamed``), so every default body opens in any reader.

Word timestamps (``return_timestamps``, ``caption_format``) and Kokoro-FastAPI's
``POST /dev/captioned_speech``: see ``speech_timestamps``.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
from collections.abc import AsyncIterator

from fastapi import APIRouter
from fastapi import Request as HttpRequest
from fastapi.responses import Response, StreamingResponse

from omnistep.audio import MEDIA_TYPES, StreamEncoder, make_encoder
from omnistep.core import (
    Capability,
    Modality,
    OmnistepError,
    RequestFailedError,
    RequestTimeoutError,
    WordTiming,
)
from omnistep.engine import AsyncEngine, RequestStream
from omnistep.server.disconnect import abort_on_disconnect, log_client_gone
from omnistep.server.errors import StreamCut, api_error, from_exception
from omnistep.server.models import require_capability
from omnistep.server.protocol import CaptionedSpeechRequest, SpeechRequest
from omnistep.server.speech_timestamps import (
    captions,
    check_word_timestamps,
    json_lines,
    timestamps_json,
    whole_timed_response,
)
from omnistep.server.voice_fields import request_voice

log = logging.getLogger("omnistep.server")

router = APIRouter()


async def encoded(
    stream: RequestStream, encoder: StreamEncoder, words: list[WordTiming] | None = None
) -> AsyncIterator[bytes]:
    """The request's audio chunks through ``encoder``; empty pieces are skipped. With
    ``words``, each chunk's words (``StreamChunk.words``) are appended to it before its bytes
    are yielded.

    Closing this iterator early (client gone) aborts the request.
    """
    try:
        async for chunk in stream:
            if chunk.modality is Modality.AUDIO and chunk.audio is not None:
                if words is not None:
                    words.extend(chunk.words)
                data = encoder.encode(chunk.audio)
                if data:
                    yield data
        tail = encoder.flush()
        if tail:
            yield tail
    finally:
        stream.cancel()


async def _audio_body(
    first: bytes, pieces: AsyncIterator[bytes], stream: RequestStream
) -> AsyncIterator[bytes]:
    """The raw audio body: ``first``, then the rest of ``pieces``.

    The 200 is sent before the rest exists, so a failure (or timeout) later cannot become an
    error status: it is raised as ``StreamCut`` and the ASGI server closes the connection
    without the final chunk, so the client sees a truncated body (httpx:
    ``RemoteProtocolError``). Expected endings log one line each: the engine logs timeouts
    and failures, this logs an abort (shutdown) and a client that left; unexpected errors
    keep their traceback.
    """
    ended = False
    try:
        if first:
            yield first
        async for piece in pieces:
            yield piece
        ended = True
    except OmnistepError as exc:
        ended = True
        if not isinstance(exc, RequestTimeoutError | RequestFailedError):  # the engine logs those
            log.info("response of %s cut short: %s", stream.request_id, exc)
        raise StreamCut(stream.request_id, exc) from exc
    finally:
        if not ended:
            log_client_gone(stream.request_id)
        stream.cancel()
        await pieces.aclose()  # type: ignore[attr-defined]


def _sse_event(payload: dict) -> bytes:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


async def _sse(
    pieces: AsyncIterator[bytes],
    stream: RequestStream,
    words: list[WordTiming] | None = None,
    caption_format: str | None = None,
) -> AsyncIterator[bytes]:
    """``speech.audio.delta`` events with base64 audio, then ``speech.audio.done`` with usage.

    With ``words`` (the list ``pieces`` fills, see ``encoded``), each delta also carries the
    ``timestamps`` of the words synthesised since the last one, and the done event those left
    and, with a ``caption_format``, the ``captions`` of every word.

    A failure ends the events with ``speech.audio.error``, whose ``error`` is OpenAI's error
    object (``message``, ``type``, ``param``, ``code``; e.g. ``generation_failed``,
    ``request_timeout``).
    """
    ended = False
    spoken: list[WordTiming] = []

    def timed(event: dict) -> dict:
        if words is not None:
            event["timestamps"] = timestamps_json(words)
            spoken.extend(words)
            words.clear()
        return event

    try:
        async for piece in pieces:
            audio = base64.b64encode(piece).decode()
            yield _sse_event(timed({"type": "speech.audio.delta", "audio": audio}))
        usage = dict(stream.usage)
        usage["total_tokens"] = usage["input_tokens"] + usage["output_tokens"]
        ended = True
        done = timed({"type": "speech.audio.done", "usage": usage})
        if caption_format is not None:
            done["captions"] = captions(spoken, caption_format)
        yield _sse_event(done)
    except Exception as exc:  # noqa: BLE001 - the status is sent: report it in the stream
        ended = True
        yield _sse_event({"type": "speech.audio.error", "error": api_error(exc).to_dict()})
    finally:
        if not ended:
            log_client_gone(stream.request_id)
        stream.cancel()


async def start_speech(
    http: HttpRequest, body: SpeechRequest
) -> tuple[RequestStream, StreamEncoder]:
    """Check ``body`` against its model (speech; word timestamps when asked), resolve its voice,
    add its request to the engine; the request's stream and a fresh encoder.

    Raises:
        OmnistepError: an unknown model, one that cannot speak or time words, a bad voice, a
            full engine (the app's handler answers OpenAI error JSON).
    """
    engine: AsyncEngine = http.app.state.engine
    model = require_capability(engine, body.model, Capability.TEXT_TO_SPEECH)
    check_word_timestamps(engine, body)
    voice = await request_voice(http.app, model.card, body.voice_name(), body)
    request = dataclasses.replace(body.to_request(body.model), voice=voice)
    stream = engine.add_request(request)
    return stream, make_encoder(body.response_format, model.card.sample_rate)


@router.post("/v1/audio/speech")
async def create_speech(body: SpeechRequest, http: HttpRequest) -> Response:
    """Synthesize ``body.input``; see ``SpeechRequest`` for the fields.

    Errors before the first audio byte are OpenAI error JSON (500 failed, 504 timed out);
    afterwards an SSE stream ends with ``speech.audio.error`` and a raw audio stream is cut
    short (see ``_audio_body``). A client that disconnects aborts the request.
    """
    stream, encoder = await start_speech(http, body)
    headers = {"x-request-id": stream.request_id, "x-omnistep-seed": str(stream.seed)}
    words: list[WordTiming] | None = [] if body.wants_timestamps() else None
    if body.stream_format == "sse":
        return StreamingResponse(
            _sse(encoded(stream, encoder, words), stream, words, body.caption_format),
            headers=headers,
            media_type="text/event-stream",
        )
    pieces = encoded(stream, encoder, words)
    if words is not None:  # one JSON object: the whole audio and its words
        return await whole_timed_response(http, body, stream, pieces, encoder, words, headers)
    try:
        async with abort_on_disconnect(http, stream):
            # Wait for the first audio (or an early failure) before committing to a 200.
            first = await anext(pieces, b"")
            if not body.streamed():
                data = encoder.with_lengths(first + b"".join([p async for p in pieces]))
                return Response(data, media_type=MEDIA_TYPES[body.response_format], headers=headers)
    except OmnistepError as exc:
        await pieces.aclose()  # type: ignore[attr-defined]
        return from_exception(exc)
    return StreamingResponse(
        _audio_body(first, pieces, stream),
        headers=headers,
        media_type=MEDIA_TYPES[body.response_format],
    )


@router.post("/dev/captioned_speech")
async def captioned_speech(body: CaptionedSpeechRequest, http: HttpRequest) -> Response:
    """Kokoro-FastAPI's captioned speech: audio and word timestamps as JSON (see
    ``speech_timestamps``); ``stream`` (default true) answers JSON lines, one per audio piece.
    ``return_timestamps: false`` gives the same shapes with empty ``timestamps``."""
    stream, encoder = await start_speech(http, body)
    headers = {"x-request-id": stream.request_id, "x-omnistep-seed": str(stream.seed)}
    words: list[WordTiming] = []
    pieces = encoded(stream, encoder, words if body.wants_timestamps() else None)
    if body.stream is False:
        return await whole_timed_response(http, body, stream, pieces, encoder, words, headers)
    return StreamingResponse(
        json_lines(pieces, stream, words, body.response_format),
        headers=headers,
        media_type="application/x-ndjson",
    )
