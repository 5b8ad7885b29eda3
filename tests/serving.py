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


async def abort_all(engine, streams, after_s: float = 0.3) -> None:
    """Let ``streams`` (of ``engine``) run ``after_s`` seconds, abort them all, check each ends
    with ``RequestAbortedError``, then wait until no batch is still running (one running when
    they were aborted folds, then frees)."""
    import asyncio

    import pytest

    from omnistep.core import RequestAbortedError

    await asyncio.sleep(after_s)
    for stream in streams:
        stream.cancel()
    for stream in streams:
        with pytest.raises(RequestAbortedError):
            async for _ in stream:
                pass
    for _ in range(1200):  # up to 60 s: a big prefill batch on a loaded CI machine
        if not engine.stats()["running_batches"]:
            break
        await asyncio.sleep(0.05)
