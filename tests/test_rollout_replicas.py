"""Rollout replicas on Ray (``omnistep.rollout_replicas``): two replicas of a tiny ChatTTS
give the samples one in-process engine gives for the same seeds, a group never split; the
trainer's torch.distributed broadcast reaches both before either runs the new version, with
item 3's version rules and the NaN check; score on the replicas equals in-process score; a
killed replica fails only its groups. One local 2-CPU Ray and one pair of replicas for the
module: the tests run in file order (the last one kills a replica)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from omnistep.core import (
    InvalidRequestError,
    OmnistepError,
    SamplingParams,
    WeightUpdateError,
    WeightVersionError,
)
from omnistep.offline import OmniEngine, RolloutGroup
from omnistep.rollout_replicas import ReplicaDiedError, RolloutReplicas, assign_groups

OPTIONS = {"kv_cache_gb": 0.02, "batch_invariant": True}
SAMPLING = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=16, min_new_tokens=16)
INPUTS = ["A short one.", "A somewhat longer input to speak.", "Middle length text."]
ROLL = {"n": 2, "seed": 7, "voice": "alloy", "sampling": SAMPLING, "logprobs": "policy"}


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    from omnistep.models.chattts.tiny import write_servable_tiny_chattts

    return f"chattts={write_servable_tiny_chattts(tmp_path_factory.mktemp('rr') / 'ckpt')}"


@pytest.fixture(scope="module")
def local(spec):
    """The in-process engine, at one torch thread as the 1-CPU actors compute (CPU kernels
    round differently with other thread counts)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with OmniEngine(spec, **OPTIONS) as engine:
        yield engine
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def replicas(ray_cluster, spec):
    start = time.perf_counter()
    with RolloutReplicas.start(spec, n=2, num_cpus=1, reference=True, **OPTIONS) as reps:
        print(f"2 replicas up in {time.perf_counter() - start:.1f} s")
        yield reps


@pytest.fixture(scope="module")
def trainer(local):
    """The trainer's copy (in this process); its tensors go to both engines alike."""
    return local.trainer()


def _same(a: RolloutGroup, b: RolloutGroup) -> None:
    assert a.input == b.input and len(a.samples) == len(b.samples)
    for x, y in zip(a.samples, b.samples, strict=True):
        assert x.seed == y.seed
        if x.audio is not None:
            assert x.audio.size > 0 and x.audio.tobytes() == y.audio.tobytes()
        dx, dy = x.loops["decode"], y.loops["decode"]
        assert np.array_equal(dx.tokens, dy.tokens) and dx.tokens.shape[0] == 16
        assert np.array_equal(dx.logprobs, dy.logprobs)
        assert np.array_equal(dx.weight_versions, dy.weight_versions)


def _perturb(trainer, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in trainer.weights().values():
            if tensor.is_floating_point():
                tensor.add_(torch.randn(tensor.shape, generator=gen) * 0.05)


def _until_decoding(replicas: RolloutReplicas, which: tuple[int, ...]) -> None:
    """Wait until each replica of ``which`` runs requests."""
    deadline = time.monotonic() + 60
    while not all(replicas.stats()[r]["live_requests"] for r in which):
        assert time.monotonic() < deadline, replicas.stats()
        time.sleep(0.02)


def test_assign_groups_balances_and_keeps_groups_whole():
    plan = assign_groups([10, 1, 1, 7, 3, 2], 2)
    assert plan == [[0, 5], [1, 2, 3, 4]]  # costs 12 and 12
    assert sorted(i for p in plan for i in p) == list(range(6))
    assert assign_groups([1, 1], 3) == [[0], [1], []]
    with pytest.raises(ValueError, match="num_replicas"):
        assign_groups([1], 0)


def test_two_replicas_equal_one_engine_and_never_split_a_group(replicas, local):
    expected = local.rollout(INPUTS, audio=True, progress=False, **ROLL)
    got = replicas.rollout(INPUTS, audio=True, **ROLL)
    assert len(got) == len(INPUTS)
    for i, (a, b) in enumerate(zip(expected, got, strict=True)):
        _same(a, b)
        assert b.group.endswith(f"/{i}")
        assert len({s.replica for s in b.samples}) == 1  # one group, one replica
        assert all((s.loops["decode"].weight_versions == 0).all() for s in b.samples)
    assert {g.samples[0].replica for g in got} == {0, 1}
    assert all(s.replica is None for g in expected for s in g.samples)
    with pytest.raises(InvalidRequestError, match="n must be"):
        replicas.rollout(INPUTS, n=0)


def test_score_on_ray_equals_in_process(replicas, local):
    groups = replicas.rollout(INPUTS[:2], **ROLL)
    remote = replicas.score(groups, entropy=True)
    here = local.score(groups, entropy=True)
    samples = [s for g in groups for s in g.samples]
    assert len(remote) == len(samples) == 4
    for r, h, s in zip(remote, here, samples, strict=True):
        recorded = torch.tensor(s.loops["decode"].logprobs)
        assert torch.equal(r["decode"].logprobs, h["decode"].logprobs)
        assert torch.equal(r["decode"].logprobs, recorded)
        assert torch.equal(r["decode"].entropy, h["decode"].entropy)
        assert r["decode"].entropy.min() > 0
    with pytest.raises(InvalidRequestError, match="trainer"):
        replicas.score(groups, trainer=object())
    # score options reach the replicas' score_samples: routing replay on a dense model is
    # refused there, by name, as in process
    with pytest.raises(InvalidRequestError) as info:
        replicas.score(groups, routing_replay=True)
    assert info.value.param == "routing_replay"


def test_broadcast_reaches_every_replica_before_any_uses_it(replicas, local, trainer):
    before = replicas.rollout(INPUTS[:1], **ROLL)
    _perturb(trainer, 1)
    report = replicas.apply_weights(trainer, version=5)
    assert report.version == 5 and trainer.version == 5 and report.replicas == (0, 1)
    assert report.num_bytes > 0 and set(report.received_at) == {0, 1}
    # every replica held (and had checked) the weights before any began to apply them
    assert max(report.received_at.values()) <= min(report.committing_at.values())
    assert replicas.weight_versions() == {0: 5, 1: 5}
    assert local.update_weights(trainer, version=5) == 5
    expected = local.rollout(INPUTS, audio=True, progress=False, **ROLL)
    got = replicas.rollout(INPUTS, audio=True, **ROLL)
    for a, b in zip(expected, got, strict=True):
        _same(a, b)
        assert all((s.loops["decode"].weight_versions == 5).all() for s in b.samples)
    # the reference copies keep the starting weights; serving scores the new ones
    reference = replicas.score(before, reference=True)
    serving = replicas.score(before)
    recorded = torch.tensor(before[0].samples[0].loops["decode"].logprobs)
    assert torch.equal(reference[0]["decode"], recorded)
    assert (serving[0]["decode"] - recorded).abs().max() > 1e-3


def test_refused_updates_change_nothing_on_any_replica(replicas, trainer):
    state = trainer.state()
    reference = replicas.rollout(INPUTS[:1], **ROLL)
    with pytest.raises(WeightVersionError, match="version 3 .*runs version 5"):
        replicas.update_weights(state, version=3)
    with pytest.raises(WeightVersionError, match="version 5 .*runs version 5"):
        replicas.update_weights(state, version=5)
    name = next(iter(state))
    bad = {**state, name: state[name].clone()}
    bad[name].view(-1)[0] = float("nan")
    with pytest.raises(WeightUpdateError, match="NaN"):
        replicas.update_weights(bad, version=9)
    with pytest.raises(WeightUpdateError, match="unknown tensor"):
        replicas.update_weights({"no.such": torch.zeros(2)}, version=9)
    assert replicas.weight_versions() == {0: 5, 1: 5}
    _same(reference[0], replicas.rollout(INPUTS[:1], **ROLL)[0])


def test_a_rollout_racing_an_update_never_mixes_versions_in_a_step(replicas, local, trainer):
    racing = dict(ROLL, sampling=SamplingParams(max_new_tokens=200, min_new_tokens=200))
    out: list = []
    thread = threading.Thread(target=lambda: out.append(replicas.rollout(INPUTS, **racing)))
    thread.start()
    _perturb(trainer, 2)
    _until_decoding(replicas, (0, 1))
    report = replicas.apply_weights(trainer)
    thread.join()
    print(f"broadcast {report.num_bytes / 1e6:.1f} MB: {report.total_s:.3f} s")
    assert report.version == 6 and replicas.weight_versions() == {0: 6, 1: 6}
    assert max(report.received_at.values()) <= min(report.committing_at.values())
    assert local.update_weights(trainer, version=6) == 6
    for group in out[0]:
        versions = [s.loops["decode"].weight_versions for s in group.samples]
        for v in versions:
            assert set(v.tolist()) <= {5, 6} and (np.diff(v) >= 0).all()
        # a group's samples step together on one replica: each step ran one version
        assert all(np.array_equal(versions[0], v) for v in versions)
    mixed = [g for g in out[0] if set(g.samples[0].loops["decode"].weight_versions) == {5, 6}]
    assert mixed, "the update did not land mid-rollout"
    after = replicas.rollout(INPUTS[:1], **ROLL)
    assert all((s.loops["decode"].weight_versions == 6).all() for s in after[0].samples)


def test_a_replica_that_cannot_build_its_engine_says_why(ray_cluster, tmp_path):
    with pytest.raises(OmnistepError, match="replica 0 failed to start: .*no_such"):
        RolloutReplicas.start(f"chattts={tmp_path / 'no_such'}", n=1, num_cpus=0)


def test_a_killed_replica_fails_only_its_groups(replicas, local, trainer, ray_cluster):
    long = dict(ROLL, sampling=SamplingParams(max_new_tokens=80, min_new_tokens=80))
    inputs = [*INPUTS, "A fourth input."]
    expected = local.rollout(inputs, progress=False, **long)
    out: list = []
    thread = threading.Thread(
        target=lambda: out.append(replicas.rollout(inputs, return_exceptions=True, **long))
    )
    thread.start()
    _until_decoding(replicas, (1,))
    ray_cluster.kill(replicas.handles[1])
    thread.join()
    results = out[0]
    failed = [i for i, r in enumerate(results) if isinstance(r, ReplicaDiedError)]
    done = [i for i, r in enumerate(results) if isinstance(r, RolloutGroup)]
    assert failed and done and sorted(failed + done) == list(range(len(inputs)))
    for i in failed:
        assert results[i].replica == 1 and results[i].groups == tuple(failed)
        assert "replica 1 died" in str(results[i])
    for i in done:
        assert {s.replica for s in results[i].samples} == {0}
        for a, b in zip(expected[i].samples, results[i].samples, strict=True):
            assert np.array_equal(a.loops["decode"].tokens, b.loops["decode"].tokens)
    assert replicas.alive == (0,)
    # later calls run on the live replica; the next broadcast forms a group without the dead
    again = replicas.rollout(INPUTS[:2], **ROLL)
    assert {s.replica for g in again for s in g.samples} == {0}
    _perturb(trainer, 3)
    assert replicas.update_weights(trainer) == 7
    assert replicas.weight_versions() == {0: 7}
    assert local.update_weights(trainer, version=7) == 7
    _same(
        local.rollout(INPUTS[:1], progress=False, **ROLL)[0],
        replicas.rollout(INPUTS[:1], **ROLL)[0],
    )


def test_typed_errors_cross_processes_as_themselves():
    """What a replica raises arrives typed, with its attributes (pickled by Ray)."""
    import pickle

    for error in (WeightVersionError("chattts", 3, 5), ReplicaDiedError(1, [0, 2], "gone")):
        back = pickle.loads(pickle.dumps(error))
        assert type(back) is type(error) and str(back) == str(error)
        assert back.__dict__ == error.__dict__
