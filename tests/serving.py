"""Start the real server (``omnistep serve``) in a subprocess on a free loopback port."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def running_server(*args: str, timeout: float = 120.0) -> Iterator[str]:
    """Run ``omnistep serve ARGS`` on a free port; yields its base URL; stops it after."""
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
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited early:\n{proc.stdout.read()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError("server did not become healthy")
            time.sleep(0.2)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
