"""The engine's collaborators where the engine tests do not reach them: a weight change that
fails inside the pause (``WeightUpdates.pause``) must reopen the model's gates."""

from __future__ import annotations

import asyncio

import pytest

from omnistep.core import ExecutionProfile, ModelInstance, Request, SamplingParams
from omnistep.engine import AsyncEngine
from omnistep.models.toy.card import build_card as build_toy
from omnistep.parity import collect


def _rollout(text: str, seed: int, slow: bool = False) -> Request:
    return Request(
        "toy",
        text=("<slow> " if slow else "") + text,
        seed=seed,
        profile=ExecutionProfile.ROLLOUT,
        sampling=SamplingParams(max_new_tokens=20, min_new_tokens=20),
    )


async def test_a_drain_whose_update_fails_starts_the_held_requests_on_the_old_weights():
    model = ModelInstance.load(build_toy())
    engine = AsyncEngine([model])
    table = model.components["lm"].table.copy()

    def broken(prepared, version):
        raise RuntimeError("device lost while copying")

    model.update_weights = broken  # the change fails after the checks passed
    try:
        first = engine.add_request(_rollout("old weights", 4, slow=True))
        update = asyncio.create_task(
            engine.update_weights("toy", {"table": table * 0.5}, mode="drain")
        )
        while "toy" not in engine._weights._draining and not update.done():  # drain on
            await asyncio.sleep(0.002)
        held = engine.add_request(_rollout("held by the drain", 5))
        assert engine.stats()["waiting_requests"] == 1
        [c async for c in first]
        with pytest.raises(RuntimeError, match="device lost"):
            await update

        async def drain_stream():
            return [c async for c in held]

        chunks = await asyncio.wait_for(drain_stream(), timeout=30)  # started after the update
        # ... on the old weights
        assert chunks and {r.weight_version for r in held.trajectories["decode"]} == {0}
        assert engine.weight_versions == {"toy": 0}
        assert engine.stats()["waiting_requests"] == 0
        # the model is not left paused: a new request runs as on a fresh engine
        fresh = AsyncEngine([ModelInstance.load(build_toy())])
        try:
            expected = await collect(fresh, _rollout("after", 6))
        finally:
            await fresh.shutdown()
        got = await asyncio.wait_for(collect(engine, _rollout("after", 6)), timeout=30)
        assert got.text == expected.text and len(got.text) > 0
    finally:
        await engine.shutdown()
