"""The voice a speech or rollout request asks for: ``request_voice`` serves both
``/v1/audio/speech`` and ``/v1/rollouts``.

It applies, in order: ``task_type`` (vllm-omni's ``CustomVoice`` / ``VoiceDesign`` / ``Base``)
checked against what the served card can do (``card_task_types``; a mismatch is a 400, code
``unsupported_task_type``); an inline clone, ``ref_audio`` + ``ref_text`` (the peers' clients,
vllm-omni and SGLang-Omni, clone a voice this way on every request); else the ``voice`` field,
a saved name swapped for its spec (``voices.saved_voice_spec``).

``ref_audio`` may be base64 of an audio file, a ``data:`` URL with base64, a file path (only
under the directory given by ``--allowed-local-media-path``; a relative path is taken under
it; ``file://`` URLs too) or an http(s) URL (only with ``--allow-remote-media``; fetched with
httpx, ``MediaPolicy.max_bytes`` and ``timeout_s`` bound it). Otherwise it is a 400 naming the
flag. The clip is decoded like an uploaded voice sample and enrolled by the card
(``AsyncEngine.clone_voice``); ``InlineVoiceCache`` keeps the spec by the clip's sha256 and
the transcript (and the model's weight version), so a repeated clip skips the encoders and its
spec, equal to the first, finds the voice's prompt rows the talker kept (the KV prefix saved
voices use).

When ``ref_audio`` is given, ``voice`` is ignored (vllm-omni's client always sends one).

Imports FastAPI, ``omnistep.core``, ``omnistep.audio``, ``omnistep.engine`` and the
server's ``voices``, ``protocol`` and ``media_fetch`` modules (where media may come from:
``media_fetch.MediaPolicy``, shared with the chat content parts).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict
from collections.abc import Awaitable, Callable

from fastapi import FastAPI
from fastapi.concurrency import run_in_threadpool

from omnistep.audio.decode import AudioDecodeError, decode_audio
from omnistep.core import Capability, InvalidRequestError, ModelCard
from omnistep.engine import AsyncEngine
from omnistep.server.media_fetch import MediaPolicy, read_media
from omnistep.server.protocol import ReferenceVoiceFields
from omnistep.server.voices import MAX_DECODE_SECONDS, saved_voice_spec

TASK_TYPES = ("CustomVoice", "VoiceDesign", "Base")
"""vllm-omni's task types, in its order."""
INLINE_CACHE_SIZE = 64
"""Inline clones ``InlineVoiceCache`` keeps (a spec is 9-33k characters)."""


def _bad(message: str, param: str, code: str = "invalid_value") -> InvalidRequestError:
    return InvalidRequestError(message, param=param, code=code)


# ----------------------------------------------------------------------------- task_type


def card_task_types(card: ModelCard) -> list[str]:
    """The task types ``card`` serves: ``Base`` if it clones (``Capability.VOICE_CLONING``),
    ``VoiceDesign`` if instructions describe its voice (``Capability.VOICE_DESIGN``),
    ``CustomVoice`` if it has named voices."""
    caps = card.capabilities
    fits = {
        "CustomVoice": bool(card.voices),
        "VoiceDesign": Capability.VOICE_DESIGN in caps,
        "Base": Capability.VOICE_CLONING in caps,
    }
    return [task for task in TASK_TYPES if fits[task]]


def check_task_type(card: ModelCard, task_type: str) -> None:
    """Raise InvalidRequestError (param ``task_type``, code ``unsupported_task_type``) unless
    ``card`` serves ``task_type`` (``card_task_types``)."""
    fits = card_task_types(card)
    if task_type not in fits:
        serves = f"task_type {' or '.join(fits)}" if fits else "none of the task types"
        raise _bad(
            f"task_type '{task_type}' does not fit model '{card.card_id}': it serves {serves}",
            "task_type",
            "unsupported_task_type",
        )


# ----------------------------------------------------------------------------- the clip


async def read_ref_audio(ref: str, policy: MediaPolicy) -> bytes:
    """The bytes of the audio file ``ref`` gives: base64, a data URL, a path or an http(s) URL
    (``media_fetch.read_media``, param ``ref_audio``).

    Raises:
        InvalidRequestError: param ``ref_audio``: bad base64 (``invalid_base64``), a path or
            URL the policy refuses (``local_media_disabled``, ``local_media_forbidden``,
            ``remote_media_disabled``), a missing file (``file_not_found``), too many bytes
            (``audio_too_large``), a failed fetch (``fetch_failed``).
    """
    return await read_media(ref, policy, "ref_audio", bare_base64=True, too_large="audio_too_large")


# ----------------------------------------------------------------------------- the cache


class InlineVoiceCache:
    """Specs of inline clones, by (card id, weight version, clip sha256, transcript); least
    recently used dropped past ``size``. Requests with a clip being enrolled wait for that
    enrollment instead of starting their own.

    Attributes:
        num_enrolled: enrollments that made a spec (failed ones are not kept or counted).
        num_reused: requests answered from the cache or from a running enrollment.
    """

    def __init__(self, size: int = INLINE_CACHE_SIZE):
        self.size = size
        self.num_enrolled = 0
        self.num_reused = 0
        self._specs: OrderedDict[tuple, str] = OrderedDict()
        self._pending: dict[tuple, asyncio.Future[str]] = {}

    def __len__(self) -> int:
        return len(self._specs)

    async def get(self, key: tuple, make: Callable[[], Awaitable[str]]) -> str:
        """The spec kept for ``key``, else ``make()``'s (kept when it succeeds; an error is
        raised to every request waiting for it and nothing is kept)."""
        if key in self._specs:
            self._specs.move_to_end(key)
            self.num_reused += 1
            return self._specs[key]
        task = self._pending.get(key)
        if task is None:
            task = asyncio.ensure_future(self._make(key, make))
            self._pending[key] = task
        else:
            self.num_reused += 1
        return await asyncio.shield(task)  # one client leaving does not cancel the others'

    async def _make(self, key: tuple, make: Callable[[], Awaitable[str]]) -> str:
        try:
            spec = await make()
            self.num_enrolled += 1
            self._specs[key] = spec
            while len(self._specs) > self.size:
                self._specs.popitem(last=False)
            return spec
        finally:
            self._pending.pop(key, None)


def install(app: FastAPI, policy: MediaPolicy | None = None) -> InlineVoiceCache:
    """Keep ``policy`` and a fresh ``InlineVoiceCache`` on ``app.state`` (``media_policy``,
    ``inline_voices``)."""
    app.state.media_policy = policy or MediaPolicy()
    app.state.inline_voices = InlineVoiceCache()
    return app.state.inline_voices


async def _enroll(engine: AsyncEngine, card: ModelCard, data: bytes, transcript: str) -> str:
    """Decode the clip and make the card's voice of it; card errors name the peers' fields."""
    try:
        decoded = await run_in_threadpool(decode_audio, data, MAX_DECODE_SECONDS)
    except AudioDecodeError as exc:
        raise _bad(f"ref_audio is not audio: {exc}", "ref_audio", "invalid_audio") from None
    if decoded.truncated:
        raise _bad(
            f"ref_audio lasts more than {MAX_DECODE_SECONDS:g} s", "ref_audio", "audio_too_long"
        )
    try:
        return await engine.clone_voice(
            card.card_id, decoded.samples, decoded.sample_rate, transcript
        )
    except InvalidRequestError as exc:
        param = {"audio": "ref_audio", "transcript": "ref_text"}.get(exc.param or "", exc.param)
        raise InvalidRequestError(str(exc), param=param, code=exc.code) from None


async def inline_voice(app: FastAPI, card: ModelCard, ref_audio: str, ref_text: str | None) -> str:
    """The spec of the voice cloned from ``ref_audio`` (``read_ref_audio``) and ``ref_text``,
    through the app's ``InlineVoiceCache``.

    Raises:
        InvalidRequestError: the card cannot clone (param ``ref_audio``, code
            ``voice_cloning_unsupported``), no ``ref_text`` (``missing_required_parameter``),
            a clip refused by ``read_ref_audio``, not audio (``invalid_audio``), or one the
            card rejects (too short or long: ``audio_too_short``, ``audio_too_long``).
    """
    if Capability.VOICE_CLONING not in card.capabilities:
        raise _bad(
            f"model '{card.card_id}' cannot clone a voice from ref_audio (a voice-cloning model "
            "can, e.g. a Qwen3-TTS Base folder)",
            "ref_audio",
            "voice_cloning_unsupported",
        )
    if ref_text is None or not ref_text.strip():
        raise _bad(
            "ref_text (what ref_audio says) is required to clone a voice from ref_audio",
            "ref_text",
            "missing_required_parameter",
        )
    engine: AsyncEngine = app.state.engine
    data = await read_ref_audio(ref_audio, app.state.media_policy)
    if not data:
        raise _bad("ref_audio is empty", "ref_audio", "empty_file")
    cache: InlineVoiceCache = app.state.inline_voices
    version = engine.weight_versions.get(card.card_id, 0)  # new encoder weights: a new spec
    key = (card.card_id, version, hashlib.sha256(data).hexdigest(), ref_text)
    return await cache.get(key, lambda: _enroll(engine, card, data, ref_text))


# ----------------------------------------------------------------------------- the voice


def _task_type(fields: ReferenceVoiceFields) -> str | None:
    """The request's task type: as given, or ``Base`` when it sends a reference (vllm-omni)."""
    if fields.task_type is None and (fields.ref_audio is not None or fields.ref_text is not None):
        return "Base"
    return fields.task_type


async def request_voice(
    app: FastAPI, card: ModelCard, voice: str | None, fields: ReferenceVoiceFields
) -> str | None:
    """The voice spec a speech or rollout request runs with on ``card``: an inline clone of
    ``fields.ref_audio``, else ``voice`` with a saved name replaced by its spec (None: the
    card's default). A given ``fields.task_type`` is checked first (one inferred from
    ``ref_audio`` is not: a card that cannot clone says so).

    Raises:
        InvalidRequestError: a ``task_type`` the card does not serve; ``ref_audio`` or
            ``ref_text`` with a task type other than ``Base``; ``ref_text`` without
            ``ref_audio``; ``x_vector_only_mode`` true; what ``inline_voice`` and
            ``saved_voice_spec`` raise.
    """
    if fields.task_type is not None:
        check_task_type(card, fields.task_type)
    task = _task_type(fields)
    if fields.x_vector_only_mode:
        raise _bad(
            "x_vector_only_mode is not supported: cloning conditions on ref_text and the "
            "clip's codes (in-context mode)",
            "x_vector_only_mode",
            "unsupported_value",
        )
    for name in ("ref_audio", "ref_text"):
        if task != "Base" and getattr(fields, name) is not None:
            raise _bad(f"'{name}' goes with task_type 'Base' (voice cloning), not '{task}'", name)
    if fields.ref_audio is not None:
        return await inline_voice(app, card, fields.ref_audio, fields.ref_text)
    if fields.ref_text is not None:
        raise _bad(
            "'ref_text' needs 'ref_audio' (the clip it transcribes)",
            "ref_audio",
            "missing_required_parameter",
        )
    return await saved_voice_spec(app, card, voice)
