"""Hardening of the real server on the toy card: bad requests, a bounded queue, API key, CORS.

Every bad request must get a 4xx with OpenAI's error JSON (``{"error": {"message", "type",
"param", "code"}}``) and leave the server healthy; a full engine answers 429 with Retry-After;
an API key guards every route but health and the docs; CORS is off unless origins are given.
"""

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from omnistep.cli import build_parser, server_config
from omnistep.core import EngineOverloadedError, ModelInstance, OmnistepError, Request
from omnistep.engine import AsyncEngine, EngineConfig
from omnistep.launch import load_engine
from omnistep.models.toy.card import build_card
from omnistep.server import ServerConfig
from tests.serving import running_server

SPEECH = "/v1/audio/speech"
CHAT = "/v1/chat/completions"
JSON = {"content-type": "application/json"}
ANY = object()  # the error's param is not checked


def speech(**fields) -> bytes:
    """A speech body: a valid one, with ``fields`` changed (None removes a field)."""
    body = {"model": "toy", "input": "hello there", "seed": 3, "max_new_tokens": 20, **fields}
    return json.dumps({k: v for k, v in body.items() if v is not None}).encode()


def chat(**fields) -> bytes:
    """A chat body: a valid one, with ``fields`` changed."""
    body = {
        "model": "toy",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 5,
        **fields,
    }
    return json.dumps(body).encode()


def raw_speech(extra: str) -> bytes:
    """A speech body as raw text, for what ``json.dumps`` cannot write (NaN, lone surrogates)."""
    return ('{"model": "toy", "input": "hello", ' + extra + "}").encode()


# (id, method, path, body, headers, status, param)
BAD_REQUESTS = [
    ("empty input", "POST", SPEECH, speech(input=""), JSON, 400, "input"),
    ("whitespace input", "POST", SPEECH, speech(input=" \n\t  "), JSON, 400, "input"),
    ("input over 4096", "POST", SPEECH, speech(input="a" * 4097), JSON, 400, "input"),
    ("NUL in input", "POST", SPEECH, speech(input="a\u0000b"), JSON, 400, "input"),
    ("C0 controls", "POST", SPEECH, speech(input="bell \u0007 esc \u001b"), JSON, 400, "input"),
    ("C1 control", "POST", SPEECH, speech(input="next\u0085line"), JSON, 400, "input"),
    (
        "NUL in instructions",
        "POST",
        SPEECH,
        speech(instructions="a\u0000b"),
        JSON,
        400,
        "instructions",
    ),
    ("emoji only", "POST", SPEECH, speech(input="\U0001f600 \U0001f389"), JSON, 400, "input"),
    ("punctuation only", "POST", SPEECH, speech(input="?! ... \u2014 ;"), JSON, 400, "input"),
    (
        "lone surrogate",
        "POST",
        SPEECH,
        b'{"model": "toy", "input": "a\\ud800b"}',
        JSON,
        400,
        "input",
    ),
    ("unknown model", "POST", SPEECH, speech(model="nope"), JSON, 404, "model"),
    ("unknown voice", "POST", SPEECH, speech(voice="nobody"), JSON, 400, "voice"),
    ("voice object", "POST", SPEECH, speech(voice={"name": "alloy"}), JSON, 400, "voice"),
    ("bad format", "POST", SPEECH, speech(response_format="m4a"), JSON, 400, "response_format"),
    ("speed 0", "POST", SPEECH, speech(speed=0), JSON, 400, "speed"),
    ("speed -1", "POST", SPEECH, speech(speed=-1), JSON, 400, "speed"),
    ("speed 10", "POST", SPEECH, speech(speed=10), JSON, 400, "speed"),
    ("speed NaN", "POST", SPEECH, raw_speech('"speed": NaN'), JSON, 400, "speed"),
    ("speed Infinity", "POST", SPEECH, raw_speech('"speed": Infinity'), JSON, 400, "speed"),
    ("speed string", "POST", SPEECH, speech(speed="fast"), JSON, 400, "speed"),
    ("temperature NaN", "POST", SPEECH, raw_speech('"temperature": NaN'), JSON, 400, "temperature"),
    ("temperature bool", "POST", SPEECH, speech(temperature=True), JSON, 400, "temperature"),
    ("top_p string", "POST", SPEECH, speech(top_p="0.7"), JSON, 400, "top_p"),
    ("top_k bool", "POST", SPEECH, speech(top_k=True), JSON, 400, "top_k"),
    ("max_new_tokens str", "POST", SPEECH, speech(max_new_tokens="7"), JSON, 400, "max_new_tokens"),
    ("input number", "POST", SPEECH, speech(input=42), JSON, 400, "input"),
    ("input list", "POST", SPEECH, speech(input=["hello"]), JSON, 400, "input"),
    ("voice number", "POST", SPEECH, speech(voice=5), JSON, 400, "voice"),
    ("voice too long", "POST", SPEECH, speech(voice="v" * 4097), JSON, 400, "voice"),
    ("speed a boolean", "POST", SPEECH, speech(speed=True), JSON, 400, "speed"),
    ("stream a string", "POST", SPEECH, speech(stream="no"), JSON, 400, "stream"),
    ("missing input", "POST", SPEECH, speech(input=None), JSON, 400, "input"),
    ("missing model", "POST", SPEECH, speech(model=None), JSON, 400, "model"),
    ("not JSON", "POST", SPEECH, b"model=toy&input=hi", JSON, 400, None),
    ("truncated JSON", "POST", SPEECH, b'{"model": "toy", "input": ', JSON, 400, None),
    ("empty body", "POST", SPEECH, b"", JSON, 400, None),
    ("array body", "POST", SPEECH, b'[{"model": "toy", "input": "hi"}]', JSON, 400, None),
    ("null body", "POST", SPEECH, b"null", JSON, 400, None),
    # chat bodies may carry media parts in base64: their limit is 48 MiB
    ("chat body over 48 MB", "POST", CHAT, chat(pad="x" * (48 << 20)), JSON, 413, None),
    # speech bodies may carry an inline clip (ref_audio): their limit is 16 MiB
    ("speech body over 16 MB", "POST", SPEECH, speech(pad="x" * (16 << 20)), JSON, 413, None),
    ("bad stream_format", "POST", SPEECH, speech(stream_format="chunks"), JSON, 400, ANY),
    ("negative seed", "POST", SPEECH, speech(seed=-1), JSON, 400, "seed"),
    ("float seed", "POST", SPEECH, speech(seed=1.5), JSON, 400, "seed"),
    ("huge seed", "POST", SPEECH, speech(seed=2**64), JSON, 400, "seed"),
    ("string seed", "POST", SPEECH, speech(seed="7"), JSON, 400, "seed"),
    ("text/plain", "POST", SPEECH, speech(), {"content-type": "text/plain"}, 400, None),
    ("no content-type", "POST", SPEECH, speech(), {}, 400, None),
    ("GET speech", "GET", SPEECH, b"", {}, 405, None),
    ("unknown route", "POST", "/v1/audio/nope", speech(), JSON, 404, None),
    ("chat no messages", "POST", CHAT, chat(messages=[]), JSON, 400, "messages"),
    (
        "chat bad role",
        "POST",
        CHAT,
        chat(messages=[{"role": "x", "content": "hi"}]),
        JSON,
        400,
        "messages",
    ),
    ("chat bad modality", "POST", CHAT, chat(modalities=["video"]), JSON, 400, "modalities"),
    ("chat audio, no audio", "POST", CHAT, chat(modalities=["text", "audio"]), JSON, 400, "audio"),
    (
        "chat bad audio format",
        "POST",
        CHAT,
        chat(modalities=["text", "audio"], audio={"voice": "default", "format": "ogg"}),
        JSON,
        400,
        "audio",
    ),
    (
        "chat unknown voice",
        "POST",
        CHAT,
        chat(modalities=["text", "audio"], audio={"voice": "nobody", "format": "wav"}),
        JSON,
        400,
        "voice",
    ),
    (
        "chat lone surrogate",
        "POST",
        CHAT,
        b'{"model": "toy", "messages": [{"role": "user", "content": "a\\udc80"}]}',
        JSON,
        400,
        "messages",
    ),
    ("chat messages string", "POST", CHAT, chat(messages="hi"), JSON, 400, "messages"),
    ("chat n=2", "POST", CHAT, chat(n=2), JSON, 400, "n"),
    ("chat model missing", "POST", CHAT, b'{"messages": []}', JSON, 400, ANY),
]


@pytest.fixture(scope="module")
def base():
    with running_server("--model", "toy") as url:
        yield url


def _check_error(r: httpx.Response, status: int, param: object = ANY) -> dict:
    """``r`` is ``status`` with exactly OpenAI's error shape; returns the error object."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"].strip()
    assert isinstance(error["type"], str) and error["type"]
    assert error["code"] is None or isinstance(error["code"], str)
    if param is not ANY:
        assert error["param"] == param, error
    return error


def _send(client: httpx.Client, method: str, path: str, body: bytes, headers: dict):
    return client.request(method, path, content=body or None, headers=headers)


def test_the_table_has_30_distinct_cases():
    ids = [case[0] for case in BAD_REQUESTS]
    assert len(set(ids)) == len(ids) >= 30
    assert len({(c[1], c[2], c[3], tuple(c[4].items())) for c in BAD_REQUESTS}) == len(ids)


@pytest.mark.parametrize(
    ("method", "path", "body", "headers", "status", "param"),
    [pytest.param(*case[1:], id=case[0]) for case in BAD_REQUESTS],
)
def test_bad_request_gets_openai_error(base, method, path, body, headers, status, param):
    with httpx.Client(base_url=base, timeout=30) as client:
        r = _send(client, method, path, body, headers)
    error = _check_error(r, status, param)
    assert 400 <= status < 500 and error["type"] == "invalid_request_error"


def test_healthy_after_the_whole_table_on_one_connection(base):
    with httpx.Client(base_url=base, timeout=30) as client:
        for _, method, path, body, headers, status, param in BAD_REQUESTS:
            _check_error(_send(client, method, path, body, headers), status, param)
        health = client.get("/health")
        ok = client.post(SPEECH, content=speech(response_format="wav"), headers=JSON)
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert health.json()["live_requests"] == 0 and health.json()["live_loops"] == 0
    assert ok.status_code == 200 and ok.content[:4] == b"RIFF"


@pytest.mark.parametrize(
    "text", ["42", "\u65e5\u672c\u8a9e", "hi \U0001f600", "\u00e9t\u00e9!", "tab\tand\nnewline"]
)
def test_speakable_inputs_are_accepted(base, text):
    r = httpx.post(base + SPEECH, content=speech(input=text, response_format="pcm"), headers=JSON)
    assert r.status_code == 200, r.text
    assert len(r.content) > 0


def test_unknown_fields_are_ignored(base):
    """As before: extra fields (other providers' options, typos) are ignored, not rejected."""
    plain = httpx.post(base + SPEECH, content=speech(response_format="pcm"), headers=JSON)
    extra = httpx.post(
        base + SPEECH,
        content=speech(response_format="pcm", user="u-1", foo={"bar": [1, 2]}),
        headers=JSON,
    )
    assert extra.status_code == 200 and extra.content == plain.content
    r = httpx.post(base + CHAT, content=chat(logit_bias={"1": 2}, user="u"), headers=JSON)
    assert r.status_code == 200, r.text


def test_body_messages_are_specific(base):
    """Whole-body errors say what is wrong with the body, not "Invalid value for 'body'"."""
    r = httpx.post(base + SPEECH, content=speech(), headers={"content-type": "text/plain"})
    assert "Content-Type: application/json" in r.json()["error"]["message"]
    r = httpx.post(base + SPEECH, content=b"", headers=JSON)
    assert "empty" in r.json()["error"]["message"]
    r = httpx.post(base + SPEECH, content=b"[]", headers=JSON)
    assert "JSON object" in r.json()["error"]["message"]
    r = httpx.post(base + CHAT, content=chat(messages=[]), headers=JSON)
    assert "'messages'" in r.json()["error"]["message"]


def test_unparsable_bodies_say_why(base):
    """A body that cannot be parsed says what is wrong with it: the decoder's reason and where,
    invalid UTF-8, or nesting too deep to decode (not "is it UTF-8?" for valid UTF-8)."""

    def message(body: bytes) -> str:
        r = httpx.post(base + SPEECH, content=body, headers=JSON)
        return _check_error(r, 400, None)["message"]

    assert message(b'{"model": "toy", "input": ') == (
        "The request body is not valid JSON: Expecting value (at character 26)."
    )
    assert message(b'{"model": "toy", "input": "\xff\xfe"}') == (
        "The request body could not be read as JSON text: it is not valid UTF-8."
    )
    deep = b'{"model": "toy", "input": "hi", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    assert message(deep) == "The request body is nested too deeply to be read as JSON."


def test_cors_is_off_by_default(base):
    origin = {"origin": "http://app.example"}
    preflight = httpx.options(
        base + SPEECH, headers={**origin, "access-control-request-method": "POST"}
    )
    assert "access-control-allow-origin" not in preflight.headers
    r = httpx.get(base + "/v1/models", headers=origin)
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_no_key_configured_means_no_check(base):
    r = httpx.get(base + "/v1/models", headers={"authorization": "Bearer whatever"})
    assert r.status_code == 200


# ------------------------------------------------------------------ bounded queue


async def test_engine_refuses_requests_over_max_queued():
    engine = AsyncEngine([ModelInstance.load(build_card())], EngineConfig(max_queued=2))
    try:
        first = engine.add_request(Request("toy", text="one", seed=1))
        second = engine.add_request(Request("toy", text="two", seed=2))
        with pytest.raises(EngineOverloadedError) as info:
            engine.add_request(Request("toy", text="three", seed=3))
        assert info.value.retry_after >= 1
        assert engine.stats()["live_requests"] == 2
        async for _ in first:
            pass
        third = engine.add_request(Request("toy", text="three", seed=3))  # room again
        for stream in (second, third):
            async for _ in stream:
                pass
        assert set(engine.stats().values()) == {0}  # idle: nothing held
    finally:
        await engine.shutdown()


def test_engine_config_rejects_a_zero_queue():
    with pytest.raises(ValueError, match="max_queued"):
        EngineConfig(max_queued=0)


@pytest.fixture(scope="module")
def small_queue():
    # fcfs: under EDF a second stream is held at admission while the first runs short of audio
    # (its client reads nothing here), which made each test wait out the 30 s admission limit
    with running_server("--model", "toy", "--max-queued", "2", "--scheduling", "fcfs") as url:
        yield url


SLOW = {"input": "<slow> hello there", "seed": 11, "max_new_tokens": 50, "response_format": "pcm"}


def _wait_idle(client: httpx.Client) -> dict:
    """Health once the engine has no live request (aborts finish at the next step)."""
    for _ in range(200):
        health = client.get("/health").json()
        if health["live_requests"] == 0:
            return health
        time.sleep(0.05)
    return health


def _check_429(r: httpx.Response) -> None:
    error = _check_error(r, 429, None)
    assert error["code"] == "rate_limit_exceeded" and error["type"] == "requests"
    assert int(r.headers["retry-after"]) >= 1


def test_full_engine_answers_429_for_speech_and_chat(small_queue):
    with httpx.Client(base_url=small_queue, timeout=60) as client:
        long = speech(**{**SLOW, "max_new_tokens": 2000})
        with (
            client.stream("POST", SPEECH, content=long, headers=JSON) as a,
            client.stream("POST", SPEECH, content=long, headers=JSON) as b,
        ):
            assert a.status_code == b.status_code == 200
            pieces = a.iter_bytes(), b.iter_bytes()  # kept: a dropped iterator closes the stream
            assert all(next(p) for p in pieces)  # both admitted and producing
            assert client.get("/health").json()["live_requests"] == 2
            _check_429(client.post(SPEECH, content=speech(), headers=JSON))
            _check_429(client.post(CHAT, content=chat(), headers=JSON))
            sse = client.post(SPEECH, content=speech(stream_format="sse"), headers=JSON)
            _check_429(sse)
        # closing the streams aborted both requests: there is room again
        health = _wait_idle(client)
        assert health["live_requests"] == 0 and health["live_loops"] == 0
        assert client.post(SPEECH, content=speech(), headers=JSON).status_code == 200


def test_burst_gets_full_audio_or_429(small_queue):
    with httpx.Client(base_url=small_queue, timeout=60) as client:
        reference = client.post(SPEECH, content=speech(**SLOW, stream=False), headers=JSON)
        assert reference.status_code == 200 and len(reference.content) > 0

        def one(i: int) -> httpx.Response:
            body = speech(**SLOW, stream=bool(i % 2))
            return httpx.post(small_queue + SPEECH, content=body, headers=JSON, timeout=60)

        with ThreadPoolExecutor(12) as pool:
            results = list(pool.map(one, range(12)))
        ok = [r for r in results if r.status_code == 200]
        refused = [r for r in results if r.status_code != 200]
        for r in refused:
            _check_429(r)
        for r in ok:
            assert r.content == reference.content  # full audio, same seed, same bytes
        assert ok and refused, [r.status_code for r in results]
        health = _wait_idle(client)
        assert health["status"] == "ok"
        assert health["live_requests"] == health["live_loops"] == health["queued_units"] == 0


def test_openai_client_sees_rate_limit_error(small_queue):
    client = openai.OpenAI(base_url=small_queue + "/v1", api_key="unused", max_retries=0)
    with httpx.Client(base_url=small_queue, timeout=60) as http:
        long = speech(**{**SLOW, "max_new_tokens": 2000})
        with (
            http.stream("POST", SPEECH, content=long, headers=JSON) as a,
            http.stream("POST", SPEECH, content=long, headers=JSON) as b,
        ):
            pieces = a.iter_bytes(), b.iter_bytes()
            assert all(next(p) for p in pieces)
            with pytest.raises(openai.RateLimitError) as info:
                client.audio.speech.create(model="toy", voice="default", input="hello")
            assert info.value.code == "rate_limit_exceeded"
        _wait_idle(http)


# ------------------------------------------------------------------ API key and CORS

KEY = "sk-test-0123456789"
ORIGIN = "http://app.example"


@pytest.fixture(scope="module")
def guarded():
    with running_server("--model", "toy", "--api-key", KEY, "--cors-origin", ORIGIN) as url:
        yield url


def _bearer(key: str) -> dict:
    return {"authorization": f"Bearer {key}"}


@pytest.mark.parametrize(
    "headers",
    [
        {},
        _bearer("wrong"),
        {"authorization": "Bearer"},
        _bearer(KEY + "x"),
        {"authorization": f"Basic {KEY}"},
    ],
    ids=["none", "wrong", "empty", "longer", "basic"],
)
@pytest.mark.parametrize(
    ("method", "path"), [("GET", "/v1/models"), ("POST", SPEECH), ("POST", CHAT)]
)
def test_key_required_on_v1(guarded, headers, method, path):
    body = speech() if path == SPEECH else chat()
    r = httpx.request(method, guarded + path, content=body, headers={**JSON, **headers})
    error = _check_error(r, 401, None)
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key"
    assert KEY not in r.text
    assert r.headers["www-authenticate"] == "Bearer"


def test_right_key_is_served_and_health_is_open(guarded):
    assert httpx.get(guarded + "/health").json()["status"] == "ok"
    assert httpx.get(guarded + "/openapi.json").status_code == 200
    assert httpx.get(guarded + "/v1/models", headers=_bearer(KEY)).status_code == 200
    lower = {"authorization": f"bearer {KEY}"}  # the scheme is case-insensitive
    r = httpx.post(
        guarded + SPEECH, content=speech(response_format="wav"), headers={**JSON, **lower}
    )
    assert r.status_code == 200 and r.content[:4] == b"RIFF"


def test_key_is_checked_before_the_body_is_read(guarded):
    big = speech(pad="x" * (17 << 20))  # over the speech limit (16 MiB)
    _check_error(httpx.post(guarded + SPEECH, content=big, headers=JSON), 401)
    r = httpx.post(guarded + SPEECH, content=big, headers={**JSON, **_bearer(KEY)})
    _check_error(r, 413)


def test_openai_client_with_and_without_the_key(guarded):
    good = openai.OpenAI(base_url=guarded + "/v1", api_key=KEY, max_retries=0)
    audio = good.audio.speech.create(
        model="toy", voice="default", input="hello there", response_format="wav"
    )
    assert audio.content[:4] == b"RIFF"
    reply = good.chat.completions.create(
        model="toy", messages=[{"role": "user", "content": "hi"}], max_tokens=5
    )
    assert reply.choices[0].message.content
    assert {m.id for m in good.models.list()} == {"toy", "toy-tts"}
    bad = openai.OpenAI(base_url=guarded + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        bad.audio.speech.create(model="toy", voice="default", input="hello")
    assert info.value.status_code == 401 and info.value.code == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_cors_allows_the_given_origin_only(guarded):
    preflight = {
        "access-control-request-method": "POST",
        "access-control-request-headers": "authorization, content-type",
    }
    ok = httpx.options(guarded + SPEECH, headers={"origin": ORIGIN, **preflight})
    assert ok.status_code == 200  # a preflight carries no key and needs none
    assert ok.headers["access-control-allow-origin"] == ORIGIN
    assert "authorization" in ok.headers["access-control-allow-headers"].lower()
    evil = httpx.options(guarded + SPEECH, headers={"origin": "http://evil.example", **preflight})
    assert evil.status_code >= 400 and "access-control-allow-origin" not in evil.headers

    r = httpx.post(
        guarded + SPEECH,
        content=speech(response_format="pcm"),
        headers={**JSON, **_bearer(KEY), "origin": ORIGIN},
    )
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    assert "x-omnistep-seed" in r.headers["access-control-expose-headers"].lower()
    denied = httpx.get(guarded + "/v1/models", headers={"origin": ORIGIN})
    assert denied.status_code == 401  # errors carry CORS headers, so a page can read them
    assert denied.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.get(
        guarded + "/v1/models", headers={**_bearer(KEY), "origin": "http://evil.example"}
    )
    assert "access-control-allow-origin" not in other.headers


# ------------------------------------------------------------------ configuration


def _serve_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def test_api_key_from_flag_or_environment(monkeypatch):
    monkeypatch.delenv("OMNISTEP_API_KEY", raising=False)
    assert server_config(_serve_args()).api_key is None
    monkeypatch.setenv("OMNISTEP_API_KEY", "from-env")
    assert server_config(_serve_args()).api_key == "from-env"
    assert server_config(_serve_args("--api-key", "from-flag")).api_key == "from-flag"
    monkeypatch.setenv("OMNISTEP_API_KEY", "")
    assert server_config(_serve_args()).api_key is None  # an empty variable: no key
    with pytest.raises(OmnistepError):
        server_config(_serve_args("--api-key", ""))
    with pytest.raises(OmnistepError):
        server_config(_serve_args("--api-key", "two words"))


def test_server_config_hides_the_key_and_takes_origins():
    config = server_config(
        _serve_args("--api-key", KEY, "--cors-origin", ORIGIN, "--cors-origin", "http://b.example")
    )
    assert KEY not in repr(config)
    assert config.cors_origins == (ORIGIN, "http://b.example")
    assert ServerConfig().api_key is None and ServerConfig().cors_origins == ()


def test_max_queued_flag():
    assert _serve_args().max_queued == EngineConfig().max_queued == 256
    assert _serve_args("--max-queued", "3").max_queued == 3
    with pytest.raises(SystemExit):
        _serve_args("--max-queued", "0")


async def test_admission_max_wait_flag_reaches_the_engine():
    assert _serve_args().admission_max_wait == EngineConfig().admission_max_wait_s == 120.0
    assert _serve_args("--admission-max-wait", "0").admission_max_wait == 0.0
    for bad in ("-1", "inf", "soon"):
        with pytest.raises(SystemExit):
            _serve_args("--admission-max-wait", bad)
    engine = load_engine(["toy"], "cpu", 8, admission_max_wait=7.5)
    try:
        assert engine.config.admission_max_wait_s == 7.5
        assert engine._admission.policy.max_wait_s == 7.5
    finally:
        await engine.shutdown()
