"""The Ray executor: same outputs as in process (toy, piper), replicas, fault isolation, the
deploy file and the ``serve --executor ray --deploy`` wiring. Runs a local 2-CPU Ray."""

import asyncio
import json
import threading
import time

import numpy as np
import pytest

from omnistep.cli import build_parser, load_engine
from omnistep.core import OmnistepError, Request, RequestFailedError, SamplingParams
from omnistep.engine.ray_executor import ComponentPlacement, DeployConfigError, parse_deploy
from omnistep.parity import collect, run_interleaved

TOY = {"toy": ("toy", ["lm", "vocoder"])}


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray for this module (``ray.init`` takes about 7 s on the 2-core CI box)."""
    ray = pytest.importorskip("ray")
    start = time.perf_counter()
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        ignore_reinit_error=True,
        log_to_driver=False,
    )
    print(f"ray.init took {time.perf_counter() - start:.1f} s")
    yield ray
    ray.shutdown()


def _toy_requests(n: int) -> list[Request]:
    return [
        Request(
            "toy",
            text=f"ray request {i} " * (i + 1),
            seed=40 + i,
            sampling=SamplingParams(temperature=0.8, max_new_tokens=12 + 3 * i),
        )
        for i in range(n)
    ]


async def test_toy_on_ray_equals_in_process_and_replicas_share_batches(ray_cluster, tmp_path):
    deploy = tmp_path / "deploy.yaml"
    deploy.write_text(
        "models:\n"
        "  toy:\n"
        "    components:\n"
        "      lm: {num_cpus: 0.5}\n"
        "      vocoder: {num_cpus: 0.5, replicas: 2}\n"
    )
    reqs = _toy_requests(5)
    local = load_engine(["toy"], "cpu", 8)
    try:
        expected = await run_interleaved(local, reqs)
    finally:
        await local.shutdown()
    engine = load_engine(["toy"], "cpu", 8, executor="ray", deploy=str(deploy))
    try:
        got = await run_interleaved(engine, reqs)
        batches = engine._executor.replica_batches("toy", "vocoder")
    finally:
        await engine.shutdown()
    for a, b in zip(expected, got, strict=True):
        assert a.text == b.text and a.text
        assert a.audio.tobytes() == b.audio.tobytes() and a.audio.size > 0
    assert len(batches) == 2 and all(n > 0 for n in batches), batches


async def test_failing_request_fails_alone_on_ray(ray_cluster):
    engine = load_engine(["toy"], "cpu", 8, executor="ray")
    try:
        reqs = _toy_requests(3)
        reqs[1] = Request("toy", text="this one <fail>s", seed=3)
        results = await asyncio.gather(*(collect(engine, r) for r in reqs), return_exceptions=True)
        assert engine.stats()["live_requests"] == 0
    finally:
        await engine.shutdown()
    assert isinstance(results[1], RequestFailedError)
    assert "injected fault" in str(results[1])
    for i in (0, 2):
        assert not isinstance(results[i], BaseException) and results[i].audio.size > 0


async def test_piper_on_ray_equals_in_process(ray_cluster):
    pytest.importorskip("piper")
    reqs = [
        Request("piper", text="Hello from the ray executor.", seed=11),
        Request("piper", text="A second short sentence. And a third one.", seed=12),
    ]
    local = load_engine(["piper"], "cpu", 1)
    try:
        expected = await run_interleaved(local, reqs)
    finally:
        await local.shutdown()
    engine = load_engine(["piper"], "cpu", 1, executor="ray")
    try:
        got = await run_interleaved(engine, reqs)
    finally:
        await engine.shutdown()
    for a, b in zip(expected, got, strict=True):
        assert a.sample_rate == b.sample_rate == 22050
        assert a.audio.size > 0 and np.array_equal(a.audio, b.audio)


def test_parse_deploy_defaults_and_values():
    assert parse_deploy(None, TOY) == {
        ("toy", "lm"): ComponentPlacement(),
        ("toy", "vocoder"): ComponentPlacement(),
    }
    data = {
        "models": {
            "toy": {
                "components": {
                    "lm": {"num_gpus": 1, "device": "cuda", "resources": {"thinker_node": 1}},
                    "vocoder": {"num_cpus": 2, "replicas": 2},
                }
            }
        }
    }
    got = parse_deploy(data, TOY)
    assert got[("toy", "lm")] == ComponentPlacement(
        num_cpus=1.0, num_gpus=1.0, resources={"thinker_node": 1.0}, device="cuda"
    )
    assert got[("toy", "vocoder")] == ComponentPlacement(num_cpus=2.0, replicas=2)
    # a card may be named by its family too
    assert parse_deploy({"models": {"piper": None}}, {"piper": ("piper", ["voice"])})


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"models": {"toy": {"components": {"gpt": {}}}}}, "has no component 'gpt'"),
        ({"models": {"chattts": {}}}, "not served"),
        ({"models": {"toy": {"components": {"lm": {"gpus": 1}}}}}, "unknown keys ['gpus']"),
        ({"models": {"toy": {"components": {"lm": {"replicas": 0}}}}}, "replicas must be >= 1"),
        ({"models": {"toy": {"components": {"lm": {"replicas": 1.5}}}}}, "whole number"),
        ({"models": {"toy": {"components": {"lm": {"num_cpus": "two"}}}}}, "must be a number"),
        ({"toy": {}}, "one key, 'models'"),
    ],
)
def test_parse_deploy_errors(data, message):
    with pytest.raises(DeployConfigError) as info:
        parse_deploy(data, TOY)
    assert message in str(info.value)


def test_deploy_file_errors_and_cli_flags(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(json.dumps({"models": {"toy": {"components": {"nope": {}}}}}))
    with pytest.raises(OmnistepError, match="no component 'nope'; its components: lm, vocoder"):
        load_engine(["toy"], "cpu", 8, executor="ray", deploy=str(bad))
    with pytest.raises(OmnistepError, match="--deploy needs --executor ray"):
        load_engine(["toy"], "cpu", 8, deploy=str(bad))
    args = build_parser().parse_args(
        ["serve", "--model", "toy", "--executor", "ray", "--deploy", str(bad)]
    )
    assert (args.executor, args.deploy, args.ray_address) == ("ray", str(bad), None)
    assert build_parser().parse_args(["serve"]).executor == "inprocess"


async def test_payload_that_does_not_pickle_fails_its_units_clearly(ray_cluster):
    from functools import partial

    from omnistep.core import WorkUnitKind
    from omnistep.engine.ray_executor import ComponentDeployment, RayExecutor
    from omnistep.models.registry import build_component

    factory = partial(build_component, "toy", "lm", "cpu", {})
    executor = RayExecutor([ComponentDeployment("toy", "lm", factory, ComponentPlacement(0))])
    try:
        outcomes = await executor.run(
            None, WorkUnitKind.AR_TOKEN, [threading.Lock()] * 2, model_id="toy", name="lm"
        )
    finally:
        executor.close()
    assert len(outcomes) == 2
    assert all(isinstance(o, TypeError) and "payloads pickle" in str(o) for o in outcomes)
