"""``WS /v1/realtime?model=M``: OpenAI's Realtime API (speech in, speech or text out) on a card
that hears (``Capability.AUDIO_INPUT``).

Events are those of the ``openai`` SDK's ``types/realtime`` (GA shapes). Client events:
``session.update`` (``instructions``, ``output_modalities`` ``["audio"]`` or ``["text"]``,
``audio.input.format`` / ``audio.output.format`` ``audio/pcm`` at 24 kHz only,
``audio.input.turn_detection`` ``server_vad`` or null, ``audio.output.voice``,
``max_output_tokens``; other fields are accepted and ignored), ``input_audio_buffer.append``
(base64 pcm16 mono 24 kHz) / ``commit`` / ``clear``, ``conversation.item.create`` (a message:
``input_text`` and ``input_audio`` parts for user and system, ``output_text`` for assistant),
``conversation.item.delete``, ``conversation.item.truncate``, ``response.create``,
``response.cancel``. Server events: ``session.created`` / ``updated``,
``input_audio_buffer.speech_started`` / ``speech_stopped`` / ``committed`` / ``cleared``,
``conversation.item.added`` / ``done`` / ``deleted`` / ``truncated``, ``response.created``,
``response.output_item.added`` / ``done``, ``response.content_part.added`` / ``done``,
``response.output_audio.delta`` / ``done``, ``response.output_audio_transcript.delta`` /
``done`` (audio output) or ``response.output_text.delta`` / ``done`` (text output),
``response.done`` (status, usage), ``error``.

The conversation is kept as chat history: each item becomes a ``ChatMessage`` (user audio as a
``MediaItem`` resampled with soxr from 24 kHz to the card's ``media_sample_rate``; assistant
turns as the text of what was said, and, for a finished answer, the token ids the model
generated, ``RequestStream.text_ids``, which the card's template puts back verbatim), and each
response is one engine request over the whole history (``instructions`` as a leading system
message; for an audio answer from a card with a ``speech_system_prompt``, that prompt leads,
verbatim, and ``instructions`` follow as a second system message), text out, plus audio when
asked (the card's audio resampled to 24 kHz pcm16). The history is bounded (``MAX_ITEMS``
items, ``MAX_HISTORY_AUDIO_SECONDS`` of user audio: the oldest items go first).

KV across turns: each request carries the session id as its ``Request.cache_salt``, so an AR
component with prefix caching (the Qwen2.5-Omni thinker) keeps the finished turn's full KV
blocks in its block manager's evictable cache and the next turn's prefill starts on the
longest equal prefix of its prompt (the history as the model saw and said it) and computes
only the new rows: the new user audio and the template around it. Nothing is pinned: cached
blocks count as free and are evicted, least recently freed first, when an admission needs
room, so a closed or dropped session leaves no live block (its cached ones age out), and a
history trimmed at the front simply misses the cache (its rows change from the start).
A truncated answer goes back as re-tokenized text (the cache hits up to it).

Turn detection ``server_vad`` (the default, ``realtime_vad.EnergyVad``): speech start sends
``speech_started``; silence after it sends ``speech_stopped``, commits the turn (from
``prefix_padding_ms`` before the speech to its end) as a user item and, with
``create_response``, answers it. Speech that starts while a response runs cancels it (with
``interrupt_response``; ``response.done`` status ``cancelled``, reason ``turn_detected``): the
assistant item keeps the audio sent so far and its text, and the client says how much it played
with ``conversation.item.truncate``, which cuts the item's transcript to the same fraction
(``truncate_transcript``): the next turns see only what the user heard. With
``turn_detection: null`` the client commits and asks for responses itself.

An event that is malformed, unknown or out of order (``response.create`` while a response runs,
a commit of an empty buffer, a truncate past the audio) gets an ``error`` event (OpenAI's error
object with the client's ``event_id``) and the session goes on. Closing the socket (or the
client vanishing) cancels the running response and frees the session's history and buffers.
Refused at connect (an ``error`` event, then close 1008): no or an unknown ``model``, a model
that does not hear, a disallowed browser ``Origin``; 1013 while the server drains.

The session's settings and items as data (and their JSON) are in ``realtime_protocol``, the
VAD in ``realtime_vad``. Imports numpy, FastAPI/starlette, pydantic, ``omnistep.core``,
``omnistep.audio``, ``omnistep.engine`` and the server's own modules.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
from dataclasses import dataclass

import numpy as np
from fastapi import APIRouter
from pydantic import ValidationError
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketDisconnected

from omnistep.audio import make_encoder
from omnistep.audio.resample import Resampler
from omnistep.core import (
    Capability,
    ChatMessage,
    InvalidRequestError,
    MediaItem,
    MediaKind,
    Modality,
    OmnistepError,
    Request,
    RequestAbortedError,
    SamplingParams,
)
from omnistep.core.request import check_text
from omnistep.engine import AsyncEngine, RequestStream
from omnistep.server.errors import ApiError, api_error
from omnistep.server.models import require_capability
from omnistep.server.realtime_protocol import (
    PCM_FORMAT,
    Item,
    SessionConfig,
    SessionFields,
    b64_audio,
    bad,
    given,
    new_id,
    truncate_transcript,
)
from omnistep.server.realtime_vad import (
    SAMPLE_RATE,
    EnergyVad,
    SpeechStarted,
    SpeechStopped,
)
from omnistep.server.speech_stream import allowed_origin
from omnistep.server.voices import saved_voice_spec

log = logging.getLogger("omnistep.server")
router = APIRouter()

PATH = "/v1/realtime"
MAX_ITEMS = 64
"""Conversation items kept; older ones are dropped (OpenAI's ``truncation: auto``)."""
MAX_HISTORY_AUDIO_SECONDS = 600.0
"""User audio kept in the history; older audio items are dropped first."""
MIN_COMMIT_MS = 100
"""A commit needs at least this much buffered audio (OpenAI's rule)."""
MAX_EVENT_CHARS = 16 << 20
"""Longest client event (a base64 append of ~5 minutes of 24 kHz audio)."""
CLOSE_POLICY_VIOLATION = 1008
CLOSE_TRY_AGAIN_LATER = 1013


@dataclass
class _Response:
    """A response in progress."""

    id: str
    item: Item
    modalities: tuple[str, ...]
    stream: RequestStream | None = None
    cancel_reason: str | None = None
    task: asyncio.Task | None = None

    def cancel(self, reason: str) -> None:
        if self.cancel_reason is None:
            self.cancel_reason = reason
        if self.stream is not None:
            self.stream.cancel()


class _Gone(Exception):
    """The client disconnected."""


# ----------------------------------------------------------------------------- session


class RealtimeSession:
    """One ``/v1/realtime`` connection (see the module docstring)."""

    def __init__(self, ws: WebSocket, engine: AsyncEngine, model_id: str, max_audio_s: float):
        self.ws = ws
        self.engine = engine
        self.model_id = model_id
        self.card = engine.resolve(model_id).card
        self.id = new_id("sess")
        self.config = SessionConfig(
            output_modalities=("audio",)
            if Capability.CHAT_AUDIO in self.card.capabilities
            else ("text",)
        )
        self.items: list[Item] = []
        self.max_buffer = int(max_audio_s * SAMPLE_RATE)
        self.buffer: list[np.ndarray] = []  # 24 kHz float32 chunks not yet committed
        self.buffer_start = 0  # session sample index of the buffer's first sample
        self.total = 0  # samples appended in the session
        self.vad = self._new_vad()
        self.speech_item: str | None = None  # the id the turn being spoken will get
        self.voice_spec: str | None = None  # the session's voice, a saved name resolved
        self.response: _Response | None = None
        self.last_task: asyncio.Task | None = None  # the newest response's task
        self.tasks: set[asyncio.Task] = set()  # every response task not yet finished
        self._send_lock = asyncio.Lock()

    # ----------------------------------------------------------------- plumbing
    async def send(self, kind: str, **fields: object) -> None:
        """Send one server event (with a fresh ``event_id``)."""
        event = {"type": kind, "event_id": new_id("event"), **fields}
        try:
            async with self._send_lock:
                await self.ws.send_text(json.dumps(event, separators=(",", ":")))
        except (WebSocketDisconnect, WebSocketDisconnected, OSError, RuntimeError):
            raise _Gone from None

    async def send_error(self, error: ApiError, event_id: object = None) -> None:
        body = error.to_dict()
        body["event_id"] = event_id if isinstance(event_id, str) else None
        await self.send("error", error=body)

    async def run(self) -> None:
        """Serve events until the client leaves; then free everything."""
        try:
            await self.send("session.created", session=self._session_json())
            while True:
                await self._one_event()
        except _Gone:
            pass
        finally:
            await self._close()

    async def _close(self) -> None:
        if self.response is not None:
            self.response.cancel("client_cancelled")
        tasks = set(self.tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
        self.items.clear()
        self.buffer.clear()
        self.response = None

    async def _one_event(self) -> None:
        message = await self.ws.receive()
        if message["type"] == "websocket.disconnect":
            raise _Gone
        event = self._parse(message)
        if isinstance(event, ApiError):
            await self.send_error(event)
            return
        handler = self.HANDLERS.get(event["type"])
        try:
            if handler is None:
                raise bad(
                    f"Unknown or unsupported event type '{event['type'][:80]}'",
                    "type",
                    "unknown_event_type",
                )
            await handler(self, event)
        except OmnistepError as exc:
            await self.send_error(api_error(exc), event.get("event_id"))

    @staticmethod
    def _parse(message: dict) -> dict | ApiError:
        text = message.get("text")
        if text is None:
            return ApiError(
                400, "Binary frames are not accepted: send JSON events.", code="invalid_event"
            )
        if len(text) > MAX_EVENT_CHARS:
            return ApiError(
                400, f"Events are limited to {MAX_EVENT_CHARS} characters.", code="event_too_large"
            )
        try:
            event = json.loads(text)
        except ValueError as exc:
            return ApiError(400, f"The event is not valid JSON: {exc}", code="invalid_json")
        if not isinstance(event, dict) or not isinstance(event.get("type"), str):
            return ApiError(
                400,
                "Each event must be a JSON object with a string 'type'.",
                param="type",
                code="invalid_event",
            )
        return event

    def _session_json(self) -> dict:
        return self.config.to_json(self.id, self.model_id, self.card.default_voice)

    def _new_vad(self) -> EnergyVad | None:
        """A VAD whose time line starts at the session's next sample."""
        vad = self.config.turn_detection
        return EnergyVad(vad, origin=self.total) if vad is not None else None

    # ----------------------------------------------------------------- session.update
    async def on_session_update(self, event: dict) -> None:
        raw = event.get("session")
        if not isinstance(raw, dict):
            raise bad("'session' must be an object", "session")
        try:
            fields = SessionFields.model_validate(raw)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first.get("loc", ()))
            raise bad(
                f"Invalid value for 'session.{where}': {first.get('msg')}", f"session.{where}"
            ) from None
        except ValueError as exc:
            raise bad(str(exc), "session") from None
        if fields.model is not None and self.engine.resolve(fields.model).card is not self.card:
            raise bad("The session's model cannot change; open a new session", "session.model")
        if (
            fields.output_modalities == ["audio"]
            and Capability.CHAT_AUDIO not in self.card.capabilities
        ):
            raise bad(
                f"Model '{self.model_id}' answers with text only: use output_modalities ['text']",
                "session.output_modalities",
                "unsupported_value",
            )
        voice = fields.audio.output.voice if fields.audio and fields.audio.output else None
        if voice is not None:
            try:
                spec = await saved_voice_spec(self.ws.app, self.card, voice)
                assert spec is not None
                self.card.validate_voice(spec)
                self.voice_spec = spec
            except InvalidRequestError as exc:
                raise bad(
                    str(exc), "session.audio.output.voice", exc.code or "invalid_value"
                ) from None
        before = self.config.turn_detection
        self.config.update(fields, lambda path: given(raw, path))
        if self.config.turn_detection != before:
            self.vad = self._new_vad()
            self.speech_item = None
        await self.send("session.updated", session=self._session_json())

    # ----------------------------------------------------------------- input audio buffer
    async def on_append(self, event: dict) -> None:
        audio = event.get("audio")
        if not isinstance(audio, str):
            raise bad("'audio' must be a base64 string of pcm16 24 kHz audio", "audio")
        samples = b64_audio(audio, "audio")
        held = sum(len(c) for c in self.buffer)
        if held + len(samples) > self.max_buffer:
            raise bad(
                f"The input audio buffer would hold over {self.max_buffer / SAMPLE_RATE:g} s "
                "(--max-audio-seconds); commit or clear it",
                "audio",
                "input_audio_buffer_full",
            )
        self.buffer.append(samples)
        self.total += len(samples)
        if self.vad is None:
            return
        for vad_event in self.vad.feed(samples):
            if isinstance(vad_event, SpeechStarted):
                await self._speech_started(vad_event)
            else:
                await self._speech_stopped(vad_event)
        if not self.vad.speaking:
            self._drop_old_silence()

    def _drop_old_silence(self) -> None:
        """Between turns keep only the last ``prefix_padding_ms`` (and the frame in progress)."""
        assert self.config.turn_detection is not None
        keep = (
            self.config.turn_detection.prefix_padding_ms * SAMPLE_RATE // 1000 + SAMPLE_RATE // 50
        )
        held = np.concatenate(self.buffer) if self.buffer else np.zeros(0, np.float32)
        if len(held) > keep:
            self.buffer = [held[len(held) - keep :]]
            self.buffer_start = self.total - keep

    async def _speech_started(self, started: SpeechStarted) -> None:
        self.speech_item = new_id("item")
        await self.send(
            "input_audio_buffer.speech_started",
            audio_start_ms=started.start_ms,
            item_id=self.speech_item,
        )
        vad = self.config.turn_detection
        if self.response is not None and vad is not None and vad.interrupt_response:
            self.response.cancel("turn_detected")

    async def _speech_stopped(self, stopped: SpeechStopped) -> None:
        item_id = self.speech_item or new_id("item")
        self.speech_item = None
        await self.send(
            "input_audio_buffer.speech_stopped", audio_end_ms=stopped.end_ms, item_id=item_id
        )
        vad = self.config.turn_detection
        assert vad is not None
        start = max(
            self.buffer_start, (stopped.start_ms - vad.prefix_padding_ms) * SAMPLE_RATE // 1000
        )
        end = stopped.end_ms * SAMPLE_RATE // 1000
        held = np.concatenate(self.buffer)
        turn = held[start - self.buffer_start : end - self.buffer_start]
        self.buffer = [held[end - self.buffer_start :]]
        self.buffer_start = end
        await self._commit(turn, item_id)
        if vad.create_response:
            await self._start_response(None, None)

    async def on_commit(self, event: dict) -> None:
        held = np.concatenate(self.buffer) if self.buffer else np.zeros(0, np.float32)
        if len(held) * 1000 < MIN_COMMIT_MS * SAMPLE_RATE:
            raise bad(
                f"The input audio buffer holds {len(held) * 1000 // SAMPLE_RATE} ms; at least "
                f"{MIN_COMMIT_MS} ms are needed to commit",
                None,
                "input_audio_buffer_commit_empty",
            )
        self._reset_buffer()
        await self._commit(held, self.speech_item or new_id("item"))
        self.speech_item = None

    async def on_clear(self, event: dict) -> None:
        self._reset_buffer()
        self.speech_item = None
        await self.send("input_audio_buffer.cleared")

    def _reset_buffer(self) -> None:
        self.buffer = []
        self.buffer_start = self.total
        if self.vad is not None:
            self.vad.reset()

    def _media(self, samples: np.ndarray, source: str) -> MediaItem:
        """24 kHz samples as a ``MediaItem`` at the card's media rate (soxr, VHQ)."""
        rate = self.card.media_sample_rate
        resampler = Resampler(SAMPLE_RATE, rate, quality="VHQ")
        data = np.concatenate([resampler.process(samples), resampler.flush()])
        return MediaItem.of(MediaKind.AUDIO, data, sample_rate=rate, source=source)

    async def _commit(self, samples: np.ndarray, item_id: str) -> None:
        previous = self.items[-1].id if self.items else None
        await self.send("input_audio_buffer.committed", item_id=item_id, previous_item_id=previous)
        media = await asyncio.to_thread(self._media, samples, item_id)  # soxr: off the loop
        await self._add_item(Item(item_id, "user", (media,)))

    # ----------------------------------------------------------------- conversation
    async def _add_item(self, item: Item) -> None:
        previous = self.items[-1].id if self.items else None
        self.items.append(item)
        self._bound_history()
        await self.send("conversation.item.added", item=item.to_json(), previous_item_id=previous)
        if item.status == "completed":
            await self.send(
                "conversation.item.done", item=item.to_json(), previous_item_id=previous
            )

    def _bound_history(self) -> None:
        """Drop the oldest items (never the running response's) past the bounds."""
        running = self.response.item if self.response is not None else None

        def over() -> bool:
            audio = sum(i.audio_seconds for i in self.items)
            return len(self.items) > MAX_ITEMS or audio > MAX_HISTORY_AUDIO_SECONDS

        while over() and self.items and self.items[0] is not running:
            self.items.pop(0)

    def _find(self, item_id: object, param: str = "item_id") -> Item:
        for item in self.items:
            if item.id == item_id:
                return item
        raise bad(f"No conversation item with id '{str(item_id)[:80]}'", param, "item_not_found")

    async def on_item_create(self, event: dict) -> None:
        raw = event.get("item")
        if not isinstance(raw, dict) or raw.get("type", "message") != "message":
            raise bad("'item' must be a message ({type: 'message', role, content})", "item")
        role = raw.get("role")
        if role not in ("user", "system", "assistant"):
            raise bad("'item.role' must be user, system or assistant", "item.role")
        content = raw.get("content")
        if not isinstance(content, list) or not content:
            raise bad("'item.content' must be a non-empty list of parts", "item.content")
        item_id = raw.get("id") or new_id("item")
        if not isinstance(item_id, str) or len(item_id) > 64:
            raise bad("'item.id' must be a string of at most 64 characters", "item.id")
        if any(i.id == item_id for i in self.items):
            raise bad(f"An item with id '{item_id}' exists already", "item.id", "duplicate_item_id")
        parts = [
            self._part(part, role, f"item.content[{k}]", item_id) for k, part in enumerate(content)
        ]
        if role == "assistant":
            item = Item(item_id, role, text="".join(parts))  # type: ignore[arg-type]
        else:
            item = Item(item_id, role, tuple(parts))
        await self._add_item(item)

    def _part(self, part: object, role: str, param: str, item_id: str) -> str | MediaItem:
        kind = part.get("type") if isinstance(part, dict) else None
        if role == "assistant":
            if kind not in ("output_text", "text"):
                raise bad(f"'{param}' of an assistant item must be output_text", param)
            key = "text"
        elif kind == "input_audio" and role == "user":
            audio = part.get("audio")  # type: ignore[union-attr]
            if not isinstance(audio, str):
                raise bad(f"'{param}.audio' must be base64 pcm16 24 kHz audio", f"{param}.audio")
            samples = b64_audio(audio, f"{param}.audio")
            if len(samples) > self.max_buffer:
                raise bad(f"'{param}.audio' is too long", f"{param}.audio", "audio_too_long")
            if len(samples) < MIN_COMMIT_MS * SAMPLE_RATE // 1000:  # as a commit: the
                # encoders take no clip of a few ms, and the item would fail every response
                raise bad(
                    f"'{param}.audio' holds {1000 * len(samples) / SAMPLE_RATE:.0f} ms; at "
                    f"least {MIN_COMMIT_MS} ms are needed",
                    f"{param}.audio",
                    "audio_too_short",
                )
            return self._media(samples, f"{item_id}.{param}")
        elif kind == "input_text":
            key = "text"
        else:
            raise bad(f"'{param}' must be input_text or (user) input_audio", param)
        text = part.get(key)  # type: ignore[union-attr]
        check_text(text, f"{param}.text")  # a string, valid Unicode
        return text  # type: ignore[return-value]

    async def on_item_delete(self, event: dict) -> None:
        item = self._find(event.get("item_id"))
        if self.response is not None and item is self.response.item:
            raise bad("The running response's item cannot be deleted", "item_id")
        self.items.remove(item)
        await self.send("conversation.item.deleted", item_id=item.id)

    async def on_item_truncate(self, event: dict) -> None:
        item = self._find(event.get("item_id"))
        end_ms, index = event.get("audio_end_ms"), event.get("content_index", 0)
        if item.role != "assistant" or not item.audio_output:
            raise bad("Only an assistant item with audio can be truncated", "item_id")
        running = self.response
        if running is not None and running.item is item and running.cancel_reason is None:
            raise bad("The item's response is still running: cancel it first", "item_id")
        if index != 0:
            raise bad("'content_index' must be 0 (an item holds one audio part)", "content_index")
        if not isinstance(end_ms, int) or isinstance(end_ms, bool) or end_ms < 0:
            raise bad("'audio_end_ms' must be an integer >= 0", "audio_end_ms")
        played = end_ms * SAMPLE_RATE // 1000
        if played > item.output_samples:
            raise bad(
                f"'audio_end_ms' {end_ms} is past the item's audio "
                f"({item.output_samples * 1000 // SAMPLE_RATE} ms)",
                "audio_end_ms",
            )
        item.text = truncate_transcript(item.text, played, item.output_samples)
        item.token_ids = None  # the history keeps the heard text, re-tokenized
        item.output_samples = item.played_samples = played
        await self.send(
            "conversation.item.truncated", item_id=item.id, content_index=0, audio_end_ms=end_ms
        )

    # ----------------------------------------------------------------- responses
    async def on_response_create(self, event: dict) -> None:
        params = event.get("response") or {}
        if not isinstance(params, dict):
            raise bad("'response' must be an object", "response")
        if self.response is not None and self.response.cancel_reason is None:
            raise bad(
                "The conversation already has an active response; cancel it or wait for "
                "response.done",
                None,
                "conversation_already_has_active_response",
            )
        modalities = params.get("output_modalities")
        if modalities is not None and modalities not in (["text"], ["audio"]):
            raise bad(
                "'response.output_modalities' must be ['text'] or ['audio']",
                "response.output_modalities",
            )
        instructions = params.get("instructions")
        if instructions is not None and not isinstance(instructions, str):
            raise bad("'response.instructions' must be a string", "response.instructions")
        await self._start_response(modalities, instructions)

    async def on_response_cancel(self, event: dict) -> None:
        response = self.response
        wanted = event.get("response_id")
        if (
            response is None
            or response.cancel_reason is not None
            or wanted not in (None, response.id)
        ):
            raise bad(
                "There is no active response to cancel", "response_id", "response_cancel_not_active"
            )
        response.cancel("client_cancelled")

    async def _start_response(self, modalities: list[str] | None, instructions: str | None) -> None:
        chosen = tuple(modalities or self.config.output_modalities)
        if "audio" in chosen and Capability.CHAT_AUDIO not in self.card.capabilities:
            raise bad(
                f"Model '{self.model_id}' answers with text only",
                "response.output_modalities",
                "unsupported_value",
            )
        item = Item(
            new_id("item"), "assistant", audio_output="audio" in chosen, status="in_progress"
        )
        response = _Response(new_id("resp"), item, chosen)
        previous, self.response = self.last_task, response
        task = asyncio.create_task(self._respond_quietly(response, previous, instructions))
        response.task = self.last_task = task
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def _request(self, response: _Response, instructions: str | None) -> Request:
        system = instructions if instructions is not None else self.config.instructions
        history = [m for i in self.items if i is not response.item for m in [i.chat_message()] if m]
        lead = [ChatMessage("system", system)] if system else []
        required = self.card.speech_system_prompt
        if response.item.audio_output and required and system != required:
            lead.insert(0, ChatMessage("system", required))
        messages = lead + history
        outputs = {Modality.TEXT} | ({Modality.AUDIO} if response.item.audio_output else set())
        return Request(
            model=self.model_id,
            messages=tuple(messages),
            voice=self.voice_spec if response.item.audio_output else None,
            sampling=SamplingParams(max_new_tokens=self.config.max_output_tokens),
            output_modalities=frozenset(outputs),
            cache_salt=self.id,  # the session's turns reuse its KV blocks, no one else's
        )

    async def _respond_quietly(
        self, response: _Response, previous: asyncio.Task | None, instructions: str | None
    ) -> None:
        """``_respond``, ending quietly when the client has gone (the session frees the rest)."""
        try:
            await self._respond(response, previous, instructions)
        except _Gone:
            if response.stream is not None:
                response.stream.cancel()
        except Exception:  # noqa: BLE001 - a bug: log it; the session goes on
            log.exception("realtime response %s failed", response.id)
            if response.stream is not None:
                response.stream.cancel()
            if self.response is response:
                self.response = None

    async def _respond(
        self, response: _Response, previous: asyncio.Task | None, instructions: str | None
    ) -> None:
        """Run one response: its events from ``response.created`` to ``response.done``."""
        if previous is not None:  # a cancelled response winds down first
            await asyncio.wait({previous})
        status, details, usage = "completed", None, None
        try:
            await self.send(
                "response.created", response=self._response_json(response, "in_progress")
            )
            await self._open_item(response)
            if response.cancel_reason is not None:
                raise RequestAbortedError("cancelled before it started")
            response.stream = self.engine.add_request(self._request(response, instructions))
            await self._stream(response)
            response.item.token_ids = response.stream.text_ids  # type: ignore[union-attr]
            usage = response.stream.usage  # type: ignore[union-attr]
            cap = self.config.max_output_tokens
            if cap is not None and usage["output_tokens"] >= cap:
                status, details = (
                    "incomplete",
                    {"type": "incomplete", "reason": "max_output_tokens"},
                )
        except RequestAbortedError:
            status = "cancelled"
            details = {"type": "cancelled", "reason": response.cancel_reason or "client_cancelled"}
        except OmnistepError as exc:
            error = api_error(exc)
            status, details = (
                "failed",
                {
                    "type": "failed",
                    "error": {"type": error.type, "code": error.code, "message": error.message},
                },
            )
        finally:
            if response.stream is not None:
                response.stream.cancel()
            if self.response is response:
                self.response = None
        if usage is None and response.stream is not None:
            usage = response.stream.usage
        response.item.status = "completed" if status == "completed" else "incomplete"
        await self._close_item(response)
        await self.send(
            "response.done", response=self._response_json(response, status, details, usage)
        )

    async def _open_item(self, response: _Response) -> None:
        item = response.item
        self.items.append(item)
        self._bound_history()
        previous = self.items[-2].id if len(self.items) > 1 else None
        ids = {"response_id": response.id, "output_index": 0}
        await self.send("response.output_item.added", item=item.to_json(), **ids)
        await self.send("conversation.item.added", item=item.to_json(), previous_item_id=previous)
        part = item.content_json()[0]
        await self.send(
            "response.content_part.added",
            item_id=item.id,
            content_index=0,
            part=self._part_json(part),
            **ids,
        )

    @staticmethod
    def _part_json(part: dict) -> dict:
        if part["type"] == "output_audio":
            return {"type": "audio", "transcript": part["transcript"]}
        return {"type": "text", "text": part["text"]}

    async def _stream(self, response: _Response) -> None:
        item, stream = response.item, response.stream
        assert stream is not None
        ids = {
            "response_id": response.id,
            "item_id": item.id,
            "output_index": 0,
            "content_index": 0,
        }
        text_event = (
            "response.output_audio_transcript.delta"
            if item.audio_output
            else "response.output_text.delta"
        )
        encoder = make_encoder("pcm", self.card.sample_rate) if item.audio_output else None
        async for chunk in stream:
            if chunk.modality is Modality.TEXT and chunk.text:
                item.text += chunk.text
                await self.send(text_event, delta=chunk.text, **ids)
            elif encoder is not None and chunk.audio is not None:
                await self._send_audio(item, encoder.encode(chunk.audio), ids)
        if encoder is not None:
            await self._send_audio(item, encoder.flush(), ids)

    async def _send_audio(self, item: Item, data: bytes, ids: dict) -> None:
        if data and item.played_samples is None:  # nothing after a truncation
            item.output_samples += len(data) // 2
            await self.send(
                "response.output_audio.delta", delta=base64.b64encode(data).decode(), **ids
            )

    async def _close_item(self, response: _Response) -> None:
        item = response.item
        ids = {
            "response_id": response.id,
            "item_id": item.id,
            "output_index": 0,
            "content_index": 0,
        }
        if item.audio_output:
            await self.send("response.output_audio.done", **ids)
            await self.send("response.output_audio_transcript.done", transcript=item.text, **ids)
        else:
            await self.send("response.output_text.done", text=item.text, **ids)
        part = self._part_json(item.content_json()[0])
        await self.send("response.content_part.done", part=part, **ids)
        await self.send(
            "response.output_item.done",
            item=item.to_json(),
            response_id=response.id,
            output_index=0,
        )
        index = next((k for k, i in enumerate(self.items) if i is item), None)
        previous = self.items[index - 1].id if index else None
        await self.send("conversation.item.done", item=item.to_json(), previous_item_id=previous)

    def _response_json(
        self,
        response: _Response,
        status: str,
        details: dict | None = None,
        usage: dict | None = None,
    ) -> dict:
        body: dict = {
            "object": "realtime.response",
            "id": response.id,
            "status": status,
            "status_details": details,
            "output": [response.item.to_json()] if status != "in_progress" else [],
            "conversation_id": self.id,
            "output_modalities": list(response.modalities),
            "max_output_tokens": self.config.max_output_tokens or "inf",
            "audio": {
                "output": {
                    "format": PCM_FORMAT,
                    "voice": self.config.voice or self.card.default_voice,
                }
            },
            "metadata": None,
            "usage": None,
        }
        if usage is not None:
            body["usage"] = {
                "total_tokens": usage["input_tokens"] + usage["output_tokens"],
                "input_tokens": usage["input_tokens"],
                "output_tokens": usage["output_tokens"],
                "input_token_details": {"cached_tokens": usage.get("cached_tokens", 0)},
            }
        return body

    HANDLERS = {
        "session.update": on_session_update,
        "input_audio_buffer.append": on_append,
        "input_audio_buffer.commit": on_commit,
        "input_audio_buffer.clear": on_clear,
        "conversation.item.create": on_item_create,
        "conversation.item.delete": on_item_delete,
        "conversation.item.truncate": on_item_truncate,
        "response.create": on_response_create,
        "response.cancel": on_response_cancel,
    }


# ----------------------------------------------------------------------------- the route


async def _refuse(ws: WebSocket, code: int, error: ApiError) -> None:
    with contextlib.suppress(WebSocketDisconnect, WebSocketDisconnected, OSError, RuntimeError):
        event = {
            "type": "error",
            "event_id": new_id("event"),
            "error": {**error.to_dict(), "event_id": None},
        }
        await ws.send_text(json.dumps(event))
        await ws.close(code, (error.code or "")[:120])


def _open_session(ws: WebSocket, model: str | None) -> str:
    """The card id a new session serves.

    Raises:
        OmnistepError: no model, an unknown one, or one that does not hear.
    """
    if not model:
        raise bad(
            "Name the model in the URL: /v1/realtime?model=...",
            "model",
            "missing_required_parameter",
        )
    engine: AsyncEngine = ws.app.state.engine
    require_capability(engine, model, Capability.AUDIO_INPUT)
    return engine.resolve(model).card.card_id


@router.websocket(PATH)
async def realtime(ws: WebSocket, model: str | None = None) -> None:
    """A Realtime API session (see the module docstring)."""
    await ws.accept()
    drain = getattr(ws.app.state, "drain", None)
    if drain is not None and drain.draining:
        error = ApiError(
            503,
            "The server is shutting down and accepts no new sessions.",
            "server_error",
            code="server_shutting_down",
        )
        await _refuse(ws, CLOSE_TRY_AGAIN_LATER, error)
        return
    if not allowed_origin(ws):
        origin = ws.headers.get("origin", "")[:200]
        error = ApiError(
            400,
            f"Origin '{origin}' is not allowed; start the server with --cors-origin for it.",
            code="origin_not_allowed",
        )
        await _refuse(ws, CLOSE_POLICY_VIOLATION, error)
        return
    try:
        card_id = _open_session(ws, model)
    except OmnistepError as exc:
        await _refuse(ws, CLOSE_POLICY_VIOLATION, api_error(exc))
        return
    limits = ws.app.state.media_limits
    session = RealtimeSession(ws, ws.app.state.engine, card_id, limits.max_audio_seconds)
    try:
        await session.run()
    except Exception:  # noqa: BLE001 - a bug: logged; the session is freed by run()
        log.exception("realtime session %s failed", session.id)
        with contextlib.suppress(WebSocketDisconnect, WebSocketDisconnected, OSError, RuntimeError):
            await ws.close(1011)
