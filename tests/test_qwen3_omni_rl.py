"""Qwen3-Omni RL on the tiny checkpoint: MoE routing recorded per sampled token (thinker and
talker), ``score`` equal to the recorded log-probs with and without Rollout Routing Replay under
``batch_invariant``, replay holding the rollout's experts when the router changed, the routing
over HTTP (JSON, safetensors, ``/v1/score?routing_replay=true``), rollouts of media prompts
(audio, image, video: encoder rows, M-RoPE positions, deepstack features) scored back to the
bit in process and over HTTP, and weight updates by the official tensor names (per-expert names
included), refused whole when one is bad."""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import struct

import numpy as np
import pytest
import torch
from starlette.testclient import TestClient

from omnistep.core import (
    ChatMessage,
    ExecutionProfile,
    InvalidRequestError,
    MediaItem,
    MediaKind,
    Modality,
    ModelInstance,
    Request,
    SamplingParams,
    WeightUpdateError,
)
from omnistep.engine import AsyncEngine
from omnistep.engine.collect import collect
from omnistep.layers.moe import MoEFeedForward
from omnistep.models import registry
from omnistep.offline import OmniEngine
from omnistep.offline import _sample as rollout_sample
from omnistep.runners.media_prompt import ThinkerPrompt
from omnistep.server import ServerConfig, build_app
from tests.media_files import png_b64 as _png

SAMPLING = SamplingParams(temperature=0.9, max_new_tokens=6)
INPUT = "say something nice"
LOOPS = {"think": "thinker", "talk": "talker"}


def _engine(folder, batch_invariant: bool) -> OmniEngine:
    return OmniEngine(
        f"qwen3_omni={folder}",
        batch_invariant=batch_invariant,
        kv_cache_gb=0.02,
        talker_max_new_tokens=8,
    )


@pytest.fixture(scope="module")
def omni(qwen3_omni_folder):
    with _engine(qwen3_omni_folder, batch_invariant=True) as engine:
        yield engine


@pytest.fixture(scope="module")
def groups(omni):
    return omni.rollout([INPUT], n=2, seed=5, sampling=SAMPLING, audio=True, progress=False)


def _moe_layers(component) -> list[MoEFeedForward]:
    return [layer.mlp for layer in component.llama.layers if layer.sparse]


def _capture(component) -> tuple[list[torch.Tensor], list]:
    """Forward hooks on every MoE layer of ``component``: the expert ids each call chose."""
    seen: list[torch.Tensor] = []

    def hook(_module, _inputs, output):
        seen.append(output.expert_ids.detach().cpu())

    return seen, [m.register_forward_hook(hook) for m in _moe_layers(component)]


def _experts_used(component, score) -> np.ndarray:
    """``[rows, MoE layers, k]``: the experts ``score()`` (one trajectory) routed each row to."""
    seen, hooks = _capture(component)
    try:
        score()
    finally:
        for h in hooks:
            h.remove()
    return torch.stack(seen, dim=1).numpy()


def test_rollout_records_the_routing_of_every_token(omni, groups):
    """Per loop and sample: ``routing`` ``[T, MoE layers, k]`` and ``prompt_routing`` for the
    other prompt rows, int16, equal to what the router chooses on the same rows (a
    teacher-forced forward of the same weights); the group's members share the prompt's."""
    model = omni.engine.models[next(iter(omni.engine.models))]
    samples = groups[0].samples
    for loop, name in LOOPS.items():
        component = model.components[name]
        k = component.llama.config.moe.num_experts_per_tok
        layers = len(_moe_layers(component))
        for sample in samples:
            actions = sample.loops[loop]
            steps = actions.tokens.shape[0]
            assert actions.routing.shape == (steps, layers, k) and steps >= 2
            assert actions.routing.dtype == np.int16 and actions.prompt_routing.dtype == np.int16
            full = actions.replay_routing()
            assert full.shape[0] == actions.prompt_routing.shape[0] + steps
            # the routing a forward of the same rows chooses (no replay): row by row equal
            chosen = _experts_used(
                component,
                lambda sample=sample, loop=loop: omni.score(sample, loops=loop, batch_size=1),
            )
            np.testing.assert_array_equal(chosen, full)
            assert len(np.unique(full[:, 0, 0])) > 1  # not a constant
        first, second = (s.loops[loop] for s in samples)
        np.testing.assert_array_equal(first.prompt_routing, second.prompt_routing)


@pytest.mark.parametrize("mode", ["processed", "policy"])
def test_score_equals_recorded_logprobs_with_and_without_replay(omni, groups, mode):
    """batch_invariant: every token's scored log-prob equals the recorded one within 1e-6
    (measured: equal to the bit), thinker and talker, routing replayed or not."""
    samples = groups[0].samples
    if mode == "policy":
        samples = omni.rollout(
            [INPUT], n=2, seed=5, sampling=SAMPLING, audio=True, logprobs=mode, progress=False
        )[0].samples
        for a, b in zip(groups[0].samples, samples, strict=True):  # same seeds, same actions
            np.testing.assert_array_equal(a.loops["talk"].tokens, b.loops["talk"].tokens)
    for replay in (False, True):
        scores = omni.score(samples, routing_replay=replay)
        for sample, scored in zip(samples, scores, strict=True):
            for loop in LOOPS:
                recorded = sample.loops[loop].logprobs
                assert np.any(recorded < 0)
                got = scored[loop].detach().numpy()
                np.testing.assert_allclose(got, recorded, atol=1e-6, rtol=0)


def test_replay_keeps_the_rollouts_experts_when_the_router_moved(omni, groups):
    """A trainer whose routers were perturbed: with routing replay its forward uses exactly
    the experts the rollout recorded (every row, every MoE layer), without replay it routes
    some rows elsewhere; the router still gets a gradient under replay (its probabilities
    weight the replayed experts). The trainer trains the fused expert tensors, not the
    per-expert names."""
    trainer = omni.trainer()
    names = trainer.weights()
    assert "thinker.model.layers.0.mlp.experts.gate_up_proj" in names
    assert not any(".experts.0." in n for n in names)  # per-expert views are for updates
    sample = groups[0].samples[0]
    gen = torch.Generator().manual_seed(0)
    for loop, name in LOOPS.items():
        component = trainer.policy.components[name]
        with torch.no_grad():
            for layer in _moe_layers(component):
                weight = layer.gate.weight
                weight.add_(torch.randn(weight.shape, generator=gen) * 3 * weight.std())
        recorded = sample.loops[loop].replay_routing()

        def score(replay, loop=loop):
            return omni.score(
                sample, trainer=trainer, loops=loop, routing_replay=replay, batch_size=1
            )

        replayed = _experts_used(component, lambda: score(True))
        np.testing.assert_array_equal(replayed, recorded)
        free = _experts_used(component, lambda: score(False))
        assert free.shape == recorded.shape and not np.array_equal(free, recorded)
        [scored] = score(True)
        scored[loop].sum().backward()
        router = names[f"{name}.model.layers.0.mlp.gate.weight"]
        assert router.grad is not None and float(router.grad.abs().sum()) > 0


def test_replay_without_recorded_routing_is_refused(omni, groups):
    sample = groups[0].samples[0]
    bare = dataclasses.replace(
        sample, loops={"think": dataclasses.replace(sample.loops["think"], prompt_routing=None)}
    )
    with pytest.raises(InvalidRequestError, match="routing") as err:
        omni.score(bare, routing_replay=True)
    assert err.value.param == "routing_replay"
    short = dataclasses.replace(
        sample,
        loops={
            "think": dataclasses.replace(
                sample.loops["think"], routing=sample.loops["think"].routing[:-1]
            )
        },
    )
    with pytest.raises(ValueError, match="routing of trajectory 0"):
        omni.score(short, routing_replay=True)


def test_a_prompt_from_the_prefix_cache_carries_the_routing_of_every_row(omni):
    """Two rollouts of one prompt under one ``cache_salt`` (no group): the second starts on
    the first's cached blocks (rows taken from the prefix cache), and still records the
    routing of every prompt row (kept with the cached blocks when they were computed): equal
    to the first's, and ``score`` with routing replay equals its recorded log-probs within
    1e-6 under batch_invariant."""
    model = omni.engine.models[next(iter(omni.engine.models))]
    thinker = model.components["thinker"]
    text = " ".join([INPUT] * 4)  # a prompt longer than a KV block (16 rows)
    samples, cached = [], []
    for _ in range(2):
        request = Request(
            model.card.card_id,
            messages=(ChatMessage("user", text),),
            output_modalities=frozenset({Modality.TEXT}),
            seed=5,
            sampling=SAMPLING,
            profile=ExecutionProfile.ROLLOUT,
            cache_salt="rl-prefix-cache",
        )
        before = thinker.num_cached_rows
        done = omni._call(collect(omni.engine, request))
        cached.append(thinker.num_cached_rows - before)
        samples.append(rollout_sample(0, request, done, "processed", False))
    assert cached[0] == 0 and cached[1] > 0
    first, second = (s.loops["think"] for s in samples)
    assert second.prompt_routing is not None
    assert second.prompt_routing.shape[0] == len(first.prompt_routing) > cached[1]
    np.testing.assert_array_equal(second.prompt_routing, first.prompt_routing)
    [scored] = omni.score(samples[1], loops="think", routing_replay=True)
    np.testing.assert_allclose(scored["think"].detach().numpy(), second.logprobs, atol=1e-6, rtol=0)


# ------------------------------------------------------------------ media prompts
def _media_item(kind: str) -> MediaItem:
    rng = np.random.default_rng(7)
    if kind == "audio":
        clip = (0.1 * rng.standard_normal(16000 * 2)).astype(np.float32)
        return MediaItem.of(MediaKind.AUDIO, clip, sample_rate=16000)
    if kind == "image":
        return MediaItem.of(MediaKind.IMAGE, rng.integers(0, 256, (200, 130, 3), dtype=np.uint8))
    frames = rng.integers(0, 256, (5, 40, 60, 3), dtype=np.uint8)  # 3 temporal patches
    return MediaItem.of(MediaKind.VIDEO, frames, fps=2.0)


@pytest.mark.parametrize("kind", ["audio", "image", "video"])
def test_media_rollouts_score_to_the_recorded_logprobs(omni, kind):
    """A conversation with an audio clip, an image or a video: the thinker's prompt holds the
    encoder rows at its placeholders and their M-RoPE positions (image, video: deepstack
    features too), the routing covers every prompt row, and ``score`` equals the recorded
    log-probs within 1e-6 (measured: to the bit) with and without routing replay, the thinker's
    and the talker's (which speaks answers to media prompts). Without the deepstack features
    the scores move (what scoring before they were added gave)."""
    item = _media_item(kind)
    conversation = (ChatMessage("user", "What is it?", parts=(item, "What is it?")),)
    (group,) = omni.rollout(
        [conversation], n=2, seed=5, sampling=SAMPLING, audio=True, progress=False
    )
    samples = group.samples
    for sample in samples:
        actions = sample.loops["think"]
        prompt = actions.prompt
        assert isinstance(prompt, ThinkerPrompt) and actions.media == (item.sha256,)
        assert len(prompt.deepstack) == (0 if kind == "audio" else 1)
        # audio tokens sit at their index; an image's or video's at (t, h, w) of their patch
        assert np.array_equal(prompt.positions[0], prompt.positions[1]) == (kind == "audio")
        assert actions.prompt_routing.shape[0] == len(prompt.ids) - 1
    # the talker speaks the answer to a media prompt too: its codes score back as well
    assert all(set(sample.loops) == {"think", "talk"} for sample in samples)
    for replay in (False, True):
        for sample, scored in zip(samples, omni.score(samples, routing_replay=replay), strict=True):
            for loop, actions in sample.loops.items():
                assert np.any(actions.logprobs < 0), loop
                got = scored[loop].detach().numpy()
                np.testing.assert_allclose(got, actions.logprobs, atol=1e-6, rtol=0, err_msg=loop)
    if kind != "audio":
        actions = samples[0].loops["think"]
        zeros = tuple(torch.zeros_like(d) for d in actions.prompt.deepstack)
        bare = dataclasses.replace(
            actions, prompt=dataclasses.replace(actions.prompt, deepstack=zeros)
        )
        [scored] = omni.score(dataclasses.replace(samples[0], loops={"think": bare}))
        assert np.abs(scored["think"].detach().numpy() - actions.logprobs).max() > 1e-3


# ------------------------------------------------------------------ HTTP
@pytest.fixture(scope="module")
def client(qwen3_omni_folder, tmp_path_factory):
    card = registry.build_card(
        f"qwen3_omni={qwen3_omni_folder}",
        kv_cache_gb=0.02,
        talker_max_new_tokens=8,
        batch_invariant=True,
    )
    engine = AsyncEngine([ModelInstance.load(card)])
    db = tmp_path_factory.mktemp("q3rl_voices") / "v.db"
    with TestClient(build_app(engine, ServerConfig(voices_db=str(db)))) as c:
        yield c


BODY = {
    "model": "qwen3_omni",
    "inputs": [INPUT],
    "n": 2,
    "seed": 5,
    "temperature": 0.9,
    "max_new_tokens": 6,
}


def test_http_rollout_routing_json_safetensors_and_replayed_score(client):
    """``/v1/rollouts`` returns each loop's ``routing`` and ``prompt_routing`` (JSON lists;
    int16 safetensors tensors, equal); ``/v1/score?routing_replay=true`` equals the recorded
    log-probs within 1e-6; a malformed routing is a 400 naming it."""
    answer = client.post("/v1/rollouts", json=BODY).json()
    loop = answer["groups"][0]["samples"][1]["loops"]["think"]
    routing = np.array(loop["routing"])
    assert routing.shape == (len(loop["tokens"]), 2, 2)
    assert np.array(loop["prompt_routing"]).shape == (len(loop["prompt_ids"]) - 1, 2, 2)
    raw = client.post(
        "/v1/rollouts", json=BODY, headers={"Accept": "application/x-safetensors"}
    ).content
    from safetensors.numpy import load

    tensors = load(raw)
    assert tensors["g0.s1.think.routing"].dtype == np.int16
    np.testing.assert_array_equal(tensors["g0.s1.think.routing"], routing)
    for body, headers in (
        (json.dumps(answer).encode(), {"Content-Type": "application/json"}),
        (raw, {"Content-Type": "application/x-safetensors"}),
    ):
        scored = client.post("/v1/score?routing_replay=true", content=body, headers=headers)
        assert scored.status_code == 200, scored.text
        for g, group in enumerate(scored.json()["groups"]):
            for s, sample in enumerate(group["samples"]):
                want = answer["groups"][g]["samples"][s]["loops"]["think"]["logprobs"]
                got = sample["loops"]["think"]["logprobs"]
                np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
    bad = json.loads(json.dumps(answer))
    bad["groups"][0]["samples"][0]["loops"]["think"]["routing"] = [[1, 2]]
    r = client.post("/v1/score?routing_replay=true", json=bad)
    assert r.status_code == 400 and "routing" in r.json()["error"]["param"]
    header_len = struct.unpack("<Q", raw[:8])[0]
    assert b"prompt_routing" in raw[8 : 8 + header_len]


def _wav() -> str:
    import soundfile

    buf = io.BytesIO()
    clip = (0.1 * np.random.default_rng(3).standard_normal(16000)).astype(np.float32)
    soundfile.write(buf, clip, 16000, format="WAV", subtype="PCM_16")
    return base64.b64encode(buf.getvalue()).decode()


def test_http_media_rollouts_score_back_with_and_without_replay(client):
    """``/v1/rollouts`` with ``messages`` holding an ``input_audio`` part and an ``image_url``
    part: ``/v1/score`` rebuilds each prompt from the echoed input (encoders, positions,
    deepstack) and equals the recorded log-probs within 1e-6, routing replayed or not."""
    audio = {"type": "input_audio", "input_audio": {"data": _wav(), "format": "wav"}}
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + _png()}}
    text = {"type": "text", "text": "What is it?"}
    inputs = [[{"role": "user", "content": [part, text]}] for part in (audio, image)]
    answer = client.post("/v1/rollouts", json={**BODY, "inputs": inputs})
    assert answer.status_code == 200, answer.text
    answer = answer.json()
    for group in answer["groups"]:
        for sample in group["samples"]:
            think = sample["loops"]["think"]
            assert len(think["media"]) == 1 and think["prompt_ids"] is None
    for query in ("", "?routing_replay=true"):
        scored = client.post(f"/v1/score{query}", json=answer)
        assert scored.status_code == 200, scored.text
        for g, group in enumerate(scored.json()["groups"]):
            for s, sample in enumerate(group["samples"]):
                want = answer["groups"][g]["samples"][s]["loops"]["think"]["logprobs"]
                got = sample["loops"]["think"]["logprobs"]
                assert np.shape(got) == np.shape(want)
                np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)


# ------------------------------------------------------------------ weight updates
def test_weight_updates_by_official_names(qwen3_omni_folder):
    """Thinker and talker tensors by their published names (a MoE layer's
    ``mlp.experts.{e}.gate_proj.weight`` too) change the rollout, atomically, in pause and
    drain mode; a bad name or shape in an update is refused and nothing changes."""
    with _engine(qwen3_omni_folder, batch_invariant=False) as omni:
        model = omni.engine.models[next(iter(omni.engine.models))]
        thinker, talker = model.components["thinker"], model.components["talker"]
        specs = model.weight_specs()
        expert = "thinker.model.layers.0.mlp.experts.3.gate_proj.weight"
        talker_expert = "talker.model.layers.1.mlp.experts.2.down_proj.weight"
        for name in (
            expert,
            talker_expert,
            "thinker.model.layers.0.mlp.gate.weight",
            "thinker.model.layers.0.mlp.experts.gate_up_proj",
            "thinker.lm_head.weight",
            "talker.model.layers.0.mlp.shared_expert_gate.weight",
        ):
            assert name in specs, name

        def rollout():
            out = omni.rollout([INPUT], n=1, seed=1, sampling=SAMPLING, audio=True, progress=False)
            return out[0].samples[0]

        before = rollout()
        inner = thinker.llama.config.moe.moe_intermediate_size
        old = thinker.llama.layers[0].mlp.experts.gate_up_proj[3, :inner].clone()
        bad_sets = [
            {
                expert: torch.zeros(specs[expert][1]),
                "thinker.model.layers.0.mlp.experts.9x": torch.zeros(1),
            },
            {expert: torch.zeros(specs[expert][1]), talker_expert: torch.zeros(3, 3)},
        ]
        for bad in bad_sets:
            with pytest.raises(WeightUpdateError):
                omni.update_weights(bad)
        assert torch.equal(thinker.llama.layers[0].mlp.experts.gate_up_proj[3, :inner], old)
        assert omni.engine.weight_versions[model.card.card_id] == 0
        np.testing.assert_array_equal(
            rollout().loops["think"].logprobs, before.loops["think"].logprobs
        )

        gen = torch.Generator().manual_seed(3)
        new = {}
        for e in range(thinker.llama.config.moe.num_experts):
            for part in ("gate_proj", "up_proj", "down_proj"):
                name = f"thinker.model.layers.0.mlp.experts.{e}.{part}.weight"
                new[name] = torch.randn(specs[name][1], generator=gen)
        router = "thinker.model.layers.0.mlp.gate.weight"
        new[router] = torch.randn(specs[router][1], generator=gen)
        version = omni.update_weights(new, mode="drain")
        assert version == 1
        got = thinker.llama.layers[0].mlp.experts.gate_up_proj[3, :inner]
        assert torch.equal(got, new[expert])
        after = rollout()
        assert not np.allclose(after.loops["think"].logprobs, before.loops["think"].logprobs)
        assert set(after.loops["think"].weight_versions) == {1}

        talk_new = {
            f"talker.model.layers.1.mlp.experts.{e}.down_proj.weight": torch.randn(
                specs[talker_expert][1], generator=gen
            )
            for e in range(talker.llama.config.moe.num_experts)
        }
        assert omni.update_weights(talk_new, mode="pause") == 2
        down = talker.llama.layers[1].mlp.experts.down_proj[2]
        assert torch.equal(down, talk_new[talker_expert])
        again = rollout()
        np.testing.assert_array_equal(again.loops["think"].tokens, after.loops["think"].tokens)
        assert not np.allclose(again.loops["talk"].logprobs, after.loops["talk"].logprobs)
