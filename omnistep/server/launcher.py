"""Start ``omnistep serve`` in a subprocess on a free loopback port (tests and benchmarks)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx


@dataclass(frozen=True, slots=True)
class LaunchedServer:
    """A running server: its base URL (``http://127.0.0.1:PORT``), process id and process
    (e.g. to signal it and wait for its exit status)."""

    url: str
    pid: int
    process: subprocess.Popen | None = field(default=None, repr=False, compare=False)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def launch_server(*args: str, timeout: float = 180.0) -> Iterator[LaunchedServer]:
    """Run ``omnistep serve ARGS`` on a free port until ``/health`` answers; stop it after.

    Raises:
        RuntimeError: the server exited before becoming healthy (its output is in the message).
        TimeoutError: not healthy within ``timeout`` seconds.
    """
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "omnistep.cli",
        "serve",
        "--port",
        str(port),
        "--log-level",
        "warning",
        *args,
    ]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited early:\n{proc.stdout.read()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"server did not become healthy in {timeout} s")
            time.sleep(0.2)
        yield LaunchedServer(url, proc.pid, proc)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
