"""Sample groups (a rollout's n samples of one input) on the shared paged-KV AR component:
the prompt is prefilled once and its KV blocks shared by reference (copy-on-write), and each
sample equals the same request sent alone with its seed (ChatTTS tiny checkpoint, official
layout; the Qwen2.5-Omni thinker on its tiny checkpoint)."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest

from omnistep.core import ExecutionProfile, ModelInstance, Request, SamplingParams
from omnistep.engine import AsyncEngine
from omnistep.models.chattts.card import ChatTTSOptions, build_card
from omnistep.models.chattts.tiny import write_servable_tiny_chattts
from omnistep.parity import run_alone, run_interleaved

TEXT = "hello world this is a group"
G = 4
SEED = 100


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return write_servable_tiny_chattts(tmp_path_factory.mktemp("chattts") / "ckpt")


def _model(root, **options) -> ModelInstance:
    opts = ChatTTSOptions(**{"kv_cache_gb": 0.02, **options})
    return ModelInstance.load(build_card(str(root), opts))


class _PrefillCounter:
    """Counts the prompt rows the GPT computes (wraps ``_compute_prefills``)."""

    def __init__(self, gpt):
        self.units = 0
        self._inner = gpt._compute_prefills
        gpt._compute_prefills = self

    def __call__(self, units, inputs):
        self.units += len(units)
        return self._inner(units, inputs)


def _group(voice="alloy", group="g1", n=G, max_new_tokens=24) -> list[Request]:
    return [
        Request(
            "chattts",
            text=TEXT,
            voice=voice,
            seed=SEED + k,
            group=group,
            profile=ExecutionProfile.ROLLOUT,
            sampling=SamplingParams(max_new_tokens=max_new_tokens),
        )
        for k in range(n)
    ]


async def test_group_prefills_once_and_each_sample_equals_its_seed_alone(root):
    model = _model(root, batch_invariant=True)
    gpt = model.components["gpt"]
    counter = _PrefillCounter(gpt)
    engine = AsyncEngine([model])
    grouped = await run_interleaved(engine, _group())
    assert counter.units == 1, "the group's prompt should be computed once"
    alone = await run_alone(engine, [dataclasses.replace(r, group=None) for r in _group()])
    await engine.shutdown()
    assert counter.units == 1 + G
    for a, b in zip(grouped, alone, strict=True):
        assert a.audio.size > 0 and np.array_equal(a.audio, b.audio)
    assert len({a.audio.tobytes() for a in grouped}) == G, "samples should differ by seed"
    assert gpt.blocks.num_used_blocks == 0 and not gpt.groups


async def test_group_members_with_different_prompts_do_not_share(root):
    """No voice: each sample's speaker is drawn from its own seed, so the prompts differ and
    every member computes its own prefill."""
    model = _model(root)
    counter = _PrefillCounter(model.components["gpt"])
    engine = AsyncEngine([model])
    await run_interleaved(engine, _group(voice=None, max_new_tokens=4))
    await engine.shutdown()
    assert counter.units == G


async def test_group_codes_equal_alone_in_the_default_mode(root):
    model = _model(root)
    engine = AsyncEngine([model])

    async def codes(reqs, together):
        async def one(r):
            stream = engine.add_request(r)
            [c async for c in stream]
            return [r.tokens for r in stream.trajectories["decode"]]

        if together:
            return await asyncio.gather(*(one(r) for r in reqs))
        return [await one(r) for r in reqs]

    grouped = await codes(_group(group="g2"), together=True)
    alone = await codes([dataclasses.replace(r, group=None) for r in _group()], together=False)
    await engine.shutdown()
    assert grouped == alone


async def test_aborted_groups_free_every_block(root):
    model = _model(root)
    gpt = model.components["gpt"]
    engine = AsyncEngine([model])
    streams = [
        engine.add_request(r)
        for g in range(50)
        for r in _group(group=f"abort-{g}", n=3, max_new_tokens=200)
    ]
    for i, stream in enumerate(streams):
        if i % 5 == 0:
            await asyncio.sleep(0.01)
        stream.cancel()
    await asyncio.sleep(0.2)
    for _ in range(600):  # a batch in flight frees its units' blocks when it returns
        if not engine.stats()["running_batches"]:
            break
        await asyncio.sleep(0.05)
    assert engine.stats()["live_requests"] == 0
    assert gpt.blocks.num_used_blocks == 0 and not gpt.lengths and not gpt.groups
    await engine.shutdown()


async def test_qwen_thinker_group_shares_its_prompt_and_the_talker_only_equal_rows(tmp_path):
    """The thinker's prompt (the chat's ids) is equal in a group: computed once. The talker's
    prompt ends with the row of each sample's first reply token: samples that drew the same
    first token have bit-equal talker prompts (batch-invariant thinker) and share one prefill
    (found by the rows' content hash, no family hook), the others compute their own. Samples
    equal their seeds alone."""
    from omnistep.core import ChatMessage, Modality
    from omnistep.models.qwen2_5_omni.card import QwenOmniOptions
    from omnistep.models.qwen2_5_omni.card import build_card as build_qwen
    from omnistep.models.qwen2_5_omni.tiny import write_tiny_qwen_omni

    root = write_tiny_qwen_omni(tmp_path / "qwen")
    opts = QwenOmniOptions(kv_cache_gb=0.02, talker_max_new_tokens=8, batch_invariant=True)
    model = ModelInstance.load(build_qwen(str(root), opts))
    thinker = _PrefillCounter(model.components["thinker"])
    talker = _PrefillCounter(model.components["talker"])
    engine = AsyncEngine([model])

    def requests(group):
        return [
            Request(
                "qwen2.5-omni",
                messages=(ChatMessage("user", "tell me about the sea"),),
                seed=SEED + k,
                group=group,
                voice="Chelsie",
                profile=ExecutionProfile.ROLLOUT,
                sampling=SamplingParams(max_new_tokens=8),
                output_modalities=frozenset({Modality.TEXT, Modality.AUDIO}),
            )
            for k in range(3)
        ]

    grouped = await run_interleaved(engine, requests("q"))
    first_tokens = {a.trajectories["think"][0].tokens for a in grouped}
    assert thinker.units == 1 and talker.units == len(first_tokens)
    alone = await run_alone(engine, requests(None))
    await engine.shutdown()
    for a, b in zip(grouped, alone, strict=True):
        # the token2wav stages batch outside batch-invariant kernels: audio within 1e-5
        assert a.text == b.text and np.abs(a.audio - b.audio).max() <= 1e-5
        for loop in ("think", "talk"):
            assert [r.tokens for r in a.trajectories[loop]] == [
                r.tokens for r in b.trajectories[loop]
            ]
    assert model.components["thinker"].blocks.num_used_blocks == 0
