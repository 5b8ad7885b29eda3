"""bench/grpo_split.py (``bench/rollout.py --grpo``): the GRPO advantages, and one timed
iteration of the tiny ChatTTS with every phase measured."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from omnistep.offline import LoopActions, RolloutGroup, RolloutSample

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))
import grpo_split  # noqa: E402 - bench/ is not a package


def _sample(first_codes: list[int]) -> RolloutSample:
    tokens = np.array([[c, 0, 0, 0] for c in first_codes], dtype=np.int64)
    actions = LoopActions(
        tokens=tokens,
        logprobs=np.zeros(tokens.shape, np.float32),
        weight_versions=np.zeros(len(tokens), np.int64),
        mode="policy",
        stop_reason="length",
        seed=0,
        prompt=None,
    )
    return RolloutSample(0, 0, {grpo_split.LOOP: actions}, "", None, 24000)


def test_advantages_are_group_relative():
    # rewards (share of first codes below 313): group 1 -> 1.0, 0.0; group 2 -> 0.5, 0.5
    groups = [
        RolloutGroup("a", "g/0", [_sample([1, 2]), _sample([400, 500])]),
        RolloutGroup("b", "g/1", [_sample([1, 400]), _sample([400, 1])]),
    ]
    adv = grpo_split.advantages(groups, 626)
    assert adv[:2] == pytest.approx([1.0, -1.0], abs=1e-5)
    assert adv[2:] == [0.0, 0.0]
    assert grpo_split.reward(np.zeros((0, 4), np.int64), 626) == 0.0


def test_one_tiny_chattts_iteration_times_every_phase(tmp_path):
    res = grpo_split.run_family(
        "chattts", size="tiny", root=tmp_path / "chattts", inputs=1, n=2, tokens=3, iterations=1
    )
    phases = {"rollout", "score", "score_per_sample", "backward", "optimizer", "update"}
    assert set(res["cpu_s"]) == phases and set(res["wall_s"]) == phases
    assert all(v > 0 for v in res["wall_s"].values())
    assert res["samples"] == 2 and res["frames_per_sample"] == 3
    assert res["score_ratio_wall"] == res["wall_s"]["score"] / res["wall_s"]["score_per_sample"]
    with pytest.raises(ValueError, match="family must be one of"):
        grpo_split.run_family("kokoro")
