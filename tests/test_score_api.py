"""``POST /v1/score`` on the real server (toy card, ``--batch-invariant``): a rollout answer,
JSON or safetensors, scores back to its recorded log-probs; each loop carries the prompt ids it
was conditioned on and its sampled-id mask; a bad answer is a 400 naming the field."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
from safetensors.numpy import load

from tests.serving import running_server

ST = "application/x-safetensors"


@pytest.fixture(scope="module")
def base():
    with running_server("--model", "toy", "--batch-invariant") as url:
        yield url


def _roll(base, accept="application/json", **body):
    payload = {"model": "toy", "inputs": ["score me", "and me too"], "n": 3, "seed": 7,
               "max_new_tokens": 12, "temperature": 0.7, **body}  # fmt: skip
    reply = httpx.post(base + "/v1/rollouts", json=payload, headers={"Accept": accept}, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply


def _score(base, content, content_type="application/json", accept="application/json", **query):
    return httpx.post(
        base + "/v1/score",
        content=content,
        params=query,
        headers={"Content-Type": content_type, "Accept": accept},
        timeout=60,
    )


@pytest.mark.parametrize("mode", ["processed", "policy"])
def test_a_json_rollout_scores_back_to_its_recorded_logprobs(base, mode):
    rollout = _roll(base, logprobs=mode).json()
    assert rollout["sampling"]["temperature"] == 0.7
    for group in rollout["groups"]:
        for sample in group["samples"]:
            loop = sample["loops"]["decode"]
            assert loop["prompt_ids"] and all(isinstance(t, int) for t in loop["prompt_ids"])
            assert np.array(loop["mask"]).shape == np.array(loop["tokens"]).shape
    reply = _score(base, json.dumps(rollout))
    assert reply.status_code == 200, reply.text
    scored = reply.json()
    assert scored["object"] == "score" and scored["mode"] == mode and scored["model"] == "toy"
    for group, got in zip(rollout["groups"], scored["groups"], strict=True):
        for sample, out in zip(group["samples"], got["samples"], strict=True):
            want = np.array(sample["loops"]["decode"]["logprobs"], dtype=np.float32)
            have = np.array(out["loops"]["decode"]["logprobs"], dtype=np.float32)
            assert out["index"] == sample["index"] and np.array_equal(have, want)


def test_a_safetensors_rollout_scores_back_as_safetensors(base):
    body = _roll(base, accept=ST).content
    reply = _score(base, body, content_type=ST, accept=ST)
    assert reply.status_code == 200, reply.text
    recorded, scored = load(body), load(reply.content)
    keys = [k for k in recorded if k.endswith(".logprobs")]
    assert keys and sorted(keys) == sorted(k for k in scored if k.endswith(".logprobs"))
    for key in keys:
        assert np.array_equal(scored[key], recorded[key])
    assert all(recorded[k.replace(".logprobs", ".mask")].all() for k in keys)  # one codebook


def test_bad_score_bodies_are_400s_naming_the_field(base):
    rollout = _roll(base).json()
    assert _score(base, b"not json").json()["error"]["param"] == "body"
    assert _score(base, json.dumps({"object": "x"})).json()["error"]["param"] == "object"
    no_prompt = json.loads(json.dumps(rollout))
    no_prompt["groups"][0]["samples"][1]["loops"]["decode"]["prompt_ids"] = None
    reply = _score(base, json.dumps(no_prompt))
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "groups[0].samples[1].loops.decode.prompt_ids"
    outside = json.loads(json.dumps(rollout))
    outside["groups"][0]["samples"][0]["loops"]["decode"]["tokens"][0] = [10**6]
    assert _score(base, json.dumps(outside)).status_code == 400
    assert _score(base, json.dumps(rollout), mode="greedy").json()["error"]["param"] == "mode"
    assert _score(base, json.dumps(rollout), entropy="true").status_code == 400  # numpy toy
    assert _score(base, json.dumps(rollout), bogus="1").status_code == 400
    assert _score(base, b"\x00" * 16, content_type=ST).json()["error"]["param"] == "body"
    # the server still answers
    assert _score(base, json.dumps(rollout)).status_code == 200
