"""The FastAPI application: routes, error handlers and the engine's lifetime."""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse

from omnistep import __version__
from omnistep.engine import AsyncEngine
from omnistep.server import (
    chat,
    media,
    metrics,
    models,
    playground,
    realtime,
    rollouts,
    score,
    speech,
    speech_stream,
    transcriptions,
    voice_fields,
    voices,
)
from omnistep.server.auth import ApiKeyAuth
from omnistep.server.errors import install_error_handlers
from omnistep.server.lifecycle import Drain, DrainGate
from omnistep.server.limits import BodySizeLimit


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Settings of the HTTP server.

    Attributes:
        host: interface to bind; loopback by default.
        port: TCP port.
        max_body_bytes: larger request bodies get 413 (OpenAI inputs are at most 4096 chars).
        max_weights_bytes: the limit for a weights file uploaded to ``POST /v1/weights``.
        max_voice_upload_bytes: the limit for ``POST /v1/audio/voices`` (a reference clip
            uploaded to clone a voice: a minute of 48 kHz 24-bit stereo WAV is 17 MB) and
            ``POST /v1/audio/transcriptions`` (OpenAI takes files up to 25 MB).
        max_speech_body_bytes: the limit for ``POST /v1/audio/speech`` and ``/v1/rollouts``,
            whose ``ref_audio`` may hold a clip in base64 (a minute of 48 kHz 16-bit stereo
            WAV, 11.5 MB, is 15.4 MB in base64).
        api_key: when set, every route but health, metrics and the docs needs
            ``Authorization: Bearer <api_key>`` (401 otherwise); None serves without a key.
            Left out of ``repr`` so that it is never logged.
        cors_origins: browser origins allowed by CORS (``"*"`` for any); empty turns CORS off.
        shutdown_grace: seconds in-flight requests get to finish after SIGTERM before they are
            cancelled (new requests are refused meanwhile).
        voices_db: the SQLite file of saved voices (``/v1/audio/voices``), created on the first
            save; None: ``voices.default_voices_db()`` (per user).
        allowed_local_media_path: a directory whose files a request's ``ref_audio`` may name
            (``--allowed-local-media-path``, vLLM's name); None: no file paths (400).
        allow_remote_media: a request's ``ref_audio`` may be an http(s) URL the server fetches
            (``--allow-remote-media``; at most ``max_voice_upload_bytes``, 15 s); False: 400.
            Both also govern chat media parts' URLs.
        media_limits: limits on chat media parts (``media.MediaLimits``: seconds of audio and
            video, video frames, image pixels, parts per request).
        max_chat_body_bytes: the limit for ``POST /v1/chat/completions``, whose media parts
            may hold files in base64.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    max_body_bytes: int = 1 << 20
    max_weights_bytes: int = 64 << 30
    max_voice_upload_bytes: int = 32 << 20
    max_speech_body_bytes: int = 16 << 20
    api_key: str | None = field(default=None, repr=False)
    cors_origins: tuple[str, ...] = ()
    shutdown_grace: float = 30.0
    voices_db: str | None = None
    allowed_local_media_path: str | None = None
    allow_remote_media: bool = False
    media_limits: media.MediaLimits = field(default_factory=media.MediaLimits)
    max_chat_body_bytes: int = 48 << 20

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        key = self.api_key
        if key is not None and not (key and key.isascii() and key.isprintable() and " " not in key):
            raise ValueError("api_key must be non-empty printable ASCII without spaces")
        if isinstance(self.cors_origins, str):
            raise TypeError("cors_origins must be a tuple of origins, not a string")
        if not 0 <= self.shutdown_grace < float("inf"):
            raise ValueError(f"shutdown_grace must be >= 0 seconds, got {self.shutdown_grace}")
        media = self.allowed_local_media_path
        if media is not None and not os.path.isdir(media):
            raise ValueError(f"allowed_local_media_path {media!r} is not a directory")

    def media_policy(self) -> voice_fields.MediaPolicy:
        """Where ``ref_audio`` may come from (``voice_fields.MediaPolicy``)."""
        media = self.allowed_local_media_path
        return voice_fields.MediaPolicy(
            allowed_local_media_path=None if media is None else Path(media),
            allow_remote_media=self.allow_remote_media,
            max_bytes=self.max_voice_upload_bytes,
        )


def build_app(
    engine: AsyncEngine, config: ServerConfig | None = None, drain: Drain | None = None
) -> FastAPI:
    """The app serving ``engine``'s models; the engine is shut down with the app.

    ``app.state.drain`` (``drain``, or a new ``Drain``) refuses new API requests with 503 once
    started; the server started by ``lifecycle.serve`` starts it on SIGTERM or SIGINT.
    """
    config = config or ServerConfig()
    drain = drain or Drain()
    drain.engine = engine

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await engine.shutdown()

    app = FastAPI(title="omnistep", version=__version__, lifespan=lifespan)
    app.state.engine = engine
    app.state.drain = drain
    app.state.started = int(time.time())
    app.state.metrics = metrics.metrics_registry(engine)  # this app's own registry
    # Each add_middleware wraps what is already there, so requests pass, outermost first:
    # CORS (answers preflights, and adds its headers to every answer, errors included), the API
    # key (before any body is read), the drain gate (503 while shutting down), the body size
    # limit (413), the error middleware, the routes.
    install_error_handlers(app)
    app.add_middleware(
        BodySizeLimit,
        max_bytes=config.max_body_bytes,
        path_limits={
            "/v1/weights": config.max_weights_bytes,
            "/v1/audio/voices": config.max_voice_upload_bytes,
            "/v1/audio/speech": config.max_speech_body_bytes,  # ref_audio in base64
            "/v1/rollouts": config.max_speech_body_bytes,
            "/v1/score": score.MAX_SCORE_BODY_BYTES,  # a rollout answer
            "/v1/chat/completions": config.max_chat_body_bytes,  # media parts in base64
            "/v1/audio/transcriptions": config.max_voice_upload_bytes,  # an audio file
        },
    )
    app.add_middleware(DrainGate, drain=drain)
    if config.api_key is not None:
        app.add_middleware(ApiKeyAuth, api_key=config.api_key)
    if config.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(config.cors_origins),
            allow_methods=["GET", "POST", "DELETE"],
            allow_headers=["*"],
            expose_headers=["x-request-id", "x-omnistep-seed", "Retry-After"],
        )
    app.include_router(models.router)
    app.include_router(speech.router)
    app.include_router(chat.router)
    app.include_router(playground.router)
    voices.install(app, config.voices_db)
    voice_fields.install(app, config.media_policy())
    app.state.media_limits = config.media_limits
    app.include_router(speech_stream.router)
    app.include_router(transcriptions.router)
    app.include_router(realtime.router)
    app.include_router(metrics.router)
    app.include_router(rollouts.router)
    app.include_router(score.router)

    @app.get("/health")
    async def health() -> JSONResponse:
        """Status (``ok``; ``draining`` with a 503 while shutting down; ``degraded`` with a
        503 while a component of a model has no live replica, each such one listed in
        ``degraded``), the models and the engine's live counts (``AsyncEngine.stats``);
        ``replicas`` lists the components run in Ray actors that miss a replica."""
        replicas = [h for h in engine.component_health() if h.state != "ok"]
        down = [h for h in replicas if not h.live]
        status = "draining" if drain.draining else "degraded" if down else "ok"
        body = {"status": status, "models": list(engine.models), **engine.stats()}
        if down:
            body["degraded"] = [
                {"model": h.model, "component": h.component, "state": h.state} for h in down
            ]
        if replicas:
            body["replicas"] = [
                {"model": h.model, "component": h.component, "live": h.live, "of": h.replicas}
                for h in replicas
            ]
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    return app
