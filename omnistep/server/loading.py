"""Serve while the models load: the server listens at once, ``/health`` answers 503
``{"status": "loading", ...}`` naming what loads, every other route 503 with ``Retry-After``;
once loaded, the real app takes over (``/health`` 200).

``LoadingApp`` is the ASGI app uvicorn runs: it starts the load on a background thread at the
lifespan startup (so that uvicorn listens right away), builds the real app on the event loop
when the engine is ready, runs that app's lifespan, and forwards every request to it from then
on. A failed load stops the server; ``error`` holds why.

A product-plane module: imports engine (types), the server's errors and lifecycle.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

from fastapi import FastAPI
from starlette.responses import JSONResponse
from starlette.types import Receive, Scope, Send

from omnistep.engine import AsyncEngine
from omnistep.server.errors import error_response
from omnistep.server.lifecycle import Drain

log = logging.getLogger("omnistep.server")

RETRY_AFTER_S = 5
"""``Retry-After`` (seconds) of the 503 a route answers while the models load."""


class LoadingApp:
    """An ASGI app that answers while ``load`` runs, then hands over to ``build(engine)``.

    Args:
        load: builds the engine (slow: reads weights); runs on a daemon thread and gets a
            callback taking each progress line (``launch.load_engine``'s ``progress``).
        build: the app serving the engine (``server.build_app``); runs on the event loop.
        drain: the server's drain; gets the engine once it is loaded.
        what: what loads, for ``/health`` until the first progress line (e.g. ``hibari``).
        on_ready: called on the event loop with the engine once the app serves it (the
            banner).

    When ``load`` or ``build`` raises, ``error`` holds the exception and the server stops
    (``Drain.stop``).
    """

    def __init__(
        self,
        load: Callable[[Callable[[str], None]], AsyncEngine],
        build: Callable[[AsyncEngine], FastAPI],
        drain: Drain,
        what: str,
        on_ready: Callable[[AsyncEngine], None] | None = None,
    ) -> None:
        self.load = load
        self.build = build
        self.drain = drain
        self.status = f"loading {what}"
        self.on_ready = on_ready
        self.app: FastAPI | None = None
        self.error: BaseException | None = None
        self.started = time.monotonic()
        self._lifespan: AbstractAsyncContextManager[Any] | None = None
        self._task: asyncio.Task | None = None
        self._thread: threading.Thread | None = None
        self._settled = False  # the load returned or raised (set by the loader thread)

    @property
    def loading(self) -> bool:
        """Whether the load thread still runs (neither done nor failed)."""
        return self._thread is not None and not self._settled

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._serve_lifespan(receive, send)
        elif self.app is not None:
            await self.app(scope, receive, send)
        elif scope["type"] == "http":
            await self._loading_response(scope)(scope, receive, send)
        else:  # a WebSocket: 1013, "try again later"
            await send({"type": "websocket.close", "code": 1013, "reason": "models loading"})

    def _loading_response(self, scope: Scope) -> JSONResponse:
        elapsed = round(time.monotonic() - self.started, 1)
        if scope["path"] == "/health":
            body = {"status": "loading", "loading": self.status, "elapsed_s": elapsed}
            return JSONResponse(body, status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})
        return error_response(
            503,
            f"The server is still {self.status} ({elapsed:g} s so far); retry shortly.",
            type_="server_error",
            code="model_loading",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )

    async def _serve_lifespan(self, receive: Receive, send: Send) -> None:
        """The lifespan protocol: startup starts the load; shutdown stops the real app."""
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self._task = asyncio.get_running_loop().create_task(self._load())
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self._shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _load(self) -> None:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[AsyncEngine] = loop.create_future()

        def progress(line: str) -> None:
            self.status = line  # read by /health; a str assignment is atomic

        def run() -> None:
            try:
                engine = self.load(progress)
            except BaseException as exc:  # noqa: BLE001 - handed to the event loop
                self._settled = True
                loop.call_soon_threadsafe(_settle, done, None, exc)
            else:
                self._settled = True
                loop.call_soon_threadsafe(_settle, done, engine, None)

        # A daemon thread, not the loop's executor: a Ctrl-C while loading must not wait for
        # the load to finish before the process exits.
        self._thread = threading.Thread(target=run, name="omnistep-loader", daemon=True)
        self._thread.start()
        try:
            # Not ``done.done()``: a shutdown cancels this task and so ``done``, while the
            # thread still runs; only the thread says when the load has ended.
            engine = await done
            app = self.build(engine)
            self._lifespan = app.router.lifespan_context(app)
            await self._lifespan.__aenter__()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - reported by the caller of serve
            self.error = exc
            self.drain.stop()
            return
        self.drain.engine = engine
        self.app = app
        log.info("ready after %.1f s", time.monotonic() - self.started)
        if self.on_ready is not None:
            self.on_ready(engine)

    async def _shutdown(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()  # the thread goes on; the process does not wait for it
        if self._lifespan is not None:
            lifespan, self._lifespan = self._lifespan, None
            await lifespan.__aexit__(None, None, None)


def _settle(
    future: asyncio.Future, result: AsyncEngine | None, error: BaseException | None
) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
