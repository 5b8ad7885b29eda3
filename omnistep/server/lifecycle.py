"""Graceful shutdown: run uvicorn so that SIGTERM drains the server and exits with status 0.

On SIGTERM (or SIGINT) uvicorn stops listening, closes idle keep-alive connections, waits up
to ``timeout_graceful_shutdown`` seconds for the open ones to finish their responses, cancels
what is left, and runs the app's shutdown (which stops the engine). This module adds what
uvicorn leaves out: requests that still reach the app after the signal (on a connection that
was already open) get 503 with OpenAI's error JSON instead of starting new work, ``/health``
says ``draining`` with a 503 so load balancers stop routing here, and a SIGTERM-initiated
stop exits with status 0 instead of dying of the re-raised signal.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from types import FrameType

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from omnistep.server.errors import error_response, install_log_filter


class Drain:
    """Whether the server is shutting down; set once, by the signal handler."""

    def __init__(self) -> None:
        self.draining = False

    def start(self) -> None:
        """Stop admitting requests (idempotent)."""
        self.draining = True


class DrainGate:
    """Pure ASGI middleware: while draining, API requests get 503 with OpenAI's error JSON.

    Paths outside ``/v1/`` (health, docs) pass; ``/health`` reports the drain itself.
    """

    def __init__(self, app: ASGIApp, drain: Drain):
        self.app = app
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.drain.draining or not _is_api(scope["path"]):
            await self.app(scope, receive, send)
            return
        response = error_response(
            503,
            "The server is shutting down and accepts no new requests; retry on another instance.",
            type_="server_error",
            code="server_shutting_down",
            headers={"Connection": "close", "Retry-After": "1"},
        )
        await response(scope, receive, send)


def _is_api(path: str) -> bool:
    return path.startswith("/v1/")


class GracefulServer(uvicorn.Server):
    """A uvicorn server that starts ``drain`` on the first SIGTERM/SIGINT and exits cleanly.

    uvicorn re-raises a captured signal once it has shut down, so that the process dies of it;
    after a graceful SIGTERM stop this server returns normally instead (exit status 0). SIGINT
    keeps uvicorn's behaviour (a second Ctrl-C forces the exit).
    """

    def __init__(self, config: uvicorn.Config, drain: Drain):
        super().__init__(config)
        self.drain = drain

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """Signal handler: drain, then let uvicorn begin its graceful shutdown."""
        self.drain.start()
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn's signal capture, minus the re-raise of a SIGTERM after the shutdown."""
        with super().capture_signals():
            yield
            captured = getattr(self, "_captured_signals", None)
            if isinstance(captured, list):
                captured[:] = [s for s in captured if s != signal.SIGTERM]


def serve(app: ASGIApp, drain: Drain, *, shutdown_grace: float, **options: object) -> None:
    """Run ``app`` with uvicorn until SIGTERM/SIGINT; in-flight requests get ``shutdown_grace``
    seconds to finish. ``options`` are ``uvicorn.Config`` arguments (host, port, log_level)."""
    config = uvicorn.Config(app, timeout_graceful_shutdown=shutdown_grace, **options)
    install_log_filter()  # after Config, which sets up uvicorn's loggers
    GracefulServer(config, drain).run()
