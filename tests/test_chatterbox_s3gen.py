"""Chatterbox S3Gen (token-to-mel flow) and HiFT against the reference (chatterbox-tts 0.1.7 in
the ``.ref/chatterbox`` overlay) on a tiny ``s3gen.safetensors`` its own classes wrote: the mel
of the whole flow (10 Euler steps with CFG) within 1e-4 with the same initial noise, the
waveform within 1e-4 with the same source noise; the loader's errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from omnistep.models.chatterbox.hift import SourceNoise, trim_fade
from omnistep.models.chatterbox.loader import ChatterboxCheckpointError, load_hift, load_s3gen
from omnistep.runners.flow_matching import cosine_time_points
from tests.chatterbox_ref.env import call_reference

FLOW_SEED, HIFT_SEED = 7, 11
OTHER_FILES = ("ve.safetensors", "t3_cfg.safetensors", "tokenizer.json")


def _inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        "tokens": torch.randint(0, 6561, (9,), generator=g),
        "prompt_tokens": torch.randint(0, 6561, (5,), generator=g),
        "prompt_mel": torch.randn(10, 80, generator=g),
        "embedding": torch.randn(192, generator=g),
    }


@pytest.fixture(scope="module")
def flow(case):
    return load_s3gen(case[0])


@pytest.fixture(scope="module")
def case(tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("chatterbox-s3gen")
    inputs = {k: v.tolist() if v.dtype == torch.long else v.numpy() for k, v in _inputs().items()}
    ref = call_reference(
        "tests.chatterbox_ref.upstream_s3gen:case",
        root=str(root),
        flow_seed=FLOW_SEED,
        hift_seed=HIFT_SEED,
        **inputs,
    )
    for name in OTHER_FILES:  # this file tests S3Gen only: the folder check wants all four
        (root / name).write_bytes(b"")
    return root, ref


def _upstream_noise(frames: int, seed: int) -> torch.Tensor:
    """Upstream's initial state: ``torch.randn_like(mu)`` ``[1, 80, T]`` right after
    ``torch.manual_seed(seed)`` (a fresh CPU generator gives the same numbers)."""
    return torch.randn((1, 80, frames), generator=torch.Generator().manual_seed(seed))[0]


def test_flow_mel_matches_reference(case, flow):
    _, ref = case
    inputs = flow.prepare(**_inputs())
    assert inputs.num_frames == 2 * (9 + 5) and inputs.prompt_frames == 10
    mel = flow.generate(inputs, _upstream_noise(inputs.num_frames, FLOW_SEED))
    assert mel.shape == (80, 18) == ref["mel"].shape
    assert np.abs(ref["mel"]).max() > 0.5  # not a degenerate output
    np.testing.assert_allclose(mel.numpy(), ref["mel"], atol=1e-4, rtol=0)


def test_flow_guidance_and_noise_matter(case, flow):
    """The comparison above can fail: another noise moves the mel; guidance moves a step."""
    _, ref = case
    inputs = flow.prepare(**_inputs())
    noise = _upstream_noise(inputs.num_frames, FLOW_SEED + 1)
    assert np.abs(flow.generate(inputs, noise).numpy() - ref["mel"]).max() > 1e-2
    times = cosine_time_points(10, torch.float32, "cpu")
    guided, _ = flow.step([inputs], noise[None], times, [0])
    plain, _ = flow.step([inputs], noise[None], times, [0], cfg_rate=0.0)
    assert (guided - plain).abs().max() > 1e-3


def test_cosine_schedule_values():
    t = cosine_time_points(4, torch.float32, "cpu")
    expected = 1 - np.cos(np.linspace(0, 1, 5) * np.pi / 2)
    np.testing.assert_allclose(t.numpy(), expected, atol=1e-7)
    with pytest.raises(ValueError, match="num_steps"):
        cosine_time_points(0, torch.float32, "cpu")


def test_estimator_sizes_read_back_from_the_tensors():
    """Every size (blocks per stage included: the published estimator has 4) is read back from
    a state dict under the published prefix."""
    from omnistep.models.chatterbox.s3gen_estimator import EstimatorConfig, S3GenEstimator

    config = EstimatorConfig(channels=64, num_heads=2, num_blocks=3, num_mid_blocks=2)
    prefix = "flow.decoder.estimator."
    state = {prefix + k: v for k, v in S3GenEstimator(config).state_dict().items()}
    assert EstimatorConfig.from_state_dict(state, prefix) == config


def test_prepare_rejects_bad_input(flow):
    inputs = _inputs()
    with pytest.raises(ValueError, match="speech tokens"):
        flow.prepare(**(inputs | {"tokens": torch.tensor([6561])}))
    with pytest.raises(ValueError, match="prompt mel"):
        flow.prepare(**(inputs | {"prompt_mel": torch.zeros(9, 80)}))


def test_loader_names_missing_file_and_tensor(case, tmp_path):
    root, _ = case
    for name in OTHER_FILES:
        (tmp_path / name).write_bytes(b"")
    with pytest.raises(ChatterboxCheckpointError, match="s3gen.safetensors"):
        load_s3gen(tmp_path)
    from safetensors.torch import load_file, save_file

    state = load_file(root / "s3gen.safetensors")
    del state["flow.encoder_proj.weight"]
    save_file(state, tmp_path / "s3gen.safetensors")
    with pytest.raises(ChatterboxCheckpointError, match="encoder_proj.weight"):
        load_s3gen(tmp_path)


def test_hift_waveform_matches_reference(case):
    """HiFT on upstream's mel, its source noise drawn by ``SourceNoise.draw`` from a generator
    seeded as upstream's global one (the phases' ``rand``, then the noise's ``randn``)."""
    root, ref = case
    hift = load_hift(root)
    mel = torch.from_numpy(ref["mel"])[None]
    wav, source = hift(
        mel, hift.draw_noise(mel.shape[-1], torch.Generator().manual_seed(HIFT_SEED))
    )
    assert wav.shape == (1, 18 * 480) == (1, *ref["wav"].shape)
    assert np.abs(ref["wav"]).max() > 0.01
    np.testing.assert_allclose(source[0, 0].numpy(), ref["source"], atol=1e-5, rtol=0)
    np.testing.assert_allclose(wav[0].numpy(), ref["wav"], atol=1e-4, rtol=0)
    other, _ = hift(mel, hift.draw_noise(mel.shape[-1], torch.Generator().manual_seed(0)))
    assert np.abs(other[0].numpy() - ref["wav"]).max() > 1e-3  # the noise matters


def test_source_noise_draw_order():
    g = torch.Generator().manual_seed(3)
    noise = SourceNoise.draw(2, 9, 100, g)
    assert noise.phases.shape == (2, 9) and noise.noise.shape == (2, 9, 100)
    assert torch.all(noise.phases[:, 0] == 0)
    assert torch.all(noise.phases.abs() <= np.pi)
    g = torch.Generator().manual_seed(3)
    rand = torch.rand((2, 9, 1), generator=g)
    np.testing.assert_allclose(
        noise.phases[:, 1:], (-np.pi + rand * 2 * np.pi)[:, 1:, 0], atol=1e-6
    )
    assert torch.equal(noise.noise, torch.randn((2, 9, 100), generator=g))


def test_trim_fade():
    out = trim_fade(torch.ones(2000))
    assert torch.all(out[:480] == 0) and torch.all(out[960:] == 1)
    assert 0 < float(out[720]) < 1 and torch.all(out[480:960].diff() >= 0)
