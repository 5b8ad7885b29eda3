"""Engine tests on the toy card: interleave parity (C3), seed (C1), abort, fault isolation."""

import asyncio
import dataclasses
import math
import time

import numpy as np
import pytest

from omnistep.core import (
    ComponentSpec,
    ExecutionProfile,
    InvalidRequestError,
    ModelInstance,
    ModelNotFoundError,
    Request,
    RequestAbortedError,
    RequestFailedError,
    SamplingParams,
    WorkUnitKind,
)
from omnistep.engine import AsyncEngine, EngineConfig
from omnistep.models.toy.card import build_card
from omnistep.models.toy.lm import ToyLM
from omnistep.models.toy.vocoder import ToyVocoder
from omnistep.parity import collect, run_alone, run_interleaved


@pytest.fixture
async def engine():
    eng = AsyncEngine([ModelInstance.load(build_card())])
    yield eng
    await eng.shutdown()


def _requests(n: int) -> list[Request]:
    return [
        Request(
            "toy",
            text=f"request number {i} " * (i + 1),
            seed=100 + i,
            sampling=SamplingParams(temperature=0.8, max_new_tokens=10 + 3 * i),
        )
        for i in range(n)
    ]


async def test_interleaved_equals_alone(engine):
    reqs = _requests(6)
    alone = await run_alone(engine, reqs)
    engine.batch_sizes.clear()
    together = await run_interleaved(engine, reqs)
    for a, b in zip(alone, together, strict=True):
        assert a.text == b.text and a.text
        assert np.array_equal(a.audio, b.audio) and a.audio.size > 0
    assert max(engine.batch_sizes) > 1, "concurrent requests should batch"
    texts = {a.text for a in alone}
    assert len(texts) == len(reqs), "different seeds and prompts should differ"


async def test_same_seed_same_output_and_seed_is_reported(engine):
    first = await collect(engine, Request("toy", text="abc", seed=7))
    second = await collect(engine, Request("toy", text="abc", seed=7))
    other = await collect(engine, Request("toy", text="abc", seed=8))
    assert first.text == second.text and np.array_equal(first.audio, second.audio)
    assert first.text != other.text
    drawn = await collect(engine, Request("toy", text="abc"))
    again = await collect(engine, Request("toy", text="abc", seed=drawn.seed))
    assert drawn.text == again.text


async def test_stream_sequence_numbers_and_sample_rate(engine):
    out = await collect(engine, Request("toy", text="hello", seed=1))
    assert [c.seq for c in out.chunks] == list(range(len(out.chunks)))
    assert out.sample_rate == 8000
    assert out.audio.size == 80 * out.text.count("<")


async def test_unknown_model_and_bad_input_raise_before_streaming(engine):
    with pytest.raises(ModelNotFoundError):
        engine.add_request(Request("nope", text="x"))
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request(Request("toy", text="   "))
    assert info.value.param == "input"
    assert engine.stats()["live_requests"] == 0


async def test_abort_mid_loop_releases_and_spares_others(engine):
    reqs = _requests(3)
    alone = await run_alone(engine, reqs)
    victim = engine.add_request(
        Request("toy", text="victim " * 5, seed=5, sampling=SamplingParams(max_new_tokens=400))
    )
    others = [
        asyncio.create_task(collect(engine, r))
        for r in [Request(r.model, r.text, seed=r.seed, sampling=r.sampling) for r in reqs]
    ]
    received = []
    async for chunk in victim:
        received.append(chunk)
        if len(received) == 5:
            assert engine.abort(victim.request_id)
            break
    with pytest.raises(RequestAbortedError):  # chunks already published may come first
        async for _ in victim:
            pass
    results = await asyncio.gather(*others)
    for a, b in zip(alone, results, strict=True):
        assert a.text == b.text and np.array_equal(a.audio, b.audio)
    assert set(engine.stats().values()) == {0}  # idle: nothing held
    assert not engine.abort(victim.request_id)


async def test_closing_generate_early_aborts(engine):
    gen = engine.generate(
        Request("toy", text="long " * 20, seed=3, sampling=SamplingParams(max_new_tokens=300))
    )
    async for _ in gen:
        break
    await gen.aclose()
    assert engine.stats()["live_requests"] == 0


@pytest.mark.parametrize("marker", ["<fail>", "<fail-late>", "<fail-vocoder>"])
async def test_fault_in_one_request_fails_only_it(engine, marker):
    reqs = _requests(4)
    alone = await run_alone(engine, reqs)
    bad = Request(
        "toy",
        text=f"{marker} boom boom",
        seed=9,
        sampling=SamplingParams(min_new_tokens=25, max_new_tokens=30),
    )
    results = await asyncio.gather(
        *(
            collect(engine, r)
            for r in [
                bad,
                *[Request(r.model, r.text, seed=r.seed, sampling=r.sampling) for r in reqs],
            ]
        ),
        return_exceptions=True,
    )
    assert isinstance(results[0], RequestFailedError)
    assert "injected fault" in str(results[0])
    for a, b in zip(alone, results[1:], strict=True):
        assert not isinstance(b, BaseException)
        assert a.text == b.text and np.array_equal(a.audio, b.audio)
    assert engine.stats()["live_requests"] == 0


async def test_rollout_records_logprobs_that_recompute(engine):
    """C2 on the toy: recomputing the recorded tokens' log-probs gives the recorded values."""
    req = Request(
        "toy",
        text="roll",
        seed=11,
        profile=ExecutionProfile.ROLLOUT,
        sampling=SamplingParams(max_new_tokens=10),
    )
    stream = engine.add_request(req)
    text = "".join([c.text async for c in stream if c.text])
    trajectory = stream.trajectories["decode"]
    assert text == "".join(f"<{r.tokens[0]}>" for r in trajectory if r.tokens[0] != 0)
    table = ToyLM().table
    prev = 1 + ord("l") % 63
    for record in trajectory:
        (token,), (logprob,) = record.tokens, record.logprobs
        recomputed = table[prev] - np.logaddexp.reduce(table[prev])
        assert abs(recomputed[token] - logprob) <= 1e-6
        assert record.policy_logprobs == record.logprobs  # the toy truncates nothing
        prev = token
    serve = await collect(
        engine, Request("toy", text="roll", seed=11, sampling=SamplingParams(max_new_tokens=10))
    )
    assert serve.text == text


async def test_engine_stays_responsive_while_computing():
    class SlowLM(ToyLM):
        def execute(self, kind, payloads):
            time.sleep(0.02)
            return super().execute(kind, payloads)

    card = build_card()
    model = ModelInstance.load(card)
    model.components["lm"] = SlowLM()
    eng = AsyncEngine([model])
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            await asyncio.sleep(0.005)
            ticks += 1

    task = asyncio.create_task(ticker())
    start = time.perf_counter()
    await collect(
        eng, Request("toy", text="slow", seed=1, sampling=SamplingParams(max_new_tokens=10))
    )
    elapsed = time.perf_counter() - start
    task.cancel()
    await eng.shutdown()
    assert elapsed > 0.1
    assert ticks >= elapsed / 0.005 * 0.3, "event loop was blocked by model compute"


def test_toy_lm_rejects_wrong_kind():
    with pytest.raises(ValueError):
        ToyLM().execute(WorkUnitKind.AUDIO_CHUNK, [])


async def test_components_overlap_but_each_respects_its_concurrency():
    """Two workers: the lm and the vocoder run side by side, but a component with
    max_concurrency 1 never runs two batches at once; outputs stay equal to alone."""
    import dataclasses
    import threading

    active: dict[str, int] = {"lm": 0, "vocoder": 0}
    peak = dict(active)
    overlaps = [0]
    lock = threading.Lock()

    def tracked(name, component):
        execute = component.execute

        def run(kind, payloads):
            with lock:
                active[name] += 1
                peak[name] = max(peak[name], active[name])
                overlaps[0] += sum(active.values()) > active[name]
            time.sleep(0.003)
            try:
                return execute(kind, payloads)
            finally:
                with lock:
                    active[name] -= 1

        component.execute = run
        return component

    card = build_card(max_batch_size=1)  # batches of one: many batches to overlap
    model = ModelInstance.load(card)
    for name in active:
        tracked(name, model.components[name])
    eng = AsyncEngine([model])
    reqs = _requests(4)
    alone = await run_alone(eng, reqs)
    together = await run_interleaved(eng, reqs)
    await eng.shutdown()
    assert peak == {"lm": 1, "vocoder": 1}
    assert overlaps[0] > 0, "lm and vocoder batches should have run side by side"
    for a, b in zip(alone, together, strict=True):
        assert np.array_equal(a.audio, b.audio)

    card2 = build_card(max_batch_size=1)
    lm_spec = dataclasses.replace(card2.components[0], max_concurrency=2)
    card2 = dataclasses.replace(card2, components=(lm_spec, card2.components[1]))
    model2 = ModelInstance.load(card2)
    peak.update(lm=0, vocoder=0)
    for name in active:
        tracked(name, model2.components[name])
    eng2 = AsyncEngine([model2])
    again = await run_interleaved(eng2, reqs)
    await eng2.shutdown()
    assert peak["lm"] == 2, "a thread-safe component may run two batches at once"
    for a, b in zip(alone, again, strict=True):
        assert np.array_equal(a.audio, b.audio)


# ---------------------------------------------------------------- deadline-aware scheduling


async def _first_audio(stream) -> None:
    async for chunk in stream:
        if chunk.audio is not None and chunk.audio.size:
            return


async def test_edf_ranks_a_new_request_ahead_of_a_stream_with_audio_buffered():
    engine = AsyncEngine([ModelInstance.load(build_card())], EngineConfig(admission_guard_s=None))
    try:
        long = Request(
            "toy", text="a long story " * 8, seed=1, sampling=SamplingParams(max_new_tokens=200)
        )
        stream = engine.add_request(long)
        run_long = engine._runs[long.request_id]
        async for _ in stream:  # the toy card makes audio much faster than real time
            if run_long.clock.buffered(time.monotonic()) > 1.5:
                break
        assert run_long.clock.started and run_long.clock.buffered(time.monotonic()) > 1.2
        new = Request("toy", text="hello", seed=2)
        new_stream = engine.add_request(new)
        run_new = engine._runs[new.request_id]
        assert engine._priority(run_new) < engine._priority(run_long)
        together = [c async for c in new_stream]
        rest = [c async for c in stream]
        assert together and rest
    finally:
        await engine.shutdown()
    fcfs = AsyncEngine([ModelInstance.load(build_card())], EngineConfig(scheduling="fcfs"))
    try:
        run = fcfs.add_request(Request("toy", text="x", seed=3))
        assert fcfs._priority(fcfs._runs[run.request_id]) is None
        assert fcfs.stats()["waiting_requests"] == 0
        [c async for c in run]
    finally:
        await fcfs.shutdown()


async def test_admission_holds_a_newcomer_while_a_stream_is_short_of_audio():
    """With a guard no stream can meet, a newcomer waits ``admission_max_wait_s``, then runs;
    its output is the same as alone."""
    reqs = [Request("toy", text="<slow> first " * 3, seed=5), Request("toy", text="second", seed=6)]
    alone = AsyncEngine([ModelInstance.load(build_card())])
    try:
        expected = await run_alone(alone, reqs)
    finally:
        await alone.shutdown()
    config = EngineConfig(admission_guard_s=1e6, admission_max_wait_s=0.3)
    engine = AsyncEngine([ModelInstance.load(build_card())], config)
    try:
        first = engine.add_request(reqs[0])
        await _first_audio(first)
        added = time.monotonic()
        second = engine.add_request(reqs[1])
        assert engine.stats()["waiting_requests"] == 1
        got = np.concatenate([c.audio async for c in second if c.audio is not None])
        assert time.monotonic() - added >= 0.3
        assert engine.stats()["waiting_requests"] == 0
        [c async for c in first]
    finally:
        await engine.shutdown()
    assert np.array_equal(got, expected[1].audio)


async def test_a_request_admitted_late_is_due_first_audio_s_after_admission():
    """A request that waited for admission gets its first-audio deadline from its admission,
    so it does not run ahead of every playing stream; TTFA still counts from its arrival."""
    config = EngineConfig(admission_guard_s=1e6, admission_max_wait_s=0.3, first_audio_s=1.0)
    engine = AsyncEngine([ModelInstance.load(build_card())], config)
    try:
        first = engine.add_request(Request("toy", text="<slow> first " * 3, seed=5))
        await _first_audio(first)
        late = Request("toy", text="second", seed=6)
        added = time.monotonic()
        second = engine.add_request(late)
        run = engine._runs[late.request_id]
        assert run.clock.deadline() == pytest.approx(run.clock.arrival + 1.0)
        ttfa = None
        async for chunk in second:
            if ttfa is None and chunk.audio is not None and chunk.audio.size:
                ttfa = time.monotonic() - added
        assert run.clock.first_audio_s >= 0.3 + 1.0  # due 1 s after it was admitted
        assert ttfa >= 0.3
        [c async for c in first]
    finally:
        await engine.shutdown()
    assert engine.metrics.ttfa["toy"].sum >= 0.3


async def test_edf_priority_is_the_deadline_less_the_units_expected_time():
    """Least laxity: a unit's priority is its request's deadline less its expected run time,
    ``est_seconds`` when the loop gives it, else ``num_tokens`` times the measured seconds per
    token of its component and kind."""
    from omnistep.core import ResourceRequest, ShapeSignature, WorkPlan

    engine = AsyncEngine([ModelInstance.load(build_card())])
    try:
        stream = engine.add_request(Request("toy", text="hello", seed=1))
        run = engine._runs[stream.request_id]
        live = next(iter(run.live.values()))
        deadline, real_plan = run.clock.deadline(), live.plan
        kind = WorkUnitKind.AUDIO_CHUNK
        shape = ShapeSignature(kind, ())
        live.plan = WorkPlan(kind, "vocoder", shape, None, ResourceRequest(num_tokens=40))
        # never measured: first (a 0 estimate would leave it behind every measured unit)
        assert engine._priority(run, live) == -math.inf
        engine._unit_cost.observe((live.model_id, "vocoder", kind), 100, 0.5)
        assert engine._priority(run, live) == pytest.approx(deadline - 0.2)
        live.plan = WorkPlan(kind, "vocoder", shape, None, ResourceRequest(est_seconds=0.7))
        assert engine._priority(run, live) == pytest.approx(deadline - 0.7)
        live.plan = real_plan
        [c async for c in stream]
    finally:
        await engine.shutdown()


async def test_a_card_with_max_starting_starts_a_burst_a_few_at_a_time():
    """piper-like cards set ``max_starting``: a burst is admitted as earlier requests start
    playing; every request still completes with its output alone."""
    card = dataclasses.replace(build_card(), max_starting=1)
    reqs = _requests(3)
    engine = AsyncEngine([ModelInstance.load(card)])
    try:
        expected = await run_alone(engine, reqs)
        streams = [engine.add_request(r) for r in reqs]
        assert engine.stats()["waiting_requests"] == 2
        got = [[c async for c in s] for s in streams]
    finally:
        await engine.shutdown()
    for chunks, alone in zip(got, expected, strict=True):
        audio = np.concatenate([c.audio for c in chunks if c.audio is not None])
        assert np.array_equal(audio, alone.audio)


async def test_a_request_given_a_streams_clock_continues_that_stream():
    """``add_request(clock=...)``: the request's deadline is when the stream's audio runs out
    (not a new request's first-audio deadline), its audio counts on the stream's clock, and it
    is admitted at once while a newcomer waits; time to first audio stays per request."""
    config = EngineConfig(admission_guard_s=1e6, admission_max_wait_s=0.3)
    engine = AsyncEngine([ModelInstance.load(build_card())], config)
    try:
        first = engine.add_request(
            Request(
                "toy", text="a long story " * 4, seed=1, sampling=SamplingParams(max_new_tokens=80)
            )
        )
        chunks = [c async for c in first]
        clock = first.clock
        made = sum(c.audio.size / c.sample_rate for c in chunks if c.audio is not None)
        assert clock.started and clock.audio_sent_s == pytest.approx(made) and made > 0.5
        nxt = Request("toy", text="the next sentence", seed=2)
        second = engine.add_request(nxt, clock=clock)
        run = engine._runs[nxt.request_id]
        assert second.clock is clock and run.clock is clock
        assert engine._priority(run) == clock.first_audio_at + made
        assert engine._priority(run) != run.waiting_since + config.first_audio_s
        assert engine.stats()["waiting_requests"] == 0  # continues a playing stream
        newcomer = engine.add_request(Request("toy", text="hello", seed=3))
        assert newcomer.clock is not clock
        assert engine.stats()["waiting_requests"] == 1
        more = [c async for c in second]
        [c async for c in newcomer]
    finally:
        await engine.shutdown()
    added = sum(c.audio.size / c.sample_rate for c in more if c.audio is not None)
    assert added > 0 and clock.audio_sent_s == pytest.approx(made + added)
    assert engine.metrics.ttfa["toy"].count == 3


class _TimedLM(ToyLM):
    """The toy LM, logging when each of its batches starts."""

    starts: list[float] = []

    def execute(self, kind, payloads):
        type(self).starts.append(time.monotonic())
        return super().execute(kind, payloads)


class _SlowVocoder(ToyVocoder):
    """The toy vocoder taking 50 ms a chunk, logging each chunk's (start, end)."""

    calls: list[tuple[float, float]] = []

    def execute(self, kind, payloads):
        start = time.monotonic()
        time.sleep(0.05)
        out = super().execute(kind, payloads)
        type(self).calls.append((start, time.monotonic()))
        return out


@pytest.mark.parametrize("alone", [True, False])
async def test_first_audio_alone_holds_the_requests_lm_during_its_first_chunk(alone):
    """``ModelCard.first_audio_alone``: while the first chunk is made, none of the request's
    LM units starts (with the flag off, it decodes on beside it); after the first audio the
    two stages overlap again, and the audio is the same either way."""
    card = build_card()
    card = dataclasses.replace(
        card,
        components=(
            ComponentSpec("lm", _TimedLM, max_batch_size=8),
            ComponentSpec("vocoder", _SlowVocoder, max_batch_size=8),
        ),
        first_audio_alone=alone,
    )
    request = Request(
        "toy",
        text="<slow> hello there, first audio",
        seed=3,
        sampling=SamplingParams(max_new_tokens=24),
    )
    _TimedLM.starts, _SlowVocoder.calls = [], []
    engine = AsyncEngine([ModelInstance.load(card)])
    try:
        got = await collect(engine, request)
    finally:
        await engine.shutdown()
    assert len(_SlowVocoder.calls) >= 3

    def lm_starts_during(call: tuple[float, float]) -> int:
        return sum(call[0] < t < call[1] for t in _TimedLM.starts)

    first, later = _SlowVocoder.calls[0], _SlowVocoder.calls[1:]
    if alone:
        assert lm_starts_during(first) == 0
    else:
        assert lm_starts_during(first) > 0
    assert sum(lm_starts_during(c) for c in later) > 0
    reference = AsyncEngine([ModelInstance.load(build_card())])
    try:
        expected = await collect(reference, request)
    finally:
        await reference.shutdown()
    assert np.array_equal(got.audio, expected.audio)
