"""Robustness of the real server on the toy card: dropped clients, request timeouts, SIGTERM.

- 200 streams dropped at random points (before the first byte, or after k chunks) while ten
  requests run to completion with the bytes they give alone; afterwards the engine holds
  nothing (``/health`` shows ``AsyncEngine.stats``: requests, loops, queued units, running
  batches, KV blocks) and stays healthy.
- ``--request-timeout``: 504 with OpenAI's error JSON before the first byte, an SSE error
  event or a cut raw stream after it; the request's resources are freed.
- SIGTERM: the in-flight stream finishes, new requests are refused, the process exits 0;
  past ``--shutdown-grace`` the stream is cut and the process still exits 0.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import random
import signal
import threading
import time

import httpx
import pytest

from omnistep.core import ModelInstance, Request, RequestTimeoutError, SamplingParams
from omnistep.engine import AsyncEngine, EngineConfig
from omnistep.models.toy.card import build_card
from omnistep.server import ServerConfig, build_app
from omnistep.server.launcher import launch_server
from omnistep.server.lifecycle import Drain, GracefulServer
from tests.serving import running_server

SPEECH = "/v1/audio/speech"
CHAT = "/v1/chat/completions"
SPEECH_FORMATS = ["pcm", "mp3", "wav", "opus", "aac", "flac"]
CHAT_FORMATS = ["pcm16", "wav", "mp3"]


@pytest.fixture(scope="module")
def base():
    with running_server("--model", "toy") as url:
        yield url


# ------------------------------------------------------------------ request builders


def speech_body(seed: int, text: str, fmt: str = "pcm", sse: bool = False, **extra) -> dict:
    """A speech body; ``sse`` asks for ``stream_format: sse``."""
    body = {"model": "toy", "input": text, "seed": seed, "response_format": fmt, **extra}
    if sse:
        body["stream_format"] = "sse"
    return body


def chat_body(seed: int, text: str, fmt: str = "pcm16", stream: bool = True, **extra) -> dict:
    """A chat body asking for text and audio."""
    return {
        "model": "toy",
        "messages": [{"role": "user", "content": text}],
        "modalities": ["text", "audio"],
        "audio": {"voice": "default", "format": fmt},
        "stream": stream,
        "seed": seed,
        **extra,
    }


def sse_events(text: str) -> list:
    """The JSON payloads of an SSE body (``[DONE]`` as the string)."""
    lines = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    return [line if line == "[DONE]" else json.loads(line) for line in lines]


def chat_content(path: str, body: dict, raw: bytes) -> tuple[str, bytes]:
    """(text, audio bytes) of a chat reply, streamed or not (ids and timestamps differ)."""
    if not body["stream"]:
        message = json.loads(raw)["choices"][0]["message"]
        return message["content"], base64.b64decode(message["audio"]["data"])
    text, audio = [], []
    for event in sse_events(raw.decode()):
        if event == "[DONE]" or not event["choices"]:
            continue
        delta = event["choices"][0]["delta"]
        text.append(delta.get("content") or "")
        audio.append(base64.b64decode(delta.get("audio", {}).get("data", "")))
    return "".join(text), b"".join(audio)


async def fetch(client: httpx.AsyncClient, path: str, body: dict) -> object:
    """The whole answer in a comparable form: the body bytes, or chat's (text, audio)."""
    r = await client.post(path, json=body)
    assert r.status_code == 200, r.text
    return chat_content(path, body, r.content) if path == CHAT else r.content


HELD = ("live_requests", "live_loops", "queued_units", "running_batches", "kv_blocks_used")


async def wait_idle(client: httpx.AsyncClient, timeout: float = 10.0) -> dict:
    """``/health`` once the engine holds nothing (a batch that was running when its
    requests were aborted still has to return), or after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        health = (await client.get("/health")).json()
        if not any(health[k] for k in HELD) or time.monotonic() > deadline:
            return health
        await asyncio.sleep(0.05)


def assert_idle(health: dict) -> None:
    """Nothing held: no request, loop, queued unit, running batch or KV block."""
    assert health["status"] == "ok"
    assert {k: health[k] for k in HELD} == dict.fromkeys(HELD, 0), health


# ------------------------------------------------------------------ disconnects

NUM_VICTIMS = 200
KEEPERS = [  # (path, body): run to completion beside the victims
    (SPEECH, speech_body(1, "keeper one speaks " * 3, "pcm", max_new_tokens=120)),
    (SPEECH, speech_body(2, "keeper two speaks " * 3, "mp3", max_new_tokens=120)),
    (SPEECH, speech_body(3, "keeper three speaks " * 3, "wav", max_new_tokens=120)),
    (SPEECH, speech_body(4, "keeper four speaks " * 3, "opus", max_new_tokens=120)),
    (SPEECH, speech_body(5, "keeper five speaks " * 3, "pcm", sse=True, max_new_tokens=120)),
    (SPEECH, speech_body(6, "keeper six speaks " * 3, "aac", sse=True, max_new_tokens=120)),
    (SPEECH, speech_body(7, "keeper seven " * 3, "flac", stream=False, max_new_tokens=120)),
    (CHAT, chat_body(8, "keeper eight chats " * 3, "pcm16", max_tokens=120)),
    (CHAT, chat_body(9, "keeper nine chats " * 3, "mp3", max_tokens=120)),
    (CHAT, chat_body(10, "keeper ten chats " * 3, "wav", stream=False, max_tokens=120)),
]


def victim(rng: random.Random, i: int) -> tuple[str, dict, int | None]:
    """(path, body, chunks to read before dropping; None: drop before the first byte)."""
    text = f"victim {i} talks and talks " * 4
    kind = rng.choice(["audio", "sse", "chat"])
    if kind == "chat":
        body = chat_body(1000 + i, text, rng.choice(CHAT_FORMATS), max_tokens=2000)
        path = CHAT
    else:
        fmt = rng.choice(SPEECH_FORMATS)
        body = speech_body(1000 + i, text, fmt, sse=kind == "sse", max_new_tokens=2000)
        body["stream"] = True  # wav and flac are sent whole unless asked for as a stream
        path = SPEECH
    drop_after = None if rng.random() < 0.25 else rng.randint(0, 6)
    return path, body, drop_after


async def drop(
    client: httpx.AsyncClient, path: str, body: dict, after: int | None, delay: float
) -> None:
    """Send a request and go away: ``delay`` seconds after sending (``after`` None), or after
    reading ``after`` body chunks."""
    if after is None:
        task = asyncio.ensure_future(client.post(path, json=body))
        await asyncio.sleep(delay)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return
    async with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200, await r.aread()
        read = 0
        async for _ in r.aiter_raw():
            read += 1
            if read > after:
                break


async def test_dropped_streams_free_everything_and_spare_the_others(base):
    """200 dropped streams (seeded random points) beside 10 full ones; then nothing is held."""
    rng = random.Random(20240611)
    victims = [victim(rng, i) for i in range(NUM_VICTIMS)]
    delays = [rng.uniform(0, 0.02) for _ in victims]
    limits = httpx.Limits(max_connections=100, max_keepalive_connections=20)
    async with httpx.AsyncClient(base_url=base, timeout=60, limits=limits) as client:
        alone = [await fetch(client, path, body) for path, body in KEEPERS]
        gate = asyncio.Semaphore(40)  # victims in flight at once

        async def run_victim(spec: tuple, delay: float) -> None:
            async with gate:
                await drop(client, *spec, delay)

        start = time.monotonic()
        results = await asyncio.gather(
            *(fetch(client, path, body) for path, body in KEEPERS),
            *(run_victim(spec, delay) for spec, delay in zip(victims, delays, strict=True)),
            return_exceptions=True,
        )
        stormed = time.monotonic() - start
        for r in results:
            if isinstance(r, BaseException):
                raise r
        for (path, body), before, during in zip(
            KEEPERS, alone, results[: len(KEEPERS)], strict=True
        ):
            assert during == before, f"{path} {body} changed beside dropped requests"
        # each victim asks for 2000 tokens: only aborts let the engine go idle this soon
        health = await wait_idle(client, timeout=10)
        assert_idle(health)
        assert (await fetch(client, *KEEPERS[0])) == alone[0]
    assert stormed < 60, f"storm took {stormed:.1f} s"


async def test_disconnect_before_a_non_streamed_answer_aborts(base):
    """A client that leaves while a whole-file answer is being collected aborts the request."""
    slow = speech_body(5, "<slow> nobody waits", "wav", stream=False, max_new_tokens=400)
    chat = chat_body(6, "<slow> nobody waits", "wav", stream=False, max_tokens=400)
    async with httpx.AsyncClient(base_url=base, timeout=60) as client:
        for path, body in [(SPEECH, slow), (CHAT, chat)]:
            await drop(client, path, body, None, delay=0.3)  # 400 slow steps take 8 s
            assert_idle(await wait_idle(client, timeout=3))


# ------------------------------------------------------------------ request timeout


async def test_engine_times_out_a_request_and_frees_it():
    engine = AsyncEngine([ModelInstance.load(build_card())], EngineConfig(request_timeout=0.3))
    try:
        slow = engine.add_request(
            Request(
                "toy", text="<slow> take long", seed=1, sampling=SamplingParams(max_new_tokens=500)
            )
        )
        quick = engine.add_request(
            Request("toy", text="quick", seed=2, sampling=SamplingParams(max_new_tokens=5))
        )
        chunks = [c async for c in quick]
        assert chunks  # finished well within the limit
        start = time.monotonic()
        with pytest.raises(RequestTimeoutError) as info:
            async for _ in slow:
                pass
        assert info.value.timeout == 0.3 and time.monotonic() - start < 1.0
        await asyncio.sleep(0.05)  # the in-flight slow batch returns and is released
        assert set(engine.stats().values()) == {0}
    finally:
        await engine.shutdown()


async def test_stats_count_kv_blocks_of_paged_components():
    from omnistep.kv import BlockManager, SequenceTable

    model = ModelInstance.load(build_card())
    table = SequenceTable(BlockManager(num_blocks=8, block_size=4))
    model.components["vocoder"].table = table  # as an AR component keeps its paged cache
    engine = AsyncEngine([model])
    try:
        assert table.admit_prefill("seq", 10)
        assert engine.stats()["kv_blocks_used"] == 3
        table.free("seq")
        assert engine.stats()["kv_blocks_used"] == 0
    finally:
        await engine.shutdown()


def test_request_timeout_must_be_positive():
    for bad in (0, -1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="request_timeout"):
            EngineConfig(request_timeout=bad)


@pytest.fixture(scope="module")
def timeout_base():
    with running_server("--model", "toy", "--request-timeout", "0.5") as url:
        yield url


def _check_timeout_error(error: dict) -> None:
    assert error["type"] == "timeout_error" and error["code"] == "request_timeout"
    assert "0.5 s" in error["message"] and set(error) == {"message", "type", "param", "code"}


async def test_request_timeout_in_every_response_mode(timeout_base):
    """``<slow>`` requests (0.02 s a step, 200 steps) outlive the 0.5 s limit."""
    text = "<slow> this takes a while"
    async with httpx.AsyncClient(base_url=timeout_base, timeout=30) as client:

        async def whole(path: str, body: dict) -> httpx.Response:
            return await client.post(path, json=body)

        async def raw_stream() -> tuple[int, int, Exception | None]:
            body = speech_body(3, text, "pcm", max_new_tokens=200)
            received = 0
            async with client.stream("POST", SPEECH, json=body) as r:
                try:
                    async for piece in r.aiter_raw():
                        received += len(piece)
                except httpx.HTTPError as exc:
                    return r.status_code, received, exc
            return r.status_code, received, None

        plain, sse, chat, chat_stream, stream, quick = await asyncio.gather(
            whole(SPEECH, speech_body(1, text, "wav", stream=False, max_new_tokens=200)),
            whole(SPEECH, speech_body(2, text, "mp3", sse=True, max_new_tokens=200)),
            whole(CHAT, chat_body(4, text, "wav", stream=False, max_tokens=200)),
            whole(CHAT, chat_body(5, text, "pcm16", max_tokens=200)),
            raw_stream(),
            whole(SPEECH, speech_body(6, "quick one", "pcm", max_new_tokens=5)),
        )
        for r in (plain, chat):
            assert r.status_code == 504 and r.headers["content-type"] == "application/json"
            _check_timeout_error(r.json()["error"])
        events = sse_events(sse.text)
        assert sse.status_code == 200 and events[-1]["type"] == "speech.audio.error"
        assert events[0]["type"] == "speech.audio.delta"  # audio came before the limit
        _check_timeout_error(events[-1]["error"])
        events = sse_events(chat_stream.text)
        assert events[-1] == "[DONE]" and "error" in events[-2]
        _check_timeout_error(events[-2]["error"])
        status, received, error = stream
        assert status == 200 and received > 0 and isinstance(error, httpx.RemoteProtocolError)
        assert quick.status_code == 200 and len(quick.content) > 0
        assert_idle(await wait_idle(client, timeout=3))


async def test_expected_endings_log_one_line_without_traceback():
    """A raw stream cut by the timeout, one cut by a failure, SSE and chat streams cut by the
    timeout, and clients that leave mid-stream (raw, SSE, chat): each logs exactly one line
    naming its request, and the server log holds no traceback."""
    slow = "<slow> this takes a while"
    with launch_server(
        "--model", "toy", "--request-timeout", "0.5", "--log-level", "info"
    ) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:

            async def cut(path: str, body: dict, keep: int | None = None) -> str:
                """Read the stream to its end (or only ``keep`` chunks); the request id."""
                async with client.stream("POST", path, json=body) as r:
                    assert r.status_code == 200
                    rid = r.headers.get("x-request-id")
                    with contextlib.suppress(httpx.RemoteProtocolError):
                        async for _ in r.aiter_raw():
                            if keep is not None:
                                keep -= 1
                                if keep < 0:
                                    break
                return rid

            # the slow ones take 4 s; those read for one chunk only are left well within 0.5 s
            ids = [
                await cut(SPEECH, speech_body(1, slow, "pcm", max_new_tokens=200)),
                await cut(SPEECH, speech_body(2, "<fail-late> x", "mp3", max_new_tokens=60)),
                await cut(SPEECH, speech_body(3, slow, "pcm", sse=True, max_new_tokens=200)),
                await cut(SPEECH, speech_body(4, slow, "pcm", max_new_tokens=200), keep=1),
                await cut(SPEECH, speech_body(5, slow, sse=True, max_new_tokens=200), keep=1),
            ]
            timeout_chat = await client.post(CHAT, json=chat_body(6, slow, max_tokens=200))
            await cut(CHAT, chat_body(7, slow, max_tokens=200), keep=1)
            assert timeout_chat.status_code == 200
            assert_idle(await wait_idle(client, timeout=5))
    log = server.process.stdout.read()
    assert "Traceback" not in log and "Exception in ASGI" not in log, log
    assert None not in ids
    for rid in ids:
        lines = [line for line in log.splitlines() if rid in line]
        assert len(lines) == 1, (rid, lines)
    assert log.count("timed out after 0.5 s") == 3, log  # raw, SSE, chat
    assert log.count("disconnected; aborting it") == 3, log  # raw, SSE, chat


def test_stream_cut_filter_drops_only_stream_cuts():
    import logging

    from omnistep.core import RequestTimeoutError
    from omnistep.server.errors import QuietStreamCuts, StreamCut

    def record(exc: BaseException | None) -> logging.LogRecord:
        info = (type(exc), exc, None) if exc is not None else None
        return logging.LogRecord("uvicorn.error", 40, "", 0, "Exception", (), info)

    cut = StreamCut("req-1", RequestTimeoutError("late", 1.0))
    try:
        raise RuntimeError("Caught handled exception, but response already started.") from cut
    except RuntimeError as wrapped:
        wrapping = wrapped
    keep = QuietStreamCuts()
    assert not keep.filter(record(cut)) and not keep.filter(record(wrapping))
    assert keep.filter(record(ZeroDivisionError("bug"))) and keep.filter(record(None))


def test_request_timeout_flag():
    from omnistep.cli import build_parser

    parse = build_parser().parse_args
    assert parse(["serve"]).request_timeout is None
    assert parse(["serve", "--request-timeout", "2.5"]).request_timeout == 2.5
    assert parse(["serve"]).shutdown_grace == 30.0
    assert parse(["serve", "--shutdown-grace", "0"]).shutdown_grace == 0.0
    for bad in (
        ["--request-timeout", "0"],
        ["--shutdown-grace", "-1"],
        ["--request-timeout", "inf"],
    ):
        with pytest.raises(SystemExit):
            parse(["serve", *bad])


# ------------------------------------------------------------------ SIGTERM


def _stream_in_thread(url: str, body: dict, started: threading.Event, out: dict) -> None:
    """Stream ``body``; set ``started`` at the first bytes; put the bytes or the error in out."""
    data = b""
    try:
        with httpx.stream("POST", url + SPEECH, json=body, timeout=30) as r:
            out["status"] = r.status_code
            for piece in r.iter_raw():
                data += piece
                started.set()
    except httpx.HTTPError as exc:
        out["error"] = exc
    finally:
        out["data"] = data
        started.set()


def _sigterm_during_stream(
    grace: str, body: dict, reference: bool
) -> tuple[dict, httpx.Response | Exception, int, float]:
    """Start ``body`` streaming on a fresh server, SIGTERM it, try a new request; returns the
    stream's outcome (and, if ``reference``, the same request's audio before the signal), the
    new request's outcome, the exit status and the seconds from the signal to the exit."""
    with launch_server("--model", "toy", "--shutdown-grace", grace) as server:
        out: dict = {}
        if reference:
            full = httpx.post(server.url + SPEECH, json={**body, "stream": False}, timeout=60)
            out["reference"] = full.content
        started = threading.Event()
        thread = threading.Thread(target=_stream_in_thread, args=(server.url, body, started, out))
        thread.start()
        assert started.wait(30)
        os.kill(server.pid, signal.SIGTERM)
        signalled = time.monotonic()
        time.sleep(0.3)  # uvicorn notices the signal within 0.1 s
        try:
            late: httpx.Response | Exception = httpx.post(
                server.url + SPEECH, json={**body, "input": "hello"}, timeout=10
            )
        except httpx.HTTPError as exc:
            late = exc
        assert server.process is not None
        status = server.process.wait(timeout=float(grace) + 20)
        exited = time.monotonic() - signalled
        thread.join(10)
    return out, late, status, exited


def _check_refused(late: httpx.Response | Exception) -> None:
    if isinstance(late, Exception):
        assert isinstance(late, httpx.ConnectError), late
    else:  # came in on a connection that was already open: refused by the drain gate
        assert late.status_code == 503 and late.json()["error"]["code"] == "server_shutting_down"


def test_sigterm_finishes_the_stream_refuses_new_requests_and_exits_0():
    body = speech_body(3, "<slow> finish me please", "pcm", max_new_tokens=60)  # ~1.2 s
    out, late, status, exited = _sigterm_during_stream("10", body, reference=True)
    assert out["status"] == 200 and "error" not in out, out.get("error")
    assert out["data"] == out["reference"] and len(out["data"]) > 0  # the whole audio
    _check_refused(late)
    assert status == 0 and exited < 10


def test_sigterm_cuts_streams_past_the_grace_period_and_exits_0():
    body = speech_body(3, "<slow> too long to wait for", "pcm", max_new_tokens=600)  # ~12 s
    out, late, status, exited = _sigterm_during_stream("1", body, reference=False)
    assert out["status"] == 200 and len(out["data"]) > 0
    assert isinstance(out.get("error"), httpx.RemoteProtocolError)  # cut, not ended cleanly
    _check_refused(late)
    assert status == 0 and exited < 5


# ------------------------------------------------------------------ drain gate


async def test_draining_app_refuses_api_requests_with_503():
    engine = AsyncEngine([ModelInstance.load(build_card())])
    app = build_app(engine, ServerConfig())
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            body = speech_body(1, "hello", "pcm", max_new_tokens=5)
            assert (await client.post(SPEECH, json=body)).status_code == 200
            assert (await client.get("/health")).json()["status"] == "ok"
            app.state.drain.start()
            for r in (
                await client.post(SPEECH, json=body),
                await client.post(CHAT, json=chat_body(1, "hi")),
                await client.get("/v1/models"),
            ):
                assert r.status_code == 503 and r.headers["connection"] == "close"
                error = r.json()["error"]
                assert error["code"] == "server_shutting_down" and error["type"] == "server_error"
            health = await client.get("/health")
            assert health.status_code == 503 and health.json()["status"] == "draining"
            assert (await client.get("/openapi.json")).status_code == 200
    finally:
        await engine.shutdown()


async def test_graceful_server_drains_on_the_signal():
    import uvicorn

    drain = Drain()
    server = GracefulServer(uvicorn.Config(app=None), drain)
    server.handle_exit(signal.SIGTERM, None)
    assert drain.draining and not server.should_exit  # the handler only records the signal
    assert await server.on_tick(0)  # nothing in flight: the next tick stops the server


def test_shutdown_grace_must_not_be_negative():
    assert ServerConfig().shutdown_grace == 30.0
    with pytest.raises(ValueError, match="shutdown_grace"):
        ServerConfig(shutdown_grace=-1)


# ------------------------------------------------------------------ unexpected exceptions


async def test_unexpected_errors_are_json_before_the_body_and_cut_it_after():
    """A bug before the response starts is a 500 with OpenAI's error JSON; after the body has
    started it must reach the ASGI server (which drops the connection), not end it cleanly."""
    from fastapi.responses import StreamingResponse

    engine = AsyncEngine([ModelInstance.load(build_card())])
    app = build_app(engine, ServerConfig())

    @app.get("/v1/boom")
    async def boom() -> None:
        raise ZeroDivisionError("bug")

    @app.get("/v1/boom-later")
    async def boom_later() -> StreamingResponse:
        async def body():
            yield b"some audio"
            raise ZeroDivisionError("bug after the first byte")

        return StreamingResponse(body())

    try:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            r = await client.get("/v1/boom")
            assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
            assert "bug" not in r.text  # internals stay in the log
        sent = []
        with pytest.raises(ZeroDivisionError):
            await app(_get_scope("/v1/boom-later"), _receive_nothing(), _append_to(sent))
        assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
        assert [m.get("body") for m in sent[1:]] == [b"some audio"]
        assert all(m.get("more_body") for m in sent[1:]), "the body must not end cleanly"
    finally:
        await engine.shutdown()


def _get_scope(path: str) -> dict:
    """An ASGI HTTP scope for ``GET path`` (spec 2.3, as uvicorn sends)."""
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(b"host", b"test")],
        "client": ("127.0.0.1", 1234),
        "server": ("test", 80),
    }


def _receive_nothing():
    """An ASGI receive: an empty body, then nothing (the client stays)."""
    messages = [{"type": "http.request", "body": b"", "more_body": False}]

    async def receive() -> dict:
        if messages:
            return messages.pop()
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    return receive


def _append_to(sent: list):
    async def send(message: dict) -> None:
        sent.append(message)

    return send
