"""Rollouts over conversations with media on the tiny Qwen2.5-Omni folder: the offline API
takes ``ChatMessage`` inputs, ``POST /v1/rollouts`` takes ``messages`` lists parsed by the chat
API's own code, the samples record the media hashes, and ``POST /v1/score`` rebuilds the
prompt from the answer's input and gives back the recorded log-probs."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import httpx
import numpy as np
import pytest

from omnistep.core import ChatMessage, ModelInstance, SamplingParams
from omnistep.engine import AsyncEngine
from omnistep.models.qwen2_5_omni.card import QwenOmniOptions, build_card
from omnistep.models.qwen2_5_omni.tiny import write_tiny_qwen_omni
from omnistep.offline import AsyncOmniEngine
from omnistep.server import ServerConfig, build_app
from omnistep.server.media import MediaLimits, decode_audio_item
from tests.test_chat_media import audio_file, tone

MODEL = "qwen2.5-omni"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root: Path = write_tiny_qwen_omni(tmp_path_factory.mktemp("omni_roll") / "ckpt")
    # batch-invariant kernels: rollout and score agree to the bit (C2), not to ~2e-6
    options = QwenOmniOptions(kv_cache_gb=0.02, batch_invariant=True)
    return ModelInstance.load(build_card(str(root), options))


def _clip() -> bytes:
    return audio_file(tone(1.2, 24000, freq=330.0), 24000)


async def test_offline_rollout_takes_a_conversation_with_audio(model):
    """A ``ChatMessage`` input with an audio item: both samples record its hash, the group
    keeps the conversation, and ``score`` gives the recorded log-probs back."""
    item = decode_audio_item(_clip(), "inputs[0]", MediaLimits(), 16000)
    conversation = (ChatMessage("user", "What is said?", parts=(item, "What is said?")),)
    engine = AsyncEngine([model])
    omni = AsyncOmniEngine(engine)
    try:
        sampling = SamplingParams(temperature=0.8, max_new_tokens=5)
        (group,) = await omni.rollout([conversation], n=2, seed=3, sampling=sampling)
        assert group.input == conversation and len(group.samples) == 2
        for sample in group.samples:
            assert sample.loops["think"].media == (item.sha256,)
            assert sample.loops["think"].prompt_ids is None  # not plain ids: rows inside
        scores = await omni.score(group)
        for sample, scored in zip(group.samples, scores, strict=True):
            got = scored["think"].detach().numpy()
            assert np.abs(got - sample.loops["think"].logprobs).max() <= 1e-6
        with pytest.raises(Exception, match="inputs\\[1\\]"):
            await omni.rollout(["fine", 42], n=1)
    finally:
        await engine.shutdown()


async def test_http_rollout_with_an_audio_part_scores_back(model, tmp_path):
    """``inputs`` holding a ``messages`` list with an ``input_audio`` part: the answer echoes
    the input and records the media hash; ``/v1/score`` on it equals the recorded log-probs
    within 1e-6; a bad part is a 400 naming ``inputs[k][i].content[j]``; an unknown field is
    still a 400; tampered media fail the hash check."""
    engine = AsyncEngine([model])
    app = build_app(engine, ServerConfig(voices_db=str(tmp_path / "voices.db")))
    clip = _clip()
    data = base64.b64encode(clip).decode()
    part = {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}
    messages = [{"role": "user", "content": [part, {"type": "text", "text": "What is said?"}]}]
    body = {
        "model": MODEL,
        "inputs": [messages, "plain text"],
        "n": 2,
        "seed": 5,
        "temperature": 0.8,
        "max_new_tokens": 5,
    }
    sha = decode_audio_item(clip, "x", MediaLimits(), 16000).sha256
    try:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test/") as client:
            r = await client.post("/v1/rollouts", json=body, timeout=600)
            assert r.status_code == 200, r.text
            rollout = r.json()
            media_group, text_group = rollout["groups"]
            assert media_group["input"] == messages and text_group["input"] == "plain text"
            for sample in media_group["samples"]:
                think = sample["loops"]["think"]
                assert think["media"] == [sha] and think["prompt_ids"] is None
            assert text_group["samples"][0]["loops"]["think"]["media"] == []
            r = await client.post("/v1/score", content=json.dumps(rollout), timeout=600)
            assert r.status_code == 200, r.text
            for group, scored in zip(rollout["groups"], r.json()["groups"], strict=True):
                for sample, got in zip(group["samples"], scored["samples"], strict=True):
                    want = np.array(sample["loops"]["think"]["logprobs"], np.float32)
                    have = np.array(got["loops"]["think"]["logprobs"], np.float32)
                    assert have.shape == want.shape and np.abs(have - want).max() <= 1e-6

            other = audio_file(tone(1.2, 24000, freq=500.0), 24000)
            tampered = json.loads(json.dumps(rollout))
            tampered["groups"][0]["input"][0]["content"][0]["input_audio"]["data"] = (
                base64.b64encode(other).decode()
            )
            r = await client.post("/v1/score", content=json.dumps(tampered))
            assert r.status_code == 400 and r.json()["error"]["param"] == "groups[0].input"

            empty = {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}
            bad = {**body, "inputs": ["ok", [{"role": "user", "content": [empty]}]]}
            r = await client.post("/v1/rollouts", json=bad)
            assert r.status_code == 400
            assert r.json()["error"]["param"] == "inputs[1][0].content[0]"
            r = await client.post("/v1/rollouts", json={**body, "logprob": "policy"})
            assert r.status_code == 400 and "logprob" in r.text
    finally:
        await engine.shutdown()
