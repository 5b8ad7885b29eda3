"""Qwen3-Omni's tiny checkpoint (models/qwen3_omni/tiny.py) is the published layout, and the
loader (models/qwen3_omni/loader.py) reads it and names a missing or wrong file."""

from __future__ import annotations

import json
import shutil

import pytest

from omnistep.core import ModelFilesError
from omnistep.models.qwen3_omni.loader import Qwen3OmniCheckpoint, Qwen3OmniCheckpointError
from omnistep.models.qwen3_omni.tiny import ADDED_TOKENS, TINY_SIZES, codec_ids


def test_tiny_folder_has_the_published_files_and_names(qwen3_omni_folder):
    names = {p.name for p in qwen3_omni_folder.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors.index.json"} <= names
    assert {"vocab.json", "merges.txt", "tokenizer_config.json", "chat_template.json"} <= names
    weight_map = json.loads((qwen3_omni_folder / "model.safetensors.index.json").read_text())[
        "weight_map"
    ]
    assert len(set(weight_map.values())) > 1  # sharded, as published
    # per-expert names (not transformers 5's fused ones), the three parts under their prefixes
    for name in (
        "thinker.model.layers.0.mlp.experts.7.gate_proj.weight",
        "thinker.model.layers.1.mlp.gate.weight",
        "thinker.model.layers.0.self_attn.q_norm.weight",
        "thinker.lm_head.weight",
        "thinker.audio_tower.conv2d1.weight",
        "thinker.visual.patch_embed.proj.weight",
        "talker.model.layers.0.mlp.shared_expert_gate.weight",
        "talker.code_predictor.lm_head.14.weight",
        "code2wav.code_embedding.weight",
        "code2wav.pre_transformer.layers.1.self_attn_layer_scale.scale",
    ):
        assert name in weight_map, name
    assert not any("gate_up_proj" in k for k in weight_map)


def test_tiny_config_ids_are_the_tokenizers(qwen3_omni_folder):
    from transformers import AutoTokenizer

    config = json.loads((qwen3_omni_folder / "config.json").read_text())
    tok = AutoTokenizer.from_pretrained(qwen3_omni_folder)
    assert tok.convert_tokens_to_ids("<tts_pad>") == config["tts_pad_token_id"]
    assert tok.convert_tokens_to_ids("<|im_start|>") == config["im_start_token_id"]
    assert tok.convert_tokens_to_ids("<|audio_pad|>") == config["thinker_config"]["audio_token_id"]
    assert tok.convert_tokens_to_ids("assistant") == config["assistant_token_id"]
    first = tok.convert_tokens_to_ids(ADDED_TOKENS[0])
    assert tok.convert_tokens_to_ids(ADDED_TOKENS[-1]) == first + len(ADDED_TOKENS) - 1
    assert config["thinker_config"]["text_config"]["vocab_size"] > first + len(ADDED_TOKENS) - 1
    talker = config["talker_config"]
    assert talker["codec_eos_token_id"] == codec_ids(TINY_SIZES)["eos"]
    assert talker["text_config"]["vocab_size"] > max(talker["speaker_id"].values())
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hello"}], add_generation_prompt=True, tokenize=False
    )
    assert text == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"


def test_loader_reads_the_folder(qwen3_omni_folder):
    ckpt = Qwen3OmniCheckpoint.open(qwen3_omni_folder)
    assert ckpt.has_talker
    assert len(ckpt.shards()) > 1
    code2wav = ckpt.tensors("code2wav.")
    assert code2wav["code2wav.code_embedding.weight"].shape == (
        TINY_SIZES.codebook_size * TINY_SIZES.num_code_groups,
        TINY_SIZES.code2wav_hidden,
    )
    assert all(k.startswith("code2wav.") for k in code2wav)
    config = ckpt.code2wav_config()
    assert config.code_embedding and config.latent_dim == TINY_SIZES.code2wav_hidden
    assert config.sliding_window == TINY_SIZES.sliding_window


@pytest.mark.parametrize(
    "remove", ["config.json", "tokenizer_config.json", "vocab.json", "merges.txt"]
)
def test_a_missing_file_is_named(qwen3_omni_folder, tmp_path, remove):
    folder = shutil.copytree(qwen3_omni_folder, tmp_path / "ckpt")
    (folder / remove).unlink()
    with pytest.raises(Qwen3OmniCheckpointError, match=f"missing {remove}"):
        Qwen3OmniCheckpoint.open(folder)


def test_missing_weights_and_shards_are_named(qwen3_omni_folder, tmp_path):
    folder = shutil.copytree(qwen3_omni_folder, tmp_path / "ckpt")
    shard = sorted(folder.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(Qwen3OmniCheckpointError, match=f"missing {shard.name}"):
        Qwen3OmniCheckpoint.open(folder)
    (folder / "model.safetensors.index.json").unlink()
    with pytest.raises(Qwen3OmniCheckpointError, match="missing model.safetensors.index.json"):
        Qwen3OmniCheckpoint.open(folder)


def test_wrong_files_are_named(qwen3_omni_folder, tmp_path):
    folder = shutil.copytree(qwen3_omni_folder, tmp_path / "ckpt")
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text("{not json")
    with pytest.raises(Qwen3OmniCheckpointError, match="config.json: not a readable JSON"):
        Qwen3OmniCheckpoint.open(folder)
    config_path.write_text(json.dumps(dict(config, model_type="qwen2_5_omni")))
    with pytest.raises(Qwen3OmniCheckpointError, match="model_type is 'qwen2_5_omni'"):
        Qwen3OmniCheckpoint.open(folder)
    del config["code2wav_config"]
    config_path.write_text(json.dumps(config))
    with pytest.raises(Qwen3OmniCheckpointError, match="no code2wav_config"):
        Qwen3OmniCheckpoint.open(folder)
    config_path.write_text(json.dumps(dict(config, enable_audio_output=False)))
    ckpt = Qwen3OmniCheckpoint.open(folder)  # a thinker-only checkpoint (Thinking, Captioner)
    with pytest.raises(Qwen3OmniCheckpointError, match="no code2wav"):
        ckpt.load_code2wav()
    shard = sorted(folder.glob("model-*.safetensors"))[0]
    shard.write_bytes(b"not a safetensors file")
    with pytest.raises(Qwen3OmniCheckpointError, match=shard.name):
        ckpt.tensors("thinker.")


def test_wrong_code2wav_tensors_are_named(qwen3_omni_folder, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = shutil.copytree(qwen3_omni_folder, tmp_path / "ckpt")
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    name = "code2wav.pre_transformer.norm.weight"
    shard = folder / index[name]
    tensors = load_file(shard)
    del tensors[name]
    save_file(tensors, shard)
    with pytest.raises(ModelFilesError, match=f"missing {name}"):
        Qwen3OmniCheckpoint.open(folder).load_code2wav()
