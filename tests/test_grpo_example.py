"""examples/grpo_chattts.py end to end on the tiny ChatTTS checkpoint: 5 GRPO iterations of
rollout -> reward -> advantages -> score() loss -> optimizer step -> update_weights."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "grpo_chattts.py"


def _example():
    spec = importlib.util.spec_from_file_location("grpo_chattts", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_grpo_raises_the_mean_reward_and_each_rollout_runs_its_iterations_weights(tmp_path):
    grpo = _example()
    plot = tmp_path / "reward.png"
    history = grpo.main(["--iterations", "5", "--plot", str(plot)])
    assert [h.versions_seen for h in history] == [{i} for i in range(5)]
    rewards = [h.mean_reward for h in history]
    assert rewards[-1] > rewards[0] + 0.1, rewards
    assert sum(rewards[-2:]) > sum(rewards[:2]), rewards
    assert plot.stat().st_size > 1000 and plot.read_bytes()[:4] == b"\x89PNG"


def test_reward_and_group_relative_advantages():
    grpo = _example()
    assert grpo.reward(np.array([[0, 1, 2, 3], [400, 0, 0, 0]])) == 0.5

    def sample(first_codes):
        tokens = np.array([[c, 0, 0, 0] for c in first_codes])
        return SimpleNamespace(loops={"decode": SimpleNamespace(tokens=tokens)})

    groups = [SimpleNamespace(samples=[sample([0, 0]), sample([0, 500]), sample([500, 500])])]
    (adv,) = grpo.advantages(groups)
    assert np.allclose(adv, [1.2247, 0.0, -1.2247], atol=1e-3)  # (r - mean) / std
