"""Graceful shutdown: run uvicorn so that a signal drains the server before it stops.

On the first SIGTERM or SIGINT (Ctrl-C) the server keeps listening while it drains: requests
that arrive get 503 with OpenAI's error JSON instead of starting new work, ``/health`` says
``draining`` with a 503 so load balancers stop routing here, and the log says ``draining N
request(s) (up to G s; Ctrl-C again to quit)``. When the in-flight requests are done, or after
``shutdown_grace`` seconds, or at a second signal, the requests still running are aborted
(each ends with a clean error: OpenAI's error JSON, an SSE error event, or a closed raw stream)
and uvicorn stops: it stops listening, closes the connections, and runs the app's shutdown
(which stops the engine). No traceback is printed on the way: a task uvicorn still has to
cancel answers 503 (or closes its stream) instead of uvicorn's 500 and traceback. A third
Ctrl-C quits at once. A SIGTERM-initiated stop exits with status 0 instead of dying of the
re-raised signal; a SIGINT-initiated one with Ctrl-C's usual status (130).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import signal
import socket
import time
from collections.abc import Callable, Iterator
from types import FrameType
from typing import TYPE_CHECKING

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from omnistep.core import OmnistepError, RequestAbortedError
from omnistep.server.errors import StreamCut, error_response, install_log_filter

if TYPE_CHECKING:
    from omnistep.engine import AsyncEngine

log = logging.getLogger("omnistep.server")

CUT_GRACE_S = 2.0
"""Seconds the requests cut at the end of a drain get to send their error before uvicorn
cancels what is left."""
SHUTTING_DOWN = (
    "The server is shutting down and accepts no new requests; retry on another instance."
)


class Drain:
    """Whether the server is shutting down (set once, by the signal handler), and the engine
    whose requests it drains (None while the models load)."""

    def __init__(self, engine: AsyncEngine | None = None) -> None:
        self.draining = False
        self.engine = engine
        self.stopped = False

    def start(self) -> None:
        """Stop admitting requests (idempotent)."""
        self.draining = True

    def stop(self) -> None:
        """Stop the server at its next tick, without draining (a failed model load)."""
        self.stopped = True

    def pending(self) -> int:
        """Requests the engine still runs (0 without an engine)."""
        return 0 if self.engine is None else self.engine.stats()["live_requests"]

    def cut(self, reason: str) -> int:
        """Abort every request the engine runs with ``reason``; returns how many."""
        return 0 if self.engine is None else self.engine.abort_all(reason)


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
            SHUTTING_DOWN,
            type_="server_error",
            code="server_shutting_down",
            headers={"Connection": "close", "Retry-After": "1"},
        )
        await response(scope, receive, send)


def _is_api(path: str) -> bool:
    return path.startswith("/v1/")


class ShutdownCancels:
    """Pure ASGI middleware: a request task that uvicorn cancels at the end of a shutdown
    answers 503 with OpenAI's error JSON (or, once its response started, closes its stream
    as a ``StreamCut``, which is not logged) instead of uvicorn's 500 and a traceback of the
    ``CancelledError``. Other cancellations pass unchanged."""

    def __init__(self, app: ASGIApp, drain: Drain):
        self.app = app
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except asyncio.CancelledError:
            if not self.drain.draining:
                raise
            if started:
                raise StreamCut(scope.get("path", ""), _shutdown_error()) from None
            response = error_response(
                503,
                "The server shut down before this request finished; retry on another instance.",
                type_="server_error",
                code="server_shutting_down",
                headers={"Connection": "close", "Retry-After": "1"},
            )
            with contextlib.suppress(Exception):
                await response(scope, receive, send)


def _shutdown_error() -> OmnistepError:
    return RequestAbortedError("the server shut down")


class GracefulServer(uvicorn.Server):
    """A uvicorn server that drains on the first SIGTERM/SIGINT (see the module docstring).

    The signal handler only records the signal; ``on_tick`` (uvicorn's 0.1 s tick on the
    event loop) logs, aborts and starts uvicorn's shutdown, so nothing runs inside the
    handler that could deadlock. uvicorn re-raises a captured signal once it has shut down, so
    that the process dies of it; after a SIGTERM stop this server returns normally instead
    (exit status 0).
    """

    def __init__(
        self,
        config: uvicorn.Config,
        drain: Drain,
        on_started: Callable[[], None] | None = None,
    ):
        super().__init__(config)
        self.drain = drain
        self.on_started = on_started
        self.grace = config.timeout_graceful_shutdown or 0.0
        self._signals = 0
        self._deadline: float | None = None  # when the drain ends, once it began

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's startup (the app's lifespan, then listening); then ``on_started``, once the
        server accepts connections."""
        await super().startup(sockets=sockets)
        if self.started and self.on_started is not None:
            self.on_started()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """Signal handler: the first signal drains, the second cuts what runs and stops, a
        third quits at once (uvicorn's force exit)."""
        captured = getattr(self, "_captured_signals", None)
        if isinstance(captured, list):
            captured.append(sig)
        self._signals += 1
        self.drain.start()
        if self._signals >= 3:
            self.force_exit = True
            self.should_exit = True

    async def on_tick(self, counter: int) -> bool:
        """uvicorn's tick, plus the drain's progress once a signal came."""
        if self.drain.stopped:
            self.should_exit = True
        if self.drain.draining and not self.should_exit:
            self._drain_tick()
        return await super().on_tick(counter)

    def _drain_tick(self) -> None:
        now = time.monotonic()
        pending = self.drain.pending()
        if self._deadline is None:
            self._deadline = now + self.grace
            if pending:
                log.warning(
                    "draining %d request%s (up to %g s; Ctrl-C again to quit)",
                    pending,
                    "" if pending == 1 else "s",
                    self.grace,
                )
        if pending == 0:
            # what is left (a response's last bytes, an upload) gets the rest of the grace
            self.config.timeout_graceful_shutdown = max(self._deadline - now, CUT_GRACE_S)
            self.should_exit = True
        elif self._signals >= 2 or now >= self._deadline:
            why = "a second signal" if self._signals >= 2 else f"the {self.grace:g} s grace period"
            cut = self.drain.cut(f"The server is shutting down: the request was cut by {why}.")
            log.warning("cut %d unfinished request%s", cut, "" if cut == 1 else "s")
            self.config.timeout_graceful_shutdown = CUT_GRACE_S
            self.should_exit = True

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn's signal capture, minus the re-raise of a SIGTERM after the shutdown."""
        with super().capture_signals():
            yield
            captured = getattr(self, "_captured_signals", None)
            if isinstance(captured, list):
                captured[:] = [s for s in captured if s != signal.SIGTERM]


class QuietUvicornLifecycle(logging.Filter):
    """Drops uvicorn's start and stop lines ("Started server process", "Waiting for
    application startup." ...): omnistep logs what loads, when it serves (the banner) and what
    a signal does, and a failed start is one error line."""

    LINES = frozenset(
        {
            "Started server process [%d]",
            "Waiting for application startup.",
            "Application startup complete.",
            "Shutting down",
            "Waiting for application shutdown.",
            "Application shutdown complete.",
            "Finished server process [%d]",
        }
    )

    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg not in self.LINES


class QuietCancels(logging.Filter):
    """Drops uvicorn's traceback of a task it cancelled at shutdown (``CancelledError``): the
    shutdown is logged in one line already."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, asyncio.CancelledError)


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host``:``port`` (0: any free port), not yet listening.

    Binding first lets a server fail at once on a taken port, before it loads its models, and
    hold the port while it does (connections are refused until it listens).

    Raises:
        OmnistepError: one line saying why the address cannot be used (port in use, no such
            address on this machine, a privileged port, an unknown host name).
    """
    where = f"{host}:{port}"
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise OmnistepError(f"cannot serve on {where}: unknown host ({exc.strerror})") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise OmnistepError(f"cannot serve on {where}: {_bind_reason(exc)}") from None
    return sock


def _bind_reason(exc: OSError) -> str:
    if exc.errno == errno.EADDRINUSE:
        return "the port is in use (another server?); choose another with --port"
    if exc.errno == errno.EADDRNOTAVAIL:
        return "no such address on this machine; check --host"
    if exc.errno == errno.EACCES:
        return "permission denied (ports below 1024 need privileges); choose another --port"
    return exc.strerror or str(exc)


def listen(sock: socket.socket, backlog: int = 2048) -> None:
    """Start listening on ``sock`` (from ``bind_socket``); uvicorn's backlog by default.

    Raises:
        OmnistepError: the port was taken meanwhile (one line).
    """
    try:
        sock.listen(backlog)
    except OSError as exc:
        host, port = sock.getsockname()[:2]
        raise OmnistepError(f"cannot serve on {host}:{port}: {_bind_reason(exc)}") from None


def serve(
    app: ASGIApp,
    drain: Drain,
    *,
    shutdown_grace: float,
    sock: socket.socket | None = None,
    on_started: Callable[[], None] | None = None,
    **options: object,
) -> None:
    """Run ``app`` with uvicorn until SIGTERM/SIGINT; in-flight requests get ``shutdown_grace``
    seconds to finish. ``options`` are ``uvicorn.Config`` arguments (host, port, log_level).

    ``sock``: serve on this socket (from ``bind_socket``; it is made to listen here) instead of
    binding ``host``:``port``. ``on_started`` is called once the server accepts connections.

    Raises:
        OmnistepError: ``sock`` cannot listen (the port was taken meanwhile).
    """
    app = ShutdownCancels(app, drain)
    config = uvicorn.Config(app, timeout_graceful_shutdown=shutdown_grace, **options)
    install_log_filter()  # after Config, which sets up uvicorn's loggers
    error_log = logging.getLogger("uvicorn.error")
    for quiet in (QuietCancels, QuietUvicornLifecycle):
        if not any(isinstance(f, quiet) for f in error_log.filters):
            error_log.addFilter(quiet())
    server = GracefulServer(config, drain, on_started)
    if sock is None:
        server.run()
        return
    listen(sock, config.backlog)
    server.run(sockets=[sock])
