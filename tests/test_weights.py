"""In-place weight updates (``AsyncEngine.update_weights``): checked atomically by the
checkpoint's own tensor names, applied between steps in ``pause`` or ``drain`` mode, versions
recorded per step, and every derived copy refreshed, so outputs equal a fresh engine loaded
with the new weights, bit for bit."""

from __future__ import annotations

import asyncio
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from omnistep.core import (
    ExecutionProfile,
    InvalidRequestError,
    ModelInstance,
    Request,
    SamplingParams,
    WeightUpdateError,
    WeightVersionError,
)
from omnistep.engine import AsyncEngine
from omnistep.models.chattts.card import ChatTTSOptions
from omnistep.models.chattts.card import build_card as build_chattts
from omnistep.models.chattts.tiny import write_servable_tiny_chattts
from omnistep.models.toy.card import build_card as build_toy
from omnistep.offline import AsyncOmniEngine
from omnistep.parity import collect


def _toy_engine() -> tuple[AsyncEngine, ModelInstance]:
    model = ModelInstance.load(build_toy())
    return AsyncEngine([model]), model


def _rollout(text: str, seed: int, n: int = 30, slow: bool = False) -> Request:
    return Request(
        "toy",
        text=("<slow> " if slow else "") + text,
        seed=seed,
        profile=ExecutionProfile.ROLLOUT,
        sampling=SamplingParams(max_new_tokens=n, min_new_tokens=n),
    )


async def test_bad_updates_are_refused_whole_and_change_nothing():
    engine, model = _toy_engine()
    lm = model.components["lm"]
    before = lm.table.copy()
    good = lm.table * 0.5
    cases = {
        "unknown tensor 'tabel'": {"table": good, "tabel": good},
        "int64 [64, 64], the model's is float64": {"table": good.astype(np.int64)},
        "float64 [64, 63]": {"table": good[:, :-1]},
        "no tensors": {},
    }
    for message, tensors in cases.items():
        with pytest.raises(WeightUpdateError, match=message.replace("[", r"\[")):
            await engine.update_weights("toy", tensors)
        assert np.array_equal(lm.table, before) and engine.weight_versions["toy"] == 0
    with pytest.raises(InvalidRequestError, match="mode"):
        await engine.update_weights("toy", {"table": good}, mode="now")
    for version in (-1, "abc", 1.5, True):
        with pytest.raises(InvalidRequestError, match="version") as err:
            await engine.update_weights("toy", {"table": good}, version=version)
        assert err.value.param == "version"
        assert np.array_equal(lm.table, before) and engine.weight_versions["toy"] == 0
    await engine.shutdown()


async def test_versions_only_go_up_and_a_refused_one_changes_nothing():
    engine, model = _toy_engine()
    lm = model.components["lm"]
    good = lm.table * 0.5
    assert await engine.update_weights("toy", {"table": good}, version=10) == 10
    before = lm.table.copy()
    for version in (3, 10, 0):
        with pytest.raises(WeightVersionError) as err:
            await engine.update_weights("toy", {"table": good * 2}, version=version)
        assert (err.value.requested, err.value.current) == (version, 10)
        assert f"version {version}" in str(err.value) and "runs version 10" in str(err.value)
        assert np.array_equal(lm.table, before) and engine.weight_versions["toy"] == 10
    assert await engine.update_weights("toy", {"table": good}) == 11  # default: current + 1
    assert await engine.update_weights("toy", {"table": good}, version=12) == 12
    await engine.shutdown()


async def test_a_version_past_int64_is_refused_and_rollouts_go_on():
    # version 2**64 was taken: every later rollout then failed (its int64 weight_versions
    # overflowed) and, versions only going up, nothing could undo it
    engine, model = _toy_engine()
    good = model.components["lm"].table * 0.5
    for version in (2**64, 2**63 - 1, 2**62 + 1):
        with pytest.raises(InvalidRequestError, match="version") as err:
            await engine.update_weights("toy", {"table": good}, version=version)
        assert err.value.param == "version" and engine.weight_versions["toy"] == 0
    assert await engine.update_weights("toy", {"table": good}, version=2**62) == 2**62
    omni = AsyncOmniEngine(engine)
    [group] = await omni.rollout(["after"], n=2, sampling=SamplingParams(max_new_tokens=3))
    assert group.samples[0].loops["decode"].weight_versions.tolist() == [2**62] * 3
    await engine.shutdown()


async def test_non_finite_updates_are_refused_unless_allowed():
    engine, model = _toy_engine()
    lm = model.components["lm"]
    before = lm.table.copy()
    for bad in (np.nan, np.inf, -np.inf):
        update = lm.table.copy()
        update[3, 5] = bad
        update[7, 1] = bad
        with pytest.raises(WeightUpdateError, match="'table' holds 2 NaN/Inf"):
            await engine.update_weights("toy", {"table": update})
        assert np.array_equal(lm.table, before) and engine.weight_versions["toy"] == 0
    update = lm.table.copy()
    update[0, 0] = np.nan
    assert await engine.update_weights("toy", {"table": update}, check_finite=False) == 1
    assert np.isnan(lm.table[0, 0])
    await engine.shutdown()


async def test_another_floating_dtype_is_cast_and_reported():
    engine, model = _toy_engine()
    lm = model.components["lm"]
    new = (lm.table * 0.25).astype(np.float32)
    done = await engine.apply_weights("toy", {"table": new})
    assert done.version == 1 and done.casts == ("table: float32 -> float64",)
    assert lm.table.dtype == np.float64 and np.array_equal(lm.table, new.astype(np.float64))
    await engine.shutdown()


async def test_a_bf16_checkpoint_file_updates_a_float32_model(tmp_path):
    # a family's published files are bf16 while the model serves float32
    root = write_servable_tiny_chattts(tmp_path / "chattts")
    model = ModelInstance.load(build_chattts(str(root), ChatTTSOptions(kv_cache_gb=0.02)))
    names = [n for n in model.weight_specs() if n.startswith("layers.0.")][:3]
    live = model.components["gpt"]._weight_tensors()
    update = {n: (live[n].detach() * 1.5).to(torch.bfloat16) for n in names}
    save_file(update, str(tmp_path / "bf16.safetensors"))
    omni = AsyncOmniEngine(AsyncEngine([model]))
    done = await omni.apply_weights(tmp_path / "bf16.safetensors")
    assert done.version == 1 and len(done.casts) == 3
    assert all(c.endswith("bfloat16 -> float32") for c in done.casts)
    for name in names:
        assert live[name].dtype == torch.float32
        assert torch.equal(live[name].detach(), update[name].float())
    await omni.close()


async def test_torch_components_take_numpy_arrays_as_well(tmp_path):
    # check_weights compares dtypes by name (numpy float32 == torch.float32): the copy must
    # take numpy too, else an update passes the check and fails half applied
    root = write_servable_tiny_chattts(tmp_path / "chattts")
    model = ModelInstance.load(build_chattts(str(root), ChatTTSOptions(kv_cache_gb=0.02)))
    gpt = model.components["gpt"]
    names = [n for n in model.weight_specs() if n.startswith("layers.0.")][:2]
    live = gpt._weight_tensors()
    new = {name: live[name].detach().numpy() * 1.5 for name in names}
    engine = AsyncEngine([model])
    assert await engine.update_weights("chattts", new) == 1
    for name in names:
        assert np.array_equal(live[name].detach().numpy(), new[name])
    await engine.shutdown()


async def test_a_zero_weight_norm_v_is_refused_and_changes_nothing(tmp_path):
    # g * v / ||v|| is NaN where a row of v is all zero: refused like other bad values
    # (even with check_finite off), the whole update, before anything changes
    from omnistep.layers.weight_norm import WeightNormError

    root = write_servable_tiny_chattts(tmp_path / "chattts")
    model = ModelInstance.load(build_chattts(str(root), ChatTTSOptions(kv_cache_gb=0.02)))
    gpt = model.components["gpt"]
    live = gpt._weight_tensors()
    v_name, layer = "head_code.1.parametrizations.weight.original1", "layers.0.mlp.up_proj.weight"
    v = live[v_name].detach().clone()
    v[3] = 0.0
    before = {n: t.detach().clone() for n, t in live.items()}
    head = gpt.head_code.clone()
    engine = AsyncEngine([model])
    update = {layer: live[layer].detach() * 1.5, v_name: v}
    for check_finite in (True, False):
        with pytest.raises(WeightUpdateError, match=rf"'{v_name}' has \|\|v\|\| = 0") as caught:
            await engine.update_weights("chattts", update, check_finite=check_finite)
        assert "nothing changed" in str(caught.value) and "(dim 0: 3)" in str(caught.value)
    # the component refuses it too where no ModelInstance checked first (a Ray actor)
    with pytest.raises(WeightNormError, match=v_name):
        gpt.update_weights(update)
    assert all(torch.equal(live[n].detach(), t) for n, t in before.items())
    assert torch.equal(gpt.head_code, head) and gpt.weight_version == 0
    v[3] = 1.0  # a non-zero row is taken
    assert await engine.update_weights("chattts", {v_name: v}) == 1
    assert torch.isfinite(gpt.head_code).all() and not torch.equal(gpt.head_code, head)
    await engine.shutdown()

    # a checkpoint holding such a v is refused at load, naming it
    embed_file = root / "asset/Embed.safetensors"
    embed = load_file(embed_file)
    embed[v_name][3] = 0.0
    save_file(embed, embed_file)
    with pytest.raises(WeightNormError, match=rf"'{v_name}'.*\(dim 0: 3\)"):
        ModelInstance.load(build_chattts(str(root), ChatTTSOptions(kv_cache_gb=0.02)))


async def test_a_model_without_updatable_weights_says_so():
    model = ModelInstance.load(build_toy())
    # a component offering no updates, as a vocoder or an ONNX voice
    model.components["lm"] = type("Frozen", (), {"execute": model.components["lm"].execute})()
    with pytest.raises(WeightUpdateError, match="takes no weight updates"):
        model.check_weights({"table": np.zeros((2, 2))})


async def test_pause_updates_between_steps_and_running_requests_go_on():
    engine, model = _toy_engine()
    new_table = np.random.default_rng(7).normal(size=model.components["lm"].table.shape)
    stream = engine.add_request(_rollout("pause me", 3, slow=True))
    chunks = []

    async def consume():
        async for chunk in stream:
            chunks.append(chunk)

    task = asyncio.create_task(consume())
    while len(chunks) < 5:
        await asyncio.sleep(0.005)
    assert await engine.update_weights("toy", {"table": new_table}) == 1
    await task
    versions = [r.weight_version for r in stream.trajectories["decode"]]
    switch = versions.index(1)
    assert 5 <= switch < len(versions) and versions == [0] * switch + [1] * (len(versions) - switch)
    assert np.array_equal(model.components["lm"].table, new_table)
    await engine.shutdown()


async def test_drain_holds_new_requests_until_the_running_ones_finish():
    engine, model = _toy_engine()
    new_table = model.components["lm"].table[::-1].copy()
    first = engine.add_request(_rollout("old weights", 4, slow=True))
    update = asyncio.create_task(engine.update_weights("toy", {"table": new_table}, mode="drain"))
    while "toy" not in engine._weights._draining:  # wait for the drain itself, not a fixed time
        await asyncio.sleep(0.001)
    second = engine.add_request(_rollout("new weights", 5))
    assert engine.stats()["waiting_requests"] == 1
    [c async for c in first]
    [c async for c in second]
    assert await update == 1
    assert {r.weight_version for r in first.trajectories["decode"]} == {0}
    assert {r.weight_version for r in second.trajectories["decode"]} == {1}
    # the held request ran exactly as on a fresh engine with the new weights
    fresh_engine, fresh = _toy_engine()
    fresh.components["lm"].table[...] = new_table
    again = await collect(fresh_engine, _rollout("new weights", 5))
    held = await collect(engine, _rollout("new weights", 5))
    assert again.text == held.text
    await engine.shutdown()
    await fresh_engine.shutdown()


# ------------------------------------------------------------------ ChatTTS on its checkpoint


def _perturbed(path, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        name: (t.float() + 0.05 * torch.randn(t.shape, generator=generator)).to(t.dtype)
        for name, t in load_file(path).items()
    }


async def test_chattts_update_equals_a_fresh_engine_on_the_new_checkpoint(tmp_path):
    root = write_servable_tiny_chattts(tmp_path / "old")
    new_root = tmp_path / "new"
    shutil.copytree(root, new_root)
    gpt_file, embed_file = "asset/gpt/model.safetensors", "asset/Embed.safetensors"
    gpt_state, embed_state = _perturbed(root / gpt_file, 1), _perturbed(root / embed_file, 2)
    save_file(gpt_state, new_root / gpt_file)
    save_file(embed_state, new_root / embed_file)

    def load(path):
        opts = ChatTTSOptions(kv_cache_gb=0.02)
        return ModelInstance.load(build_chattts(str(path), opts))

    model, fresh = load(root), load(new_root)
    gpt = model.components["gpt"]
    specs = model.weight_specs()
    update = {
        name: t.to(torch.float32)
        for name, t in {**gpt_state, **embed_state}.items()
        if name in specs  # the checkpoint's unused embed_tokens.weight is not a weight
    }
    assert set(update) == set(specs)
    engine, fresh_engine = AsyncEngine([model]), AsyncEngine([fresh])
    request = Request("chattts", text="hello weights", seed=9, voice="alloy")
    before = await collect(engine, request)
    assert await engine.update_weights("chattts", update, version=12) == 12
    assert gpt.weight_version == 12
    after = await collect(engine, Request("chattts", text="hello weights", seed=9, voice="alloy"))
    want = await collect(
        fresh_engine, Request("chattts", text="hello weights", seed=9, voice="alloy")
    )
    assert not np.array_equal(before.audio, after.audio)
    assert np.array_equal(after.audio, want.audio)
    for j in range(gpt.config.num_vq):  # the folded heads were refolded
        assert torch.equal(gpt.head_code[j], fresh.components["gpt"].head_code[j])
    await engine.shutdown()
    await fresh_engine.shutdown()


async def test_qwen_thinker_embedding_update_refreshes_the_talker_rows(tmp_path):
    from omnistep.models.qwen2_5_omni.card import QwenOmniOptions
    from omnistep.models.qwen2_5_omni.card import build_card as build_qwen
    from omnistep.models.qwen2_5_omni.tiny import write_tiny_qwen_omni

    root = write_tiny_qwen_omni(tmp_path / "qwen")
    model = ModelInstance.load(build_qwen(str(root), QwenOmniOptions(kv_cache_gb=0.02)))
    thinker, talker = model.components["thinker"], model.components["talker"]
    name = "thinker.model.embed_tokens.weight"
    assert {"talker.codec_head.weight", "thinker.model.norm.weight", name} <= set(
        model.weight_specs()
    )
    new = torch.randn(thinker.embed_weight.shape, generator=torch.Generator().manual_seed(3))
    engine = AsyncEngine([model])
    assert await engine.update_weights("qwen2.5-omni", {name: new}) == 1
    assert torch.equal(thinker.embed_weight, new)
    for token_id, row in talker.text_embeds.items():
        assert torch.equal(row, new[token_id])
    assert thinker.weight_version == 1 and talker.weight_version == 0
    # a trainer's own leaf (requires grad) or a numpy array: the talker keeps plain rows
    leaf = (new * 2).requires_grad_(True)
    assert await engine.update_weights("qwen2.5-omni", {name: leaf}) == 2
    assert all(not row.requires_grad for row in talker.text_embeds.values())
    assert await engine.update_weights("qwen2.5-omni", {name: (new * 3).numpy()}) == 3
    for token_id, row in talker.text_embeds.items():
        assert torch.equal(row, new[token_id] * 3)
    await engine.shutdown()


async def test_qwen_dit_update_equals_a_fresh_engine_and_versions_its_sde_steps(tmp_path):
    """The DiT takes updates by the checkpoint's names (what a Flow-GRPO trainer sends): the
    audio after it equals a fresh engine on the new checkpoint, and the SDE steps recorded
    after it carry the new version."""
    import json

    from omnistep.core import ChatMessage, ExecutionProfile, Modality, SamplingParams
    from omnistep.models.qwen2_5_omni.card import QwenOmniOptions
    from omnistep.models.qwen2_5_omni.card import build_card as build_qwen
    from omnistep.models.qwen2_5_omni.tiny import write_tiny_qwen_omni

    root = write_tiny_qwen_omni(tmp_path / "old")
    new_root = tmp_path / "new"
    shutil.copytree(root, new_root)
    index = json.loads((root / "model.safetensors.index.json").read_text())["weight_map"]
    prefix = "token2wav.code2wav_dit_model."
    update: dict[str, torch.Tensor] = {}
    for shard in sorted({f for n, f in index.items() if n.startswith(prefix)}):
        state = load_file(root / shard)
        generator = torch.Generator().manual_seed(len(update))
        for name, t in state.items():
            if name.startswith(prefix) and t.dim() >= 2:
                state[name] = t + 0.05 * t.std() * torch.randn(t.shape, generator=generator)
                update[name] = state[name].float()
        save_file(state, new_root / shard)

    def load(path):
        opts = QwenOmniOptions(kv_cache_gb=0.02, talker_max_new_tokens=24)
        return ModelInstance.load(build_qwen(str(path), opts))

    def request(noise: float | None = None) -> Request:
        return Request(
            "qwen2.5-omni",
            messages=(ChatMessage("user", "hello weights"),),
            seed=9,
            sampling=SamplingParams(temperature=0.0, max_new_tokens=8, flow_noise_level=noise),
            profile=ExecutionProfile.ROLLOUT,
            output_modalities=frozenset({Modality.TEXT, Modality.AUDIO}),
        )

    model, fresh = load(root), load(new_root)
    assert set(update) <= set(model.weight_specs()) and len(update) > 20
    engine, fresh_engine = AsyncEngine([model]), AsyncEngine([fresh])
    before = await collect(engine, request())
    assert await engine.update_weights("qwen2.5-omni", update, version=5) == 5
    assert model.components["dit"].weight_version == 5
    after, want = await collect(engine, request()), await collect(fresh_engine, request())
    assert not np.array_equal(before.audio, after.audio)
    assert np.array_equal(after.audio, want.audio)
    sde = await collect(engine, request(0.7))
    assert {r.weight_version for r in sde.trajectories["denoise"]} == {5}
    await engine.shutdown()
    await fresh_engine.shutdown()


def test_count_nonfinite_counts_every_nan_and_inf_past_its_one_pass_screen():
    """``count_nonfinite`` screens a torch tensor with one ``aminmax`` pass and counts only
    one that fails it: NaN, +Inf and -Inf anywhere (alone or mixed), in float32 and bf16,
    are counted exactly; finite, empty and integer tensors give 0; numpy arrays too."""
    from omnistep.core.card import count_nonfinite

    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(1000, 3).to(dtype)
        assert count_nonfinite(x) == 0
        for bad, where in ((float("nan"), [5]), (float("inf"), [999]), (-float("inf"), [0, 7])):
            y = x.clone()
            y.view(-1)[where] = bad
            assert count_nonfinite(y) == len(where)
        y = x.clone()
        y.view(-1)[[1, 2, 3]] = torch.tensor([float("nan"), float("inf"), -float("inf")]).to(dtype)
        assert count_nonfinite(y) == 3
        assert count_nonfinite(y[:, 1:]) == 2  # a strided view: the NaN and +Inf of row 0
    assert count_nonfinite(torch.empty(0)) == 0
    assert count_nonfinite(torch.arange(5)) == 0
    assert count_nonfinite(np.array([1.0, np.nan, np.inf])) == 2
