"""``WS /v1/audio/speech/stream``: speak text while it is still being written (e.g. by an LLM).

Protocol (JSON text frames from the client; JSON text events and binary audio from the server):

client                                          server
``{"type": "session.config", "model", ...}``    (first; the fields of ``/v1/audio/speech`` but
                                                ``input``; ``response_format`` ``pcm`` only;
                                                ``voice`` may be a saved voice's name)
``{"type": "input.text", "text": "..."}``       ``{"type": "audio.start", "sample_rate": 24000,
  (any number, any pieces)                        "format": "pcm_s16le", "seed": S}``, then
                                                binary frames of 16-bit LE mono PCM at 24 kHz
                                                as each sentence is synthesised
``{"type": "input.done"}``                      ``{"type": "audio.done", "segments": N}`` once
                                                everything sent before it has been spoken
``{"type": "session.close"}``                   ``{"type": "session.done"}``, then close (1000)

With ``return_timestamps: true`` in the config (models with ``Capability.WORD_TIMESTAMPS``; others
end the session with the 400 error of ``/v1/audio/speech``, close 1008), the binary frames of
each synthesised piece are followed by ``{"type": "audio.timestamps", "timestamps": [{"word",
"start_time", "end_time"}, ...]}``: the words that piece spoke, in seconds from the turn's
``audio.start`` (the turn's segments laid end to end). ``caption_format`` is not used here.

A model that takes text while it speaks (``Capability.STREAMING_TEXT_INPUT``, e.g. Qwen3-TTS,
whose talker reads the text as a second track) gets one engine request per turn instead: the
turn's first piece with something to speak starts it (``Request.text_input``), every later
``input.text`` goes into it as it arrives (``RequestStream.append_text``), and ``input.done`` ends
its text. Speech starts before the text is complete, the model waits (without computing) where
the text has not arrived, and the turn's audio is byte for byte what ``POST /v1/audio/speech``
gives for the turn's whole text with seed ``(S + t) mod 2**63`` for the t-th turn in the same
prompt layout (Qwen3-TTS: a turn uses the streaming-text layout unless the config sets
``non_streaming_mode``, a whole text its variant's default; ``non_streaming_mode: false`` in
the POST gives the turn's audio). ``audio.done`` then reports ``segments: 1``.

Otherwise text is buffered by ``SentenceBuffer``: a sentence is sent to the engine as soon as
the next one starts (or at ``input.done``), so speech begins at the first sentence boundary. Each
sentence is its own engine request (a *segment*) with seed ``(S + k) mod 2**63`` for the k-th
segment of the session (S: the config's seed, or drawn); its audio is byte for byte what ``POST
/v1/audio/speech`` with ``response_format: "pcm"`` returns for that sentence and seed. Segments
share the session's playback clock (``AsyncEngine.add_request``'s ``clock``): under EDF a later
sentence's deadline is when the audio already made for the session runs out, not a new
request's first-audio deadline, and it skips admission once the session plays; a session whose
audio ran out with nothing in flight starts a new clock. Up to
``WINDOW`` segments synthesise at once; audio is sent in input order. After ``audio.done`` more
text may follow (a new turn: ``audio.start`` ... ``audio.done`` again). ``session.close`` or a
disconnect aborts the segments in flight.

Errors are ``{"type": "error", "error": {"message", "type", "param", "code"}}`` (OpenAI's error
object). Those that end the session are followed by a close: 1003 for frames that are not JSON
objects (binary, malformed), 1008 for a bad or missing ``session.config``, a missing or wrong
API key (checked by ``ApiKeyAuth``), a browser ``Origin`` that CORS does not allow, a voice the
model does not know (at ``session.config``, with the error ``/v1/audio/speech`` gives) or other
input the model rejects (at the sentence that has it), 1011 when synthesis fails
or times out, 1013 when the server is full or shutting down. A bad ``input.text`` (not a
string, over 4096 characters, control characters) or an unknown event type only gets an error
event; the session goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections import deque
from dataclasses import dataclass
from urllib.parse import urlsplit

from fastapi import APIRouter, FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from pydantic import ValidationError
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketDisconnected

from omnistep.audio import OUTPUT_SAMPLE_RATE, make_encoder
from omnistep.core import Capability, InvalidRequestError, Modality, OmnistepError, WordTiming
from omnistep.core.request import MAX_SEED
from omnistep.engine import AsyncEngine, PlaybackClock, RequestStream
from omnistep.server.errors import ApiError, api_error, validation_message
from omnistep.server.models import require_capability
from omnistep.server.protocol import SpeechRequest, control_characters
from omnistep.server.speech_timestamps import check_word_timestamps, timestamps_json
from omnistep.server.voice_fields import request_voice
from omnistep.text import SentenceBuffer

log = logging.getLogger("omnistep.server")

router = APIRouter()

PATH = "/v1/audio/speech/stream"

WINDOW = 4
"""Segments of one session submitted to the engine at once (the one being sent included)."""
SEGMENT_MAX_CHARS = 300
"""A sentence longer than this is cut at clauses before its end arrives (as ``split_text``)."""
MAX_TEXT_CHARS = 4096
"""Longest ``input.text`` piece, and longest word (``/v1/audio/speech``'s input limit)."""
MAX_QUEUED_CHARS = 200_000
"""Text received but not yet submitted beyond which the session ends (a runaway client)."""

CLOSE_NORMAL = 1000
CLOSE_UNSUPPORTED_DATA = 1003
CLOSE_POLICY_VIOLATION = 1008
CLOSE_INTERNAL_ERROR = 1011
CLOSE_TRY_AGAIN_LATER = 1013


class SessionEnd(Exception):
    """Ends the session: ``error`` (if any) is sent as an error event, then close ``code``."""

    def __init__(self, code: int, error: ApiError | None = None):
        super().__init__(error.message if error else f"close {code}")
        self.code = code
        self.error = error


class _Gone(Exception):
    """The client disconnected."""


def _bad(code: int, message: str, param: str | None = None, error_code: str | None = None):
    return SessionEnd(code, ApiError(400, message, param=param, code=error_code))


def error_event(error: ApiError) -> dict:
    """The ``error`` event carrying OpenAI's error object."""
    return {"type": "error", "error": error.to_dict()}


def close_code(error: ApiError) -> int:
    """The close code for an engine error: 1013 when full or shutting down (429, 503), 1008
    for input the model rejects (4xx), 1011 for failures and timeouts."""
    if error.status in (429, 503):
        return CLOSE_TRY_AGAIN_LATER
    return CLOSE_POLICY_VIOLATION if error.status < 500 else CLOSE_INTERNAL_ERROR


def segment_seed(seed: int, index: int) -> int:
    """The seed of a session's ``index``-th segment: ``(seed + index) mod 2**63``."""
    return (seed + index) % (MAX_SEED + 1)


def parse_config(engine: AsyncEngine, message: dict) -> SpeechRequest:
    """The session's settings from a ``session.config`` message, validated like a
    ``/v1/audio/speech`` body (its ``input`` is a placeholder replaced per segment).

    Raises:
        SessionEnd: not a ``session.config``, an invalid field, a format other than ``pcm``,
            an unknown model or one that does not speak (close 1008).
    """
    if message.get("type") != "session.config":
        raise _bad(
            CLOSE_POLICY_VIOLATION,
            'The first message must be {"type": "session.config", "model": ...}.',
            param="type",
            error_code="session_not_configured",
        )
    fields = {k: v for k, v in message.items() if k not in ("type", "stream", "stream_format")}
    try:
        config = SpeechRequest.model_validate({"response_format": "pcm", **fields, "input": "x"})
    except ValidationError as exc:
        text, param = validation_message(RequestValidationError(exc.errors()), "application/json")
        raise _bad(CLOSE_POLICY_VIOLATION, text, param, "invalid_value") from None
    if config.response_format != "pcm":
        raise _bad(
            CLOSE_POLICY_VIOLATION,
            "The stream sends 16-bit PCM only: 'response_format' must be 'pcm'.",
            param="response_format",
            error_code="unsupported_format",
        )
    try:
        require_capability(engine, config.model, Capability.TEXT_TO_SPEECH)
        check_word_timestamps(engine, config)
    except OmnistepError as exc:
        raise SessionEnd(CLOSE_POLICY_VIOLATION, api_error(exc)) from None
    return config


async def resolve_config_voice(
    app: FastAPI, engine: AsyncEngine, config: SpeechRequest
) -> SpeechRequest:
    """``config`` with its voice resolved as ``/v1/audio/speech`` resolves it
    (``voice_fields.request_voice``: a saved voice's name becomes its spec, ``ref_audio`` +
    ``ref_text`` an inline clone, ``task_type`` is checked) and checked by the model's card, so
    every segment of the session speaks with it.

    Raises:
        SessionEnd: (close 1008) the voice is unknown to the model, or saved for other models
            only, or a bad reference clip; the error event is the one ``/v1/audio/speech``
            answers for those fields.
    """
    card = engine.resolve(config.model).card
    try:
        voice = await request_voice(app, card, config.voice_name(), config)
        if voice is not None:
            card.validate_voice(voice)
    except OmnistepError as exc:
        error = api_error(exc)
        raise SessionEnd(close_code(error), error) from None
    cleared = {"ref_audio": None, "ref_text": None, "task_type": None}  # resolved into voice
    return config.model_copy(update={"voice": voice, **cleared})


def allowed_origin(ws: WebSocket) -> bool:
    """Whether a browser may open this socket: browsers send ``Origin`` on WebSockets and apply
    no CORS, so a page from another site could otherwise use the server. No ``Origin`` (not a
    browser), the server's own origin, or an origin the CORS settings allow passes."""
    origin = ws.headers.get("origin")
    if origin is None or urlsplit(origin).netloc == ws.headers.get("host"):
        return True
    allowed: list[str] = []
    for middleware in getattr(ws.app, "user_middleware", ()):
        if middleware.cls is CORSMiddleware:
            allowed = list(middleware.kwargs.get("allow_origins", ()))
    return "*" in allowed or origin in allowed


async def receive_message(ws: WebSocket) -> dict:
    """The next client message as a JSON object with a string ``type``.

    Raises:
        _Gone: the client disconnected.
        SessionEnd: a binary frame, or text that is not such an object (close 1003).
    """
    message = await ws.receive()
    if message["type"] == "websocket.disconnect":
        raise _Gone
    text = message.get("text")
    if text is None:
        raise _bad(
            CLOSE_UNSUPPORTED_DATA,
            "Binary frames are not accepted: send JSON text frames.",
            error_code="unsupported_data",
        )
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise _bad(
            CLOSE_UNSUPPORTED_DATA,
            f"The message is not valid JSON: {exc}",
            error_code="invalid_json",
        ) from None
    if not isinstance(data, dict) or not isinstance(data.get("type"), str):
        raise _bad(
            CLOSE_UNSUPPORTED_DATA,
            "Each message must be a JSON object with a string 'type'.",
            param="type",
            error_code="invalid_message",
        )
    return data


@dataclass(eq=False)
class _Segment:
    """One sentence of the session, spoken by its own engine request."""

    index: int
    text: str
    stream: RequestStream | None = None


@dataclass(frozen=True, slots=True)
class _TurnEnd:
    """``input.done``: ``audio.done`` goes out once every segment before it is sent."""

    segments: int


class SpeechSession:
    """One configured connection: the reader turns messages into segments, the writer sends
    their audio in order; up to ``WINDOW`` segments run in the engine at once."""

    def __init__(self, ws: WebSocket, engine: AsyncEngine, config: SpeechRequest):
        self.ws = ws
        self.engine = engine
        self.config = config
        self.seed = config.seed if config.seed is not None else secrets.randbelow(MAX_SEED + 1)
        self.sample_rate = engine.resolve(config.model).card.sample_rate
        self.buffer = SentenceBuffer(SEGMENT_MAX_CHARS)
        self.next_index = 0
        self.turn_segments = 0
        self.turn_started = False
        self.items: asyncio.Queue[_Segment | _TurnEnd] = asyncio.Queue()
        self.unsubmitted: deque[_Segment] = deque()
        self.in_flight: deque[_Segment] = deque()
        self.clock: PlaybackClock | None = None  # the playback clock segments share
        card = engine.resolve(config.model).card
        self.text_input = Capability.STREAMING_TEXT_INPUT in card.capabilities
        self.turn: _Segment | None = None  # the running turn's request (text_input models)
        self.turn_chars = 0
        self.turn_dropped = False  # the running turn's request ended before its text
        self._send_lock = asyncio.Lock()  # reader (warnings) and writer both send
        self.timed = config.wants_timestamps()
        self.turn_samples = 0  # samples sent in the running turn (word times count from 0)

    async def run(self) -> None:
        """Serve the session until ``session.close`` (returns) or its end.

        Raises:
            SessionEnd: the session must end with an error; _Gone: the client left.
        """
        reader = asyncio.create_task(self._read())
        writer = asyncio.create_task(self._write())
        try:
            done, _ = await asyncio.wait({reader, writer}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (reader, writer):
                task.cancel()
            await asyncio.wait({reader, writer})
            self._abort()
        first = reader if reader in done else writer
        first.result()  # re-raises its SessionEnd or _Gone

    def _abort(self) -> None:
        for segment in self.in_flight:
            if segment.stream is not None:
                segment.stream.cancel()
        self.in_flight.clear()
        self.unsubmitted.clear()

    # ----------------------------------------------------------------- reader
    async def _read(self) -> None:
        while True:
            message = await receive_message(self.ws)
            kind = message["type"]
            if kind == "input.text":
                await self._on_text(message.get("text"))
            elif kind == "input.done":
                if self.text_input:
                    self._end_turn()
                else:
                    await self._queue(self.buffer.flush())
                self.items.put_nowait(_TurnEnd(self.turn_segments))
                self.turn_segments = 0
            elif kind == "session.close":
                return
            elif kind == "session.config":
                await self._warn(
                    "The session is already configured; open a new connection for other settings.",
                    param="type",
                    code="already_configured",
                )
            else:
                await self._warn(
                    f"Unknown message type '{kind[:100]}'; expected input.text, input.done or "
                    "session.close.",
                    param="type",
                    code="unknown_message_type",
                )

    async def _on_text(self, text: object) -> None:
        if not isinstance(text, str):
            await self._warn("'text' must be a string.", param="text", code="invalid_value")
            return
        if len(text) > MAX_TEXT_CHARS:
            await self._warn(
                f"'text' is over {MAX_TEXT_CHARS} characters; send it in smaller pieces.",
                param="text",
                code="invalid_value",
            )
            return
        bad = control_characters(text)
        if bad:
            await self._warn(
                f"'text' contains control characters {', '.join(bad[:5])}; it was dropped.",
                param="text",
                code="invalid_value",
            )
            return
        if self.text_input:
            warning = self._feed_turn(text)
            if warning is not None:
                await self._warn(warning, param="text", code="turn_ended")
            return
        await self._queue(self.buffer.feed(text))
        pending = self.buffer.pending.strip()
        if len(pending) > MAX_TEXT_CHARS and not any(c.isspace() for c in pending):
            await self._warn_too_long(self.buffer.clear())
        queued = len(self.buffer.pending) + sum(len(s.text) for s in self.unsubmitted)
        if queued > MAX_QUEUED_CHARS:
            raise _bad(
                CLOSE_POLICY_VIOLATION,
                f"Over {MAX_QUEUED_CHARS} characters of text wait to be spoken; send text "
                "no faster than it can be spoken.",
                param="text",
                error_code="too_much_text",
            )

    async def _queue(self, sentences: list[str]) -> None:
        """``_add`` the sentences, but those over ``MAX_TEXT_CHARS`` (a giant word): dropped."""
        for text in sentences:
            if len(text) > MAX_TEXT_CHARS:
                await self._warn_too_long(text)
        self._add([text for text in sentences if len(text) <= MAX_TEXT_CHARS])

    async def _warn_too_long(self, text: str) -> None:
        await self._warn(
            f"A word of over {MAX_TEXT_CHARS} characters was dropped ('{text[:20]}...').",
            param="text",
            code="invalid_value",
        )

    def _add(self, sentences: list[str]) -> None:
        """Queue the speakable ``sentences`` as segments and submit what the window allows."""
        for text in sentences:
            if not any(c.isalnum() for c in text):
                continue  # nothing to speak ("...", "*", an emoji)
            segment = _Segment(self.next_index, text)
            self.next_index += 1
            self.turn_segments += 1
            self.unsubmitted.append(segment)
            self.items.put_nowait(segment)
        self._submit_ready()

    def _feed_turn(self, text: str) -> str | None:
        """Send a piece into the turn's request; the first piece with something to speak
        starts it. Returns a warning to send when the piece was dropped, else None.

        Raises:
            SessionEnd: the engine refused the turn, or the turn's text is over
                ``MAX_QUEUED_CHARS`` (a runaway client).
        """
        self.turn_chars += len(text)
        if self.turn_chars > MAX_QUEUED_CHARS:
            raise _bad(
                CLOSE_POLICY_VIOLATION,
                f"Over {MAX_QUEUED_CHARS} characters of text in one turn; end the turn "
                "(input.done) before sending more.",
                param="text",
                error_code="too_much_text",
            )
        try:
            if self.turn is not None:
                try:
                    self.turn.stream.append_text(text)  # type: ignore[union-attr]
                except InvalidRequestError as exc:
                    if exc.code != "not_running":
                        raise
                    return self._turn_over()
                return None
            if not any(c.isalnum() for c in text):
                self.turn_chars = 0
                return None  # nothing to speak yet: leading space or punctuation
            segment = _Segment(self.next_index, text)
            body = self.config.model_copy(
                update={"input": text, "seed": segment_seed(self.seed, segment.index)}
            )
            request = body.to_request(body.model)
            request.text_input = True
            segment.stream = self.engine.add_request(request, clock=self._clock())
        except OmnistepError as exc:
            error = api_error(exc)
            raise SessionEnd(close_code(error), error) from None
        self.next_index += 1
        self.turn_segments += 1
        self.turn = segment
        self.clock = segment.stream.clock
        self.in_flight.append(segment)
        self.items.put_nowait(segment)
        return None

    def _turn_over(self) -> str | None:
        """The turn's request ended before its text did (``max_new_tokens`` reached, or it
        failed: the writer reports that): the text is dropped, with one warning per turn."""
        if self.turn_dropped:
            return None
        self.turn_dropped = True
        return (
            "The turn's speech already ended (max_new_tokens reached) before its text did; "
            "the rest of this turn's text is dropped until input.done."
        )

    def _end_turn(self) -> None:
        """``input.done`` in a text_input session: the turn's request gets no more text."""
        turn, self.turn, self.turn_chars, self.turn_dropped = self.turn, None, 0, False
        if turn is not None and turn.stream is not None and not turn.stream.finished:
            with contextlib.suppress(OmnistepError):  # it already ended (failed: the writer says)
                turn.stream.end_text()

    def _submit_ready(self) -> None:
        """Start segments in order while fewer than ``WINDOW`` are in flight.

        Raises:
            SessionEnd: the engine refused a segment (bad voice, full, shutting down).
        """
        while self.unsubmitted and len(self.in_flight) < WINDOW:
            segment = self.unsubmitted.popleft()
            body = self.config.model_copy(
                update={"input": segment.text, "seed": segment_seed(self.seed, segment.index)}
            )
            try:
                request = body.to_request(body.model)
                segment.stream = self.engine.add_request(request, clock=self._clock())
            except OmnistepError as exc:
                error = api_error(exc)
                raise SessionEnd(close_code(error), error) from None
            self.clock = segment.stream.clock
            self.in_flight.append(segment)

    def _clock(self) -> PlaybackClock | None:
        """The clock the next segment continues: the session's, so its deadline is when the
        audio already made for the session runs out; None (a new clock, as for a new request)
        when nothing is in flight and that audio has run out (the client waited for text)."""
        clock = self.clock
        if clock is not None and not self.in_flight and clock.deadline() <= time.monotonic():
            return None
        return clock

    async def _warn(self, message: str, param: str | None, code: str) -> None:
        await self._send_json(error_event(ApiError(400, message, param=param, code=code)))

    # ----------------------------------------------------------------- writer
    async def _write(self) -> None:
        while True:
            item = await self.items.get()
            await self._start_turn()
            if isinstance(item, _TurnEnd):
                await self._send_json({"type": "audio.done", "segments": item.segments})
                self.turn_started = False
                self.turn_samples = 0
                continue
            assert self.in_flight and self.in_flight[0] is item and item.stream is not None
            try:
                await self._send_segment(item.stream)
            except OmnistepError as exc:
                error = api_error(exc)
                raise SessionEnd(close_code(error), error) from None
            self.in_flight.popleft()
            if not self.text_input:
                self._submit_ready()

    async def _send_segment(self, stream: RequestStream) -> None:
        encoder = make_encoder("pcm", self.sample_rate)
        offset = self.turn_samples / self.sample_rate  # the segment's start in the turn, s
        async for chunk in stream:
            if chunk.modality is Modality.AUDIO and chunk.audio is not None:
                data = encoder.encode(chunk.audio)
                if data:
                    await self._send_bytes(data)
                self.turn_samples += chunk.audio.size
                if self.timed and chunk.words:
                    await self._send_timestamps(chunk.words, offset)
        tail = encoder.flush()
        if tail:
            await self._send_bytes(tail)

    async def _send_timestamps(self, words: tuple[WordTiming, ...], offset: float) -> None:
        """The ``audio.timestamps`` event of ``words`` (a segment's), shifted by ``offset``
        seconds into the turn."""
        shifted = [WordTiming(w.word, w.start + offset, w.end + offset) for w in words]
        await self._send_json({"type": "audio.timestamps", "timestamps": timestamps_json(shifted)})

    async def _start_turn(self) -> None:
        if not self.turn_started:
            self.turn_started = True
            await self._send_json(
                {
                    "type": "audio.start",
                    "sample_rate": OUTPUT_SAMPLE_RATE,
                    "format": "pcm_s16le",
                    "seed": self.seed,
                }
            )

    async def _send_json(self, event: dict) -> None:
        try:
            async with self._send_lock:
                await self.ws.send_text(json.dumps(event, separators=(",", ":")))
        except (WebSocketDisconnect, WebSocketDisconnected, OSError):
            raise _Gone from None

    async def _send_bytes(self, data: bytes) -> None:
        try:
            async with self._send_lock:
                await self.ws.send_bytes(data)
        except (WebSocketDisconnect, WebSocketDisconnected, OSError):
            raise _Gone from None


async def _close(ws: WebSocket, code: int, event: dict | None = None, reason: str = "") -> None:
    """Send ``event`` (if any) and close with ``code``; a client already gone is no error."""
    with contextlib.suppress(WebSocketDisconnect, WebSocketDisconnected, OSError, RuntimeError):
        if event is not None:
            await ws.send_text(json.dumps(event, separators=(",", ":")))
        await ws.close(code, reason[:120])


@router.websocket(PATH)
async def speech_stream(ws: WebSocket) -> None:
    """Stream speech for text that arrives in pieces; see the module docstring."""
    engine: AsyncEngine = ws.app.state.engine
    await ws.accept()
    try:
        drain = getattr(ws.app.state, "drain", None)
        if drain is not None and drain.draining:
            raise SessionEnd(
                CLOSE_TRY_AGAIN_LATER,
                ApiError(
                    503,
                    "The server is shutting down and accepts no new sessions.",
                    "server_error",
                    code="server_shutting_down",
                ),
            )
        if not allowed_origin(ws):
            raise _bad(
                CLOSE_POLICY_VIOLATION,
                f"Origin '{ws.headers.get('origin', '')[:200]}' is not allowed; start the server "
                "with --cors-origin for it.",
                error_code="origin_not_allowed",
            )
        config = parse_config(engine, await receive_message(ws))
        config = await resolve_config_voice(ws.app, engine, config)
        await SpeechSession(ws, engine, config).run()
    except SessionEnd as end:
        event = error_event(end.error) if end.error is not None else None
        reason = (end.error.code or "") if end.error is not None else ""
        await _close(ws, end.code, event, reason)
    except _Gone:
        log.debug("speech stream client disconnected")
    except Exception as exc:  # noqa: BLE001 - a bug: log it, tell the client, close
        await _close(ws, CLOSE_INTERNAL_ERROR, error_event(api_error(exc)), "internal_error")
    else:
        await _close(ws, CLOSE_NORMAL, {"type": "session.done"})
