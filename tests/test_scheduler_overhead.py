"""The null card under many live loops: every loop gets exactly its steps, and units batch.

Correctness only; the time per unit is measured by ``bench/scheduler_overhead.py``.
"""

from collections import Counter

from omnistep.core import ModelInstance, Request, SamplingParams
from omnistep.engine import AsyncEngine, EngineConfig
from omnistep.models.toy.null import build_null_card

LOOPS, STEPS, EMIT_EVERY = 200, 20, 5


async def test_many_live_loops_each_get_their_steps_and_units_batch():
    model = ModelInstance.load(build_null_card(emit_every=EMIT_EVERY))
    engine = AsyncEngine([model])
    steps = [STEPS + i % 3 for i in range(LOOPS)]  # a few lengths: loops finish at different steps
    streams = [
        engine.add_request(Request("null", seed=i, sampling=SamplingParams(max_new_tokens=n)))
        for i, n in enumerate(steps)
    ]
    texts = [[chunk.text async for chunk in stream] for stream in streams]
    stats = engine.stats()
    await engine.shutdown()

    for n, text in zip(steps, texts, strict=True):
        assert text == ["."] * (n // EMIT_EVERY) + [str(n)]  # the loop's chunks, then its count
    units = sum(steps)
    assert engine.units_by_kind == Counter({"ar_token": units})
    batches = sum(engine.batch_sizes.values())
    assert model.components["null"].calls == batches
    assert units / batches > 1, "units of live loops with the same shape should batch"
    assert max(engine.batch_sizes) == engine.config.max_batch_size
    assert set(stats.values()) == {0}  # idle: nothing held


async def test_batch_size_one_runs_every_unit_alone():
    engine = AsyncEngine([ModelInstance.load(build_null_card())], EngineConfig(max_batch_size=1))
    streams = [
        engine.add_request(Request("null", seed=i, sampling=SamplingParams(max_new_tokens=5)))
        for i in range(20)
    ]
    finals = [[chunk.text async for chunk in stream][-1] for stream in streams]
    await engine.shutdown()
    assert finals == ["5"] * 20
    assert engine.batch_sizes == Counter({1: 100})
