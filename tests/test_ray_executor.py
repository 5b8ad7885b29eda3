"""The Ray executor: same outputs as in process (toy, piper, and the AR cards chattts and
qwen2_5_omni on tiny checkpoints), replicas with sticky sequence routing, KV blocks freed in the
actors on abort, fault isolation, the deploy file and the ``serve --executor ray --deploy``
wiring; the serving process (the driver) builds no component and reads no weights. Runs one
local 2-CPU Ray for the module."""

import asyncio
import contextlib
import dataclasses
import gc
import json
import threading
import time

import numpy as np
import pytest

from omnistep.cli import build_parser, load_engine
from omnistep.core import (
    ExecutionProfile,
    ModelInstance,
    OmnistepError,
    Request,
    RequestFailedError,
    SamplingParams,
    WeightUpdateError,
)
from omnistep.engine import AsyncEngine, EngineConfig
from omnistep.engine.deploy import ComponentPlacement, DeployConfigError, parse_deploy
from omnistep.engine.executor import InProcessExecutor
from omnistep.engine.ray_executor import RemoteComponent
from omnistep.kv import kv_usage
from omnistep.models.registry import build_card
from omnistep.parity import collect, run_interleaved

TOY = {"toy": ("toy", ["lm", "vocoder"])}


def _refuse(*args, **kwargs):
    raise AssertionError("the serving process built a component or read weights")


def _no_builds_in_driver(monkeypatch) -> None:
    """From here on this process (the Ray driver) cannot build a component or read a weight
    file: ``load_engine``'s cards (``omnistep.launch``) get builders that raise, and so do the
    checkpoint readers and piper's ONNX session. The actors run in their own processes,
    unpatched."""
    import omnistep.launch

    real = omnistep.launch.build_card

    def card_without_builders(spec: str, **options):
        card = real(spec, **options)
        specs = tuple(dataclasses.replace(c, build=_refuse) for c in card.components)
        return dataclasses.replace(card, components=specs)

    monkeypatch.setattr(omnistep.launch, "build_card", card_without_builders)
    monkeypatch.setattr("omnistep.models.chattts.loader.ChatTTSFiles.tensors", _refuse)
    monkeypatch.setattr("omnistep.models.qwen2_5_omni.loader.QwenOmniFiles.tensors", _refuse)
    with contextlib.suppress(ImportError):  # piper (onnx) installed
        monkeypatch.setattr("omnistep.models.piper.voice._seeded_graph", _refuse)


def _stand_ins_only(engine) -> bool:
    """Every component of every model of ``engine`` is a ``RemoteComponent``."""
    from omnistep.engine.ray_executor import RemoteComponent

    components = [c for m in engine.models.values() for c in m.components.values()]
    return bool(components) and all(isinstance(c, RemoteComponent) for c in components)


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


async def test_toy_on_ray_equals_in_process_and_replicas_share_batches(
    ray_cluster, tmp_path, monkeypatch
):
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
    _no_builds_in_driver(monkeypatch)
    engine = load_engine(["toy"], "cpu", 8, executor="ray", deploy=str(deploy))
    try:
        assert _stand_ins_only(engine)
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


async def test_piper_on_ray_equals_in_process(ray_cluster, monkeypatch):
    """The sentence loop gets the voice's settings from the card: the serving process opens
    no ONNX session."""
    reqs = [
        Request("piper", text="Hello from the ray executor.", seed=11),
        Request("piper", text="A second short sentence. And a third one.", seed=12),
    ]
    local = load_engine(["piper"], "cpu", 1)
    try:
        expected = await run_interleaved(local, reqs)
    finally:
        await local.shutdown()
    _no_builds_in_driver(monkeypatch)
    engine = load_engine(["piper"], "cpu", 1, executor="ray")
    try:
        assert _stand_ins_only(engine)
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
        ({"toy": {}}, "keys 'models' and (optional) 'recovery'"),
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
    from omnistep.engine.deploy import ComponentDeployment
    from omnistep.engine.ray_executor import RayExecutor
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


# ------------------------------------------------------------------ AR cards


def _deploy(tmp_path, family: str, components: dict[str, str]) -> str:
    """A deploy file giving each component a fraction of the 2-CPU test cluster."""
    lines = ["models:", f"  {family}:", "    components:"]
    lines += [f"      {name}: {{{spec}}}" for name, spec in components.items()]
    path = tmp_path / f"{family}.yaml"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def chattts_root(tmp_path_factory):
    from omnistep.models.chattts.tiny import write_servable_tiny_chattts

    return write_servable_tiny_chattts(tmp_path_factory.mktemp("chattts") / "ckpt")


CHATTTS_OPTIONS = {"kv_cache_gb": 0.02, "batch_invariant": True}
"""``batch_invariant``: replicas split batches, so outputs must not depend on the batch."""


async def _in_process(spec: str, reqs: list[Request], **options):
    """The in-process outputs, and the engine's models, at one torch thread: an actor with
    ``num_cpus`` < 2 computes with one (Ray sets ``OMP_NUM_THREADS``), and CPU kernels round
    differently with other thread counts (~1e-7 in the vocoder), executor aside."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    local = load_engine([spec], "cpu", 8, **options)
    try:
        return await run_interleaved(local, reqs), local.models
    finally:
        torch.set_num_threads(threads)
        await local.shutdown()


def _live(cls: type) -> int:
    """Objects of ``cls`` (or a subclass) alive in this process."""
    return sum(1 for o in gc.get_objects() if issubclass(type(o), cls))


async def _until_kv_used(engine, model_id: str, name: str, timeout: float = 60.0) -> int:
    """Wait until the actors report KV blocks in use; returns ``stats()``'s count then."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        used = engine.stats()["kv_blocks_used"]
        if used > 0:
            return used
    raise AssertionError(f"{model_id}/{name} never reported KV blocks in use")


async def _until_idle(engine, timeout: float = 60.0) -> None:
    """Wait until no batch runs (an aborted request's last batch frees it when it returns)."""
    deadline = time.monotonic() + timeout
    while engine.stats()["running_batches"] or engine.stats()["live_requests"]:
        assert time.monotonic() < deadline, engine.stats()
        await asyncio.sleep(0.02)


async def test_chattts_on_ray_equals_in_process_with_sticky_replicas(
    ray_cluster, chattts_root, tmp_path, monkeypatch
):
    """Two concurrent sampled requests: byte-identical audio to in process (so the generators
    advanced in the actors were copied back), each sequence on its own GPT replica; an aborted
    request leaves no KV block in use in either actor. The serving process builds no module
    and no KV table and reads no weight file."""
    import torch

    from omnistep.kv import SequenceTable

    spec = f"chattts={chattts_root}"
    reqs = [
        Request(
            "chattts", text=text, seed=seed, sampling=SamplingParams(max_new_tokens=n, top_k=50)
        )
        for text, seed, n in (("hello world", 5, 30), ("a longer sentence to speak", 6, 36))
    ]
    expected, models = await _in_process(spec, reqs, **CHATTTS_OPTIONS)
    blocks = models["chattts"].components["gpt"].blocks.num_blocks  # per replica
    deploy = _deploy(
        tmp_path,
        "chattts",
        {"gpt": "num_cpus: 0.5, replicas: 2", "vocoder": "num_cpus: 0.5"},
    )
    del models
    gc.collect()
    before = _live(torch.nn.Module), _live(SequenceTable)
    _no_builds_in_driver(monkeypatch)
    start = time.perf_counter()
    engine = load_engine([spec], "cpu", 8, executor="ray", deploy=deploy, **CHATTTS_OPTIONS)
    print(f"chattts actors up in {time.perf_counter() - start:.1f} s")
    executor = engine._executor
    try:
        assert _stand_ins_only(engine)
        assert _live(torch.nn.Module) <= before[0] and _live(SequenceTable) <= before[1]
        got = await run_interleaved(engine, reqs)
        batches = executor.replica_batches("chattts", "gpt")
        assert executor.replica_sequences("chattts", "gpt") == [0, 0]
        assert await executor.refresh_kv_blocks("chattts", "gpt") == (0, 2 * blocks)
        # abort mid-decode: the loop's owner (a RemoteComponent) frees it in its actor
        long = Request("chattts", text="hello", seed=9, sampling=SamplingParams(max_new_tokens=900))
        stream = engine.add_request(long)
        used = await _until_kv_used(engine, "chattts", "gpt")
        stream.cancel()
        await _until_idle(engine)
        assert used > 0
        assert await executor.refresh_kv_blocks("chattts", "gpt") == (0, 2 * blocks)
        assert engine.stats()["kv_blocks_used"] == 0
        assert engine.occupancy().kv_blocks[("chattts", "gpt")] == (0, 2 * blocks)
        # a weight-norm v with a zero row is refused before any component changes: the GPT's
        # check runs in its actor (RemoteComponent.weight_problems) before any actor copies
        specs = engine.models["chattts"].weight_specs()
        v_name = "head_code.1.parametrizations.weight.original1"
        v = np.ones(specs[v_name][1], np.float32)
        v[3] = 0.0
        other = "layers.0.mlp.up_proj.weight"
        bad = {other: np.zeros(specs[other][1], np.float32), v_name: v}
        with pytest.raises(WeightUpdateError, match=rf"'{v_name}' has \|\|v\|\| = 0") as caught:
            await engine.update_weights("chattts", bad)
        assert "nothing changed" in str(caught.value)
        assert engine.weight_versions["chattts"] == 0
    finally:
        await engine.shutdown()
    assert len(batches) == 2 and min(batches) > 0, batches
    for a, b in zip(expected, got, strict=True):
        assert a.audio.size > 512 * 8
        assert a.audio.tobytes() == b.audio.tobytes()


async def test_qwen3_tts_codec_streams_stay_on_their_replica_and_are_freed(
    ray_cluster, qwen3_tts_root, tmp_path
):
    """The qwen3_tts codec keeps each request's decoder state in the actor that ran its first
    chunk: with 2 codec replicas, every later chunk of a request is routed there (its
    ``seq_id``), so concurrent requests give the same bytes as in process (batch-invariant);
    a request aborted mid-stream frees its stream through the stand-in."""
    spec = f"qwen3_tts={qwen3_tts_root}"
    options = {"kv_cache_gb": 0.01, "batch_invariant": True, "max_new_tokens": 24}
    reqs = [Request("qwen3-tts", text="Hello there.", seed=s, voice="ryan") for s in (1, 2, 3)]
    expected, _ = await _in_process(spec, reqs, **options)
    deploy = _deploy(
        tmp_path,
        "qwen3_tts",
        {"talker": "num_cpus: 0.5", "codec": "num_cpus: 0.5, replicas: 2"},
    )
    engine = load_engine([spec], "cpu", 8, executor="ray", deploy=deploy, **options)
    executor = engine._executor
    try:
        got = await run_interleaved(engine, reqs)
        batches = executor.replica_batches("qwen3-tts", "codec")
        assert executor.replica_sequences("qwen3-tts", "codec") == [0, 0]
        long = Request("qwen3-tts", text="Hello there, " * 8, seed=4, voice="ryan")
        stream = engine.add_request(long)
        async for chunk in stream:  # its first audio: the codec holds its stream now
            if chunk.audio is not None:
                break
        assert sum(executor.replica_sequences("qwen3-tts", "codec")) == 1
        stream.cancel()
        await _until_idle(engine)
        assert executor.replica_sequences("qwen3-tts", "codec") == [0, 0]
        # the talker actor's free_sequence reply may still be on its way: wait for it
        used, _free = await executor.refresh_kv_blocks("qwen3-tts", "talker")
        assert used == 0
        assert engine.stats() == dict.fromkeys(engine.stats(), 0)
    finally:
        await engine.shutdown()
    assert min(batches) > 0, batches
    for a, b in zip(expected, got, strict=True):
        assert a.audio.size > 1920 * 4
        assert a.audio.tobytes() == b.audio.tobytes()


@pytest.fixture(scope="module")
def qwen_root(tmp_path_factory):
    from omnistep.models.qwen2_5_omni.tiny import write_tiny_qwen_omni

    return write_tiny_qwen_omni(tmp_path_factory.mktemp("qwen") / "ckpt")


def _qwen_requests() -> list[Request]:
    from omnistep.core import ChatMessage, Modality

    return [
        Request(
            "qwen2.5-omni",
            messages=(ChatMessage("user", text),),
            seed=seed,
            sampling=SamplingParams(temperature=0.8, top_k=20, max_new_tokens=8),
            output_modalities=frozenset({Modality.TEXT, Modality.AUDIO}),
            voice="Chelsie",
        )
        for text, seed in (("hello there, how are you?", 21), ("say something short", 22))
    ]


async def test_qwen_omni_on_ray_equals_in_process(ray_cluster, qwen_root, tmp_path, monkeypatch):
    """The thinker -> talker -> DiT -> BigVGAN cascade, each stage in its own actor: two
    concurrent sampled chats give the same text and byte-identical audio as in process (the
    thinker's streamed rows reach the talker through the driver); no KV block stays in use.
    The serving process builds no component and reads no weights (only config, tokenizer
    and speakers)."""
    spec = f"qwen2_5_omni={qwen_root}"
    options = {"kv_cache_gb": 0.02, "batch_invariant": True, "talker_max_new_tokens": 16}
    reqs = _qwen_requests()
    expected, _ = await _in_process(spec, reqs, **options)
    deploy = _deploy(
        tmp_path,
        "qwen2_5_omni",
        {name: "num_cpus: 0.25" for name in ("thinker", "talker", "dit", "bigvgan")},
    )
    _no_builds_in_driver(monkeypatch)
    start = time.perf_counter()
    engine = load_engine([spec], "cpu", 8, executor="ray", deploy=deploy, **options)
    print(f"qwen actors up in {time.perf_counter() - start:.1f} s")
    try:
        assert _stand_ins_only(engine)
        got = await run_interleaved(engine, reqs)
        kv = {
            name: await engine._executor.refresh_kv_blocks("qwen2.5-omni", name)
            for name in ("thinker", "talker", "dit")
        }
        stats = engine.stats()
    finally:
        await engine.shutdown()
    assert kv["thinker"][0] == kv["talker"][0] == 0 and kv["thinker"][1] > 0
    assert kv["dit"] is None  # no paged cache
    assert stats["kv_blocks_used"] == 0
    for a, b in zip(expected, got, strict=True):
        assert a.text == b.text and a.text
        assert a.audio.size > 0 and a.audio.tobytes() == b.audio.tobytes()


# ------------------------------------------------------------------ the driver's view (no Ray)


class _ElsewhereExecutor(InProcessExecutor):
    """What the Ray executor does, in process: batches run on components built apart from the
    engine's models (``built``, as in an actor), while the engine's models hold only
    ``RemoteComponent`` stand-ins, which reach this executor for ``free_sequence`` and
    ``kv_blocks``, the only things a stand-in has."""

    def __init__(self, built: ModelInstance):
        super().__init__(EngineConfig().num_workers)
        self.built = built
        self.freed: list[tuple[str, str]] = []

    async def run(self, component, kind, payloads, *, model_id="", name=""):
        assert isinstance(component, RemoteComponent), component
        return await super().run(self.built.components[name], kind, payloads)

    def free_sequence(self, model_id: str, name: str, seq_id: str) -> None:
        self.freed.append((name, seq_id))
        self.built.components[name].free_sequence(seq_id)

    def kv_blocks(self, model_id: str, name: str):
        return kv_usage(self.built.components[name])


def _case(name: str, request) -> tuple[str, list[Request], dict]:
    """(model spec, requests, card options) of one card, on the tiny checkpoints."""
    if name == "toy":
        return "toy", _toy_requests(3), {}
    if name == "piper":
        return "piper", [Request("piper", text="One sentence. Then a longer one.", seed=3)], {}
    if name == "hibari":
        return "hibari", [Request("hibari", text="One sentence. Then a longer one.", seed=3)], {}
    if name == "chattts":
        root = request.getfixturevalue("chattts_root")
        sampling = SamplingParams(max_new_tokens=20)
        reqs = [Request("chattts", text="hello", seed=5, sampling=sampling)]
        return f"chattts={root}", reqs, {"kv_cache_gb": 0.02}
    if name == "qwen3_tts":
        root = request.getfixturevalue("qwen3_tts_root")
        reqs = [Request("qwen3-tts", text="Hello there.", seed=s, voice="ryan") for s in (1, 2)]
        return f"qwen3_tts={root}", reqs, {"kv_cache_gb": 0.01, "max_new_tokens": 20}
    root = request.getfixturevalue("qwen_root")
    options = {"kv_cache_gb": 0.02, "talker_max_new_tokens": 16}
    return f"qwen2_5_omni={root}", _qwen_requests()[:1], options


@pytest.fixture(scope="module")
def qwen3_tts_root(tmp_path_factory):
    from omnistep.models.qwen3_tts.tiny import write_tiny_qwen3_tts

    root = tmp_path_factory.mktemp("qwen3_tts") / "custom_voice"
    write_tiny_qwen3_tts(root, "custom_voice", 0)
    return root


@pytest.mark.parametrize("name", ["toy", "hibari", "piper", "chattts", "qwen2_5_omni", "qwen3_tts"])
async def test_cards_serve_with_stand_ins_for_every_component(name, request):
    """Every card serves from a ``ModelInstance`` whose components are all ``RemoteComponent``
    stand-ins (which raise on anything but ``free_sequence`` and ``kv_blocks``), with the same
    outputs as in process: its loops and program nodes read nothing of a built component.
    The AR cards free their sequences through the stand-ins, and so does qwen3_tts's codec
    (its per-request decoder state)."""
    spec, reqs, options = _case(name, request)
    expected = await _run_in_process(spec, reqs, options)
    executor = _ElsewhereExecutor(ModelInstance.load(build_card(spec, **options)))
    card = build_card(spec, **options)
    stand_ins = {c.name: RemoteComponent(executor, card.card_id, c.name) for c in card.components}
    engine = AsyncEngine([ModelInstance.assemble(card, stand_ins)], executor=executor)
    try:
        got = await run_interleaved(engine, reqs)
        assert engine.stats()["kv_blocks_used"] == 0
    finally:
        await engine.shutdown()
    for a, b in zip(expected, got, strict=True):
        assert a.text == b.text
        assert a.audio.size > 0 and a.audio.tobytes() == b.audio.tobytes()
    freed = {component for component, _ in executor.freed}
    expected_freed = {
        "chattts": {"gpt"},
        "qwen2_5_omni": {"thinker", "talker"},
        "qwen3_tts": {"talker", "codec"},
    }
    assert freed == expected_freed.get(name, set())
    if name == "qwen3_tts":  # every request's stream freed in the component that held it
        codec = executor.built.components["codec"]
        assert codec.num_streams == 0
        streams = {s for c, s in executor.freed if c == "codec"}
        assert len(streams) == len(reqs) and all(s.endswith("/vocode") for s in streams)


async def _run_in_process(spec: str, reqs: list[Request], options: dict) -> list:
    local = load_engine([spec], "cpu", 8, **options)
    try:
        return await run_interleaved(local, reqs)
    finally:
        await local.shutdown()


def test_stand_in_has_no_other_attributes_and_assemble_checks_names():
    from omnistep.core import CardValidationError
    from omnistep.models.toy.card import build_card as toy_card

    stand_in = RemoteComponent(None, "toy", "lm")  # type: ignore[arg-type]
    with pytest.raises(AttributeError, match="toy/lm runs in Ray actors .* no 'sample_rate'"):
        _ = stand_in.sample_rate
    assert getattr(stand_in, "table", None) is None  # kv_usage's probe
    with pytest.raises(RuntimeError, match="runs in Ray actors"):
        stand_in.execute(None, [])  # type: ignore[arg-type]
    card = toy_card()
    with pytest.raises(CardValidationError, match="has components"):
        ModelInstance.assemble(card, {"lm": stand_in})
    model = ModelInstance.assemble(card, {"lm": stand_in, "vocoder": stand_in}, device="cpu")
    assert model.components["lm"] is stand_in and set(model.loops) == {"tokens", "audio"}


# ------------------------------------------------------------------ transport (no Ray session)


def test_pickled_views_carry_their_own_elements_only():
    import pickle

    import torch

    from omnistep.engine.ray_worker import dumps

    batch = torch.randn(32, 64)  # [batch, hidden], as a GPT step's hidden states
    rows = [batch[b] for b in range(32)]
    blob = dumps(rows)
    assert len(blob) < len(pickle.dumps(rows)) / 8  # each row no longer sends all 32
    back = pickle.loads(blob)
    assert all(torch.equal(a, b) for a, b in zip(rows, back, strict=True))
    assert back[3].untyped_storage().nbytes() == 64 * 4


def test_generator_state_comes_back_into_the_drivers_generator():
    """What the executor does around an actor: the actor samples with an unpickled copy of
    the payload's generator and returns its state; the driver's generator then continues as
    if it had drawn the numbers itself."""
    import pickle

    import torch

    from omnistep.engine.ray_worker import dumps, stateful_fields
    from omnistep.loops.ar_decode import ARStepInput

    def payload(seed):
        return ARStepInput("r/decode", (1,), 1, (), None, torch.Generator().manual_seed(seed))

    in_process, driver = payload(7), payload(7)
    torch.rand(4, generator=in_process.generator)
    in_actor = pickle.loads(dumps(driver))
    torch.rand(4, generator=in_actor.generator)
    states = [(n, g.get_state()) for n, g in stateful_fields(in_actor)]
    assert [n for n, _ in states] == ["generator"]
    for name, state in states:
        getattr(driver, name).set_state(state)
    a, b = torch.rand(3, generator=in_process.generator), torch.rand(3, generator=driver.generator)
    assert torch.equal(a, b)
    assert stateful_fields(object()) == [] and stateful_fields(ARStepInput) == []


async def test_weight_update_reaches_every_replica_before_work_resumes(ray_cluster, tmp_path):
    """Two lm replicas on Ray: after ``update_weights`` both run the new table, every step
    after it records the new version, and outputs equal an in-process engine updated alike."""
    from omnistep.models.toy.lm import ToyLM

    deploy = tmp_path / "deploy.yaml"
    deploy.write_text("models:\n  toy:\n    components:\n      lm: {num_cpus: 0.5, replicas: 2}\n")
    new_table = np.ascontiguousarray(ToyLM().table[::-1])
    reqs = [
        dataclasses.replace(r, profile=ExecutionProfile.ROLLOUT, request_id=f"w{i}")
        for i, r in enumerate(_toy_requests(4))
    ]
    local = load_engine(["toy"], "cpu", 8)
    engine = load_engine(["toy"], "cpu", 8, executor="ray", deploy=str(deploy))
    try:
        with pytest.raises(WeightUpdateError, match="tabel"):
            await engine.update_weights("toy", {"tabel": new_table})
        for eng in (local, engine):
            assert await eng.update_weights("toy", {"table": new_table}, version=3) == 3
        expected = await run_interleaved(local, reqs)
        got = await run_interleaved(engine, reqs)
        batches = engine._executor.replica_batches("toy", "lm")
    finally:
        await local.shutdown()
        await engine.shutdown()
    for a, b in zip(expected, got, strict=True):
        assert a.text == b.text and a.text
        assert {r.weight_version for r in b.trajectories["decode"]} == {3}
    assert all(n > 0 for n in batches), batches


async def test_a_sample_group_lives_on_one_replica(ray_cluster, chattts_root, tmp_path):
    """Two GPT replicas: the four samples of a group go to one replica (so they can share
    their prompt's KV blocks there), with outputs equal to in process; the routes are
    forgotten once the group ends."""
    spec = f"chattts={chattts_root}"
    reqs = [
        Request(
            "chattts",
            text="one prompt, four samples",
            voice="alloy",
            seed=20 + k,
            group="ray-group",
            profile=ExecutionProfile.ROLLOUT,
            sampling=SamplingParams(max_new_tokens=24),
        )
        for k in range(4)
    ]
    expected, models = await _in_process(spec, reqs, **CHATTTS_OPTIONS)
    del models
    deploy = _deploy(
        tmp_path, "chattts", {"gpt": "num_cpus: 0.5, replicas: 2", "vocoder": "num_cpus: 0.5"}
    )
    engine = load_engine([spec], "cpu", 8, executor="ray", deploy=deploy, **CHATTTS_OPTIONS)
    executor = engine._executor
    try:
        running = asyncio.ensure_future(run_interleaved(engine, reqs))
        await _until_kv_used(engine, "chattts", "gpt")
        assert sorted(executor.replica_sequences("chattts", "gpt")) == [0, 4]
        got = await running
        assert executor.replica_sequences("chattts", "gpt") == [0, 0]
        assert not executor._groups and not executor._group_size and not executor._group_of
    finally:
        await engine.shutdown()
    for a, b in zip(expected, got, strict=True):
        assert a.audio.tobytes() == b.audio.tobytes() and a.audio.size > 0
