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
import errno
import signal
import socket
from collections.abc import Callable, Iterator
from types import FrameType

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from omnistep.core import OmnistepError
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

    def __init__(
        self,
        config: uvicorn.Config,
        drain: Drain,
        on_started: Callable[[], None] | None = None,
    ):
        super().__init__(config)
        self.drain = drain
        self.on_started = on_started

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's startup (the app's lifespan, then listening); then ``on_started``, once the
        server accepts connections."""
        await super().startup(sockets=sockets)
        if self.started and self.on_started is not None:
            self.on_started()

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
    config = uvicorn.Config(app, timeout_graceful_shutdown=shutdown_grace, **options)
    install_log_filter()  # after Config, which sets up uvicorn's loggers
    server = GracefulServer(config, drain, on_started)
    if sock is None:
        server.run()
        return
    listen(sock, config.backlog)
    server.run(sockets=[sock])
