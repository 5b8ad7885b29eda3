"""RL over HTTP on the real server (toy card): ``POST /v1/rollouts`` as JSON and as one
safetensors body, ``POST /v1/weights`` from a path or an uploaded file, ``GET /v1/weights``,
bad input as OpenAI-style 4xx errors that hold nothing, and the API key."""

from __future__ import annotations

import base64
import io
import json
import time

import httpx
import numpy as np
import pytest
import soundfile as sf
from safetensors.numpy import load, save, save_file

from omnistep.models.toy.lm import ToyLM
from tests.serving import running_server

KEY = "sk-rollout-test"


@pytest.fixture(scope="module")
def base():
    with running_server("--model", "toy") as url:
        yield url


def _roll(base, timeout=60.0, **body):
    payload = {"model": "toy", "inputs": ["roll me", "and me"], "n": 3, "seed": 40,
               "max_new_tokens": 10, **body}  # fmt: skip
    # json.dumps escapes non-ASCII (httpx's json= cannot send a lone surrogate)
    return httpx.post(
        base + "/v1/rollouts",
        content=json.dumps(payload),
        headers={"Content-Type": "application/json"},
        timeout=timeout,
    )


def test_rollout_json_groups_samples_and_loops(base):
    reply = _roll(base, audio_format="wav")
    assert reply.status_code == 200, reply.text
    out = reply.json()
    assert out["object"] == "rollout" and out["model"] == "toy" and out["logprobs"] == "processed"
    assert [g["input"] for g in out["groups"]] == ["roll me", "and me"]
    for group in out["groups"]:
        assert [s["seed"] for s in group["samples"]] == [40, 41, 42]
        for sample in group["samples"]:
            loop = sample["loops"]["decode"]
            assert len(loop["tokens"]) == loop["num_steps"] == len(loop["logprobs"]) <= 10
            assert all(len(t) == 1 for t in loop["tokens"]) and loop["stop_reason"] in (
                "eos",
                "length",
            )
            assert all(v == 0 for v in loop["weight_versions"])
            audio, rate = sf.read(io.BytesIO(base64.b64decode(sample["audio"])), dtype="float32")
            assert rate == 24000 and audio.size > 0
    # the same call gives the same samples (seeds S+k)
    again = _roll(base, audio_format="wav").json()
    assert again["groups"][0]["samples"] == out["groups"][0]["samples"]


def test_rollout_safetensors_body_equals_the_json(base):
    as_json = _roll(base, logprobs="policy").json()
    reply = httpx.post(
        base + "/v1/rollouts",
        json={
            "model": "toy",
            "inputs": ["roll me", "and me"],
            "n": 3,
            "seed": 40,
            "max_new_tokens": 10,
            "logprobs": "policy",
        },  # fmt: skip
        headers={"Accept": "application/x-safetensors"},
        timeout=60,
    )
    assert reply.headers["content-type"] == "application/x-safetensors"
    tensors = load(reply.content)
    header_len = int.from_bytes(reply.content[:8], "little")
    meta = json.loads(json.loads(reply.content[8 : 8 + header_len])["__metadata__"]["rollout"])
    assert meta["logprobs"] == "policy"
    for i, group in enumerate(as_json["groups"]):
        for k, sample in enumerate(group["samples"]):
            loop = sample["loops"]["decode"]
            tokens = tensors[f"g{i}.s{k}.decode.tokens"]
            assert tokens.dtype == np.int64 and tokens.tolist() == loop["tokens"]
            assert np.allclose(tensors[f"g{i}.s{k}.decode.logprobs"], loop["logprobs"], atol=1e-6)
            assert meta["groups"][i]["samples"][k]["seed"] == sample["seed"]


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"n": 0}, 400, "n"),
        ({"n": 300}, 400, "n"),
        ({"n": "3"}, 400, "n"),
        ({"inputs": []}, 400, "inputs"),
        ({"inputs": ["x"] * 5, "n": 256}, 400, "n"),
        ({"logprobs": "raw"}, 400, "logprobs"),
        ({"model": "nope"}, 404, "model"),
        ({"audio_format": "m4a"}, 400, "audio_format"),
        ({"temperature": -1}, 400, "temperature"),
        ({"inputs": [1]}, 400, "inputs"),
        ({"inputs": ["a\ud800b"]}, 400, "inputs"),  # a lone surrogate: was a 500
        ({"inputs": ["a\u0000b\u001b[31m"]}, 400, "inputs"),  # controls, as /v1/audio/speech
        ({"inputs": ["a" * 5000]}, 400, "inputs"),
    ],
)
def test_bad_rollouts_are_4xx_and_hold_nothing(base, body, status, param):
    reply = _roll(base, **body)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert httpx.get(base + "/health").json()["live_requests"] == 0


@pytest.mark.parametrize("level", [-1, 4.01, "0.7", True, [], 1e309])
def test_a_bad_flow_noise_level_is_a_400_naming_it(base, level):
    """(``true`` was taken as noise 1.0 and ``"0.7"`` as 0.7; the message said 'body'.)"""
    reply = _roll(base, flow_noise_level=level)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "flow_noise_level"
    assert "Invalid value for 'flow_noise_level'" in error["message"]


def test_a_card_without_a_flow_decoder_ignores_flow_noise_level(base):
    reply = _roll(base, flow_noise_level=0.7, audio_format="wav")
    assert reply.status_code == 200, reply.text
    samples = [s for g in reply.json()["groups"] for s in g["samples"]]
    assert samples and all("denoise" not in s and s["audio"] for s in samples)


def test_weights_from_a_path_and_an_upload(tmp_path):
    table = ToyLM().table
    save_file({"table": np.ascontiguousarray(table[::-1])}, str(tmp_path / "w1.safetensors"))
    save_file({"table": np.ascontiguousarray(table * 0.5)}, str(tmp_path / "w2.safetensors"))
    save_file({"tabel": table}, str(tmp_path / "bad.safetensors"))
    # a client with a minute of patience: the server is a subprocess, slow on a loaded box
    with (
        running_server("--model", "toy", "--api-key", KEY) as url,
        httpx.Client(timeout=60) as http,
    ):
        auth = {"Authorization": f"Bearer {KEY}"}
        assert http.get(url + "/v1/weights").status_code == 401
        assert http.post(url + "/v1/weights", json={"path": "x"}).status_code == 401
        versions = http.get(url + "/v1/weights", headers=auth).json()
        assert versions["data"] == [{"object": "weights", "model": "toy", "version": 0}]

        bad = http.post(
            url + "/v1/weights", json={"path": str(tmp_path / "bad.safetensors")}, headers=auth
        )
        assert bad.status_code == 400 and "tabel" in bad.json()["error"]["message"]
        missing = http.post(url + "/v1/weights", json={"path": "/nope.st"}, headers=auth)
        assert missing.status_code == 400 and missing.json()["error"]["param"] == "path"
        junk = http.post(
            url + "/v1/weights",
            content=b"not safetensors",
            headers={**auth, "Content-Type": "application/x-safetensors"},
        )
        assert junk.status_code == 400

        done = http.post(
            url + "/v1/weights", json={"path": str(tmp_path / "w1.safetensors")}, headers=auth
        )
        assert done.json() == {"object": "weights", "model": "toy", "version": 1}
        upload = http.post(
            url + "/v1/weights?version=7&mode=drain",
            content=(tmp_path / "w2.safetensors").read_bytes(),
            headers={**auth, "Content-Type": "application/x-safetensors"},
        )
        assert upload.json()["version"] == 7, upload.text
        roll = http.post(
            url + "/v1/rollouts",
            json={"model": "toy", "inputs": ["after"], "max_new_tokens": 4},
            headers=auth,
            timeout=60,
        ).json()
        assert roll["groups"][0]["samples"][0]["loops"]["decode"]["weight_versions"] == [7] * 4
        assert roll["weight_version"] == roll["groups"][0]["samples"][0]["weight_version"] == 7
        assert http.get(url + "/v1/weights", headers=auth).json()["data"][0]["version"] == 7

        # versions only go up: a lower or equal one is a 409 naming both; nothing changes
        for version in (3, 7):
            back = http.post(
                url + "/v1/weights",
                json={"path": str(tmp_path / "w1.safetensors"), "version": version},
                headers=auth,
            )
            assert back.status_code == 409, back.text
            error = back.json()["error"]
            assert error["code"] == "version_conflict" and error["param"] == "version"
            assert f"version {version}" in error["message"] and "runs version 7" in error["message"]
        # NaN is refused (400, nothing changes) unless check_finite is false
        poisoned = table.copy()
        poisoned[1, 2] = np.nan
        save_file({"table": np.ascontiguousarray(poisoned)}, str(tmp_path / "nan.safetensors"))
        nan = http.post(
            url + "/v1/weights", json={"path": str(tmp_path / "nan.safetensors")}, headers=auth
        )
        assert nan.status_code == 400 and "NaN/Inf" in nan.json()["error"]["message"], nan.text
        assert http.get(url + "/v1/weights", headers=auth).json()["data"][0]["version"] == 7
        allowed = http.post(
            url + "/v1/weights?check_finite=false",
            content=(tmp_path / "nan.safetensors").read_bytes(),
            headers={**auth, "Content-Type": "application/x-safetensors"},
        )
        assert allowed.status_code == 200 and allowed.json()["version"] == 8, allowed.text


def test_a_rollout_of_more_samples_than_the_engine_queue_runs(base):
    # 64 x 5 = 320 samples > --max-queued 256: within the route's 1024, it must not be a 429
    reply = _roll(base, inputs=["a"] * 64, n=5, max_new_tokens=2)
    assert reply.status_code == 200, reply.text
    assert [len(g["samples"]) for g in reply.json()["groups"]] == [5] * 64
    assert httpx.get(base + "/health").json()["live_requests"] == 0


@pytest.mark.parametrize(
    ("kwargs", "param", "says"),
    [
        ({}, "body", "takes JSON"),  # no body
        ({"content": b"path=/x", "headers": {"Content-Type": "text/plain"}}, "body", "JSON"),
        ({"json": {"path": "/x", "version": -1}}, "version", "Invalid value for 'version'"),
        ({"json": {"path": "/x", "version": "abc"}}, "version", "valid integer"),
        ({"json": {"path": "/x", "mode": "now"}}, "mode", "'pause' or 'drain'"),
        ({"json": {"path": "/tmp"}}, "path", "no weights file"),  # a directory
        # uploads: query parameters checked as the JSON fields (these were 500s)
        ({"params": {"mode": "now"}, "upload": True}, "mode", "'pause' or 'drain'"),
        ({"params": {"model": ""}, "upload": True}, "model", "at least 1"),
        ({"params": {"version": str(2**70)}, "upload": True}, "version", "less than"),
        ({"params": {"version": "\u00b2"}, "upload": True}, "version", "non-negative"),
        ({"content": b"junk", "upload": True}, "weights", "the uploaded body is not"),
        # a misspelt query parameter applied the update under the default version (200), and
        # a JSON body ignored the query's version
        ({"params": {"verison": "7"}, "upload": True}, "verison", "unknown query parameter"),
        ({"params": {"version": "7"}, "json": {"path": "/x"}}, "version", "in the body"),
    ],
)
def test_bad_weight_updates_are_400s_naming_the_field(base, kwargs, param, says):
    kwargs = dict(kwargs)
    if kwargs.pop("upload", False):
        kwargs.setdefault("content", save({"table": np.ascontiguousarray(ToyLM().table)}))
        kwargs["headers"] = {"Content-Type": "application/x-safetensors"}
    reply = httpx.post(base + "/v1/weights", timeout=60, **kwargs)  # a loaded CI box
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and says in error["message"], error
    assert "/tmp/omnistep-weights-" not in error["message"]  # no server temp path
    assert "pydantic" not in error["message"]
    assert httpx.get(base + "/v1/weights").json()["data"][0]["version"] == 0


def test_unknown_rollout_fields_are_400s_naming_them(base):
    reply = _roll(base, logprob="policy", temprature=0.5)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert "'logprob'" in error["message"] and "'temprature'" in error["message"]
    assert error["param"] == "logprob"


def test_min_new_tokens_holds_the_end_off(base):
    # the toy's EOS is rare: at temperature 5 about 0.8% a step, so 8 samples of up to 200
    # steps end early (seeded: the same every run)
    fields = {"inputs": ["stop early"], "n": 8, "max_new_tokens": 200, "temperature": 5.0}
    free = _roll(base, **fields).json()
    steps = [s["loops"]["decode"]["num_steps"] for s in free["groups"][0]["samples"]]
    assert min(steps) < 200, steps
    held = _roll(base, **fields, min_new_tokens=200).json()
    assert [s["loops"]["decode"]["num_steps"] for s in held["groups"][0]["samples"]] == [200] * 8
    bad = _roll(base, max_new_tokens=4, min_new_tokens=8)
    assert bad.status_code == 400 and "min_new_tokens" in bad.json()["error"]["message"]


def test_a_client_that_leaves_aborts_its_rollout(base):
    # nobody reads the answer: the samples must not run on (<slow>: 20 ms per toy step)
    with pytest.raises(httpx.ReadTimeout):
        _roll(base, inputs=["<slow> long"], n=3, max_new_tokens=4000, timeout=1.0)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        health = httpx.get(base + "/health").json()
        if health["live_requests"] == 0:
            break
        time.sleep(0.05)
    assert health["live_requests"] == 0 and health["live_loops"] == 0


@pytest.mark.parametrize(
    ("accept", "safetensors"),
    [
        ("application/x-safetensors", True),
        ("application/json, application/x-safetensors", True),
        ("application/x-safetensors;q=0, application/json", False),  # a refusal
        ("application/json;q=1, application/x-safetensors;q=0.5", False),
        ("application/json", False),
    ],
)
def test_accept_header_q_values_pick_the_body(base, accept, safetensors):
    payload = {"model": "toy", "inputs": ["q"], "max_new_tokens": 2}
    reply = httpx.post(base + "/v1/rollouts", json=payload, headers={"Accept": accept})
    assert reply.status_code == 200, reply.text
    is_tensors = reply.headers["content-type"].startswith("application/x-safetensors")
    assert is_tensors == safetensors
