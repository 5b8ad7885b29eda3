"""The runner plane's shared pieces on their own (omnistep/runners/): the chunked vocoder
component, the flow-matching math, the serving options, and the checkpoint-folder check they
came with (runners/locate.py). The families' tests run them on real checkpoints; these pin each
piece's contract with hand-built inputs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from omnistep.core import ModelFilesError, WorkUnitKind
from omnistep.kv import KVCacheConfig
from omnistep.loops import AudioChunkInput
from omnistep.runners.flow_matching import (
    SolverConfig,
    gaussian_logprob,
    guided_velocity,
    rk4_38_delta,
    sde_mean,
)
from omnistep.runners.locate import checkpoint_folder
from omnistep.runners.options import ServingOptions
from omnistep.runners.vocoder import ChunkVocoder


class _Hop2(nn.Module):
    """A vocoder of hop 2: frame f of the window gives samples (sum of f's channels) * (1, -1);
    records the window shapes it was called with."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))
        self.shapes: list[tuple[int, ...]] = []

    def decode_chunk(self, window: torch.Tensor, left: int, chunk: int) -> torch.Tensor:
        self.shapes.append(tuple(window.shape))
        per_frame = window.sum(-1) * self.scale  # [B, W]
        samples = torch.stack([per_frame, -per_frame], dim=-1).flatten(1)  # [B, 2 W]
        return samples[:, 2 * left : 2 * (left + chunk)]


class _ChannelsFirst(_Hop2):
    def decode_chunk(self, window: torch.Tensor, left: int, chunk: int) -> torch.Tensor:
        return super().decode_chunk(window.transpose(1, 2), left, chunk)


def _unit(values: list[list[float]], left: int, chunk: int) -> AudioChunkInput:
    return AudioChunkInput(tuple(torch.tensor(v) for v in values), left, chunk)


def test_chunk_vocoder_decodes_each_units_chunk_in_one_call():
    module = _Hop2()
    vocoder = ChunkVocoder(module, "hop-2 vocoder")
    units = [_unit([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], 1, 1), _unit([[0.0, 1.0]] * 3, 1, 1)]
    out = vocoder.execute(WorkUnitKind.AUDIO_CHUNK, units)
    assert module.shapes == [(2, 3, 2)]  # one call, [B, W, dim]
    assert [o.tolist() for o in out] == [[7.0, -7.0], [1.0, -1.0]]
    assert all(o.dtype == np.float32 and o.flags.c_contiguous for o in out)


def test_chunk_vocoder_batch_invariant_and_channels_first():
    module = _ChannelsFirst()
    vocoder = ChunkVocoder(module, "mel vocoder", batch_invariant=True, channels_first=True)
    units = [_unit([[1.0, 2.0], [3.0, 4.0]], 0, 2), _unit([[2.0, 2.0], [1.0, 1.0]], 0, 2)]
    out = vocoder.execute(WorkUnitKind.AUDIO_CHUNK, units)
    assert module.shapes == [(1, 2, 2), (1, 2, 2)]  # each unit alone
    assert [o.tolist() for o in out] == [[3.0, -3.0, 7.0, -7.0], [4.0, -4.0, 2.0, -2.0]]
    with pytest.raises(ValueError, match="mel vocoder runs AUDIO_CHUNK units, got"):
        vocoder.execute(WorkUnitKind.DENOISE_STEP, units)


def test_chunk_vocoder_runs_a_subclass_decode_without_autograd():
    """``execute`` turns autograd off for the whole decode, also for a subclass that overrides
    ``decode`` (the Qwen3 codec component, VoxCPM's AudioVAE): with it on, every chunk recorded
    a graph through the decoder's parameters."""
    seen: list[tuple[bool, bool]] = []

    class Streams(ChunkVocoder):
        def decode(self, payloads):
            seen.append((torch.is_inference_mode_enabled(), torch.is_grad_enabled()))
            return [
                self.decoder.decode_chunk(torch.stack(list(p.frames))[None], p.left, p.chunk)[0]
                for p in payloads
            ]

    module = _Hop2()
    out = Streams(module, "streams").execute(
        WorkUnitKind.AUDIO_CHUNK, [_unit([[1.0, 2.0], [3.0, 4.0]], 0, 2)]
    )
    assert seen == [(True, False)]
    assert out[0].tolist() == [3.0, -3.0, 7.0, -7.0]


def test_rk4_38_step_integrates_a_linear_flow_to_fourth_order():
    # dy/dt = a y: one 3/8-rule step gives y0 (1 + z + z^2/2 + z^3/6 + z^4/24), z = a h
    a, h = -0.7, 0.3
    y0 = torch.full((2, 3, 4), 1.5, dtype=torch.float64)
    t0 = torch.zeros(2, dtype=torch.float64)
    dt = torch.full((2,), h, dtype=torch.float64)
    delta, k1 = rk4_38_delta(lambda t, y: a * y, t0, dt, t0 + dt, y0)
    z = a * h
    taylor = 1 + z + z * z / 2 + z**3 / 6 + z**4 / 24
    torch.testing.assert_close(y0 + delta, y0 * taylor, rtol=1e-12, atol=0)
    torch.testing.assert_close(k1, a * y0)


def test_guidance_sde_mean_and_logprob_formulas():
    c, u = torch.tensor([1.0, 4.0]), torch.tensor([3.0, 2.0])
    assert guided_velocity(c, u, 0.5).tolist() == [0.0, 5.0]
    mean = sde_mean(torch.tensor([1.0]), 0.25, 0.5, torch.tensor([2.0]), torch.tensor([4.0]))
    assert mean.tolist() == [1.0 + 0.25 * (0.5 * 2.0 - 4.0)]
    x, m = torch.randn(3, 5, 2), torch.randn(3, 5, 2)
    expected = torch.distributions.Normal(m.double(), 0.3).log_prob(x.double()).sum((1, 2))
    torch.testing.assert_close(gaussian_logprob(x, m, 0.3), expected)


def test_solver_schedule_is_sway_sampled():
    t = SolverConfig(num_steps=5).time_points(torch.float64, "cpu")
    u = torch.linspace(0, 1, 5, dtype=torch.float64)
    torch.testing.assert_close(t, 1 - torch.cos(math.pi / 2 * u))  # s = -1
    with pytest.raises(ValueError, match="num_steps"):
        SolverConfig(num_steps=1)


def test_serving_options_size_the_kv_pool_and_name_bad_fields():
    opts = ServingOptions(kv_cache_gb=0.5, block_size=8, dtype=torch.bfloat16)
    expected = KVCacheConfig.from_memory(0.5, 4, 2, 64, 2, 8)
    assert opts.kv_config(4, 2, 64) == expected
    assert expected.num_blocks == int(0.5 * 2**30) // (2 * 4 * 8 * 2 * 64 * 2)
    for field, value in (("kv_cache_gb", 0), ("block_size", 0), ("max_batch_size", 2.5)):
        with pytest.raises(ValueError, match=field):
            ServingOptions(**{field: value})


def test_checkpoint_folder_names_what_is_missing(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "assets").mkdir()
    assert checkpoint_folder(tmp_path, "Tiny", "layout L", ("config.json", "assets")) == tmp_path
    with pytest.raises(ModelFilesError, match=r"Tiny checkpoint folder .*/nope not found \(L\)"):
        checkpoint_folder(tmp_path / "nope", "Tiny", "L")
    with pytest.raises(ModelFilesError, match="is not a folder"):
        checkpoint_folder(tmp_path / "config.json", "Tiny", "L")
    with pytest.raises(ModelFilesError, match=r"is missing assets \(L\)"):
        checkpoint_folder(tmp_path, "Tiny", "L", ("config.json", "assets"), files_only=True)
    with pytest.raises(ModelFilesError, match=r"missing w.index.json \(or w.bin\) \(L\)"):
        checkpoint_folder(tmp_path, "Tiny", "L", one_of=("w.index.json", "w.bin"))
