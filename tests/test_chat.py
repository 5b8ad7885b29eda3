"""/v1/chat/completions on the toy card (text + audio), through httpx and the openai client."""

import base64
import io
import json

import httpx
import numpy as np
import pytest
import soundfile as sf
from openai import OpenAI

from tests.serving import running_server

URL = "/v1/chat/completions"
MESSAGES = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": [{"type": "text", "text": "say something"}]},
]


@pytest.fixture(scope="module")
def base():
    with running_server("--model", "toy") as url:
        yield url


def _body(**kw):
    return {"model": "toy", "messages": MESSAGES, "seed": 5, "max_tokens": 40, **kw}


def test_text_only_completion(base):
    r = httpx.post(base + URL, json=_body(), timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    message = out["choices"][0]["message"]
    assert out["object"] == "chat.completion" and message["role"] == "assistant"
    assert message["content"].startswith("<") and "audio" not in message
    assert out["usage"]["completion_tokens"] == message["content"].count("<")
    assert (
        out["usage"]["total_tokens"]
        == out["usage"]["prompt_tokens"] + out["usage"]["completion_tokens"]
    )


def test_audio_completion_matches_stream(base):
    body = _body(modalities=["text", "audio"], audio={"voice": "default", "format": "wav"})
    full = httpx.post(base + URL, json=body, timeout=60).json()
    message = full["choices"][0]["message"]
    audio = message["audio"]
    assert audio["transcript"] == message["content"] and audio["expires_at"] > full["created"]
    samples, rate = sf.read(io.BytesIO(base64.b64decode(audio["data"])), dtype="float32")
    assert rate == 24000 and samples.size > 0
    assert samples.size / rate == pytest.approx(full["usage"]["completion_tokens"] * 0.01, rel=0.05)

    client = OpenAI(base_url=base + "/v1", api_key="unused")
    events = list(
        client.chat.completions.create(
            model="toy",
            messages=MESSAGES,
            modalities=["text", "audio"],
            stream=True,
            audio={"voice": "default", "format": "wav"},
            seed=5,
            max_tokens=40,
        )
    )
    text = "".join(e.choices[0].delta.content or "" for e in events if e.choices)
    pieces = [getattr(e.choices[0].delta, "audio", None) for e in events if e.choices]
    data = b"".join(base64.b64decode(p.data) for p in pieces if p and p.data)
    transcript = "".join(p.transcript or "" for p in pieces if p)
    assert text == message["content"] == transcript
    streamed, _ = sf.read(io.BytesIO(data), dtype="float32")
    assert np.array_equal(streamed, samples)
    assert events[-1].usage.total_tokens == full["usage"]["total_tokens"]
    finals = [
        e.choices[0].finish_reason for e in events if e.choices and e.choices[0].finish_reason
    ]
    assert finals == [full["choices"][0]["finish_reason"]]


def test_openai_client_parses_non_streamed_audio(base):
    client = OpenAI(base_url=base + "/v1", api_key="unused")
    out = client.chat.completions.create(
        model="toy",
        messages=MESSAGES,
        modalities=["text", "audio"],
        seed=5,
        max_tokens=40,
        audio={"voice": "default", "format": "pcm16"},
    )
    audio = out.choices[0].message.audio
    assert audio.transcript == out.choices[0].message.content
    assert len(base64.b64decode(audio.data)) == out.usage.completion_tokens * 240 * 2


def test_stream_ends_with_done(base):
    with httpx.stream("POST", base + URL, json=_body(stream=True), timeout=60) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        (_body(modalities=["text", "audio"]), 400, "audio"),
        (_body(model="nope"), 404, "model"),
        (_body(messages=[]), 400, "messages"),
        (_body(messages=[{"role": "user", "content": "  "}]), 400, "messages"),
        (_body(messages=[{"role": "wizard", "content": "hi"}]), 400, "messages"),
        (_body(audio={"voice": "x", "format": "ogg"}, modalities=["text", "audio"]), 400, "audio"),
        (_body(temperature=-1), 400, "temperature"),
        (_body(temperature=True), 400, "temperature"),
        (_body(top_p="0.9"), 400, "top_p"),
        (_body(max_tokens="16"), 400, "max_tokens"),
        (_body(n=2), 400, "n"),
    ],
)
def test_bad_chat_requests(base, body, status, param):
    r = httpx.post(base + URL, json=body, timeout=30)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param
