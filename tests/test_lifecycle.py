"""Start and stop of ``omnistep serve``: the loading state, the drain on Ctrl-C, load logs.

- Loading: the server listens before its models load; ``/health`` answers 503 ``loading``
  naming what loads, other routes 503 with ``Retry-After``; then 200 (``LoadingApp`` driven
  in-process with a load that waits for the test).
- Ctrl-C (SIGINT) with requests in flight, on the real server (toy card): the log says
  ``draining N requests``, ``/health`` answers 503 ``draining`` meanwhile, the requests still
  running at the end of the grace (or at a second Ctrl-C) end with a clean error (OpenAI error
  JSON, an SSE error event), and no traceback is printed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from omnistep.core import ModelInstance, OmnistepError
from omnistep.engine import AsyncEngine
from omnistep.launch import LoadProgress, load_engine
from omnistep.models.toy.card import build_card
from omnistep.server import ServerConfig, build_app
from omnistep.server.launcher import launch_server
from omnistep.server.lifecycle import Drain, GracefulServer
from omnistep.server.loading import LoadingApp

SPEECH = "/v1/audio/speech"
LONG = {"model": "toy", "input": "<slow> a long one", "max_new_tokens": 600, "seed": 1}
"""~12 s of toy steps: still running when the test signals the server."""


# ------------------------------------------------------------------ loading


class Lifespan:
    """Drives an ASGI app's lifespan (what uvicorn does around serving)."""

    def __init__(self, app) -> None:
        self.app = app
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.outbox: asyncio.Queue = asyncio.Queue()
        self.task: asyncio.Task | None = None

    async def start(self) -> None:
        self.task = asyncio.create_task(
            self.app({"type": "lifespan"}, self.inbox.get, self.outbox.put)
        )
        await self.inbox.put({"type": "lifespan.startup"})
        assert (await self.outbox.get())["type"] == "lifespan.startup.complete"

    async def stop(self) -> None:
        await self.inbox.put({"type": "lifespan.shutdown"})
        assert (await self.outbox.get())["type"] == "lifespan.shutdown.complete"
        await self.task


async def _wait_for(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_health_says_loading_until_the_models_serve():
    release = threading.Event()
    ready: list[AsyncEngine] = []

    def load(progress) -> AsyncEngine:
        progress("loading toy: lm (1/2)")
        assert release.wait(10)
        return AsyncEngine([ModelInstance.load(build_card())])

    drain = Drain()
    app = LoadingApp(
        load, lambda e: build_app(e, ServerConfig(), drain), drain, "toy", on_ready=ready.append
    )
    lifespan = Lifespan(app)
    await lifespan.start()  # returns at once: the load runs on its own thread
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        await _wait_for(lambda: app.status.endswith("(1/2)"))
        assert app.loading and app.app is None
        health = await client.get("/health")
        assert health.status_code == 503
        body = health.json()
        assert body["status"] == "loading" and body["loading"] == "loading toy: lm (1/2)"
        assert body["elapsed_s"] >= 0
        for r in (
            await client.get("/v1/models"),
            await client.post(SPEECH, json={"model": "toy", "input": "hi"}),
        ):
            assert r.status_code == 503 and int(r.headers["retry-after"]) > 0
            error = r.json()["error"]
            assert error["code"] == "model_loading" and "loading toy" in error["message"]
        release.set()
        await _wait_for(lambda: app.app is not None)
        assert not app.loading
        health = await client.get("/health")
        assert health.status_code == 200 and health.json()["models"] == ["toy"]
        assert (await client.get("/v1/models")).status_code == 200
        speech = await client.post(SPEECH, json={"model": "toy", "input": "hi", "seed": 1})
        assert speech.status_code == 200 and len(speech.content) > 0
    assert ready and drain.engine is ready[0]
    await lifespan.stop()  # the real app's lifespan: the engine is shut down
    assert ready[0].stats()["live_requests"] == 0 and ready[0]._task is None


async def test_a_failed_load_stops_the_server_with_its_error():
    def load(progress) -> AsyncEngine:
        raise OmnistepError("no weights in /nowhere")

    drain = Drain()
    app = LoadingApp(load, lambda e: build_app(e), drain, "toy")
    lifespan = Lifespan(app)
    await lifespan.start()
    await _wait_for(lambda: drain.stopped)
    assert isinstance(app.error, OmnistepError) and "/nowhere" in str(app.error)
    server = GracefulServer(__import__("uvicorn").Config(app=app), drain)
    assert await server.on_tick(0)  # the next tick stops the server
    await lifespan.stop()


def test_load_engine_reports_each_component(caplog):
    lines: list[str] = []
    with caplog.at_level(logging.INFO, logger="omnistep.launch"):
        engine = load_engine(["toy"], "cpu", 4, progress=lines.append)
    asyncio.run(engine.shutdown())
    assert lines == ["loading toy", "loading toy: lm (1/2)", "loading toy: vocoder (2/2)"]
    assert [r.getMessage() for r in caplog.records] == lines


def test_a_long_load_logs_that_it_is_still_loading(caplog):
    with (
        caplog.at_level(logging.INFO, logger="omnistep.launch"),
        LoadProgress(interval=0.05) as report,
    ):
        report.show("loading big from /p: thinker (1/3)")
        time.sleep(0.3)
    still = [r.getMessage() for r in caplog.records if r.getMessage().startswith("still")]
    assert len(still) >= 2
    assert still[0].startswith("still loading big from /p: thinker (1/3) (")


# ------------------------------------------------------------------ Ctrl-C


def _request(url: str, body: dict, out: dict, key: str, started: threading.Event) -> None:
    """POST ``body``; put (status, body bytes) or the transport error in ``out[key]``."""
    try:
        with httpx.stream("POST", url + SPEECH, json=body, timeout=60) as r:
            started.set()
            out[key] = (r.status_code, r.read())
    except httpx.HTTPError as exc:
        out[key] = exc
    finally:
        started.set()


def _sigint_with_requests_in_flight(grace: str, twice: bool) -> tuple[dict, dict, int, float, str]:
    """Start a non-streamed and an SSE request, SIGINT the server (twice: again 0.5 s later);
    returns the requests' outcomes, what /health and a new request got while draining, the
    exit status, the seconds from the first signal to the exit, and the server's output."""
    with launch_server("--model", "toy", "--shutdown-grace", grace) as server:
        out: dict = {}
        threads = []
        for key, extra in (("json", {"stream": False}), ("sse", {"stream_format": "sse"})):
            started = threading.Event()
            thread = threading.Thread(
                target=_request, args=(server.url, {**LONG, **extra}, out, key, started)
            )
            thread.start()
            threads.append(thread)
        time.sleep(0.5)  # both admitted
        os.kill(server.pid, signal.SIGINT)
        signalled = time.monotonic()
        time.sleep(0.4)  # the next tick (0.1 s) starts the drain
        during = {
            "health": httpx.get(server.url + "/health", timeout=5),
            "new": httpx.post(server.url + SPEECH, json={"model": "toy", "input": "x"}, timeout=5),
        }
        if twice:
            os.kill(server.pid, signal.SIGINT)
        assert server.process is not None
        status = server.process.wait(timeout=float(grace) + 15)
        exited = time.monotonic() - signalled
        for thread in threads:
            thread.join(10)
        output = server.process.stdout.read()
    return out, during, status, exited, output


def _check_clean_end(out: dict, during: dict, output: str, why: str) -> None:
    health = during["health"]
    assert health.status_code == 503 and health.json()["status"] == "draining"
    assert during["new"].status_code == 503
    assert during["new"].json()["error"]["code"] == "server_shutting_down"
    status, body = out["json"]
    assert status == 503, body
    error = json.loads(body)["error"]
    assert error["code"] == "request_aborted" and why in error["message"]
    status, body = out["sse"]
    assert status == 200
    events = [
        json.loads(line[6:]) for line in body.decode().splitlines() if line.startswith("data: ")
    ]
    assert events[-1]["type"] == "speech.audio.error"
    assert events[-1]["error"]["code"] == "request_aborted"
    assert "draining 2 requests (up to" in output and "Ctrl-C again to quit" in output
    assert "Traceback" not in output and "CancelledError" not in output, output
    assert " 500 " not in output, output


def test_ctrl_c_drains_then_cuts_at_the_grace_with_clean_errors():
    out, during, status, exited, output = _sigint_with_requests_in_flight("2", twice=False)
    _check_clean_end(out, during, output, "grace period")
    assert status == 130 and 1.8 < exited < 10, (status, exited)
    assert "cut 2 unfinished requests" in output


def test_a_second_ctrl_c_cuts_at_once_without_tracebacks():
    out, during, status, exited, output = _sigint_with_requests_in_flight("30", twice=True)
    _check_clean_end(out, during, output, "second signal")
    assert status == 130 and exited < 8, (status, exited)


@pytest.mark.parametrize("grace", ["0"])
def test_ctrl_c_with_nothing_in_flight_exits_at_once(grace):
    with launch_server("--model", "toy", "--shutdown-grace", grace) as server:
        os.kill(server.pid, signal.SIGINT)
        assert server.process is not None
        status = server.process.wait(timeout=10)
        output = server.process.stdout.read()
    assert status == 130 and "draining" not in output and "Traceback" not in output


# ------------------------------------------------------------------ load output


def test_a_qwen_omni_folder_builds_without_transformers_config_warnings(tmp_path):
    """transformers warned 14 times that the talker config's thinker token ids (and the tiny
    thinker's) lie outside a vocabulary; harmless (see ``load_tokenizer``), now silent."""
    from omnistep.models.qwen2_5_omni.tiny import write_tiny_qwen_omni

    root = write_tiny_qwen_omni(tmp_path / "ckpt")
    code = (
        "import sys; from omnistep.models.registry import build_card; "
        "card = build_card('qwen2_5_omni=' + sys.argv[1]); print('built', card.card_id)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(root)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert done.returncode == 0, done.stderr
    assert "built qwen2.5-omni" in done.stdout
    assert "Model config" not in done.stderr and "vocabulary" not in done.stderr, done.stderr


# ------------------------------------------------------------------ cancelled at shutdown


async def _cancelled_request(drain: Drain, start_response: bool) -> tuple[list[dict], object]:
    """Run a request that never ends through ``ShutdownCancels``, cancel it as uvicorn does
    at the end of a shutdown; returns what it sent and how its task ended."""
    from omnistep.server.lifecycle import ShutdownCancels

    async def forever(scope, receive, send):
        if start_response:
            await send({"type": "http.response.start", "status": 200, "headers": []})
        await asyncio.Event().wait()

    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    scope = {"type": "http", "path": "/v1/audio/speech", "method": "POST", "headers": []}
    task = asyncio.create_task(ShutdownCancels(forever, drain)(scope, receive, send))
    await asyncio.sleep(0.01)
    task.cancel()
    try:
        await task
        outcome: object = None
    except BaseException as exc:  # noqa: BLE001 - what the ASGI server would see
        outcome = exc
    return sent, outcome


async def test_a_request_cancelled_at_shutdown_answers_503_not_500():
    from omnistep.server.errors import StreamCut

    drain = Drain()
    drain.start()
    sent, outcome = await _cancelled_request(drain, start_response=False)
    assert outcome is None  # nothing for uvicorn to log or turn into a 500
    assert sent[0]["status"] == 503
    error = json.loads(sent[1]["body"])["error"]
    assert error["code"] == "server_shutting_down"
    sent, outcome = await _cancelled_request(drain, start_response=True)
    assert isinstance(outcome, StreamCut)  # the stream closes; QuietStreamCuts drops the log
    _, outcome = await _cancelled_request(Drain(), start_response=False)
    assert isinstance(outcome, asyncio.CancelledError)  # not shutting down: unchanged
