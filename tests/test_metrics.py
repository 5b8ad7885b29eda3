"""``GET /metrics`` on the toy card: exact request counts by status, histogram counts, gauges
back at 0 when idle; the collector's KV gauges; one registry per app; no API key needed."""

import asyncio
import time

import httpx
import pytest
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from omnistep.core import (
    ModelInstance,
    Request,
    RequestAbortedError,
    RequestFailedError,
    RequestTimeoutError,
    SamplingParams,
)
from omnistep.engine import AsyncEngine
from omnistep.engine.metrics import Histogram, batch_histogram, request_status
from omnistep.kv import BlockManager, SequenceTable
from omnistep.models.toy.card import build_card
from omnistep.server import ServerConfig, build_app
from omnistep.server.metrics import metrics_registry
from tests.serving import running_server

SPEECH = "/v1/audio/speech"
CHAT = "/v1/chat/completions"
STATUSES = ("ok", "error", "aborted", "timeout", "rejected")

Samples = dict[tuple[str, frozenset], float]


def parse(text: str) -> Samples:
    """Every sample of a Prometheus text page, by (sample name, labels)."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float | None:
    """The sample's value, or None when the page does not have it."""
    return samples.get((name, frozenset(labels.items())))


def requests_by_status(samples: Samples, model: str = "toy") -> dict[str, float]:
    return {s: value(samples, "omnistep_requests_total", model=model, status=s) for s in STATUSES}


def histogram_count(samples: Samples, name: str, **labels: str) -> float:
    """The histogram's count, after checking that its buckets are cumulative up to +Inf."""
    buckets = sorted(
        (float(dict(key)["le"]), v)
        for (n, key), v in samples.items()
        if n == f"{name}_bucket" and {k: v for k, v in key if k != "le"} == labels
    )
    counts = [v for _, v in buckets]
    assert counts == sorted(counts) and buckets[-1][0] == float("inf")
    count = value(samples, f"{name}_count", **labels)
    assert counts[-1] == count
    return count


def gauges(samples: Samples) -> dict[tuple[str, frozenset], float]:
    names = (
        "omnistep_live_requests",
        "omnistep_waiting_requests",
        "omnistep_queued_units",
        "omnistep_running_batches",
        "omnistep_live_loops",
    )
    return {key: v for key, v in samples.items() if key[0] in names}


# ------------------------------------------------------------------ the real server


@pytest.fixture(scope="module")
def base():
    with running_server("--model", "toy", "--max-queued", "2", "--request-timeout", "2") as url:
        yield url


@pytest.fixture
def client(base):
    with httpx.Client(base_url=base, timeout=60) as client:
        yield client


def scrape(client: httpx.Client) -> Samples:
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return parse(r.text)


def wait_idle(client: httpx.Client) -> Samples:
    """The metrics once the engine holds nothing (aborts finish at the next step)."""
    for _ in range(200):
        samples = scrape(client)
        if not any(gauges(samples).values()):
            return samples
        time.sleep(0.05)
    raise AssertionError(f"engine not idle: {gauges(samples)}")


def chat(content: str, **extra) -> dict:
    return {
        "model": "toy",
        "messages": [{"role": "user", "content": content}],
        "seed": 5,
        "max_tokens": 20,
        **extra,
    }


def test_metrics_count_requests_by_status_and_return_to_idle(base, client):
    before = scrape(client)
    assert requests_by_status(before) == dict.fromkeys(STATUSES, 0)
    assert histogram_count(before, "omnistep_time_to_first_audio_seconds", model="toy") == 0
    assert histogram_count(before, "omnistep_real_time_factor", model="toy") == 0
    assert gauges(before) and not any(gauges(before).values())
    assert value(before, "omnistep_live_loops", model="toy", kind="ar_decode") == 0
    assert value(before, "omnistep_running_batches", model="toy", component="vocoder") == 0

    # ok: two with audio (whole file, SSE) and a text-only chat (no audio: no TTFA, no RTF)
    speech = {"model": "toy", "input": "hello there", "seed": 3, "max_new_tokens": 20}
    whole = client.post(SPEECH, json={**speech, "response_format": "wav", "stream": False})
    sse = client.post(SPEECH, json={**speech, "stream_format": "sse", "response_format": "pcm"})
    text = client.post(CHAT, json=chat("hello"))
    assert [whole.status_code, sse.status_code, text.status_code] == [200, 200, 200]
    # error: a fault in the lm (text only) and one in the vocoder, before any audio
    assert client.post(CHAT, json=chat("<fail> now")).status_code == 500
    assert client.post(SPEECH, json={**speech, "input": "<fail-vocoder> x"}).status_code == 500
    # aborted: a stream whose client leaves after its first audio
    long = {
        **speech,
        "input": "a long one " * 200,
        "max_new_tokens": 4000,
        "response_format": "pcm",
    }
    with client.stream("POST", SPEECH, json=long) as r:
        assert r.status_code == 200
        next(r.iter_bytes())
    wait_idle(client)
    # timeout: two slow text-only chats pass the 2 s limit; while both run, a third gets 429
    slow = chat("<slow> take your time", max_tokens=400)

    async def slow_pair() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=base, timeout=60) as aclient:
            tasks = [asyncio.create_task(aclient.post(CHAT, json=slow)) for _ in range(2)]
            for _ in range(200):
                live = parse((await aclient.get("/metrics")).text)
                if value(live, "omnistep_live_requests", model="toy") == 2:
                    break
                await asyncio.sleep(0.02)
            assert value(live, "omnistep_live_loops", model="toy", kind="ar_decode") == 2
            assert value(live, "omnistep_live_loops", model="toy", kind="audio_decode") == 0
            rejected = await aclient.post(CHAT, json=chat("one too many"))
            assert rejected.status_code == 429
            return await asyncio.gather(*tasks)

    assert [r.status_code for r in asyncio.run(slow_pair())] == [504, 504]

    after = wait_idle(client)
    assert requests_by_status(after) == {
        "ok": 3,
        "error": 2,
        "aborted": 1,
        "timeout": 2,
        "rejected": 1,
    }
    # first audio: the two ok speech requests and the aborted stream
    assert histogram_count(after, "omnistep_time_to_first_audio_seconds", model="toy") == 3
    assert histogram_count(after, "omnistep_real_time_factor", model="toy") == 2
    assert value(after, "omnistep_real_time_factor_sum", model="toy") > 0
    for component, kind in (("lm", "ar_token"), ("vocoder", "audio_chunk")):
        units = value(
            after, "omnistep_work_units_total", model="toy", component=component, kind=kind
        )
        batch_sum = value(after, "omnistep_batch_size_sum", model="toy", component=component)
        assert units == batch_sum > 0
        assert histogram_count(after, "omnistep_batch_size", model="toy", component=component) > 0
    assert not any(k[0].startswith("omnistep_kv_blocks") for k in after)  # toy has no KV cache


# ------------------------------------------------------------------ in process


def test_histogram_buckets_follow_prometheus_le():
    hist = Histogram((0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 1.0, 7.0):
        hist.observe(v)
    assert hist.cumulative() == [(0.1, 2), (1.0, 4), (float("inf"), 5)]
    assert hist.count == 5 and hist.sum == pytest.approx(8.65)
    sizes = batch_histogram({1: 3, 3: 2, 600: 1}, bounds=(1, 2, 4))
    assert sizes.cumulative() == [(1, 3), (2, 3), (4, 5), (float("inf"), 6)]
    assert sizes.sum == 3 + 6 + 600
    with pytest.raises(ValueError):
        Histogram((1.0, 0.5))


def test_request_status_of_each_ending():
    assert request_status(None) == "ok"
    assert request_status(RequestFailedError("x")) == "error"
    assert request_status(RequestAbortedError("x")) == "aborted"
    assert request_status(RequestTimeoutError("x", 1.0)) == "timeout"


async def test_kv_gauges_of_components_with_a_paged_table():
    model = ModelInstance.load(build_card())
    table = SequenceTable(BlockManager(num_blocks=8, block_size=4))
    model.components["vocoder"].table = table  # as an AR component keeps its paged cache
    engine = AsyncEngine([model])
    registry = metrics_registry(engine)
    try:
        assert table.admit_prefill("seq", 10)
        samples = parse(generate_latest(registry).decode())
        labels = {"model": "toy", "component": "vocoder"}
        assert value(samples, "omnistep_kv_blocks_used", **labels) == 3
        assert value(samples, "omnistep_kv_blocks_free", **labels) == 5
        assert value(samples, "omnistep_kv_blocks_used", model="toy", component="lm") is None
        table.free("seq")
        samples = parse(generate_latest(registry).decode())
        assert value(samples, "omnistep_kv_blocks_used", **labels) == 0
        assert value(samples, "omnistep_kv_blocks_free", **labels) == 8
    finally:
        await engine.shutdown()


async def test_kv_gauges_follow_a_chattts_request(tmp_path):
    """The tiny ChatTTS checkpoint (random weights): its GPT's blocks are in use while a
    request decodes, and all free once it is aborted."""

    from omnistep.models.chattts.card import ChatTTSOptions
    from omnistep.models.chattts.card import build_card as build_chattts
    from omnistep.models.chattts.tiny import write_servable_tiny_chattts

    root = write_servable_tiny_chattts(tmp_path / "ckpt")
    model = ModelInstance.load(build_chattts(str(root), ChatTTSOptions(kv_cache_gb=0.02)))
    total = model.components["gpt"].table.blocks.num_blocks
    engine = AsyncEngine([model])
    registry = metrics_registry(engine)
    labels = {"model": "chattts", "component": "gpt"}
    try:
        sampling = SamplingParams(temperature=0.0, max_new_tokens=1000)  # still decoding below
        stream = engine.add_request(
            Request("chattts", text="hello world", seed=1, sampling=sampling)
        )
        async for chunk in stream:
            if chunk.audio is not None:
                samples = parse(generate_latest(registry).decode())
                used = value(samples, "omnistep_kv_blocks_used", **labels)
                assert (
                    used > 0 and used + value(samples, "omnistep_kv_blocks_free", **labels) == total
                )
                break
        stream.cancel()
        for _ in range(200):  # an in-flight step frees its loop when it returns
            if not any(engine.stats().values()):
                break
            await asyncio.sleep(0.01)
        samples = parse(generate_latest(registry).decode())
        assert value(samples, "omnistep_kv_blocks_used", **labels) == 0
        assert value(samples, "omnistep_kv_blocks_free", **labels) == total
        assert value(samples, "omnistep_requests_total", model="chattts", status="aborted") == 1
        assert (
            histogram_count(samples, "omnistep_time_to_first_audio_seconds", model="chattts") == 1
        )
    finally:
        await engine.shutdown()


async def test_each_app_has_its_own_registry_and_metrics_need_no_key():
    engines = [AsyncEngine([ModelInstance.load(build_card())]) for _ in range(2)]
    apps = [build_app(e, ServerConfig(api_key="secret")) for e in engines]
    try:
        stream = engines[0].add_request(Request("toy", text="hi", seed=1))
        async for _ in stream:
            pass
        counts = []
        for app in apps:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
                assert (await client.get("/v1/models")).status_code == 401
                r = await client.get("/metrics")  # no key
                assert r.status_code == 200
                counts.append(requests_by_status(parse(r.text))["ok"])
                om = await client.get(
                    "/metrics", headers={"accept": "application/openmetrics-text"}
                )
                assert om.headers["content-type"].startswith("application/openmetrics-text")
                assert om.text.endswith("# EOF\n")
        assert counts == [1, 0]
        assert b"omnistep_requests" not in generate_latest(REGISTRY)  # the global one is untouched
    finally:
        for engine in engines:
            await engine.shutdown()
