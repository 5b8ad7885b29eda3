"""Word timestamps and captions of the speech endpoints.

A card with ``Capability.WORD_TIMESTAMPS`` (the duration-predicting voices: hibari, Kokoro,
Piper) times every word it speaks from the model's own predicted durations
(``StreamChunk.words``, seconds in the request's audio timeline). The server hands them out:

- ``POST /v1/audio/speech`` with ``return_timestamps: true`` (Kokoro-FastAPI's field): one JSON
  object ``{"audio": base64 of the whole file in response_format, "audio_format": its media
  type, "timestamps": [{"word", "start_time", "end_time"}, ...]}`` (Kokoro-FastAPI's
  ``CaptionedSpeechResponse``); with ``stream_format: "sse"`` each ``speech.audio.delta``
  carries the ``timestamps`` of the words synthesised since the previous one (with ``pcm``,
  the words its audio holds; other encoders may hold some audio back), and
  ``speech.audio.done`` any left.
- ``caption_format: "srt"`` or ``"vtt"`` adds ``"captions"``: SubRip or WebVTT text of the same
  words, in cues of up to ``CUE_MAX_WORDS`` words (written with pysubs2).
- ``POST /dev/captioned_speech`` (Kokoro-FastAPI's endpoint, ``return_timestamps`` true by
  default): with ``stream`` (the default) JSON lines, one ``CaptionedSpeechResponse`` per audio
  piece, its ``timestamps`` the words synthesised since the previous line; else one JSON
  object as above.

Times count from the first sample of the audio as synthesised: an encoder's own delay (priming
samples) is not added. A card without the capability
(the codec models: ChatTTS, Qwen3-TTS, Qwen2.5-Omni) answers 400 with
``param: "return_timestamps"``, ``code: "unsupported_parameter"``.
"""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import AsyncIterator, Sequence

import pysubs2
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response

from omnistep.audio import MEDIA_TYPES, StreamEncoder
from omnistep.core import Capability, InvalidRequestError, OmnistepError, WordTiming
from omnistep.engine import AsyncEngine, RequestStream
from omnistep.server.disconnect import abort_on_disconnect, log_client_gone
from omnistep.server.errors import api_error, from_exception
from omnistep.server.protocol import SpeechRequest

log = logging.getLogger("omnistep.server")

CUE_MAX_WORDS = 8
"""Words per caption cue at most."""
CUE_MAX_SECONDS = 4.0
"""A cue's longest span, seconds: a word that would make it longer starts the next cue."""
CUE_BREAK_SECONDS = 0.35
"""A silence at least this long between two words (a sentence end) starts a new cue."""


def check_word_timestamps(engine: AsyncEngine, body: SpeechRequest) -> None:
    """Refuse word times from a model that cannot give them.

    Raises:
        InvalidRequestError: (``param="return_timestamps"``, ``code="unsupported_parameter"``)
            ``body`` asks for them (``wants_timestamps``) and its model has no
            ``Capability.WORD_TIMESTAMPS``; the message names the served models that have it.
    """
    if not body.wants_timestamps():
        return
    model = engine.resolve(body.model)
    if Capability.WORD_TIMESTAMPS in model.card.capabilities:
        return
    able = [m.card.card_id for m in engine.models.values()
            if Capability.WORD_TIMESTAMPS in m.card.capabilities]  # fmt: skip
    hint = f"; models served here that do: {', '.join(able)}" if able else ""
    raise InvalidRequestError(
        f"Model '{body.model}' gives no word timestamps (it predicts no per-phoneme "
        f"durations: hibari, kokoro and piper voices do){hint}.",
        param="return_timestamps",
        code="unsupported_parameter",
    )


def timestamps_json(words: Sequence[WordTiming]) -> list[dict]:
    """Kokoro-FastAPI's ``WordTimestamp`` list: ``{"word", "start_time", "end_time"}``, seconds
    rounded to the millisecond."""
    return [
        {"word": w.word, "start_time": round(w.start, 3), "end_time": round(w.end, 3)}
        for w in words
    ]


def caption_cues(words: Sequence[WordTiming]) -> list[list[WordTiming]]:
    """``words`` grouped into caption cues, in order: a cue ends after ``CUE_MAX_WORDS`` words,
    before a word that would make it span over ``CUE_MAX_SECONDS``, and at a silence of
    ``CUE_BREAK_SECONDS`` or more."""
    cues: list[list[WordTiming]] = []
    for w in words:
        cue = cues[-1] if cues else None
        if (
            cue is None
            or len(cue) >= CUE_MAX_WORDS
            or w.end - cue[0].start > CUE_MAX_SECONDS
            or w.start - cue[-1].end >= CUE_BREAK_SECONDS
        ):
            cues.append([w])
        else:
            cue.append(w)
    return cues


def captions(words: Sequence[WordTiming], fmt: str) -> str:
    """SubRip (``fmt="srt"``) or WebVTT (``"vtt"``) captions of ``words`` (``caption_cues``),
    written by pysubs2 (millisecond times)."""
    subs = pysubs2.SSAFile()
    for cue in caption_cues(words):
        event = pysubs2.SSAEvent(start=round(cue[0].start * 1000), end=round(cue[-1].end * 1000))
        event.plaintext = " ".join(w.word for w in cue)
        subs.append(event)
    return subs.to_string(fmt)


def timed_body(
    audio: bytes, fmt: str, words: Sequence[WordTiming], caption_format: str | None
) -> dict:
    """The JSON answer with the whole audio: ``audio`` (base64), ``audio_format`` (the media
    type of ``fmt``), ``timestamps``, and ``captions`` with a ``caption_format``."""
    body = {
        "audio": base64.b64encode(audio).decode(),
        "audio_format": MEDIA_TYPES[fmt],
        "timestamps": timestamps_json(words),
    }
    if caption_format is not None:
        body["captions"] = captions(words, caption_format)
    return body


async def whole_timed_response(
    http: HttpRequest,
    body: SpeechRequest,
    stream: RequestStream,
    pieces: AsyncIterator[bytes],
    encoder: StreamEncoder,
    words: list[WordTiming],
    headers: dict[str, str],
) -> Response:
    """Collect the request's audio and words (``pieces`` fills ``words``) into ``timed_body``;
    errors become OpenAI error JSON."""
    try:
        async with abort_on_disconnect(http, stream):
            data = encoder.with_lengths(b"".join([p async for p in pieces]))
    except OmnistepError as exc:
        await pieces.aclose()  # type: ignore[attr-defined]
        return from_exception(exc)
    content = timed_body(data, body.response_format, words, body.caption_format)
    return JSONResponse(content, headers=headers)


async def json_lines(
    pieces: AsyncIterator[bytes], stream: RequestStream, words: list[WordTiming], fmt: str
) -> AsyncIterator[bytes]:
    """One JSON line per audio piece, ``{"audio", "audio_format", "timestamps"}``, the
    timestamps being the words synthesised since the last line (words synthesised after the
    last piece: a last line with empty ``audio``). A failure ends the lines with ``{"error": ...}``
    (OpenAI's error object)."""
    ended = False

    def line(audio: bytes) -> bytes:
        payload = {
            "audio": base64.b64encode(audio).decode(),
            "audio_format": MEDIA_TYPES[fmt],
            "timestamps": timestamps_json(words),
        }
        words.clear()
        return (json.dumps(payload, separators=(",", ":")) + "\n").encode()

    try:
        async for piece in pieces:
            yield line(piece)
        if words:
            yield line(b"")
        ended = True
    except Exception as exc:  # noqa: BLE001 - the status is sent: report it in the body
        ended = True
        yield (json.dumps({"error": api_error(exc).to_dict()}) + "\n").encode()
    finally:
        if not ended:
            log_client_gone(stream.request_id)
        stream.cancel()
