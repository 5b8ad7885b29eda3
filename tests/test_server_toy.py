"""The real server on the toy card: formats, streaming modes, errors, models, disconnects."""

import base64
import io
import json
import time

import av
import httpx
import numpy as np
import pytest
import soundfile as sf

from tests.serving import running_server

SPEECH = "/v1/audio/speech"


@pytest.fixture(scope="module")
def base():
    with running_server("--model", "toy") as url:
        yield url


def _post(base, **body):
    payload = {
        "model": "toy",
        "input": "hello there, " * 10,
        "seed": 3,
        "max_new_tokens": 200,
        **body,
    }
    return httpx.post(base + SPEECH, json=payload, timeout=60)


def _decode(data: bytes, fmt: str, exact: bool = False) -> tuple[np.ndarray, int]:
    """Samples and rate; ``exact``: the body has exact lengths (libsndfile can read flac)."""
    if fmt == "pcm":
        return np.frombuffer(data, "<i2").astype(np.float32) / 32768, 24000
    if fmt == "wav" or (fmt == "flac" and exact):
        samples, rate = sf.read(io.BytesIO(data), dtype="float32")
        return samples, rate
    with av.open(io.BytesIO(data)) as container:
        frames = [f.to_ndarray().reshape(-1) for f in container.decode(audio=0)]
        rate = container.streams.audio[0].rate
    return np.concatenate(frames), rate


def test_models_and_health(base):
    models = httpx.get(base + "/v1/models").json()
    assert {m["id"] for m in models["data"]} == {"toy", "toy-tts"}
    assert models["object"] == "list"
    health = httpx.get(base + "/health").json()
    assert health["status"] == "ok" and health["live_requests"] == 0


@pytest.mark.parametrize("fmt", ["mp3", "opus", "aac", "flac", "wav", "pcm"])
def test_every_format_decodes_to_the_expected_duration(base, fmt):
    full = _post(base, response_format=fmt, stream=False)
    assert full.status_code == 200, full.text
    streamed = _post(base, response_format=fmt)
    assert streamed.content == full.content or fmt in ("wav", "flac")
    assert np.array_equal(_decode(streamed.content, fmt)[0], _decode(full.content, fmt)[0])
    samples, rate = _decode(full.content, fmt, exact=True)
    assert samples.size / rate == pytest.approx(_expected_seconds(base), rel=0.05)
    assert np.abs(samples).max() > 0.1


def _expected_seconds(base) -> float:
    """Toy audio is 80 samples at 8 kHz per generated token (SSE usage's output_tokens)."""
    r = _post(base, response_format="pcm", stream_format="sse")
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    return events[-1]["usage"]["output_tokens"] * 80 / 8000


def test_sse_events_carry_the_same_audio(base):
    r = _post(base, response_format="pcm", stream_format="sse")
    assert r.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1]["type"] == "speech.audio.done"
    usage = events[-1]["usage"]
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"] > 0
    deltas = [e for e in events[:-1] if e["type"] == "speech.audio.delta"]
    assert len(deltas) == len(events) - 1 > 1
    audio = b"".join(base64.b64decode(e["audio"]) for e in deltas)
    assert audio == _post(base, response_format="pcm", stream=False).content


def test_same_seed_same_bytes_and_seed_header(base):
    a, b = _post(base, response_format="wav"), _post(base, response_format="wav")
    assert a.content == b.content
    assert a.headers["x-omnistep-seed"] == "3"
    c = _post(base, response_format="wav", seed=4)
    assert c.content != a.content


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"input": ""}, 400, "input"),
        ({"input": "x" * 4097}, 400, "input"),
        ({"model": "nope"}, 404, "model"),
        ({"response_format": "ogg"}, 400, "response_format"),
        ({"speed": 0}, 400, "speed"),
        ({"speed": 10}, 400, "speed"),
        ({"speed": "fast"}, 400, "speed"),
        ({"seed": -1}, 400, "seed"),
        ({"seed": "abc"}, 400, "seed"),
        ({"stream_format": "chunks"}, 400, "stream_format"),
        ({"input": "   "}, 400, "input"),
        ({"input": "a\u0000b"}, 400, "input"),
        ({"input": "bell \u0007 escape \u001b"}, 400, "input"),
        ({"voice": 5}, 400, "voice"),
        ({"voice": {"name": "alloy"}}, 400, "voice"),
    ],
)
def test_bad_requests_get_openai_errors(base, body, status, param):
    r = _post(base, **body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param
    assert error["message"] and error["type"] == "invalid_request_error"
    assert httpx.get(base + "/health").json()["status"] == "ok"


def test_errors_keep_the_connection_usable(base):
    with httpx.Client(base_url=base, timeout=60) as client:
        bad = client.post(
            SPEECH,
            content=b'{"model": "toy", "input": ',
            headers={"content-type": "application/json"},
        )
        assert bad.status_code == 400 and bad.json()["error"]["param"] is None
        assert "not valid JSON" in bad.json()["error"]["message"]
        voice = client.post(SPEECH, json={"model": "toy", "input": "hi", "voice": {"id": ""}})
        assert "constrained" not in voice.json()["error"]["message"]
        ok = client.post(SPEECH, json={"model": "toy", "input": "hi", "seed": 1})
        assert ok.status_code == 200


def test_bodies_over_one_megabyte_get_413(base):
    big = {"model": "toy", "input": "hi", "padding": "x" * (1 << 20)}
    r = httpx.post(base + SPEECH, json=big, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: counted while read
        yield b'{"model": "toy", "input": "hi", "padding": "'
        for _ in range(20):
            yield b"x" * 65536
        yield b'"}'

    r = httpx.post(
        base + SPEECH, content=chunks(), timeout=30, headers={"content-type": "application/json"}
    )
    assert r.status_code == 413
    assert _post(base, response_format="wav").status_code == 200


def test_missing_field_and_non_json_body(base):
    r = httpx.post(base + SPEECH, json={"model": "toy"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"
    r = httpx.post(base + SPEECH, content=b"not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()


def test_failure_inside_the_engine_is_a_500_with_error_json(base):
    r = _post(base, input="<fail-vocoder> oh no", stream=False)
    assert r.status_code == 500
    assert "injected fault" in r.json()["error"]["message"]
    assert _post(base, response_format="wav").status_code == 200


def test_client_disconnect_aborts_the_request(base):
    body = {
        "model": "toy",
        "input": "a long one " * 200,
        "response_format": "pcm",
        "seed": 1,
        "max_new_tokens": 4000,
    }
    with httpx.stream("POST", base + SPEECH, json=body, timeout=60) as r:
        assert r.status_code == 200
        next(r.iter_bytes())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        health = httpx.get(base + "/health").json()
        if health["live_requests"] == 0:
            break
        time.sleep(0.05)
    assert health["live_requests"] == 0 and health["live_loops"] == 0
