"""The ``voxcpm`` card's declaration on a folder ``omnistep weights voxcpm`` writes (own random
weights, no reference): folder detection, the registry entry, voices and their errors, the
tokenizer wrapper's CJK split, cloned-voice specs, the loop's cap and missing files named."""

from __future__ import annotations

import numpy as np
import pytest

from omnistep.core import OPENAI_VOICES, InvalidRequestError, ModelFilesError
from omnistep.models.registry import build_card as build_registered
from omnistep.models.voxcpm.card import build_card
from omnistep.models.voxcpm.frontend import SPEC_PREFIX, patches_to_spec, spec_to_patches
from omnistep.models.voxcpm.lm import AUDIO_START, REF_AUDIO_END, REF_AUDIO_START
from omnistep.models.voxcpm.tiny import write_folder
from omnistep.runners.locate import infer_family


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_folder(tmp_path_factory.mktemp("voxcpm_card"))


def test_registry_detection_and_voices(folder):
    assert infer_family(folder)[0] == "voxcpm"
    card = build_registered(f"voxcpm={folder}", kv_cache_gb=0.01)
    assert card.card_id == "voxcpm2" and "voxcpm" in card.model_ids
    assert card.sample_rate == 48000 and card.default_voice == "default"
    assert set(OPENAI_VOICES) <= set(card.voices)
    card.validate_voice("nova")
    with pytest.raises(InvalidRequestError) as err:
        card.validate_voice("nobody")
    assert err.value.param == "voice" and err.value.code == "unknown_voice"
    with pytest.raises(InvalidRequestError, match="damaged"):
        card.validate_voice(SPEC_PREFIX + "@@")
    wrong = patches_to_spec(np.zeros((2, 4, 3), np.float32))  # feat_dim 3, not 16
    with pytest.raises(InvalidRequestError, match=r"\[R >= 1, 4, 16\]"):
        card.validate_voice(wrong)


def test_frontend_prompt(folder):
    card = build_card(str(folder))
    frontend = card.program.nodes[0].fn
    ids = frontend.tokenizer("the cat 你好")
    # "▁the ▁ c a t ▁ 你 好": the merged CJK token split into its characters, as upstream's
    vocab = frontend.tokenizer.tokenizer.get_vocab()
    assert vocab["你好"] not in ids and ids[-2:] == [vocab["你"], vocab["好"]]
    prompt = frontend.prompt("the cat 你好", None)
    assert prompt.rows.text_ids.tolist() == [*ids, AUDIO_START]
    assert prompt.max_len == min(int(len(ids) * 6 + 10), 4096) and prompt.cfg_value == 2.0
    patches = np.random.default_rng(0).standard_normal((3, 4, 16)).astype(np.float32)
    spec = patches_to_spec(patches)
    assert np.array_equal(spec_to_patches(spec, 4, 16).numpy(), patches)
    cloned = frontend.prompt("a cat", spec)
    t = cloned.rows.text_ids.tolist()
    assert t[0] == REF_AUDIO_START and t[4] == REF_AUDIO_END and t[-1] == AUDIO_START
    assert np.array_equal(cloned.rows.feats[1:4].numpy(), patches)
    with pytest.raises(InvalidRequestError) as err:
        frontend.prompt("", None)
    assert err.value.param == "input"


def test_missing_files_are_named(folder, tmp_path):
    with pytest.raises(InvalidRequestError, match="needs weights"):
        build_card(None)
    with pytest.raises(ModelFilesError, match="not found"):
        build_card(str(tmp_path / "absent"))
    part = tmp_path / "part"
    part.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"):
        (part / name).write_bytes((folder / name).read_bytes())
    with pytest.raises(ModelFilesError, match="audiovae.safetensors"):
        build_card(str(part))
    (part / "model.safetensors").unlink()
    with pytest.raises(ModelFilesError, match="model.safetensors"):
        build_card(str(part))


async def test_batch_invariant_c3_is_bit_identical(folder):
    """``--batch-invariant``: a request's samples beside two others (batched LM steps, LocDiT
    solves and decoder chunks) equal its samples alone, bit for bit; zero-shot and cloned."""
    from omnistep.core import ModelInstance, Request
    from omnistep.engine import AsyncEngine
    from omnistep.models.voxcpm.card import VoxCPMOptions
    from omnistep.parity import collect, run_interleaved

    card = build_card(str(folder), VoxCPMOptions(kv_cache_gb=0.01, max_len=5, batch_invariant=True))
    engine = AsyncEngine([ModelInstance.load(card)])
    clip = np.sin(np.arange(16000) * 0.05).astype(np.float32)
    try:
        spec = await engine.clone_voice("voxcpm2", clip, 16000, "x")
        reqs = [
            Request("voxcpm2", text="the cat", seed=1),
            Request("voxcpm2", text="a hat", seed=2, voice=spec),
            Request("voxcpm2", text="in the", seed=3),
        ]
        busy = await run_interleaved(engine, reqs)
        for req, got in zip(reqs, busy, strict=True):
            alone = await collect(
                engine, Request(req.model, text=req.text, seed=req.seed, voice=req.voice)
            )
            assert len(got.audio) > 0 and np.array_equal(got.audio, alone.audio), req.text
    finally:
        await engine.shutdown()
