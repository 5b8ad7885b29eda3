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


def _tampered(rollout, edit):
    body = json.loads(json.dumps(rollout))
    edit(body["groups"][0]["samples"][0]["loops"]["decode"], body)
    return json.dumps(body)


TAMPERED = {  # edit of sample 0's loop -> the param the 400 names ("" : a sample-level refusal)
    "huge id": (lambda loop, _: loop["tokens"].__setitem__(0, [2**70]), "tokens"),
    "string id": (lambda loop, _: loop["tokens"].__setitem__(0, ["a"]), "tokens"),
    "float id": (lambda loop, _: loop["tokens"].__setitem__(0, [1.5]), "tokens"),
    "ragged": (lambda loop, _: loop["tokens"].__setitem__(0, [1, 2]), "tokens"),
    "no frame": (lambda loop, _: loop.update(tokens=[], logprobs=[], mask=[]), "tokens"),
    "no codebook": (lambda loop, _: loop.update(tokens=[[] for _ in loop["tokens"]]), "tokens"),
    "2 codebooks": (
        lambda loop, _: loop.update(
            tokens=[t * 2 for t in loop["tokens"]], logprobs=None, mask=None
        ),
        "samples",
    ),
    "short mask": (lambda loop, _: loop.update(mask=loop["mask"][:-1]), "mask"),
    "short logprobs": (lambda loop, _: loop.update(logprobs=loop["logprobs"][:-1]), "logprobs"),
    "short versions": (lambda loop, _: loop.update(weight_versions=[0]), "weight_versions"),
    "empty prompt": (lambda loop, _: loop.update(prompt_ids=[]), "samples"),
    "unknown loop": (
        lambda loop, body: body["groups"][0]["samples"][0].update(loops={"bogus": loop}),
        "samples",
    ),  # fmt: skip
}


@pytest.mark.parametrize("case", sorted(TAMPERED))
def test_tampered_samples_are_400s_never_500s_or_hangs(base, case):
    # each was a 500 (numpy/toy errors) or, for an unknown loop, a request that never
    # answered (StopIteration raised into the worker thread's future)
    rollout = _roll(base, n=2).json()
    edit, param = TAMPERED[case]
    reply = _score(base, _tampered(rollout, edit))
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"].endswith(param)
    # the recorded log-probs are still reproduced
    again = _score(base, json.dumps(rollout)).json()
    recorded = rollout["groups"][1]["samples"][1]["loops"]["decode"]["logprobs"]
    assert again["groups"][1]["samples"][1]["loops"]["decode"]["logprobs"] == recorded
