"""Flow-GRPO on Chatterbox's S3Gen flow through the offline API and HTTP (tiny folder written
by this family's own ``tiny.write_folder``, ``batch_invariant``).

With ``flow_noise_level`` > 0 a rollout sample carries the flow's 10 SDE steps as
``DenoiseSteps`` (shared ``DenoiseStepRecord``s, float32 ``[frames, 80]`` arrays), beside T3's
actions; ``score`` recomputes every step's log-prob within 1e-6 (and T3's), on a trainer's
copy with gradients into the flow's weights; ``/v1/rollouts`` returns them as JSON and
safetensors and ``POST /v1/score`` recomputes both loops from either body.
"""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from safetensors.numpy import load

from omnistep.core import DenoiseStepRecord, SamplingParams
from omnistep.models.chatterbox.tiny import write_folder
from omnistep.offline import OmniEngine

LEVEL = 0.3
SDE = SamplingParams(flow_noise_level=LEVEL, max_new_tokens=4)
ST = "application/x-safetensors"
TEXT = "hello there"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_folder(tmp_path_factory.mktemp("chatterbox_rl"), seed=1)


@pytest.fixture(scope="module")
def omni(folder):
    with OmniEngine(f"chatterbox={folder}", batch_invariant=True, kv_cache_gb=0.01) as engine:
        yield engine


def test_offline_rollout_records_flow_steps_that_score_reproduces(omni):
    [group] = omni.rollout([TEXT], n=2, seed=5, sampling=SDE, audio=True, progress=False)
    for sample in group.samples:
        steps = sample.denoise["flow"]
        assert steps.noise_level == LEVEL and steps.seed == sample.seed
        assert [r.step for r in steps.steps] == list(range(10))
        for r in steps.steps:
            assert isinstance(r, DenoiseStepRecord)
            frames = r.window[3] - r.window[0]
            assert r.x.shape == r.mean.shape == r.x_next.shape == (frames, 80)
            # the flow's frames: the voice prompt's mel, then 2 per speech token (kept)
            tokens = int((sample.loops["decode"].tokens < 6561).sum())
            assert r.x.dtype == np.float32 and r.window == (0, frames - 2 * tokens, frames, frames)
            assert r.std > 0 and np.isfinite(r.logprob)
        assert set(sample.loops) == {"decode"} and sample.loops["decode"].tokens.shape[0] >= 1
    a, b = (s.denoise["flow"].logprobs for s in group.samples)
    assert not np.array_equal(a, b)  # seeds 5 and 6 sample different SDE paths
    scores = omni.score(group)
    for scored, sample in zip(scores, group.samples, strict=True):
        got = scored["flow"].detach().cpu().numpy()
        np.testing.assert_allclose(got, sample.denoise["flow"].logprobs, rtol=0, atol=1e-6)
        got = scored["decode"].detach().cpu().numpy()
        np.testing.assert_allclose(got, sample.loops["decode"].logprobs, rtol=0, atol=1e-6)
    trainer = omni.trainer()
    name = "flow.decoder.estimator.final_proj.weight"
    params = trainer.weights()
    [scored] = omni.score(group.samples[0], loops="flow", trainer=trainer)
    scored["flow"].sum().backward()
    assert params[name].grad is not None and params[name].grad.abs().sum() > 0


def test_level_zero_records_no_flow_steps(omni):
    [group] = omni.rollout([TEXT], n=1, seed=5, sampling=SamplingParams(max_new_tokens=4))
    assert group.samples[0].denoise == {} and set(group.samples[0].loops) == {"decode"}


async def test_http_rollouts_and_score(folder, tmp_path):
    from omnistep.core import ModelInstance
    from omnistep.engine import AsyncEngine
    from omnistep.models.chatterbox.card import ChatterboxOptions, build_card
    from omnistep.server import ServerConfig, build_app

    options = ChatterboxOptions(kv_cache_gb=0.01, batch_invariant=True)
    engine = AsyncEngine([ModelInstance.load(build_card(str(folder), options))])
    app = build_app(engine, ServerConfig(voices_db=str(tmp_path / "voices.db")))
    body = {"model": "chatterbox", "inputs": [TEXT], "n": 2, "seed": 3,
            "flow_noise_level": LEVEL, "max_new_tokens": 4}  # fmt: skip
    try:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            as_json = await http.post("/v1/rollouts", json=body, timeout=300)
            assert as_json.status_code == 200, as_json.text
            tensors = await http.post(
                "/v1/rollouts", json=body, headers={"Accept": ST}, timeout=300
            )
            assert tensors.status_code == 200, tensors.text
            scored = await http.post("/v1/score", json=as_json.json(), timeout=300)
            scored_st = await http.post(
                "/v1/score",
                content=tensors.content,
                headers={"Content-Type": ST, "Accept": ST},
                timeout=300,
            )
            broken = as_json.json()
            del broken["groups"][0]["samples"][0]["denoise"]["flow"]["x"]
            bad = await http.post("/v1/score", json=broken, timeout=300)
            short = as_json.json()  # a frame fewer than T3's tokens make: not replayable
            steps = short["groups"][0]["samples"][1]["denoise"]["flow"]
            steps["x"], steps["x_next"] = ([x[:-1] for x in steps[k]] for k in ("x", "x_next"))
            cut = await http.post("/v1/score", json=short, timeout=300)
    finally:
        await engine.shutdown()
    out = as_json.json()
    arrays = load(tensors.content)
    for k, sample in enumerate(out["groups"][0]["samples"]):
        steps = sample["denoise"]["flow"]
        assert steps["noise_level"] == LEVEL and steps["num_steps"] == 10
        frames = steps["window"][0][3]
        assert np.asarray(steps["x"]).shape == (10, frames, 80)
        got = arrays[f"g0.s{k}.flow.logprobs"]
        assert got.dtype == np.float64 and np.array_equal(got, steps["logprobs"])
        np.testing.assert_array_equal(arrays[f"g0.s{k}.flow.3.mean"], np.float32(steps["mean"][3]))
    assert scored.status_code == 200, scored.text
    for k, sample in enumerate(scored.json()["groups"][0]["samples"]):
        rec = out["groups"][0]["samples"][k]
        got = sample["loops"]
        np.testing.assert_allclose(got["flow"]["logprobs"], rec["denoise"]["flow"]["logprobs"],
                                   rtol=0, atol=1e-6)  # fmt: skip
        np.testing.assert_allclose(got["decode"]["logprobs"], rec["loops"]["decode"]["logprobs"],
                                   rtol=0, atol=1e-6)  # fmt: skip
    assert scored_st.status_code == 200, scored_st.text
    back = load(scored_st.content)
    assert back["g0.s1.flow.logprobs"].dtype == np.float64
    np.testing.assert_allclose(
        back["g0.s1.flow.logprobs"], arrays["g0.s1.flow.logprobs"], rtol=0, atol=1e-6
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"].endswith("denoise.flow.x")
    assert cut.status_code == 400 and "x and x_next must be" in cut.json()["error"]["message"]


def test_streamed_windows_record_steps_that_score_reproduces(folder):
    """A streamed request (4-token first chunk, 24 tokens) denoises several growing windows:
    each records its 10 SDE steps (over the window's frames, the voice prompt's first), and
    ``score`` replays the same windows: every log-prob within 1e-6."""
    sampling = SamplingParams(flow_noise_level=LEVEL, max_new_tokens=24, min_new_tokens=24)
    with OmniEngine(
        f"chatterbox={folder}",
        batch_invariant=True,
        kv_cache_gb=0.01,
        flow_chunk_tokens=4,
        hift_context=4,
    ) as omni:
        [group] = omni.rollout([TEXT], n=1, seed=5, sampling=sampling, progress=False)
        [sample] = group.samples
        steps = sample.denoise["flow"].steps
        windows = len(steps) // 10
        assert windows >= 3 and [r.step for r in steps] == list(range(10)) * windows
        frames = [steps[10 * w].x.shape[0] for w in range(windows)]
        assert frames == sorted(frames) and len(set(frames)) == windows  # growing windows
        [scored] = omni.score(group)
    got = scored["flow"].detach().cpu().numpy()
    np.testing.assert_allclose(got, sample.denoise["flow"].logprobs, rtol=0, atol=1e-6)
