"""VoxCPM2's ``config.json`` parsing: the four MiniCPM stacks it describes (LongRoPE, muP
depth scaling, a rope-less residual LM), and errors naming a wrong architecture or a missing
key. (The stacks' numbers are compared with upstream in tests/test_voxcpm_parity.py.)"""

from __future__ import annotations

import json
import math

import pytest
import torch

from omnistep.layers.rope import LongRopeScaling, rope_cos_sin
from omnistep.models.voxcpm.config import VoxCPMConfig, VoxCPMConfigError
from omnistep.models.voxcpm.tiny import tiny_config, write_tiny_voxcpm


def test_stacks_of_the_tiny_config(tmp_path):
    config = VoxCPMConfig.from_file(write_tiny_voxcpm(tmp_path) / "config.json")
    base, res = config.base_lm(), config.residual_lm()
    assert (base.hidden_size, base.num_hidden_layers, base.head_dim) == (64, 2, 16)
    assert base.residual_scale == pytest.approx(1.4 / math.sqrt(2))
    assert res.rope and res.num_hidden_layers == 2
    dit = config.local_stack(config.dit)
    assert (dit.hidden_size, dit.num_attention_heads, dit.head_dim) == (32, 2, 16)
    assert config.scale_emb == 12.0 and config.audio_vae["out_sample_rate"] == 48000
    scaling = base.rope_scaling
    assert isinstance(scaling, LongRopeScaling)
    assert scaling.factors == scaling.long_factor  # 4096 positions > the original 2048
    assert scaling.attention_factor == pytest.approx(math.sqrt(1 + math.log(2) / math.log(2048)))


def test_no_rope_and_no_mup(tmp_path):
    root = write_tiny_voxcpm(tmp_path, residual_lm_no_rope=True)
    raw = json.loads((root / "config.json").read_text())
    raw["lm_config"]["use_mup"] = False
    (root / "config.json").write_text(json.dumps(raw))
    config = VoxCPMConfig.from_file(root / "config.json")
    assert not config.residual_lm().rope
    assert config.base_lm().residual_scale == 1.0 and config.scale_emb == 1.0


def test_long_rope_cos_sin_values():
    scaling = LongRopeScaling((2.0, 4.0), (1.0, 1.0), 16, 64)
    cos, _ = rope_cos_sin(torch.tensor([0, 3]), 4, 10000.0, torch.float32, "cpu", scaling)
    factor = math.sqrt(1 + math.log(4) / math.log(16))
    inv = [1.0, 10000.0**-0.5]
    want = [factor * math.cos(3 / 2 * inv[0]), factor * math.cos(3 / 4 * inv[1])]
    assert cos[0].tolist() == pytest.approx([factor] * 4)
    assert cos[1, :2].tolist() == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda c: c.update(architecture="voxcpm"), "architecture 'voxcpm'"),
        (lambda c: c["lm_config"].pop("rope_scaling"), "lm_config has no 'rope_scaling'"),
        (lambda c: c.pop("dit_config"), "has no 'dit_config'"),
        (lambda c: c.update(feat_dim=32), "feat_dim 32 != audio_vae_config.latent_dim 16"),
        (lambda c: c["dit_config"].update(dit_mean_mode=True), "dit_mean_mode"),
    ],
)
def test_config_errors_name_the_key(tmp_path, edit, message):
    config = tiny_config()
    edit(config)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(VoxCPMConfigError, match=message):
        VoxCPMConfig.from_file(tmp_path / "config.json")
