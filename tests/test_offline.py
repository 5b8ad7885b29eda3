"""The offline Python API (omnistep.offline): the synchronous facade and the async form over
one engine, batch generation, rollout groups with per-codebook log-probs in both modes, weight
updates from tensors or a safetensors file, and bad input."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from safetensors.numpy import save_file

from omnistep.core import (
    ExecutionProfile,
    InvalidRequestError,
    Request,
    SamplingParams,
    WeightUpdateError,
)
from omnistep.models.chattts.gpt import ChatTTSPromptInput
from omnistep.models.chattts.tiny import write_servable_tiny_chattts
from omnistep.offline import AsyncOmniEngine, OmniEngine
from omnistep.parity import collect

ROLL = SamplingParams(max_new_tokens=12)


@pytest.fixture(scope="module")
def toy():
    with OmniEngine("toy") as engine:
        yield engine


def test_generate_batches_texts_and_seeds_them_in_order(toy):
    outs = toy.generate(["hello there", "a second text"], seed=5, progress=False)
    assert [o.seed for o in outs] == [5, 6]
    assert all(o.audio.dtype == np.float32 and o.duration_s > 0 for o in outs)
    again = toy.generate(["a second text"], seed=6, progress=False)[0]
    assert np.array_equal(again.audio, outs[1].audio)


def test_rollout_groups_equal_their_seeds_alone_with_both_logprob_modes(toy):
    groups = toy.rollout(["roll me", "and me"], n=3, seed=40, sampling=ROLL, progress=False)
    assert [len(g.samples) for g in groups] == [3, 3] and groups[0].group != groups[1].group
    policy = toy.rollout(["roll me"], n=3, seed=40, sampling=ROLL, logprobs="policy")[0]
    for k, sample in enumerate(groups[0].samples):
        actions = sample.loops["decode"]
        assert sample.seed == 40 + k and actions.seed == 40 + k
        assert actions.tokens.dtype == np.int64 and actions.tokens.shape == (12, 1)
        assert actions.logprobs.shape == (12, 1) and (actions.logprobs <= 0).all()
        assert actions.stop_reason == "length" and actions.prompt
        assert (actions.weight_versions == 0).all()
        assert np.array_equal(policy.samples[k].loops["decode"].tokens, actions.tokens)
        assert policy.samples[k].loops["decode"].mode == "policy"

    async def alone(k):
        request = Request(
            "toy", text="roll me", seed=40 + k, sampling=ROLL, profile=ExecutionProfile.ROLLOUT
        )
        return await collect(toy.engine, request)

    for k in range(3):
        done = asyncio.run_coroutine_threadsafe(alone(k), toy._loop).result()
        assert [r.tokens[0] for r in done.trajectories["decode"]] == list(
            groups[0].samples[k].loops["decode"].tokens[:, 0]
        )
    assert len({g.loops["decode"].tokens.tobytes() for g in groups[0].samples}) > 1


def test_rollout_refuses_bad_arguments(toy):
    for kwargs, param in (
        ({"n": 0}, "n"),
        ({"n": 10_000}, "n"),
        ({"n": True}, "n"),
        ({"logprobs": "raw"}, "logprobs"),
    ):
        with pytest.raises(InvalidRequestError) as err:
            toy.rollout(["x"], **kwargs)
        assert err.value.param == param
    with pytest.raises(InvalidRequestError, match="empty"):
        toy.rollout([])
    assert toy.engine.stats()["live_requests"] == 0


def test_inputs_of_the_wrong_type_are_refused_and_one_string_is_one_input(toy):
    for bad in ([1], [None], [b"bytes"], ["a\ud800b"]):  # a lone surrogate is not UTF-8
        with pytest.raises(InvalidRequestError) as err:
            toy.rollout(bad, sampling=ROLL)
        assert err.value.param == "input"
        with pytest.raises(InvalidRequestError):
            toy.generate(bad, progress=False)
    with pytest.raises(InvalidRequestError, match="sampling"):
        toy.rollout(["x"], sampling={"max_new_tokens": 3})
    for seed in ("3", 1.5, -1):
        with pytest.raises(InvalidRequestError) as err:
            toy.rollout(["x"], seed=seed, sampling=ROLL)
        assert err.value.param == "seed"
    [group] = toy.rollout("one text", n=2, sampling=ROLL)  # not one input per character
    assert group.input == "one text"
    assert [o.text for o in toy.generate("hello", progress=False)] == ["hello"]
    [group] = toy.rollout(["x"], n=2, seed=None, sampling=ROLL)  # a random base seed
    assert group.samples[1].seed == group.samples[0].seed + 1
    assert toy.engine.stats()["live_requests"] == 0


def test_a_rollout_larger_than_the_engine_queue_runs_whole():
    # more samples than max_queued: the offline API keeps them within the engine's limit
    with OmniEngine("toy", max_queued=4) as engine:
        groups = engine.rollout(["a", "b", "c"], n=3, seed=2, sampling=ROLL)
        assert [len(g.samples) for g in groups] == [3, 3, 3]
        assert [s.seed for s in groups[2].samples] == [2, 3, 4]
        assert len(engine.generate(["x"] * 6, seed=1, progress=False)) == 6
        assert engine.engine.stats()["live_requests"] == 0


def test_closed_engine_raises_without_leaking_coroutines(recwarn):
    engine = OmniEngine("toy")
    engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        engine.rollout(["x"])
    with pytest.raises(RuntimeError, match="closed"):
        engine.update_weights({})
    del engine
    import gc

    gc.collect()
    assert not [w for w in recwarn if "never awaited" in str(w.message)]


def test_score_takes_one_loop_name_as_a_string(toy):
    [group] = toy.rollout(["score me"], n=1, seed=3, sampling=ROLL)
    [scored] = toy.score(group, loops="decode")
    assert np.array_equal(scored["decode"], group.samples[0].loops["decode"].logprobs)


def test_update_weights_from_a_safetensors_file(tmp_path):
    with OmniEngine("toy") as engine:
        lm = engine.engine.models["toy"].components["lm"]
        table = np.ascontiguousarray(lm.table[:, ::-1])
        save_file({"table": table}, str(tmp_path / "new.safetensors"))
        save_file({"tabel": table}, str(tmp_path / "bad.safetensors"))
        with pytest.raises(WeightUpdateError, match="tabel"):
            engine.update_weights(tmp_path / "bad.safetensors")
        with pytest.raises(FileNotFoundError):
            engine.update_weights(tmp_path / "missing.safetensors")
        with pytest.raises(FileNotFoundError):
            engine.update_weights(tmp_path)  # a directory
        (tmp_path / "junk.safetensors").write_text("not safetensors")
        with pytest.raises(InvalidRequestError, match="safetensors"):
            engine.update_weights(tmp_path / "junk.safetensors")
        for bad in (5, None):
            with pytest.raises(InvalidRequestError) as err:
                engine.update_weights(bad)
            assert err.value.param == "weights"
        assert engine.update_weights(tmp_path / "new.safetensors") == 1
        assert np.array_equal(lm.table, table)
        sample = engine.rollout(["after"], n=1, seed=1, sampling=ROLL)[0].samples[0]
        assert (sample.loops["decode"].weight_versions == 1).all()


async def test_the_sync_facade_works_inside_a_running_event_loop():
    with OmniEngine("toy") as engine:
        assert engine.generate(["inside a loop"], seed=1)[0].audio.size > 0


async def test_a_cancelled_rollout_aborts_its_engine_requests():
    omni = AsyncOmniEngine.from_specs("toy")
    slow = SamplingParams(max_new_tokens=2000, min_new_tokens=2000)  # 20 ms a step
    task = asyncio.ensure_future(omni.rollout(["<slow> long"], n=3, sampling=slow))
    while omni.engine.stats()["live_requests"] < 3:
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert omni.engine.stats()["live_requests"] == 0  # aborted, not left running for nobody
    await omni.close()


async def test_async_form_rolls_out_chattts_groups_that_equal_each_seed_alone(tmp_path):
    root = write_servable_tiny_chattts(tmp_path / "chattts")
    omni = AsyncOmniEngine.from_specs(f"chattts={root}", kv_cache_gb=0.02, batch_invariant=True)
    sampling = SamplingParams(max_new_tokens=16)
    [group] = await omni.rollout(
        ["a group of four"], n=4, seed=70, voice="alloy", sampling=sampling, audio=True
    )
    for k, sample in enumerate(group.samples):
        actions = sample.loops["decode"]
        assert actions.tokens.shape[1] == 4 and actions.logprobs.shape == actions.tokens.shape
        assert isinstance(actions.prompt, ChatTTSPromptInput)
        alone = Request(
            "chattts", text="a group of four", voice="alloy", seed=70 + k, sampling=sampling
        )
        want = await collect(omni.engine, alone)
        assert np.array_equal(sample.audio, want.audio)
    gpt = omni.engine.models["chattts"].components["gpt"]
    assert gpt.blocks.num_used_blocks == 0
    await omni.close()
