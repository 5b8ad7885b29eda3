"""Start the real server (``omnistep serve``) in a subprocess on a free loopback port."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from omnistep.server.launcher import launch_server


@contextlib.contextmanager
def running_server(*args: str, timeout: float = 120.0) -> Iterator[str]:
    """Run ``omnistep serve ARGS`` on a free port; yields its base URL; stops it after."""
    with launch_server(*args, timeout=timeout) as server:
        yield server.url
