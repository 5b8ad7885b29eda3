"""The ``chatterbox`` card end to end on a tiny published folder written by the reference's own
classes (T3, S3Gen flow, HiFT, ``conds.pt``): the served waveform equals upstream's
``S3Token2Wav.inference`` on the tokens T3 sampled, with the same flow and HiFT seeds (T3's
own sampling is compared in ``test_chatterbox_t3.py``: upstream draws it from the global
generator, which no served request can share); C1; ``/v1/audio/speech`` streamed == whole
bytes; voices; the text front end; the loader's errors."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest
import torch

from omnistep.core import (
    ExecutionProfile,
    InvalidRequestError,
    ModelInstance,
    Request,
    SamplingParams,
    derived_seed,
)
from omnistep.engine import AsyncEngine
from omnistep.engine.collect import collect
from omnistep.models import registry
from omnistep.models.chatterbox.card import ChatterboxOptions, build_card
from omnistep.models.chatterbox.frontend import FLOW_SEED_KEY, HIFT_SEED_KEY, punc_norm
from omnistep.models.chatterbox.loader import ChatterboxCheckpointError
from omnistep.runners import locate
from tests.chatterbox_ref.env import call_reference

TEXT = "hello there, how are you"
STEPS = 10


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    path = tmp_path_factory.mktemp("chatterbox-card")
    call_reference("tests.chatterbox_ref.upstream_s3gen:write_folder", root=str(path))
    return path


def _engine(root, **options) -> AsyncEngine:
    card = build_card(str(root), ChatterboxOptions(kv_cache_gb=0.01, **options))
    return AsyncEngine([ModelInstance.load(card)])


async def _speak(engine, seed: int, steps: int = STEPS, **fields):
    req = Request(
        "chatterbox",
        text=TEXT,
        seed=seed,
        sampling=SamplingParams(max_new_tokens=steps),
        profile=ExecutionProfile.ROLLOUT,
        **fields,
    )
    return await collect(engine, req)


def _tokens(got) -> list[int]:
    return [int(r.tokens[0]) for r in got.trajectories["decode"]]


async def test_served_waveform_equals_upstream_on_the_sampled_tokens(root):
    """In the reference setting (``flow_chunk_tokens=0``: one flow window and one HiFT call,
    upstream's noise layouts)."""
    engine = _engine(root, flow_chunk_tokens=0)
    try:
        got = await _speak(engine, seed=5)
        again = await _speak(engine, seed=5)
        other = await _speak(engine, seed=6, steps=4)
    finally:
        await engine.shutdown()
    tokens = _tokens(got)
    assert 0 < len(tokens) <= STEPS
    speech = [t for t in tokens if t < 6561]
    assert got.audio.shape == (len(speech) * 2 * 480,)
    np.testing.assert_array_equal(again.audio, got.audio)  # C1: same seed, same samples
    assert not np.array_equal(other.audio, got.audio)
    ref = call_reference(
        "tests.chatterbox_ref.upstream_s3gen:token2wav",
        root=str(root),
        tokens=speech,
        flow_seed=derived_seed(5, FLOW_SEED_KEY),
        hift_seed=derived_seed(5, HIFT_SEED_KEY),
    )
    assert np.abs(ref).max() > 1e-3
    np.testing.assert_allclose(got.audio, ref, atol=1e-4, rtol=0)


async def test_speech_route_streams_the_same_bytes(root, tmp_path):
    from omnistep.server import ServerConfig, build_app

    engine = _engine(root)
    app = build_app(engine, ServerConfig(voices_db=str(tmp_path / "voices.db")))
    body = {
        "model": "chatterbox",
        "input": TEXT,
        "voice": "alloy",
        "seed": 3,
        "max_new_tokens": 6,
        "response_format": "pcm",
    }
    try:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            whole = await http.post("/v1/audio/speech", json=body, timeout=300)
            streamed = await http.post(
                "/v1/audio/speech", json={**body, "stream": True}, timeout=300
            )
            bad = await http.post("/v1/audio/speech", json={**body, "voice": "nobody"})
            unguided = await http.post(
                "/v1/audio/speech", json={**body, "cfg_weight": 0.0, "exaggeration": 1.5}
            )
            too_much = await http.post("/v1/audio/speech", json={**body, "exaggeration": 3.0})
    finally:
        await engine.shutdown()
    assert whole.status_code == 200, whole.text
    assert len(whole.content) > 0 and len(whole.content) % (480 * 2 * 2) == 0
    assert streamed.content == whole.content
    assert bad.status_code == 400 and "voice" in bad.text
    assert unguided.status_code == 200 and unguided.content != whole.content
    assert too_much.status_code == 400 and "exaggeration" in too_much.text


async def test_requests_batched_together_equal_each_alone(root):
    engine = _engine(root)
    try:
        alone = [await _speak(engine, seed=s, steps=6) for s in (5, 6)]
        together = await asyncio.gather(*(_speak(engine, seed=s, steps=6) for s in (5, 6)))
    finally:
        await engine.shutdown()
    for a, b in zip(alone, together, strict=True):
        assert _tokens(a) == _tokens(b)
        np.testing.assert_allclose(a.audio, b.audio, atol=1e-5, rtol=0)


def test_voices_and_front_end(root):
    card = build_card(str(root), ChatterboxOptions(kv_cache_gb=0.01))
    assert card.default_voice == "default" and "alloy" in card.voices
    card.voice_validator("nova")
    with pytest.raises(InvalidRequestError, match="unknown voice"):
        card.voice_validator("somebody")
    assert punc_norm("") == "You need to add some text for me to talk."
    assert punc_norm("hello   world\u2026 yes: no") == "Hello world,  yes, no."
    assert punc_norm("Done!") == "Done!"
    assert punc_norm("it\u2019s \u201cfine\u201d") == 'It\'s "fine".'


def test_registry_locate_and_loader_errors(root, tmp_path):
    assert "chatterbox" in registry.FAMILIES
    assert locate.LAYOUTS["chatterbox"].file_sets[0][0] == "t3_cfg.safetensors"
    with pytest.raises(InvalidRequestError, match="needs weights"):
        build_card(None)
    for name in ("ve.safetensors", "t3_cfg.safetensors", "tokenizer.json"):
        (tmp_path / name).write_bytes((root / name).read_bytes())
    with pytest.raises(ChatterboxCheckpointError, match="s3gen.safetensors"):
        build_card(str(tmp_path))


async def test_rollout_records_flow_sde_steps_that_score_reproduces(root):
    """``flow_noise_level`` > 0 under ROLLOUT: S3Gen's 10 Euler steps are sampled as Flow-GRPO
    SDE steps and recorded; ``score_steps`` recomputes each step's log-prob within 1e-6
    (``batch_invariant``: serving stepped each request alone, as scoring does). T3's records
    carry the guided log-probs it sampled from."""
    card = build_card(str(root), ChatterboxOptions(kv_cache_gb=0.01, batch_invariant=True))
    instance = ModelInstance.load(card)
    engine = AsyncEngine([instance])
    sampling = SamplingParams(max_new_tokens=4, flow_noise_level=0.3)
    try:
        got, beside = await asyncio.gather(
            collect(
                engine,
                Request(
                    "chatterbox",
                    text=TEXT,
                    seed=5,
                    sampling=sampling,
                    profile=ExecutionProfile.ROLLOUT,
                ),
            ),
            _speak(engine, seed=6, steps=4),
        )
    finally:
        await engine.shutdown()
    records = got.trajectories["flow"]
    assert [r.step for r in records] == list(range(10))
    recorded = torch.tensor([r.logprob for r in records], dtype=torch.float64)
    serving = instance.components["s3gen"]
    scored = serving.score_steps(records)
    assert scored.dtype == torch.float64 and not scored.requires_grad
    np.testing.assert_allclose(scored.numpy(), recorded.numpy(), atol=1e-6, rtol=0)
    # a trainer's copy: the same numbers, with a graph to the flow's weights by published name
    trainer = serving.training_copy()
    weights = trainer.trainable_weights(["flow.decoder.estimator.final_proj.weight"])
    trained = trainer.score_steps(records)
    np.testing.assert_allclose(trained.detach().numpy(), recorded.numpy(), atol=1e-6, rtol=0)
    trained.sum().backward()
    assert weights["flow.decoder.estimator.final_proj.weight"].grad.abs().sum() > 0
    specs = serving.weight_specs()
    assert specs["flow.encoder_proj.weight"] == ((80, 512), "torch.float32")
    assert all(r.std > 0 for r in records)
    decode = got.trajectories["decode"]
    assert len(decode) == 4 and all(np.isfinite(r.logprobs).all() for r in decode)
    assert not np.array_equal(got.audio, beside.audio)


async def test_weights_command_writes_a_folder_the_registry_serves(tmp_path):
    """``omnistep weights chatterbox DIR`` (``tiny.write_folder``, this family's own modules
    writing the published names): the registry finds the family from the files and serves it."""
    folder = registry.write_weights("chatterbox", tmp_path / "tiny")
    assert locate.infer_family(folder)[0] == "chatterbox"
    card = registry.build_card(f"chatterbox={folder}", kv_cache_gb=0.01)
    instance = ModelInstance.load(card)
    engine = AsyncEngine([instance])
    try:
        got = await _speak(engine, seed=2, steps=3)
        # a weight update by published names reaches S3Gen's flow (and T3's, by its names)
        bias = torch.full((80,), 0.25)
        instance.update_weights({"flow.encoder_proj.bias": bias}, version=1)
        updated = await _speak(engine, seed=2, steps=3)
    finally:
        await engine.shutdown()
    assert got.audio.size > 0 and np.abs(got.audio).max() > 0
    flow = instance.components["s3gen"]
    assert torch.equal(flow.flow.encoder_proj.bias, bias) and flow.weight_version == 1
    assert _tokens(updated) == _tokens(got) and not np.array_equal(updated.audio, got.audio)
