"""The Ray executor heals: a component actor killed with SIGKILL is replaced (its component
reloaded, the weight updates replayed), ``/health`` says ``degraded`` and new requests get 503
with ``Retry-After`` meanwhile, requests for other models go on, the requests whose state was in
the dead actor fail cleanly (a rollout group as a whole), nothing leaks, and every request after
the recovery gives the in-process output. One local 2-CPU Ray for the module.

The kill loops run a few kills in the default suite and 20 (``-m slow``) otherwise; each prints
its recovery times (kill to the first request served again)."""

import asyncio
import dataclasses
import functools
import os
import signal
import statistics
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from omnistep.cli import load_engine
from omnistep.core import (
    ComponentUnavailableError,
    ExecutionProfile,
    Request,
    RequestFailedError,
    SamplingParams,
)
from omnistep.engine import AsyncEngine, EngineConfig
from omnistep.engine.deploy import (
    ComponentDeployment,
    ComponentPlacement,
    DeployConfigError,
    RecoveryPolicy,
    parse_recovery,
)
from omnistep.engine.ray_executor import RayExecutor
from omnistep.launch import build_cards
from omnistep.models.registry import build_component
from omnistep.parity import collect, run_interleaved
from omnistep.server import build_app

RECOVERY_BOUND_S = 60.0
"""The longest a test accepts from a kill to the first request served again (measured: ~1 s
for the toy card, a few seconds for the tiny ChatTTS; the bound is for a loaded CI box)."""


def _kill(pid: int | None) -> None:
    assert pid is not None, "no live actor to kill"
    os.kill(pid, signal.SIGKILL)


async def _until(
    condition, timeout: float = RECOVERY_BOUND_S, what: str = "", poll: float = 0.02
) -> float:
    """Poll ``condition()`` (may be a coroutine function) every ``poll`` seconds until true;
    returns the seconds it took."""
    start = time.monotonic()
    while True:
        value = condition()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return time.monotonic() - start
        assert time.monotonic() - start < timeout, f"timed out waiting for {what}"
        await asyncio.sleep(poll)


def _toy_lm_unless(marker: str):
    """The toy lm, unless ``marker`` exists (then building it fails: a replacement that
    cannot come up while the test wants it down)."""
    if Path(marker).exists():
        raise RuntimeError(f"test marker {marker} present: refusing to build")
    return build_component("toy", "lm", "cpu", {})


def _engine(executor: RayExecutor, cards) -> AsyncEngine:
    return AsyncEngine([executor.instance(c) for c in cards], EngineConfig(), executor=executor)


# ------------------------------------------------------------------ the recovery section


def test_recovery_section_of_the_deploy_file():
    assert parse_recovery(None) == RecoveryPolicy()
    policy = parse_recovery({"recovery": {"attempts": 3, "backoff_s": 0.5, "max_backoff_s": 1}})
    assert (policy.attempts, policy.backoff_s, policy.max_backoff_s) == (3, 0.5, 1.0)
    assert [policy.delay(a) for a in (1, 2, 3, 4)] == [0.0, 0.5, 1.0, 1.0]
    with pytest.raises(DeployConfigError, match="unknown keys \\['tries'\\]"):
        parse_recovery({"recovery": {"tries": 3}})
    with pytest.raises(DeployConfigError, match="recovery.attempts must be >= 1"):
        parse_recovery({"recovery": {"attempts": 0}})


def test_recorded_updates_keep_only_current_tensors():
    """What a replacement replays: an update superseded tensor by tensor is dropped, a partly
    superseded one kept (replayed first), another recorded method's earlier call dropped."""
    from omnistep.engine.ray_executor import _Placed

    executor = RayExecutor.__new__(RayExecutor)
    executor._serial = iter(range(1, 100))
    placed = _Placed(None, {}, [])  # type: ignore[arg-type]
    executor._record(placed, "update_weights", b"1", ({"a": 1, "b": 2},))
    executor._record(placed, "refresh_text_embeds", b"2", (0,))
    executor._record(placed, "update_weights", b"3", ({"b": 3},))
    executor._record(placed, "refresh_text_embeds", b"4", (0,))
    assert [(c.ref, c.names) for c in placed.calls] == [
        (b"1", frozenset({"a"})),
        (b"3", frozenset({"b"})),
        (b"4", None),
    ]
    executor._record(placed, "update_weights", b"5", ({"a": 5, "b": 5},))
    assert [c.ref for c in placed.calls] == [b"4", b"5"]


# ------------------------------------------------------------------ server: degraded, 503


def test_unavailable_component_errors_are_503_with_retry_after():
    """A new request refused (no live replica) and a request whose replica died under it
    (the engine wraps the cause in RequestFailedError) both answer 503 + Retry-After; other
    failures stay 500."""
    from omnistep.server.errors import api_error

    refused = ComponentUnavailableError("model 'a' is unavailable", "a", "lm", retry_after=3)
    died = RequestFailedError("a.decode: ComponentUnavailableError: the Ray actor died")
    died.__cause__ = ComponentUnavailableError("the Ray actor died", "a", "lm", retry_after=2)
    for exc, retry in ((refused, "3"), (died, "2")):
        error = api_error(exc)
        assert (error.status, error.code, error.type) == (
            503,
            "component_unavailable",
            "server_error",
        )
        assert error.headers == {"Retry-After": retry}
    other = RequestFailedError("a.decode: RuntimeError: boom")
    other.__cause__ = RuntimeError("boom")
    assert api_error(other).status == 500


async def test_dead_actor_degrades_health_and_is_replaced(ray_cluster, tmp_path):
    """Model ``a``'s only lm actor is killed while its replacement cannot build: ``/health``
    is 503 ``degraded`` naming a/lm, requests for ``a`` get 503 with ``Retry-After`` and
    OpenAI's error JSON, model ``b`` serves on; once the replacement builds, ``/health`` is
    ok again, ``a`` gives the bytes it gave before, and the metrics count the death and the
    restart."""
    marker = tmp_path / "refuse"
    cards = build_cards(["toy", "toy"], ["a", "b"])
    place = ComponentPlacement(num_cpus=0.25)
    deployments = [
        ComponentDeployment("a", "lm", functools.partial(_toy_lm_unless, str(marker)), place),
        *(
            ComponentDeployment(
                m, n, functools.partial(build_component, "toy", n, "cpu", {}), place
            )
            for m, n in (("a", "vocoder"), ("b", "lm"), ("b", "vocoder"))
        ),
    ]
    executor = RayExecutor(deployments, recovery=RecoveryPolicy(100, 0.1, 0.2))
    engine = _engine(executor, cards)
    transport = httpx.ASGITransport(app=build_app(engine))
    body = {"input": "hello heal", "seed": 7, "response_format": "pcm", "max_new_tokens": 24}
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:

            async def speech(model: str) -> httpx.Response:
                return await client.post("/v1/audio/speech", json={**body, "model": model})

            before = await speech("a")
            assert before.status_code == 200 and len(before.content) > 1000
            assert (await client.get("/health")).json()["status"] == "ok"
            marker.touch()
            _kill(executor.replica_pids("a", "lm")[0])

            async def degraded() -> bool:
                return (await client.get("/health")).status_code == 503

            await _until(degraded, what="/health to say degraded")
            health = (await client.get("/health")).json()
            assert health["status"] == "degraded"
            assert health["degraded"] == [{"model": "a", "component": "lm", "state": "recovering"}]
            refused = await speech("a")
            assert refused.status_code == 503
            assert int(refused.headers["Retry-After"]) >= 1
            error = refused.json()["error"]
            assert error["code"] == "component_unavailable" and error["type"] == "server_error"
            assert "'a'" in error["message"] and "'lm'" in error["message"]
            other = await speech("b")
            assert other.status_code == 200 and other.content == before.content
            metrics = (await client.get("/metrics")).text
            assert 'omnistep_actor_deaths_total{component="lm",model="a"} 1.0' in metrics
            assert 'omnistep_replicas_live{component="lm",model="a"} 0.0' in metrics

            marker.unlink()

            async def healthy() -> bool:
                return (await client.get("/health")).status_code == 200

            await _until(healthy, what="/health to be ok again")
            after = await speech("a")
            assert after.status_code == 200 and after.content == before.content
            metrics = (await client.get("/metrics")).text
            assert 'omnistep_actor_restarts_total{component="lm",model="a"} 1.0' in metrics
            assert 'omnistep_replicas_live{component="lm",model="a"} 1.0' in metrics
        (lm,) = [h for h in executor.health() if (h.model, h.component) == ("a", "lm")]
        assert (lm.deaths, lm.restarts, lm.failed, lm.live) == (1, 1, 0, 1)
        others = [h for h in executor.health() if (h.model, h.component) != ("a", "lm")]
        assert len(others) == 3 and all(h.deaths == 0 and h.live == 1 for h in others)
    finally:
        await engine.shutdown()


async def test_replica_that_cannot_come_back_is_reported_and_the_other_serves(
    ray_cluster, tmp_path
):
    """Two lm replicas; one is killed and every try to replace it fails: it is reported
    ``failed`` (``/health`` stays 200 while a replica serves, listing 1 of 2 live), and the
    other replica serves every request with the in-process output."""
    marker = tmp_path / "refuse"
    cards = build_cards(["toy"])
    deployments = [
        ComponentDeployment(
            "toy",
            "lm",
            functools.partial(_toy_lm_unless, str(marker)),
            ComponentPlacement(num_cpus=0.25, replicas=2),
        ),
        ComponentDeployment(
            "toy",
            "vocoder",
            functools.partial(build_component, "toy", "vocoder", "cpu", {}),
            ComponentPlacement(num_cpus=0.25),
        ),
    ]
    reqs = [Request("toy", text=f"still here {i}", seed=i) for i in range(4)]
    local = load_engine(["toy"], "cpu", 8)
    try:
        expected = await run_interleaved(local, reqs)
    finally:
        await local.shutdown()
    executor = RayExecutor(deployments, recovery=RecoveryPolicy(2, 0.05, 0.05))
    engine = _engine(executor, cards)
    transport = httpx.ASGITransport(app=build_app(engine))
    try:
        marker.touch()
        _kill(executor.replica_pids("toy", "lm")[0])
        await _until(
            lambda: executor.health()[0].failed == 1, what="the replacement to be given up"
        )
        (lm, _) = executor.health()
        assert (lm.live, lm.recovering, lm.failed, lm.state) == (1, 0, 1, "degraded")
        got = await run_interleaved(
            engine, [dataclasses.replace(r, request_id=f"x{i}") for i, r in enumerate(reqs)]
        )
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            health = await client.get("/health")
    finally:
        await engine.shutdown()
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert health.json()["replicas"] == [{"model": "toy", "component": "lm", "live": 1, "of": 2}]
    for a, b in zip(expected, got, strict=True):
        assert a.audio.size > 0 and a.audio.tobytes() == b.audio.tobytes()


# ------------------------------------------------------------------ kills under load


@pytest.fixture(scope="module")
def chattts_root(tmp_path_factory):
    from omnistep.models.chattts.tiny import write_servable_tiny_chattts

    return write_servable_tiny_chattts(tmp_path_factory.mktemp("chattts") / "ckpt")


CHATTTS_OPTIONS = {"kv_cache_gb": 0.02, "batch_invariant": True}
"""``batch_invariant``: replicas split batches, so outputs must not depend on the batch."""


def _templates(card: str) -> list[Request]:
    """The requests of one round (fresh ids each round, same seeds). The toy's ``<slow>``
    keeps its requests in flight; ChatTTS's four are a rollout group of two (on one GPT
    replica) and two single requests."""
    if card == "toy":
        return [
            Request(
                "toy",
                text=f"heal round {k} <slow>",
                seed=50 + k,
                sampling=SamplingParams(temperature=0.8, max_new_tokens=30),
            )
            for k in range(4)
        ]
    sampling = SamplingParams(max_new_tokens=40, min_new_tokens=40, top_k=50)
    group = [
        Request(
            "chattts",
            text="one prompt, two samples",
            seed=60 + k,
            group="group",
            profile=ExecutionProfile.ROLLOUT,
            sampling=sampling,
        )
        for k in range(2)
    ]
    singles = [
        Request("chattts", text=f"a single request {k}", seed=70 + k, sampling=sampling)
        for k in range(2)
    ]
    return group + singles


def _fresh(templates: list[Request], round_: int) -> list[Request]:
    """Copies with new request ids (and a new group name: a group ends with the round)."""
    out = []
    for k, r in enumerate(templates):
        group = None if r.group is None else f"{r.group}-{round_}"
        out.append(dataclasses.replace(r, request_id=f"r{round_}-{k}", group=group))
    return out


async def _in_process(spec: str, reqs: list[Request], **options):
    """In-process outputs at one torch thread (what an actor with ``num_cpus`` < 2 uses)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    local = load_engine([spec], "cpu", 8, **options)
    try:
        return await run_interleaved(local, reqs)
    finally:
        torch.set_num_threads(threads)
        await local.shutdown()


def _signal_batches(executor: RayExecutor, names) -> dict[str, asyncio.Event]:
    """An event per component name, set each time a batch of it is handed to the executor
    (the test kills the actor then, while the batch is in flight)."""
    events = {name: asyncio.Event() for name in names}
    run = executor.run

    async def signalling_run(component, kind, payloads, *, model_id="", name=""):
        if name in events:
            events[name].set()
        return await run(component, kind, payloads, model_id=model_id, name=name)

    executor.run = signalling_run
    return events


def _clean_failure(result: object) -> bool:
    """A request that failed because the actor holding its state died."""
    return isinstance(result, RequestFailedError) and isinstance(
        result.__cause__, ComponentUnavailableError
    )


async def _served_again(engine: AsyncEngine, probe: Request, round_: int) -> None:
    """Send ``probe`` until it succeeds (503s while the component has no live replica)."""
    for attempt in range(100000):
        try:
            await collect(engine, dataclasses.replace(probe, request_id=f"p{round_}-{attempt}"))
            return
        except ComponentUnavailableError:
            pass
        except RequestFailedError as exc:  # sent while the death was not seen yet
            assert _clean_failure(exc), exc
        await asyncio.sleep(0.02)


async def _no_leaks(engine: AsyncEngine, model: str, kv_components: tuple[str, ...]) -> None:
    """Nothing held anywhere: engine counts, routes, groups, the actors' KV blocks."""
    executor = engine._executor
    await _until(lambda: not engine.stats()["running_batches"], what="batches to end")
    for name in kv_components:
        used, free = await executor.refresh_kv_blocks(model, name)
        assert used == 0 and free > 0, (name, used, free)
    assert engine.stats() == dict.fromkeys(engine.stats(), 0), engine.stats()
    assert not executor._routes and not executor._groups and not executor._group_size
    assert not executor._group_of
    for name in engine.models[model].components:
        assert executor.replica_sequences(model, name) == [0] * len(
            executor.replica_sequences(model, name)
        )


@pytest.mark.parametrize(
    ("card", "kills"),
    [
        ("toy", 3),
        ("chattts", 2),
        pytest.param("toy", 20, marks=pytest.mark.slow),
        pytest.param("chattts", 20, marks=pytest.mark.slow),
    ],
)
async def test_kills_under_load_recover_with_in_process_outputs(
    card, kills, ray_cluster, request, tmp_path
):
    """``kills`` rounds: four concurrent requests, SIGKILL of a component actor while they
    run (alternately the AR component and the vocoder; for ChatTTS the GPT replica holding
    the round's rollout group, of two), then: every request either finished with the
    in-process output or failed with the clean error (the group's two samples both), the
    model serves again within ``RECOVERY_BOUND_S``, the next round's requests all equal the
    in-process outputs, and nothing leaks (units, loops, routes, KV blocks)."""
    if card == "toy":
        spec, options, ar, model = "toy", {}, "lm", "toy"
        deploy = "lm: {num_cpus: 0.5}\n      vocoder: {num_cpus: 0.5}"
        kv_components: tuple[str, ...] = ()
    else:
        spec = f"chattts={request.getfixturevalue('chattts_root')}"
        options, ar, model = CHATTTS_OPTIONS, "gpt", "chattts"
        deploy = "gpt: {num_cpus: 0.5, replicas: 2}\n      vocoder: {num_cpus: 0.5}"
        kv_components = ("gpt",)
    path = tmp_path / "deploy.yaml"
    path.write_text(f"models:\n  {model}:\n    components:\n      {deploy}\n")
    templates = _templates(card)
    expected = [r.audio.tobytes() for r in await _in_process(spec, templates, **options)]
    assert all(len(b) > 1000 for b in expected)
    engine = load_engine([spec], "cpu", 8, executor="ray", deploy=str(path), **options)
    executor = engine._executor
    sent = _signal_batches(executor, (ar, "vocoder"))
    served_s, replaced_s, failed = [], [], 0
    try:
        for round_ in range(kills):
            target = ar if round_ % 2 == 0 else "vocoder"
            reqs = _fresh(templates, round_)
            sent[target].clear()
            tasks = [asyncio.ensure_future(collect(engine, r)) for r in reqs]
            group = next((r.group for r in reqs if r.group), None)
            if target == "gpt":  # the replica holding the round's group, once it runs there
                key = (model, target, group)
                await _until(lambda k=key: k in executor._groups, what="the group to start")
                victim = executor._groups[key]
                pid = victim.pid
            else:
                await asyncio.wait_for(sent[target].wait(), RECOVERY_BOUND_S)
                pid = executor.replica_pids(model, target)[0]
            _kill(pid)
            killed = time.monotonic()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            for k, (result, want) in enumerate(zip(results, expected, strict=True)):
                if isinstance(result, BaseException):
                    assert _clean_failure(result), (round_, k, result)
                    failed += 1
                else:
                    assert result.audio.tobytes() == want, (round_, k)
            if target == "gpt":  # the group lived on the dead replica: it fails as a whole
                assert all(_clean_failure(results[k]) for k in (0, 1)), results[:2]
            await _served_again(engine, templates[-1], round_)
            served_s.append(time.monotonic() - killed)

            def replaced(t=target) -> bool:
                (h,) = [h for h in executor.health() if h.component == t]
                return h.live == h.replicas

            await _until(replaced, what=f"{target} to be replaced")
            replaced_s.append(time.monotonic() - killed)
            again = await run_interleaved(engine, _fresh(templates, 1000 + round_))
            assert [r.audio.tobytes() for r in again] == expected, round_
            await _no_leaks(engine, model, kv_components)
        deaths = {h.component: (h.deaths, h.restarts, h.failed) for h in executor.health()}
    finally:
        await engine.shutdown()
    n_ar, n_voc = (kills + 1) // 2, kills // 2
    assert deaths == {ar: (n_ar, n_ar, 0), "vocoder": (n_voc, n_voc, 0)}
    assert max(served_s) < RECOVERY_BOUND_S and max(replaced_s) < RECOVERY_BOUND_S
    print(
        f"\n{card}: {kills} kills, {failed} in-flight requests failed of {4 * kills}; "
        f"served again after median {statistics.median(served_s):.2f} s, "
        f"max {max(served_s):.2f} s; replica replaced after median "
        f"{statistics.median(replaced_s):.2f} s, max {max(replaced_s):.2f} s"
    )


async def test_kill_during_weight_update_leaves_every_replica_at_one_version(ray_cluster, tmp_path):
    """Two lm replicas. A replica killed while an update is being applied, one killed just
    before an update (it is being replaced when the update runs), then both killed before one:
    each replacement replays the updates, so afterwards every replica runs the same version
    and table, and outputs equal an in-process engine updated alike."""
    from omnistep.models.toy.lm import ToyLM

    path = tmp_path / "deploy.yaml"
    path.write_text(
        "models:\n  toy:\n    components:\n"
        "      lm: {num_cpus: 0.25, replicas: 2}\n      vocoder: {num_cpus: 0.25}\n"
    )
    first = np.ascontiguousarray(ToyLM().table[::-1])
    second = np.ascontiguousarray(np.roll(ToyLM().table, 7, axis=0))
    third = np.ascontiguousarray(np.roll(ToyLM().table, 11, axis=0))
    reqs = [
        dataclasses.replace(r, profile=ExecutionProfile.ROLLOUT, request_id=f"w{i}")
        for i, r in enumerate(_templates("toy"))
    ]
    engine = load_engine(["toy"], "cpu", 8, executor="ray", deploy=str(path))
    executor = engine._executor
    real_call_all = executor.call_all
    killed: list[int] = []

    def call_all(model_id, name, method, args):  # the kill lands as the update is sent
        if method == "update_weights" and not killed:
            pid = executor.replica_pids(model_id, name)[1]
            killed.append(pid)
            _kill(pid)
        return real_call_all(model_id, name, method, args)

    def lm_live() -> int:
        return next(h.live for h in executor.health() if h.component == "lm")

    local = load_engine(["toy"], "cpu", 8)
    try:
        before = await run_interleaved(local, reqs)  # the loaded table: outputs must change
        executor.call_all = call_all
        assert await engine.update_weights("toy", {"table": first}, version=3) == 3
        assert killed
        await _until(lambda: lm_live() == 2, what="the replica killed in the update")
        assert executor.replica_versions("toy", "lm") == [3, 3]
        _kill(executor.replica_pids("toy", "lm")[0])
        assert await engine.update_weights("toy", {"table": second}, version=4) == 4
        await _until(lambda: lm_live() == 2, what="the replica killed before the update")
        assert executor.replica_versions("toy", "lm") == [4, 4]
        for pid in executor.replica_pids("toy", "lm"):  # none live: the update is replayed
            _kill(pid)
        await _until(lambda: lm_live() == 0, what="both lm replicas to be seen dead")
        assert await engine.update_weights("toy", {"table": third}, version=5) == 5
        await _until(lambda: lm_live() == 2, what="both lm replicas to be replaced")
        assert executor.replica_versions("toy", "lm") == [5, 5]
        (lm,) = [h for h in executor.health() if h.component == "lm"]
        assert (lm.deaths, lm.restarts) == (4, 4)
        assert await local.update_weights("toy", {"table": third}, version=5) == 5
        expected = await run_interleaved(local, reqs)
        got = await run_interleaved(engine, reqs)
        batches = executor.replica_batches("toy", "lm")
    finally:
        await local.shutdown()
        await engine.shutdown()
    for a, b in zip(expected, got, strict=True):
        assert a.audio.size > 0 and a.audio.tobytes() == b.audio.tobytes()
        assert {r.weight_version for r in b.trajectories["decode"]} == {5}
    assert any(
        a.audio.tobytes() != c.audio.tobytes() for a, c in zip(expected, before, strict=True)
    )
    assert all(n > 0 for n in batches), batches


async def test_streams_on_a_dead_actor_end_cleanly(ray_cluster, tmp_path):
    """Over real HTTP (uvicorn in this event loop): an SSE stream and a raw audio stream, both
    past their first audio, when the lm actor running their step is killed: the SSE stream
    ends with a ``speech.audio.error`` event (code ``component_unavailable``), the raw stream
    is closed without its final chunk. The next request, once the actor is replaced, is
    served in full."""
    import socket

    import uvicorn

    from omnistep.server.errors import install_log_filter

    install_log_filter()  # as `omnistep serve` does: a cut stream is logged in one line
    path = tmp_path / "deploy.yaml"
    path.write_text(
        "models:\n  toy:\n    components:\n"
        "      lm: {num_cpus: 0.5}\n      vocoder: {num_cpus: 0.5}\n"
    )
    engine = load_engine(["toy"], "cpu", 8, executor="ray", deploy=str(path))
    executor = engine._executor
    lm_sent = _signal_batches(executor, ("lm",))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    config = uvicorn.Config(
        build_app(engine), host="127.0.0.1", port=port, log_level="warning", lifespan="off"
    )
    server = uvicorn.Server(config)
    serving = asyncio.ensure_future(server.serve())
    body = {"model": "toy", "input": "a long stream <slow> " * 4, "seed": 5}
    body["max_new_tokens"] = 400
    started = {"sse": asyncio.Event(), "audio": asyncio.Event()}

    async def sse(client: httpx.AsyncClient) -> list[dict]:
        import json

        events = []
        async with client.stream(
            "POST", "/v1/audio/speech", json={**body, "stream_format": "sse"}
        ) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
                    started["sse"].set()
        return events

    async def raw(client: httpx.AsyncClient) -> tuple[str, int]:
        got = 0
        async with client.stream(
            "POST", "/v1/audio/speech", json={**body, "response_format": "pcm"}
        ) as r:
            assert r.status_code == 200
            try:
                async for chunk in r.aiter_raw():
                    got += len(chunk)
                    started["audio"].set()
            except httpx.RemoteProtocolError:
                return "cut", got
        return "complete", got

    try:
        await _until(lambda: server.started, what="uvicorn to start")
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=120) as client:
            streams = asyncio.gather(sse(client), raw(client))
            await asyncio.wait_for(started["sse"].wait(), 60)
            await asyncio.wait_for(started["audio"].wait(), 60)
            lm_sent["lm"].clear()
            await asyncio.wait_for(lm_sent["lm"].wait(), 60)
            _kill(executor.replica_pids("toy", "lm")[0])
            events, (ending, size) = await streams
            assert events[-1]["type"] == "speech.audio.error", events[-1]["type"]
            assert events[-1]["error"]["code"] == "component_unavailable"
            assert "toy/lm" in events[-1]["error"]["message"]
            assert sum(e["type"] == "speech.audio.delta" for e in events) >= 1
            assert ending == "cut" and size > 0
            await _until(lambda: executor.health()[0].live == 1, what="the lm to be replaced")
            short = {**body, "input": "short again", "max_new_tokens": 20, "response_format": "pcm"}
            again = await client.post("/v1/audio/speech", json=short)
            assert again.status_code == 200 and len(again.content) > 1000
    finally:
        server.should_exit = True
        await serving
        await engine.shutdown()
