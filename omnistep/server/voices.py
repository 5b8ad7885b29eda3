"""Named voices per model, saved in SQLite: ``/v1/audio/voices`` and the lookup of a saved name.

A saved voice is a name for a voice spec that a card accepts today (a ChatTTS speaker string or
``seed:N``, a speaker name of a multi-speaker card), vetted with ``ModelCard.validate_voice``
when it is saved. Requests (``voice`` of ``/v1/audio/speech``, of ``/v1/rollouts`` and of the
WebSocket's ``session.config``, ``audio.voice`` of ``/v1/chat/completions``) may name it;
``saved_voice_spec`` (``resolve_voice`` for a whole request) swaps the name for its spec before
the request reaches the engine, so the engine and the cards never see saved names.

Routes: ``GET /v1/audio/voices[?model=M]`` (built-in voices of each served card, marked
``"builtin": true``, then saved ones), ``POST /v1/audio/voices`` (201), ``DELETE
/v1/audio/voices/{name}[?model=M]``. Names are 1-64 characters of ``[A-Za-z0-9_.-]``, unique
per model, and must not shadow a voice the card accepts by itself (409). Voices are stored
under the card id (an alias such as ``tts-1`` names its card), in the SQLite file
``--voices-db`` (default ``default_voices_db()``), created on the first save.

``POST /v1/audio/voices`` takes either

- JSON ``{"name", "model", "voice"}``: ``name`` for a spec the card accepts (at most
  ``MAX_SPEC_CHARS``); or
- multipart/form-data, OpenAI's custom-voice upload: ``name``, ``audio_sample`` (a file: wav,
  flac, mp3, ogg, webm, m4a...; decoded with ``omnistep.audio.decode``, channels averaged) and
  ``consent`` (OpenAI's consent recording id: accepted and ignored, this server keeps no
  consent records), plus ours: ``model`` (a card with ``Capability.VOICE_CLONING``, e.g. a
  Qwen3-TTS Base folder) and ``transcript`` (what the clip says; required). The engine makes
  the voice (``AsyncEngine.clone_voice``: seconds, off the event loop) and its spec is saved
  under the name. A listing shows such a voice as ``"type": "audio_sample"`` with its
  transcript instead of the spec (tens of kilobytes). Errors are 4xx JSON: an empty file
  (``empty_file``), not audio (``invalid_audio``), too short or too long (``audio_too_short``,
  ``audio_too_long``), no transcript, a model that cannot clone (``voice_cloning_unsupported``),
  a name taken (409).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from fastapi import APIRouter, FastAPI
from fastapi import Request as HttpRequest
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ConfigDict, ValidationError
from starlette.datastructures import UploadFile

from omnistep.audio.decode import AudioDecodeError, decode_audio
from omnistep.core import Capability, InvalidRequestError, ModelCard, Request
from omnistep.engine import AsyncEngine
from omnistep.server.errors import error_response
from omnistep.server.protocol import OpenAIBody, control_characters

log = logging.getLogger("omnistep.server")

router = APIRouter()

NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
"""What a saved voice's name must match as a whole."""
MAX_SPEC_CHARS = 16384
"""Longest voice spec saved from a JSON body (a ChatTTS speaker string of a 768-wide model is
~900 chars); specs the engine makes from an uploaded clip have no such limit (a Qwen3-TTS
clone is 15-33k characters)."""
MAX_DECODE_SECONDS = 120.0
"""Decoding an uploaded clip stops past this much audio (the card's own limit is lower: 60 s
for Qwen3-TTS); a longer clip is refused as too long."""
AUDIO_SAMPLE = "audio_sample"
"""``SavedVoice.kind`` of a voice made from an uploaded clip (``"spec"``: a JSON spec)."""

_SCHEMA = """
CREATE TABLE IF NOT EXISTS voices (
    model TEXT NOT NULL,
    name TEXT NOT NULL,
    voice TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    kind TEXT NOT NULL DEFAULT 'spec',
    transcript TEXT,
    PRIMARY KEY (model, name)
)
"""
_COLUMNS = (("kind", "TEXT NOT NULL DEFAULT 'spec'"), ("transcript", "TEXT"))
"""Columns added after the first release: files made before get them on first use."""


def default_voices_db() -> Path:
    """The per-user voices file: ``$XDG_DATA_HOME/omnistep/voices.db``, or
    ``~/.local/share/omnistep/voices.db`` when ``XDG_DATA_HOME`` is unset or not absolute
    (as the XDG base directory spec asks)."""
    base = os.environ.get("XDG_DATA_HOME", "")
    root = Path(base) if base and os.path.isabs(base) else Path.home() / ".local" / "share"
    return root / "omnistep" / "voices.db"


@dataclasses.dataclass(frozen=True, slots=True)
class SavedVoice:
    """A saved voice: ``name`` stands for ``voice`` (the spec) on the card ``model``;
    ``kind`` is ``"spec"`` (saved from JSON) or ``AUDIO_SAMPLE`` (made from an uploaded clip,
    whose ``transcript`` is kept)."""

    model: str
    name: str
    voice: str
    created_at: int
    kind: str = "spec"
    transcript: str | None = None

    def to_dict(self) -> dict:
        """The API object: ``{"object", "name", "model", "builtin": false, "voice",
        "created_at"}``; a voice made from a clip shows ``"type": "audio_sample"`` and its
        ``"transcript"`` instead of the (long) spec."""
        body = {
            "object": "audio.voice",
            "name": self.name,
            "model": self.model,
            "builtin": False,
        }
        if self.kind == AUDIO_SAMPLE:
            body.update(type=AUDIO_SAMPLE, transcript=self.transcript)
        else:
            body["voice"] = self.voice
        body["created_at"] = self.created_at
        return body


class VoiceExistsError(Exception):
    """``VoiceStore.add``: the model already has a voice of that name."""


class VoiceStore:
    """Saved voices in one SQLite file; safe to share between threads (each call opens its own
    connection, so concurrent writers, even other processes, queue on SQLite's file lock).

    The file and its folder are created on the first ``add``; until then reads find nothing and
    create nothing. Names and specs only ever travel as SQL parameters.
    """

    def __init__(self, path: str | os.PathLike[str], timeout: float = 10.0):
        self.path = Path(path)
        self.timeout = timeout
        self._mkdir_lock = threading.Lock()

    @contextlib.contextmanager
    def _connect(self, create: bool) -> Iterator[sqlite3.Connection | None]:
        """A connection in a transaction (committed on success), or None when the file does
        not exist and ``create`` is false."""
        if not create and not self.path.exists():
            yield None
            return
        if create:
            with self._mkdir_lock:
                self.path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(self.path, timeout=self.timeout)
        try:
            with conn:
                conn.execute(_SCHEMA)
                have = {row[1] for row in conn.execute("PRAGMA table_info(voices)")}
                for column, decl in _COLUMNS:  # constants
                    if column not in have:
                        conn.execute(f"ALTER TABLE voices ADD COLUMN {column} {decl}")
                yield conn
        finally:
            conn.close()

    def add(
        self,
        model: str,
        name: str,
        voice: str,
        kind: str = "spec",
        transcript: str | None = None,
    ) -> SavedVoice:
        """Save ``name`` for ``voice`` on ``model`` (``kind``, ``transcript``: see
        ``SavedVoice``). Raises VoiceExistsError if taken."""
        saved = SavedVoice(model, name, voice, int(time.time()), kind, transcript)
        with self._connect(create=True) as conn:
            assert conn is not None
            try:
                conn.execute(
                    "INSERT INTO voices (model, name, voice, created_at, kind, transcript) "
                    "VALUES (?, ?, ?, ?, ?, ?)",
                    (
                        saved.model,
                        saved.name,
                        saved.voice,
                        saved.created_at,
                        saved.kind,
                        saved.transcript,
                    ),
                )
            except sqlite3.IntegrityError:
                raise VoiceExistsError(f"{model}/{name}") from None
        return saved

    def get(self, model: str, name: str) -> SavedVoice | None:
        """The voice ``name`` of ``model``, or None."""
        found = self._select("WHERE model = ? AND name = ?", (model, name))
        return found[0] if found else None

    def find(self, name: str) -> list[SavedVoice]:
        """Every saved voice called ``name``, whatever its model, by model."""
        return self._select("WHERE name = ? ORDER BY model", (name,))

    def list(self, model: str | None = None) -> list[SavedVoice]:
        """Saved voices of ``model`` (all models when None), by model then name."""
        if model is None:
            return self._select("ORDER BY model, name", ())
        return self._select("WHERE model = ? ORDER BY name", (model,))

    def delete(self, model: str, name: str) -> bool:
        """Forget ``name`` of ``model``; False if there was no such voice."""
        with self._connect(create=False) as conn:
            if conn is None:
                return False
            cur = conn.execute("DELETE FROM voices WHERE model = ? AND name = ?", (model, name))
            return cur.rowcount > 0

    def _select(self, where: str, params: tuple) -> list[SavedVoice]:
        columns = "model, name, voice, created_at, kind, transcript"
        sql = f"SELECT {columns} FROM voices {where}"  # where: constants
        with self._connect(create=False) as conn:
            if conn is None:
                return []
            return [SavedVoice(*row) for row in conn.execute(sql, params)]


def _store(app: FastAPI) -> VoiceStore | None:
    return getattr(app.state, "voices", None)


def install(app: FastAPI, path: str | os.PathLike[str] | None = None) -> VoiceStore:
    """Serve ``/v1/audio/voices`` on ``app`` with voices saved in ``path`` (None:
    ``default_voices_db()``); the store is ``app.state.voices``."""
    store = VoiceStore(path if path is not None else default_voices_db())
    app.state.voices = store
    app.include_router(router)
    log.info("saved voices: %s", store.path)
    return store


async def resolve_voice(app: FastAPI, card: ModelCard, request: Request) -> Request:
    """``request`` with a saved voice's name replaced by its spec (``saved_voice_spec``).

    Raises:
        InvalidRequestError: (400, code ``unknown_voice``) the name is saved for other models
            only.
    """
    voice = await saved_voice_spec(app, card, request.voice)
    return request if voice == request.voice else dataclasses.replace(request, voice=voice)


async def saved_voice_spec(app: FastAPI, card: ModelCard, voice: str | None) -> str | None:
    """The spec saved as ``voice`` for ``card``; ``voice`` itself when it is None, a built-in
    name, or not a saved name (the card then judges it).

    Raises:
        InvalidRequestError: (400, code ``unknown_voice``) the name is saved for other models
            only.
    """
    store = _store(app)
    if store is None or voice is None or voice in card.voices or not NAME_RE.fullmatch(voice):
        return voice
    found = await run_in_threadpool(store.find, voice)
    for saved in found:
        if saved.model == card.card_id:
            return saved.voice
    if found:
        models = ", ".join(s.model for s in found)
        raise InvalidRequestError(
            f"unknown voice '{voice}' for model '{card.card_id}' (it is saved for {models}); "
            f"see GET /v1/audio/voices?model={card.card_id}",
            param="voice",
            code="unknown_voice",
        )
    return voice


def _shadows(card: ModelCard, name: str) -> bool:
    """True if the card accepts ``name`` as a voice by itself (a built-in name, or any other
    spec its validator takes), so that saving it would change what the name means."""
    if name in card.voices:
        return True
    try:
        card.validate_voice(name)
    except InvalidRequestError:
        return False
    return True


def _builtin(card: ModelCard) -> list[dict]:
    return [
        {"object": "audio.voice", "name": name, "model": card.card_id, "builtin": True}
        for name in card.voices
    ]


def _engine(http: HttpRequest) -> AsyncEngine:
    return http.app.state.engine


def _require_store(http: HttpRequest) -> VoiceStore:
    store = _store(http.app)
    if store is None:  # a router included without ``install``
        raise RuntimeError("voices router served without a VoiceStore (use voices.install)")
    return store


def _bad(message: str, param: str, code: str = "invalid_value") -> InvalidRequestError:
    return InvalidRequestError(message, param=param, code=code)


def _check_name(name: str | None) -> str:
    if name is None:
        raise _bad("'name' is required", "name", "missing_required_parameter")
    if not NAME_RE.fullmatch(name):
        raise _bad(
            f"invalid voice name {name[:80]!r}: use 1-64 characters of A-Z, a-z, 0-9, '_', "
            "'.', '-'",
            "name",
            "invalid_name",
        )
    return name


class VoiceCreate(OpenAIBody):
    """Body of ``POST /v1/audio/voices``: ``name`` for ``voice`` on ``model``.

    ``voice`` is what ``model`` accepts as a request's voice (checked by the card).
    """

    model_config = ConfigDict(extra="ignore")

    name: str | None = None
    model: str | None = None
    voice: str | None = None


@router.get("/v1/audio/voices")
def list_voices(http: HttpRequest, model: str | None = None) -> dict:
    """Voices of ``model`` (every served model when omitted): built-in ones, then saved ones
    by name. Saved voices of models not served now are left out.

    ``data`` holds the voice objects; ``voices`` the same names once each, as
    Kokoro-FastAPI's ``GET /v1/audio/voices`` answers (``[{"id", "name"}]``: Open WebUI reads
    ``voices[i]["id"]`` and otherwise falls back to OpenAI's six names)."""
    engine = _engine(http)
    cards = [engine.resolve(model).card] if model else [m.card for m in engine.models.values()]
    store = _require_store(http)
    data = []
    for card in cards:
        data += _builtin(card)
        data += [v.to_dict() for v in store.list(card.card_id)]
    names = dict.fromkeys(v["name"] for v in data)  # first-seen order, once each
    voices = [{"id": name, "name": name} for name in names]
    return {"object": "list", "data": data, "voices": voices}


_UPLOAD_FIELDS = {
    "name": {"type": "string", "description": "the voice's name"},
    "audio_sample": {"type": "string", "format": "binary", "description": "reference clip"},
    "model": {"type": "string", "description": "a voice-cloning model"},
    "transcript": {"type": "string", "description": "what the clip says"},
    "consent": {"type": "string", "description": "accepted and ignored"},
}
_CREATE_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {"schema": VoiceCreate.model_json_schema()},
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "properties": _UPLOAD_FIELDS,
                    "required": ["name", "audio_sample", "model", "transcript"],
                }
            },
        },
    }
}


def _media_type(http: HttpRequest) -> str:
    return http.headers.get("content-type", "").split(";", 1)[0].strip().lower()


@router.post("/v1/audio/voices", status_code=201, openapi_extra=_CREATE_BODY)
async def create_voice(http: HttpRequest) -> JSONResponse:
    """Save a voice: JSON ``{name, model, voice}`` names a spec; a multipart upload
    (``name``, ``audio_sample``, ``model``, ``transcript``, ``consent``) clones one from a clip
    (see the module docstring). 201 with the voice object; 400 bad input, 404 unknown model,
    409 a built-in name or a name already saved."""
    if _media_type(http) in ("multipart/form-data", "application/x-www-form-urlencoded"):
        return await _create_from_upload(http)
    try:
        body = VoiceCreate.model_validate_json(await http.body())
    except ValidationError as exc:
        errors = [{**e, "loc": ("body", *e.get("loc", ()))} for e in exc.errors()]
        raise RequestValidationError(errors) from None
    name = _check_name(body.name)
    if not body.model:
        raise _bad("'model' is required", "model", "missing_required_parameter")
    card = _engine(http).resolve(body.model).card
    if not body.voice:
        raise _bad("'voice' is required", "voice", "missing_required_parameter")
    if len(body.voice) > MAX_SPEC_CHARS:
        raise _bad(f"'voice' is longer than {MAX_SPEC_CHARS} characters", "voice")
    taken = await run_in_threadpool(_name_taken, http, card, name)
    if taken is not None:
        return taken
    await run_in_threadpool(card.validate_voice, body.voice)
    return await run_in_threadpool(_save, http, card, name, body.voice, "spec", None)


def _name_taken(http: HttpRequest, card: ModelCard, name: str) -> JSONResponse | None:
    """The 409 when ``name`` is built into the card or already saved for it, else None."""
    if _shadows(card, name):
        return error_response(
            409,
            f"'{name}' is a built-in voice of model '{card.card_id}'; choose another name",
            param="name",
            code="builtin_voice",
        )
    if _require_store(http).get(card.card_id, name) is not None:
        return _exists(card, name)
    return None


def _exists(card: ModelCard, name: str) -> JSONResponse:
    return error_response(
        409,
        f"model '{card.card_id}' already has a voice named '{name}'; delete it first",
        param="name",
        code="voice_exists",
    )


def _save(
    http: HttpRequest,
    card: ModelCard,
    name: str,
    voice: str,
    kind: str,
    transcript: str | None,
) -> JSONResponse:
    try:
        saved = _require_store(http).add(card.card_id, name, voice, kind, transcript)
    except VoiceExistsError:
        return _exists(card, name)
    return JSONResponse(saved.to_dict(), status_code=201)


def _text_field(form: object, field: str, required: bool = True) -> str | None:
    """A form field's text; None when absent and not ``required``."""
    value = form.get(field)  # type: ignore[attr-defined]
    if value is None or (isinstance(value, str) and not value.strip()):
        if required:
            raise _bad(f"'{field}' is required", field, "missing_required_parameter")
        return None
    if not isinstance(value, str):
        raise _bad(f"'{field}' must be a text field, not a file", field)
    return value


MAX_TRANSCRIPT_CHARS = 4096
"""Longest transcript of a voice sample (``/v1/audio/speech``'s input limit)."""


def _check_transcript(text: str | None) -> str:
    """The transcript, held to ``/v1/audio/speech``'s rules for ``input``: at most
    ``MAX_TRANSCRIPT_CHARS`` characters, no control characters but tab and newlines, and
    something speakable (a letter or a digit). Raises InvalidRequestError (param
    ``transcript``)."""
    assert text is not None  # _text_field(required=True)
    if len(text) > MAX_TRANSCRIPT_CHARS:
        raise _bad(f"'transcript' is over {MAX_TRANSCRIPT_CHARS} characters", "transcript")
    bad = control_characters(text)
    if bad:
        raise _bad(f"'transcript' contains control characters {', '.join(bad[:5])}", "transcript")
    if not any(c.isalnum() for c in text):
        raise _bad("'transcript' has nothing spoken in it (no letter or digit)", "transcript")
    return text


async def _create_from_upload(http: HttpRequest) -> JSONResponse:
    """The multipart form of ``POST /v1/audio/voices`` (see the module docstring)."""
    async with http.form(max_files=1, max_fields=16) as form:
        name = _check_name(_text_field(form, "name"))
        model_id = _text_field(form, "model")
        engine = _engine(http)
        card = engine.resolve(model_id or "").card
        if Capability.VOICE_CLONING not in card.capabilities:
            raise _bad(
                f"model '{card.card_id}' cannot clone a voice from an audio sample (a "
                "voice-cloning model can, e.g. a Qwen3-TTS Base folder); save one of its own "
                "voices with a JSON body {name, model, voice} instead",
                "model",
                "voice_cloning_unsupported",
            )
        upload = form.get(AUDIO_SAMPLE)
        if not isinstance(upload, UploadFile):
            what = "is required" if upload is None else "must be a file"
            raise _bad(f"'{AUDIO_SAMPLE}' {what}", AUDIO_SAMPLE, "missing_required_parameter")
        transcript = _check_transcript(_text_field(form, "transcript"))
        assert model_id is not None
        taken = await run_in_threadpool(_name_taken, http, card, name)
        if taken is not None:
            return taken
        data = await upload.read()
    if not data:
        raise _bad("the audio sample is an empty file", AUDIO_SAMPLE, "empty_file")
    try:
        decoded = await run_in_threadpool(decode_audio, data, MAX_DECODE_SECONDS)
    except AudioDecodeError as exc:
        raise _bad(f"the audio sample is not audio: {exc}", AUDIO_SAMPLE, "invalid_audio") from None
    if decoded.truncated:
        raise _bad(
            f"the audio sample lasts more than {MAX_DECODE_SECONDS:g} s",
            AUDIO_SAMPLE,
            "audio_too_long",
        )
    try:
        spec = await engine.clone_voice(
            card.card_id, decoded.samples, decoded.sample_rate, transcript
        )
    except InvalidRequestError as exc:
        if exc.param != "audio":
            raise
        raise InvalidRequestError(str(exc), param=AUDIO_SAMPLE, code=exc.code) from None
    log.info("saved cloned voice %s/%s (%.1f s clip)", card.card_id, name, decoded.seconds)
    return await run_in_threadpool(_save, http, card, name, spec, AUDIO_SAMPLE, transcript)


@router.delete("/v1/audio/voices/{name}")
async def delete_voice(name: str, http: HttpRequest, model: str | None = None) -> JSONResponse:
    """Forget the saved voice ``name`` of ``model``; ``model`` may be omitted when one served
    model has a voice of that name. 404 no such voice, 409 a built-in voice, 400 ambiguous.
    The card then frees what it kept for the voice (``AsyncEngine.forget_voice``: a Qwen3-TTS
    cloned voice's kept prompt prefix)."""
    store = _require_store(http)
    engine = _engine(http)
    outcome = await run_in_threadpool(_delete_saved, store, engine, name, model)
    if isinstance(outcome, JSONResponse):
        return outcome
    card_id, spec = outcome
    await engine.forget_voice(card_id, spec)
    body = {"object": "audio.voice.deleted", "name": name, "model": card_id, "deleted": True}
    return JSONResponse(body)


def _delete_saved(
    store: VoiceStore, engine: AsyncEngine, name: str, model: str | None
) -> JSONResponse | tuple[str, str]:
    """Delete the saved voice (``delete_voice``'s checks, on a worker thread: SQLite):
    ``(card id, spec)`` of the voice deleted, or the error response."""
    if model:
        card = engine.resolve(model).card
        candidates = [card.card_id]
        if name in card.voices:
            return error_response(
                409,
                f"'{name}' is a built-in voice of model '{card.card_id}'; it cannot be deleted",
                param="name",
                code="builtin_voice",
            )
    else:
        served = {m.card.card_id for m in engine.models.values()}
        candidates = [v.model for v in store.find(name) if v.model in served]
        if len(candidates) > 1:
            raise _bad(
                f"several models have a voice named '{name}' ({', '.join(candidates)}); "
                "say which with ?model=",
                "model",
                "ambiguous_voice",
            )
    saved = store.get(candidates[0], name) if candidates and NAME_RE.fullmatch(name) else None
    if saved is None or not store.delete(candidates[0], name):
        where = f" for model '{candidates[0]}'" if model else ""
        return error_response(
            404, f"no saved voice named {name[:80]!r}{where}", param="name", code="voice_not_found"
        )
    return candidates[0], saved.voice
