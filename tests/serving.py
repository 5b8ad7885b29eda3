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


def record_requests(engine) -> list:
    """Wrap ``engine.add_request`` so every ``Request`` it is given is appended to the
    returned list (in order), then passed on unchanged."""
    sent: list = []
    add_request = engine.add_request

    def recording(req, *args, **kwargs):
        sent.append(req)
        return add_request(req, *args, **kwargs)

    engine.add_request = recording
    return sent


@contextlib.asynccontextmanager
async def served_in_process(engine, voices_db: str):
    """The server app of ``engine`` under uvicorn in this event loop, on a free loopback port:
    yields an ``openai.AsyncOpenAI`` client of it (the SDK's realtime socket needs a real
    server, not a test transport); stops the server on exit (the engine stays the caller's)."""
    import asyncio

    import openai
    import uvicorn

    from omnistep.server import ServerConfig, build_app
    from omnistep.server.launcher import free_port

    app = build_app(engine, ServerConfig(voices_db=voices_db))
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    uv = uvicorn.Server(config)
    serving = asyncio.ensure_future(uv.serve())
    while not uv.started:
        if serving.done():  # it failed to start: raise its error
            await serving
        await asyncio.sleep(0.02)
    try:
        yield openai.AsyncOpenAI(api_key="x", base_url=f"http://127.0.0.1:{port}/v1")
    finally:
        uv.should_exit = True
        await serving


async def realtime_response(conn, pcm: str, timeout_s: float = 300) -> list:
    """On a connected ``/v1/realtime`` session ``conn`` (the openai SDK's): append ``pcm``
    (base64 pcm16 at 24 kHz) to the input buffer, commit it, ask for a response and read
    events until ``response.done`` or ``error`` (the last one returned).

    Returns:
        Every event received after ``response.create``, in order.

    Raises:
        TimeoutError: no ``response.done`` or ``error`` within ``timeout_s`` seconds.
    """
    import asyncio

    await conn.input_audio_buffer.append(audio=pcm)
    await conn.input_audio_buffer.commit()
    await conn.response.create()
    events = []
    async with asyncio.timeout(timeout_s):
        async for event in conn:
            events.append(event)
            if event.type in ("response.done", "error"):
                break
    return events
