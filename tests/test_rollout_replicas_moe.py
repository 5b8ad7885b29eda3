"""Rollout replicas on Ray with a MoE card: a replica of the tiny Qwen3-Omni rolls out the
thinker and the talker with their MoE routing (it crosses the process boundary in each
sample's ``LoopActions``), and ``RolloutReplicas.score(..., routing_replay=True)`` replays it on
the replica: equal to the recorded log-probs within 1e-6 (batch-invariant kernels), as without
replay; a sample without its routing is refused by name across the process boundary."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from omnistep.core import InvalidRequestError, SamplingParams
from omnistep.rollout_replicas import RolloutReplicas

OPTIONS = {"kv_cache_gb": 0.02, "batch_invariant": True, "talker_max_new_tokens": 8}
SAMPLING = SamplingParams(temperature=0.9, max_new_tokens=6)


@pytest.fixture(scope="module")
def replicas(ray_cluster, qwen3_omni_folder):
    with RolloutReplicas.start(f"qwen3_omni={qwen3_omni_folder}", n=1, **OPTIONS) as reps:
        yield reps


def test_score_with_routing_replay_on_a_qwen3_omni_replica(replicas):
    [group] = replicas.rollout(["say something nice"], n=2, seed=5, sampling=SAMPLING, audio=True)
    samples = group.samples
    for sample in samples:
        assert sample.replica == 0
        for loop in ("think", "talk"):
            actions = sample.loops[loop]
            assert actions.routing.shape[0] == actions.tokens.shape[0]
            assert actions.replay_routing() is not None
    for replay in (False, True):
        scores = replicas.score([group], routing_replay=replay)
        assert len(scores) == len(samples)
        for sample, scored in zip(samples, scores, strict=True):
            for loop in ("think", "talk"):
                recorded = sample.loops[loop].logprobs
                assert np.any(recorded < 0)
                got = scored[loop].detach().numpy()
                np.testing.assert_allclose(got, recorded, atol=1e-6, rtol=0)
    think = samples[0].loops["think"]
    bare = dataclasses.replace(
        samples[0], loops={"think": dataclasses.replace(think, prompt_routing=None)}
    )
    with pytest.raises(InvalidRequestError) as info:
        replicas.score([bare], routing_replay=True)
    assert info.value.param == "routing_replay"
