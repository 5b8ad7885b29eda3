"""RL on VoxCPM2's continuous actions (tiny folder, own random weights, ``--batch-invariant``).

With ``flow_noise_level`` > 0 each patch's LocDiT solve runs as Flow-GRPO's SDE and a rollout
records, per AR step and per SDE step, the state, the noise-free mean, the std and the
Gaussian log-prob of the sampled next latent (``LoopActions.flow``), beside the stop
decisions' log-probs (sampled from the stop head's softmax at level > 0). Checked: the
record's shapes and its own arithmetic, the ODE path untouched at level 0, the stop drawn at
temperature 1 under the SDE (argmax with ``temperature`` 0 or at level 0), ``score`` (offline
and ``POST /v1/score``) equal to the recorded log-probs, packed (8 per forward) equal to one
at a time, gradients reaching both LMs, the LocEnc, the LocDiT and the stop head, weight
updates by the published tensor names, the AudioVAE's included (and refusals that change
nothing), ``/v1/rollouts`` as JSON and safetensors, and REINFORCE steps on the SDE log-probs
raising a toy reward.
"""

from __future__ import annotations

import math

import httpx
import numpy as np
import pytest
import torch
from safetensors.numpy import load

from omnistep.core import SamplingParams, WeightUpdateError
from omnistep.models.voxcpm.loader import load_voxcpm
from omnistep.models.voxcpm.tiny import write_folder
from omnistep.models.voxcpm.vocoder import AudioVAEComponent
from omnistep.offline import OmniEngine

STEPS = 4
"""LocDiT Euler steps per patch (3 of them SDE steps: CFG-Zero* zeroes the first)."""
LEVEL = 0.7
SDE = SamplingParams(flow_noise_level=LEVEL, max_new_tokens=3)
ST = "application/x-safetensors"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_folder(tmp_path_factory.mktemp("voxcpm_rl"), seed=1)


@pytest.fixture(scope="module")
def omni(folder):
    with OmniEngine(
        f"voxcpm={folder}", batch_invariant=True, kv_cache_gb=0.01, inference_timesteps=STEPS
    ) as engine:
        yield engine


@pytest.fixture(scope="module")
def groups(omni):
    return omni.rollout(["the cat", "a hat"], n=2, seed=7, sampling=SDE, progress=False)


def _samples(groups):
    return [s for g in groups for s in g.samples]


def test_sde_rollout_records_each_patch_step(omni, groups):
    for sample in _samples(groups):
        actions = sample.loops["decode"]
        flow = actions.flow
        steps = actions.tokens.shape[0]
        assert steps == 3 and flow.noise_level == LEVEL
        assert flow.states.shape == (steps, STEPS, 4, 16)  # S + 1 = 4 states per patch
        assert flow.means.shape == (steps, STEPS - 1, 4, 16)
        assert flow.logprobs.shape == (steps, STEPS - 1) and flow.logprobs.dtype == np.float64
        assert np.all(flow.stds > 0) and np.all(np.diff(flow.stds) < 0)  # sigma ~ sqrt(t'/(1-t'))
        # the recorded log-prob is log N(x_next; mean, std^2 I) of the recorded arrays
        z = (flow.states[:, 1:].astype(np.float64) - flow.means) / flow.stds[None, :, None, None]
        want = -0.5 * (z**2).sum((2, 3)) - 64 * (np.log(flow.stds) + 0.5 * math.log(2 * math.pi))
        np.testing.assert_allclose(flow.logprobs, want, rtol=0, atol=1e-9)
        # the stop decisions' log-probs: no stop before step min_len + 1 (log-prob 0 there)
        assert np.all(actions.logprobs[:2] == 0) and np.all(actions.logprobs <= 0)
    a, b = (s.loops["decode"].flow.states for s in groups[0].samples)
    assert not np.array_equal(a, b)  # seeds 7 and 8
    again = omni.rollout(["the cat"], n=1, seed=7, sampling=SDE, progress=False)[0].samples[0]
    assert np.array_equal(again.loops["decode"].flow.states, a)  # C1


def test_level_zero_is_the_ode(omni, groups):
    """At level 0 the solve is the ODE: no SDE steps, the patches of a plain request (the
    generator draws no SDE noise), and different from the SDE sample of the same seed."""
    ode = SamplingParams(max_new_tokens=3)
    sample = omni.rollout(["the cat"], n=1, seed=7, sampling=ode, progress=False)[0].samples[0]
    flow = sample.loops["decode"].flow
    assert flow.states.shape == (3, 1, 4, 16) and flow.logprobs.shape == (3, 0)
    sde = groups[0].samples[0].loops["decode"].flow.states[:, -1]
    assert float(np.abs(flow.patches - sde).max()) > 1e-2
    again = omni.rollout(["the cat"], n=1, seed=7, sampling=ode, progress=False)[0].samples[0]
    assert np.array_equal(again.loops["decode"].flow.patches, flow.patches)


def test_score_reproduces_and_gradients_reach_every_module(omni, groups):
    samples = _samples(groups)
    served = omni.score(samples)
    for sample, got in zip(samples, served, strict=True):
        rec = sample.loops["decode"]
        assert got["decode"].flow.dtype == torch.float64 and not got["decode"].flow.requires_grad
        np.testing.assert_allclose(got["decode"].flow.numpy(), rec.flow.logprobs, rtol=0, atol=1e-6)
        np.testing.assert_allclose(got["decode"].logprobs.numpy(), rec.logprobs, rtol=0, atol=1e-6)
    trainer = omni.trainer()
    names = [
        "base_lm.embed_tokens.weight",
        "base_lm.layers.0.self_attn.q_proj.weight",
        "residual_lm.layers.0.mlp.down_proj.weight",
        "feat_encoder.in_proj.weight",
        "feat_decoder.estimator.out_proj.weight",
        "feat_decoder.estimator.decoder.layers.0.mlp.up_proj.weight",
        "fsq_layer.in_proj.weight",
        "stop_head.weight",
    ]
    weights = trainer.weights(names)
    trained = omni.score(samples[:2], trainer=trainer, mode="policy")
    for sample, got in zip(samples[:2], trained, strict=True):
        rec = sample.loops["decode"].flow.logprobs
        np.testing.assert_allclose(got["decode"].flow.detach().numpy(), rec, rtol=0, atol=1e-6)
    loss = sum(g["decode"].flow.sum() + g["decode"].logprobs.sum() for g in trained)
    loss.backward()
    for name in names:
        grad = weights[name].grad
        assert grad is not None and float(grad.abs().sum()) > 0, name


def test_weight_updates_by_published_names(omni, groups):
    card = omni.engine.models["voxcpm2"].card.card_id
    lm = omni.engine.models[card].components["lm"]
    specs = lm.weight_specs()
    assert specs["feat_decoder.estimator.out_proj.weight"] == ((16, 32), "torch.float32")
    assert "base_lm.embed_tokens.weight" in specs and "stop_head.weight" in specs
    name = "feat_decoder.estimator.out_proj.bias"
    before = lm.backbone.estimator.out_proj.bias.detach().clone()
    bad = [
        {"feat_decoder.estimator.nope": torch.zeros(16)},
        {name: torch.zeros(15)},
        {name: torch.full((16,), float("nan"))},
        {name: torch.zeros(16), "stop_head.weight": torch.zeros(3, 3)},  # all or nothing
    ]
    for tensors in bad:
        with pytest.raises(WeightUpdateError):
            omni.update_weights(tensors, model=card)
        assert torch.equal(lm.backbone.estimator.out_proj.bias, before)
    version = omni.update_weights({name: before + 0.5}, model=card)
    try:
        assert version >= 1
        assert torch.equal(lm.backbone.estimator.out_proj.bias, before + 0.5)
        moved = omni.rollout(["the cat"], n=1, seed=7, sampling=SDE, progress=False)[0]
        got = moved.samples[0].loops["decode"]
        assert np.all(got.weight_versions == version)
        old = groups[0].samples[0].loops["decode"].flow.patches
        assert float(np.abs(got.flow.patches - old).max()) > 1e-3
    finally:
        omni.update_weights({name: before}, model=card)


async def test_http_rollouts_and_score(folder, tmp_path):
    from omnistep.core import ModelInstance
    from omnistep.engine import AsyncEngine
    from omnistep.models.voxcpm.card import VoxCPMOptions, build_card
    from omnistep.server import ServerConfig, build_app

    options = VoxCPMOptions(kv_cache_gb=0.01, batch_invariant=True, inference_timesteps=STEPS)
    engine = AsyncEngine([ModelInstance.load(build_card(str(folder), options))])
    app = build_app(engine, ServerConfig(voices_db=str(tmp_path / "voices.db")))
    body = {"model": "voxcpm2", "inputs": ["the cat"], "n": 2, "seed": 3,
            "flow_noise_level": LEVEL, "max_new_tokens": 3}  # fmt: skip
    try:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            as_json = await http.post("/v1/rollouts", json=body, timeout=300)
            assert as_json.status_code == 200, as_json.text
            tensors = await http.post(
                "/v1/rollouts", json=body, headers={"Accept": ST}, timeout=300
            )
            scored = await http.post("/v1/score", json=as_json.json(), timeout=300)
            scored_st = await http.post(
                "/v1/score",
                content=tensors.content,
                headers={"Content-Type": ST, "Accept": ST},
                timeout=300,
            )
            broken = as_json.json()
            del broken["groups"][0]["samples"][0]["loops"]["decode"]["flow"]["states"]
            bad = await http.post("/v1/score", json=broken, timeout=300)
    finally:
        await engine.shutdown()
    out = as_json.json()
    loop = out["groups"][0]["samples"][1]["loops"]["decode"]
    flow = loop["flow"]
    assert flow["noise_level"] == LEVEL and flow["num_sde_steps"] == STEPS - 1
    assert np.asarray(flow["states"]).shape == (3, STEPS, 4, 16)
    arrays = load(tensors.content)
    for key in ("states", "means", "logprobs"):
        got = arrays[f"g0.s1.decode.flow.{key}"]
        assert np.array_equal(got, np.asarray(flow[key], dtype=got.dtype)), key
    assert arrays["g0.s1.decode.flow.logprobs"].dtype == np.float64
    assert scored.status_code == 200, scored.text
    for k, sample in enumerate(scored.json()["groups"][0]["samples"]):
        rec = out["groups"][0]["samples"][k]["loops"]["decode"]
        got = sample["loops"]["decode"]
        np.testing.assert_allclose(got["flow"], rec["flow"]["logprobs"], rtol=0, atol=1e-6)
        np.testing.assert_allclose(got["logprobs"], rec["logprobs"], rtol=0, atol=1e-6)
    assert scored_st.status_code == 200, scored_st.text
    back = load(scored_st.content)
    np.testing.assert_allclose(
        back["g0.s1.decode.flow"], arrays["g0.s1.decode.flow.logprobs"], rtol=0, atol=1e-6
    )
    assert bad.status_code == 400 and "flow.states" in bad.json()["error"]["param"]


def test_policy_gradient_raises_a_toy_reward(omni):
    """REINFORCE with a group baseline on the SDE log-probs only (the stop decisions, sampled
    too, are left out: with 3 patches they are masked anyway): reward = the mean latent value
    of a sample's patches. Two steps on the LocDiT's output bias (a trainer copy,
    ``update_weights`` after each) raise the reward's mean over
    a fixed seed set training never saw. (Measured with lr 0.01: +0.016, and -0.016 with the
    reward's sign flipped: the move is the gradient's, not drift; lr 0.05 here.)"""
    names = ["feat_decoder.estimator.out_proj.bias"]
    start = {n: t.detach().clone() for n, t in omni.trainer().weights(names).items()}

    def reward(samples) -> np.ndarray:
        return np.array([s.loops["decode"].flow.patches.mean() for s in samples])

    def mean_reward() -> float:
        groups = omni.rollout(["the cat"], n=8, seed=100, sampling=SDE, progress=False)
        return float(reward(_samples(groups)).mean())

    base = mean_reward()
    trainer = omni.trainer()
    weights = trainer.weights(names)
    optimizer = torch.optim.SGD(list(weights.values()), lr=0.05)
    try:
        for step in range(2):
            groups = omni.rollout(["the cat"], n=8, seed=10 * step, sampling=SDE, progress=False)
            samples = _samples(groups)
            r = reward(samples)
            advantage = torch.tensor((r - r.mean()) / (r.std() + 1e-8))
            scores = omni.score(samples, trainer=trainer)
            logp = torch.stack([s["decode"].flow.sum() for s in scores])
            optimizer.zero_grad()
            (-(advantage * logp).mean()).backward()
            optimizer.step()
            omni.update_weights(trainer)
        after = mean_reward()
    finally:
        omni.update_weights(start, model="voxcpm2")
    assert after > base + 0.04, (base, after)


def test_a_cloned_voice_scores_as_recorded_across_its_kept_prefix(omni):
    """A cloned voice's rows are a kept prefix (prefilled apart from the text rows, shared by
    later requests of the voice); ``score`` replays the whole prompt in one dense forward and
    still equals the recorded stop and SDE log-probs within 1e-6 under ``batch_invariant``,
    for the first request of the voice and for one that shared its kept blocks."""
    clip = np.sin(np.arange(16000) * 0.05).astype(np.float32)  # 1 s at 16 kHz
    spec = omni._call(omni.engine.clone_voice("voxcpm2", clip, 16000, "x"))
    groups = omni.rollout(
        ["the cat", "a hat"], n=1, seed=3, sampling=SDE, voice=spec, progress=False
    )
    samples = _samples(groups)
    scored = omni.score(samples)
    for sample, got in zip(samples, scored, strict=True):
        rec = sample.loops["decode"]
        assert rec.flow.logprobs.shape[1] == STEPS - 1
        np.testing.assert_allclose(got["decode"].flow.numpy(), rec.flow.logprobs, rtol=0, atol=1e-6)
        np.testing.assert_allclose(got["decode"].logprobs.numpy(), rec.logprobs, rtol=0, atol=1e-6)


HALF = math.log(0.5)
"""A two-way decision's argmax has log-prob >= log(1/2)."""


@pytest.fixture(scope="module")
def long_groups(omni):
    """Up to 8 patches: steps 3.. decide freely (min_len 2), 2 texts x 6 samples."""
    sampling = SamplingParams(flow_noise_level=LEVEL, max_new_tokens=8)
    return omni.rollout(["the cat", "a hat on the mat"], n=6, seed=5, sampling=sampling,
                        progress=False)  # fmt: skip


def _free_decisions(samples) -> np.ndarray:
    """The recorded log-probs of the stop decisions after step ``min_len`` (the free ones)."""
    return np.concatenate([s.loops["decode"].logprobs[3:, 0] for s in samples])


def test_sde_rollouts_sample_the_stop_decision(omni, long_groups):
    """Under ``flow_noise_level`` > 0 the stop is drawn from the stop head's softmax (the
    tiny model's stop probabilities are near 1/2, so some of 12 samples take the less likely
    decision); with ``temperature`` 0, or at level 0, it is upstream's argmax. The draws come
    from the request's seed (the same seeds, the same decisions) and score reproduces their
    log-probs in the processed mode and in the policy mode (temperature 1: the same
    distribution once stopping is allowed)."""
    samples = _samples(long_groups)
    free = _free_decisions(samples)
    assert free.size >= 12 and np.any(free < HALF - 1e-3), free  # a non-argmax draw
    sampling = SamplingParams(flow_noise_level=LEVEL, max_new_tokens=8)
    again = omni.rollout(["the cat", "a hat on the mat"], n=6, seed=5, sampling=sampling,
                         progress=False)  # fmt: skip
    for a, b in zip(samples, _samples(again), strict=True):
        assert np.array_equal(a.loops["decode"].tokens, b.loops["decode"].tokens)
        assert np.array_equal(a.loops["decode"].flow.states, b.loops["decode"].flow.states)
    processed, policy = omni.score(samples), omni.score(samples, mode="policy")
    for sample, got, pol in zip(samples, processed, policy, strict=True):
        rec = sample.loops["decode"].logprobs
        np.testing.assert_allclose(got["decode"].logprobs.numpy(), rec, rtol=0, atol=1e-6)
        np.testing.assert_allclose(pol["decode"].logprobs.numpy()[3:], rec[3:], rtol=0, atol=1e-6)
    for sampling in (
        SamplingParams(flow_noise_level=LEVEL, max_new_tokens=8, temperature=0.0),
        SamplingParams(max_new_tokens=8),
    ):
        greedy = omni.rollout(["the cat"], n=12, seed=5, sampling=sampling, progress=False)
        assert np.all(_free_decisions(_samples(greedy)) >= HALF), sampling


def test_packed_scoring_equals_one_at_a_time(omni, long_groups):
    """``score`` packs a batch's samples in one teacher-forced forward (``batch_size``):
    each sample's stop and SDE log-probs equal its own scoring (to the bit under
    ``batch_invariant``; asserted 1e-6), for samples of different lengths and texts."""
    samples = _samples(long_groups)
    assert len({s.loops["decode"].tokens.shape[0] for s in samples}) > 1
    alone = omni.score(samples, batch_size=1)
    packed = omni.score(samples, batch_size=8)
    for a, b in zip(alone, packed, strict=True):
        for key in ("logprobs", "flow"):
            got, want = getattr(b["decode"], key).numpy(), getattr(a["decode"], key).numpy()
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


def test_audiovae_weight_updates(omni):
    """The AudioVAE decoder (and encoder) take weight updates by the audiovae file's names:
    a decoder bias changes the audio, restoring it gives the audio back bit for bit, and a
    bad update (unknown name, shape, NaN, or a bad tensor of another component beside a good
    decoder one) is refused and changes nothing."""
    card = omni.engine.models["voxcpm2"].card.card_id
    model = omni.engine.models[card]
    specs = model.weight_specs()
    assert specs["decoder.model.0.weight"] == ("vae", (16, 1, 7), "float32")
    assert specs["encoder.block.0.weight"][0] == "encoder"
    assert specs["stop_head.weight"][0] == "lm"
    vae = model.components["vae"].decoder
    name = "decoder.model.1.bias"
    before = vae.model[1].bias.detach().clone()

    def speak() -> np.ndarray:
        sampling = SamplingParams(max_new_tokens=3)
        return omni.generate(["the cat"], seed=3, sampling=sampling, progress=False)[0].audio

    audio = speak()
    bad = [
        {"decoder.nope": torch.zeros(3)},
        {name: torch.zeros(before.shape[0] + 1)},
        {name: torch.full_like(before, float("nan"))},
        {name: before + 1, "stop_head.weight": torch.zeros(3, 3)},  # all or nothing
    ]
    for tensors in bad:
        with pytest.raises(WeightUpdateError):
            omni.update_weights(tensors, model=card)
        assert torch.equal(vae.model[1].bias, before)
    assert np.array_equal(speak(), audio)
    version = omni.update_weights({name: before + 0.5}, model=card)
    try:
        assert version >= 1 and torch.equal(vae.model[1].bias, before + 0.5)
        moved = speak()
        assert moved.shape == audio.shape and float(np.abs(moved - audio).max()) > 1e-3
    finally:
        omni.update_weights({name: before}, model=card)
    assert np.array_equal(speak(), audio)


def _weight_normed_folder(root, zero: str | None = None):
    """A tiny folder whose audiovae file holds the AudioVAE's 3-d conv weights weight-normed
    (``weight_g`` / ``weight_v``, as upstream's), and the plain tensors it was made from;
    ``zero``: a ``weight_v`` whose output channel 3 is written all zero."""
    from safetensors.torch import load_file, save_file

    root = write_folder(root, seed=2)
    raw = load_file(str(root / "audiovae.safetensors"))
    gen = torch.Generator().manual_seed(0)
    normed = {}
    for key, w in raw.items():
        if key.startswith(("decoder.", "encoder.")) and key.endswith(".weight") and w.ndim == 3:
            scale = torch.rand(w.shape[0], 1, 1, generator=gen) + 0.5
            normed[key + "_v"] = (w * scale).contiguous()  # v: any positive row scaling of w
            normed[key + "_g"] = w.reshape(w.shape[0], -1).norm(dim=1).view(-1, 1, 1)
        else:
            normed[key] = w
    if zero is not None:
        normed[zero][3] = 0.0
    save_file(normed, str(root / "audiovae.safetensors"))
    return root, raw


def test_weight_normed_audiovae_takes_g_and_v(tmp_path):
    """A weight-normed audiovae file (upstream's ``weight_g`` / ``weight_v``) is updated by
    those names: the folded weight is ``torch._weight_norm(v, g, 0)`` (torch's own weight
    norm) of the pair sent, a half sent alone keeps the other half of the current weight."""
    root, raw = _weight_normed_folder(tmp_path / "wn")
    gen = torch.Generator().manual_seed(1)
    loaded = load_voxcpm(root)
    component = AudioVAEComponent(loaded.vae, normed=loaded.vae_normed)
    specs = component.weight_specs()
    assert specs["decoder.model.0.weight_g"] == ((16, 1, 1), "torch.float32")
    assert specs["decoder.model.0.weight_v"] == ((16, 1, 7), "torch.float32")
    assert "decoder.model.0.weight" not in specs and "decoder.model.0.bias" in specs
    conv = loaded.vae.model[0]
    torch.testing.assert_close(conv.weight, raw["decoder.model.0.weight"], rtol=0, atol=1e-6)
    old = conv.weight.detach().clone()
    g_old = old.reshape(16, -1).norm(dim=1).view(-1, 1, 1)
    v = torch.randn(16, 1, 7, generator=gen)
    g = torch.rand(16, 1, 1, generator=gen) + 0.1
    component.update_weights({"decoder.model.0.weight_v": v})
    torch.testing.assert_close(conv.weight, torch._weight_norm(v, g_old, 0), rtol=0, atol=1e-6)
    component.update_weights({"decoder.model.0.weight_g": g})
    torch.testing.assert_close(conv.weight, torch._weight_norm(v, g, 0), rtol=0, atol=1e-6)
    component.update_weights({"decoder.model.0.weight_g": g_old, "decoder.model.0.weight_v": old})
    torch.testing.assert_close(conv.weight, old, rtol=0, atol=1e-6)


def test_a_zero_weight_v_is_refused_and_changes_nothing(tmp_path):
    """A ``weight_v`` with an all-zero output channel folds to NaN (``g * v / ||v||``): an
    update sending one is refused as a whole, naming it, before any component changes (a
    good decoder bias beside a bad encoder ``weight_v``; a ``weight_g`` sent alone onto a
    weight whose row is zero); a file holding one is refused at load."""
    from omnistep.layers.weight_norm import WeightNormError

    root, _ = _weight_normed_folder(tmp_path / "wn")
    with OmniEngine(f"voxcpm={root}", kv_cache_gb=0.01, inference_timesteps=STEPS) as omni:
        card = omni.engine.models["voxcpm2"].card.card_id
        model = omni.engine.models[card]
        vae, encoder = model.components["vae"].decoder, model.components["encoder"].encoder
        state = {n: t.detach().clone() for n, t in [*vae.state_dict().items(),
                                                    *encoder.state_dict().items()]}  # fmt: skip
        v_name = "encoder.block.0.weight_v"
        v = torch.randn(model.weight_specs()[v_name][1])
        v[3] = 0.0
        bias = vae.model[1].bias.detach()
        for tensors in (
            {"decoder.model.1.bias": bias + 1, v_name: v},
            {"decoder.model.0.weight_v": torch.zeros_like(vae.model[0].weight)},
        ):
            with pytest.raises(WeightUpdateError, match=r"weight_v' has \|\|v\|\| = 0"):
                omni.update_weights(tensors, model=card)
        with pytest.raises(WeightUpdateError, match=rf"'{v_name}' .*\(dim 0: 3\)"):
            omni.update_weights({v_name: v}, model=card, check_finite=False)
        with pytest.raises(WeightNormError, match=v_name):  # unchecked, as in a Ray actor
            model.components["encoder"].update_weights({v_name: v})
        after = {**vae.state_dict(), **encoder.state_dict()}
        assert all(torch.equal(after[n], t) for n, t in state.items())
        # g alone onto a row that g = 0 zeroed: v (the current weight) has a zero row
        g = model.weight_specs()["decoder.model.0.weight_g"][1]
        zero_g = torch.ones(g)
        zero_g[5] = 0.0
        assert omni.update_weights({"decoder.model.0.weight_g": zero_g}, model=card) == 1
        assert torch.isfinite(vae.model[0].weight).all()
        with pytest.raises(WeightUpdateError, match=r"decoder\.model\.0\.weight_v' .*: 5\)"):
            omni.update_weights({"decoder.model.0.weight_g": torch.ones(g)}, model=card)

    bad, _ = _weight_normed_folder(tmp_path / "bad", zero="decoder.model.1.weight_v")
    with pytest.raises(WeightNormError, match=r"'decoder\.model\.1\.weight_v'.*\(dim 0: 3\)"):
        load_voxcpm(bad)
