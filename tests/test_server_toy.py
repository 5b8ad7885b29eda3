"""The real server on the toy card: formats, streaming modes, errors, models, disconnects."""

import asyncio
import base64
import io
import json
import time

import av
import httpx
import numpy as np
import openai
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
    streamed = _post(base, response_format=fmt, stream=True)
    assert streamed.content == full.content or fmt in ("wav", "flac")
    assert np.array_equal(_decode(streamed.content, fmt)[0], _decode(full.content, fmt)[0])
    samples, rate = _decode(full.content, fmt, exact=True)
    assert samples.size / rate == pytest.approx(_expected_seconds(base), rel=0.05)
    assert np.abs(samples).max() > 0.1


# What a user's reader gets from a request that leaves ``stream`` out (as OpenAI's client does):
# wav and flac come whole, with exact lengths in their headers; the others are streamed.
DEFAULT_PADDING_S = {"mp3": 0.12, "aac": 0.12, "opus": 0.05}
"""Codec delay and padding a decoder may add (mp3: encoder delay + last frame; aac: priming +
last frame; opus: pre-skip is honoured by libavcodec but the last page is padded)."""


def _pcm_samples(base) -> int:
    """Samples of the default (streamed) pcm response: 24 kHz s16le mono."""
    r = _post(base, response_format="pcm")
    assert r.status_code == 200 and len(r.content) % 2 == 0
    return len(r.content) // 2


@pytest.mark.parametrize("fmt", ["mp3", "opus", "aac", "flac", "wav", "pcm"])
def test_default_response_of_every_format_opens_in_readers(base, fmt):
    """soundfile (wav, flac) and PyAV (all six) open the default body with the right length."""
    expected = _pcm_samples(base) / 24000
    data = _post(base, response_format=fmt).content
    if fmt in ("wav", "flac"):
        info = sf.info(io.BytesIO(data))
        assert info.frames == round(expected * 24000) and info.samplerate == 24000
        samples, rate = sf.read(io.BytesIO(data), dtype="float32")
        assert samples.shape[0] == info.frames and rate == 24000
    if fmt == "pcm":  # raw s16le: PyAV needs the format named
        container = av.open(io.BytesIO(data), format="s16le", options={"sample_rate": "24000"})
    else:
        container = av.open(io.BytesIO(data))
    with container:
        stream = container.streams.audio[0]
        frames = [f.to_ndarray().reshape(-1) for f in container.decode(audio=0)]
        decoded = np.concatenate(frames).size / stream.rate
        declared = None if container.duration is None else container.duration / 1e6
    pad = DEFAULT_PADDING_S.get(fmt, 0.0)
    assert expected - 1e-3 <= decoded <= expected + pad + 1e-3, (decoded, expected)
    if fmt in ("wav", "flac", "opus"):  # the container states the length (not estimated)
        assert declared == pytest.approx(expected, abs=pad + 1e-3)


def test_openai_client_flac_opens_in_soundfile(base):
    """``client.audio.speech.create(..., response_format="flac")`` sends no ``stream`` field;
    its body must open in soundfile (a streamed STREAMINFO says 0 samples: "array is too big")."""
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    extra = {"seed": 3, "max_new_tokens": 200}
    audio = client.audio.speech.create(
        model="toy",
        voice="default",
        input="hello there, " * 10,
        response_format="flac",
        extra_body=extra,
    )
    samples, rate = sf.read(io.BytesIO(audio.content), dtype="float32")
    assert rate == 24000 and samples.shape[0] == _pcm_samples(base)
    with client.audio.speech.with_streaming_response.create(
        model="toy",
        voice="default",
        input="hello there, " * 10,
        response_format="flac",
        extra_body=extra,
    ) as response:
        assert b"".join(response.iter_bytes()) == audio.content


def test_stream_true_streams_wav_and_flac_with_unknown_lengths(base):
    """``stream: true`` asks for a stream: the same samples, headers saying "unknown"."""
    for fmt in ("wav", "flac"):
        whole = _post(base, response_format=fmt).content
        streamed = _post(base, response_format=fmt, stream=True).content
        assert streamed != whole and len(streamed) == len(whole)
        assert np.array_equal(_decode(streamed, fmt)[0], _decode(whole, fmt)[0])


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
        ({"response_format": "m4a"}, 400, "response_format"),
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
        ({"normalization_options": {"normalize": "no"}}, 400, "normalization_options"),
        ({"normalization_options": {"url_normalization": 1}}, 400, "normalization_options"),
        ({"normalization_options": False}, 400, "normalization_options"),
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
        latin = client.post(
            SPEECH,
            content=b'{"model": "toy", "input": "\xff\xfe"}',
            headers={"content-type": "application/json"},
        )
        assert latin.status_code == 400, latin.text
        assert latin.json()["error"]["code"] == "invalid_value"
        assert "UTF-8" in latin.json()["error"]["message"]
        voice = client.post(SPEECH, json={"model": "toy", "input": "hi", "voice": {"id": ""}})
        assert "constrained" not in voice.json()["error"]["message"]
        ok = client.post(SPEECH, json={"model": "toy", "input": "hi", "seed": 1})
        assert ok.status_code == 200


def test_bodies_over_the_limit_get_413(base):
    """Speech bodies may hold an inline clip (``ref_audio``): 16 MiB; others 1 MiB."""
    big = {"model": "toy", "input": "hi", "padding": "x" * (16 << 20)}
    r = httpx.post(base + SPEECH, json=big, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: counted while read
        yield b'{"model": "toy", "messages": [], "padding": "'
        for _ in range(20):
            yield b"x" * 65536
        yield b'"}'

    r = httpx.post(
        base + "/v1/chat/completions",
        content=chunks(),
        timeout=30,
        headers={"content-type": "application/json"},
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


# ------------------------------------------------------------------ fault isolation

FAULT_TEXT = "{marker} this one breaks somewhere along the way"


async def _outcome(client: httpx.AsyncClient, mode: str, text: str, seed: int) -> dict:
    """Run one request in ``mode``; returns its status, body (or the bytes received before
    the connection broke) and the transport error, if any."""
    speech = {"model": "toy", "input": text, "seed": seed, "max_new_tokens": 40}
    chat = {
        "model": "toy",
        "messages": [{"role": "user", "content": text}],
        "modalities": ["text", "audio"],
        "audio": {"voice": "default", "format": "pcm16"},
        "max_tokens": 40,
        "seed": seed,
    }
    path, body = {
        "raw": (SPEECH, {**speech, "response_format": "pcm"}),
        # pcm: an mp3 encoder holds back its first frame and delay (~2200 samples, the toy's
        # first ~27 tokens at 80 samples each), so whether any delta preceded a fault at
        # token 20 depended on the encoder's buffering (1 run in 7-10 had none)
        "sse": (SPEECH, {**speech, "response_format": "pcm", "stream_format": "sse"}),
        "whole": (SPEECH, {**speech, "response_format": "wav", "stream": False}),
        "chat_stream": ("/v1/chat/completions", {**chat, "stream": True}),
        "chat": ("/v1/chat/completions", chat),
    }[mode]
    data, error = b"", None
    async with client.stream("POST", path, json=body) as r:
        try:
            async for piece in r.aiter_raw():
                data += piece
        except httpx.RemoteProtocolError as exc:
            error = exc
    return {
        "status": r.status_code,
        "type": r.headers["content-type"],
        "data": data,
        "error": error,
    }


def _events(data: bytes) -> list:
    lines = [line[6:] for line in data.decode().splitlines() if line.startswith("data: ")]
    return [line if line == "[DONE]" else json.loads(line) for line in lines]


def _generation_failed(error: dict) -> None:
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "server_error" and error["code"] == "generation_failed"
    assert "injected fault" in error["message"]


def _check_failed(mode: str, marker: str, out: dict) -> None:
    """What a client sees when its request fails inside the engine (docs/api.md, Errors)."""
    if mode == "raw" and out["status"] == 200:
        # the 200 was sent with the first audio: the failure cuts the body short
        assert marker != "<fail-vocoder>"  # that one fails before any audio exists
        assert out["data"] and isinstance(out["error"], httpx.RemoteProtocolError)
    elif mode in ("raw", "whole", "chat"):  # failed before the first byte
        assert marker != "<fail-late>" or mode != "raw", "late faults come after audio"
        assert out["status"] == 500 and out["type"] == "application/json"
        _generation_failed(json.loads(out["data"])["error"])
    elif mode == "sse":
        events = _events(out["data"])
        assert out["status"] == 200 and out["error"] is None
        assert events[-1]["type"] == "speech.audio.error"
        assert {e["type"] for e in events[:-1]} <= {"speech.audio.delta"}
        if marker == "<fail-late>":
            assert len(events) > 1, "a late fault comes after some audio"
        _generation_failed(events[-1]["error"])
    else:  # chat_stream
        events = _events(out["data"])
        assert out["status"] == 200 and events[-1] == "[DONE]"
        _generation_failed(events[-2]["error"])


MODES = ["raw", "sse", "whole", "chat_stream", "chat"]


async def test_a_fault_fails_its_request_only_in_every_response_mode(base):
    """Every fault marker in every response mode, all at once beside good requests: each
    failing request gets its documented error; the others give what they give alone."""
    async with httpx.AsyncClient(base_url=base, timeout=60) as client:
        good = [(mode, f"good request {i} in {mode}", 50 + i) for i, mode in enumerate(MODES)]
        alone = [await _outcome(client, *spec) for spec in good]
        bad = [(m, marker) for marker in ("<fail>", "<fail-late>", "<fail-vocoder>") for m in MODES]
        results = await asyncio.gather(
            *(_outcome(client, *spec) for spec in good),
            *(_outcome(client, m, FAULT_TEXT.format(marker=k), 7) for m, k in bad),
        )
        for (mode, *_), before, during in zip(good, alone, results, strict=False):
            assert before["status"] == during["status"] == 200 and before["error"] is None
            if mode.startswith("chat"):  # ids and timestamps differ; the content may not
                assert _chat_content(during["data"]) == _chat_content(before["data"])
            else:
                assert during["data"] == before["data"]
        for (mode, marker), out in zip(bad, results[len(good) :], strict=True):
            _check_failed(mode, marker, out)
        health = httpx.get(base + "/health").json()
        for _ in range(100):
            if health["live_requests"] == 0 and health["running_batches"] == 0:
                break
            await asyncio.sleep(0.05)
            health = httpx.get(base + "/health").json()
        assert health["status"] == "ok" and health["live_requests"] == health["live_loops"] == 0


def _chat_content(data: bytes) -> tuple[str, str]:
    if not data.startswith(b"data: "):
        message = json.loads(data)["choices"][0]["message"]
        return message["content"], message["audio"]["data"]
    deltas = [e["choices"][0]["delta"] for e in _events(data)[:-1] if e["choices"]]
    text = "".join(d.get("content") or "" for d in deltas)
    return text, "".join(d.get("audio", {}).get("data", "") for d in deltas)


def test_openai_client_raises_on_a_failed_chat_stream(base):
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    stream = client.chat.completions.create(
        model="toy",
        messages=[{"role": "user", "content": "<fail-late> go on for a while"}],
        max_tokens=40,
        seed=7,
        stream=True,
    )
    with pytest.raises(openai.APIError, match="injected fault"):
        for _ in stream:
            pass
