"""The tiny Qwen3-TTS fixture is a valid published folder (upstream loads and runs it), and
omnistep's loader reads every variant of it and rejects broken folders with one typed error."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from omnistep.models.qwen3_tts import LAYOUT, Qwen3TTSCheckpoint, Qwen3TTSCheckpointError
from omnistep.models.qwen3_tts import tiny as assets
from omnistep.models.qwen3_tts.loader import model_tensor_shapes, speech_decoder_tensor_shapes
from tests.qwen3_tts_ref.assets import write_reference_qwen3_tts
from tests.qwen3_tts_ref.env import call_reference


@pytest.fixture(scope="module")
def folders(qwen3_tts_folders) -> dict[str, assets.Qwen3TTSInfo]:
    return qwen3_tts_folders


GENERATE_CASES = [
    ("custom_voice", {"speaker": "Ryan", "language": "English"}),
    ("custom_voice", {"speaker": "Dylan", "language": "Chinese"}),  # a dialect speaker
    ("voice_design", {"instruct": "a calm low voice", "language": "English"}),
]


@pytest.fixture(scope="module")
def generated(folders) -> list[dict]:  # noqa: ANN001
    """Upstream ``generate`` on each case, in one reference subprocess."""
    requests = [
        {"root": folders[v].root, "text": "hello world, how are you today", "max_new_tokens": 6}
        | kw
        for v, kw in GENERATE_CASES
    ]
    return call_reference("tests.qwen3_tts_ref.upstream:generate_many", requests=requests)


def _copy(info: assets.Qwen3TTSInfo, tmp_path: Path) -> Path:
    dst = tmp_path / info.variant
    shutil.copytree(info.root, dst)
    return dst


def test_layout_is_exactly_the_published_file_list(folders):
    for info in folders.values():
        files = sorted(str(p.relative_to(info.root)) for p in info.root.rglob("*") if p.is_file())
        assert files == sorted(LAYOUT)
        assert not (info.root / "tokenizer.json").exists()
        assert not (info.root / "merges.txt").read_text().startswith("#version")
        with safe_open(str(info.root / "model.safetensors"), "pt") as f:
            dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}  # noqa: SIM118
        assert dtypes == {"BF16"}
        with safe_open(str(info.root / "speech_tokenizer" / "model.safetensors"), "pt") as f:
            dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}  # noqa: SIM118
        assert dtypes == {"F32"}


def test_variants_differ_as_published(folders):
    has_spk = {
        v: any(k.startswith("speaker_encoder.") for k in info.tensor_shapes)
        for v, info in folders.items()
    }
    assert has_spk == {"custom_voice": False, "voice_design": False, "base": True}
    for v, info in folders.items():
        config = json.loads((info.root / "config.json").read_text())
        assert ("speaker_encoder_config" in config) == (v == "base")
        assert config["tts_model_type"] == v
    proj = "talker.code_predictor.small_to_mtp_projection.weight"
    assert proj in folders["voice_design"].tensor_shapes  # 1b7: narrower code predictor
    assert proj not in folders["custom_voice"].tensor_shapes  # 0b6


def test_same_seed_gives_byte_identical_files(folders, tmp_path):
    info = folders["custom_voice"]
    again = write_reference_qwen3_tts(tmp_path / "again", "custom_voice", seed=0)
    for rel in LAYOUT:
        assert (again.root / rel).read_bytes() == (info.root / rel).read_bytes(), rel


@pytest.mark.parametrize("case", range(len(GENERATE_CASES)))
def test_upstream_generates_from_the_fixture(folders, generated, case):
    variant = GENERATE_CASES[case][0]
    info = folders[variant]
    out = generated[case]
    codes, wav = out["codes"], out["wav"]
    assert out["tts_model_type"] == variant
    assert codes.ndim == 2 and codes.shape[1] == 16 and 1 <= codes.shape[0] <= 6
    assert codes.min() >= 0 and codes.max() < 2048  # real codes only (upstream suppresses 2048+)
    assert out["sample_rate"] == 24000
    assert wav.dtype == np.float32 and wav.shape == (codes.shape[0] * 1920,)
    assert np.isfinite(wav).all() and 0.01 < float(wav.std()) < 1.0
    assert sorted(out["speakers"]) == sorted(info.speakers)
    assert out["languages"] == sorted(["auto", *[k for k in info.languages if "dialect" not in k]])


def test_upstream_state_dict_names_and_shapes_match_ours(folders):
    for info in folders.values():
        ck = Qwen3TTSCheckpoint.open(info.root)
        ours = {k: list(v) for k, v in model_tensor_shapes(ck.config).items()}
        ours.update(
            {
                f"speech_tokenizer/{k}": list(v)
                for k, v in speech_decoder_tensor_shapes(ck.config.speech_tokenizer.decoder).items()
            }
        )
        upstream = {
            k: v
            for k, v in info.tensor_shapes.items()
            if not k.startswith("speech_tokenizer/encoder.")
        }
        assert ours == upstream, info.variant


def test_loader_reads_every_variant(folders):
    for v, info in folders.items():
        ck = Qwen3TTSCheckpoint.open(info.root, tts_model_type=v)
        c = ck.config
        s = info.sizes
        assert c.tts_model_type == v and c.tts_model_size == info.model_size
        assert c.spk_id == info.speakers and c.spk_is_dialect == info.spk_is_dialect
        assert c.codec_language_id == info.languages
        assert c.talker.hidden_size == s.hidden and c.talker.head_dim == s.head_dim
        assert c.talker.mrope_section == s.mrope_section and c.talker.mrope_interleaved
        assert c.talker.vocab_size == 3072 and c.talker.num_code_groups == 16
        assert c.talker.text_vocab_size == info.ids.text_vocab
        assert c.talker.code_predictor.hidden_size == s.cp_hidden(info.model_size)
        assert c.talker.code_predictor.vocab_size == 2048
        ids = c.ids
        assert (ids.im_start, ids.im_end, ids.assistant) == (
            info.ids.im_start,
            info.ids.im_end,
            info.ids.assistant,
        )
        assert (ids.tts_pad, ids.tts_bos, ids.tts_eos) == (
            info.ids.tts_pad,
            info.ids.tts_bos,
            info.ids.tts_eos,
        )
        assert (ids.codec_pad, ids.codec_bos, ids.codec_eos) == (2148, 2149, 2150)
        assert (ids.codec_think, ids.codec_nothink, ids.codec_think_bos, ids.codec_think_eos) == (
            2154,
            2155,
            2156,
            2157,
        )
        st = c.speech_tokenizer
        assert st.decode_upsample_rate == st.decoder.total_upsample == 1920
        assert st.decoder.num_quantizers == 16 and st.decoder.codebook_size == 2048
        assert st.encoder_valid_num_quantizers == 16 and st.output_sample_rate == 24000
        assert (c.speaker_encoder is not None) == (v == "base")
        if v == "base":
            assert c.speaker_encoder.enc_dim == s.hidden
            assert c.speaker_encoder.enc_channels == s.spk_channels
        assert c.generation.max_new_tokens == 8192 and c.generation.repetition_penalty == 1.05
        assert c.generation.do_sample and c.generation.subtalker_dosample
    cv = Qwen3TTSCheckpoint.open(folders["custom_voice"].root).config
    assert cv.spk_id["ryan"] == 3061 and cv.spk_is_dialect["dylan"] == "beijing_dialect"
    assert cv.codec_language_id["beijing_dialect"] == 2074
    assert "beijing_dialect" not in cv.languages and "english" in cv.languages


def test_loader_tensors_equal_the_files(folders):
    info = folders["base"]
    ck = Qwen3TTSCheckpoint.open(info.root)
    main = ck.model_tensors(dtype=torch.float32)
    dec = ck.speech_tokenizer_tensors(prefix="decoder.")
    assert set(main) == {k for k in info.tensor_shapes if "/" not in k}
    assert all(k.startswith("decoder.") for k in dec)
    with safe_open(str(info.root / "model.safetensors"), "pt") as f:
        for name in (
            "talker.model.codec_embedding.weight",
            "talker.code_predictor.lm_head.14.weight",
            "speaker_encoder.fc.weight",
        ):
            raw = f.get_tensor(name)
            assert raw.dtype == torch.bfloat16
            assert main[name].dtype == torch.float32
            assert torch.equal(main[name], raw.float())
    with safe_open(str(info.root / "speech_tokenizer" / "model.safetensors"), "pt") as f:
        name = "decoder.quantizer.rvq_rest.vq.layers.14._codebook.embedding_sum"
        assert torch.equal(dec[name], f.get_tensor(name))
        assert dec[name].abs().sum() > 0  # codebooks are random, not upstream's zeros
    kept = ck.model_tensors()
    assert kept["talker.codec_head.weight"].dtype == torch.bfloat16


def test_loader_tokenizer_matches_upstream(folders):
    info = folders["custom_voice"]
    tok = Qwen3TTSCheckpoint.open(info.root).tokenizer()
    texts = [
        "<|im_start|>assistant\nHello world, how are you today?<|im_end|>\n<|im_start|>assistant\n",
        "<|im_start|>user\nSay something nice.<|im_end|>\n",
        "<tts_pad><tts_text_bos><tts_text_eod> 你好 ünïcode 123",
    ]
    ours = [tok(t)["input_ids"] for t in texts]
    assert ours == call_reference(
        "tests.qwen3_tts_ref.upstream:tokenize", root=info.root, texts=texts
    )
    i = info.ids
    assert ours[0][:3] == [i.im_start, i.assistant, i.newline]
    assert ours[0][-5:] == [i.im_end, i.newline, i.im_start, i.assistant, i.newline]
    assert ours[2][:3] == [i.tts_pad, i.tts_bos, i.tts_eos]


@pytest.mark.parametrize("variant", assets.VARIANTS)
def test_omnistep_writer_has_upstreams_tensors_and_upstream_speaks_from_it(variant, tmp_path):
    """``omnistep weights qwen3_tts`` (``tiny.write_tiny_qwen3_tts``, no reference needed)
    writes every tensor upstream's modules have, under the same names and shapes, and upstream
    ``from_pretrained`` + ``generate`` runs on the folder (CustomVoice, VoiceDesign)."""
    info = assets.write_tiny_qwen3_tts(tmp_path / variant, variant, seed=2)
    upstream = call_reference("tests.qwen3_tts_ref.upstream:tensor_shapes", root=info.root)
    assert info.tensor_shapes == upstream
    if variant == "base":
        return  # upstream's generate_* speak named or designed voices only
    kw = {"speaker": "Ryan"} if variant == "custom_voice" else {"instruct": "a calm voice"}
    out = call_reference(
        "tests.qwen3_tts_ref.upstream:generate",
        root=info.root,
        text="hello world",
        language="English",
        max_new_tokens=4,
        **kw,
    )
    assert out["tts_model_type"] == variant and out["codes"].shape[1] == 16
    assert out["wav"].size == out["codes"].shape[0] * 1920 and np.isfinite(out["wav"]).all()


@pytest.mark.parametrize("rel", LAYOUT)
def test_each_missing_file_is_named(folders, tmp_path, rel):
    root = _copy(folders["custom_voice"], tmp_path)
    (root / rel).unlink()
    with pytest.raises(Qwen3TTSCheckpointError, match=rel.replace(".", r"\.")) as err:
        ck = Qwen3TTSCheckpoint.open(root)
        ck.model_tensors()
        ck.speech_tokenizer_tensors()
    assert isinstance(err.value, ValueError)


def test_wrong_tts_model_type_is_rejected(folders):
    with pytest.raises(Qwen3TTSCheckpointError, match="tts_model_type.*'voice_design'.*asked"):
        Qwen3TTSCheckpoint.open(folders["voice_design"].root, tts_model_type="custom_voice")


def _edit_config(root: Path, rel: str, edit) -> None:  # noqa: ANN001
    path = root / rel
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("rel", "edit", "message"),
    [
        ("config.json", lambda c: c.update(model_type="qwen2_5_omni"), "model_type"),
        ("config.json", lambda c: c.update(tts_model_type="dialogue"), "tts_model_type"),
        ("config.json", lambda c: c.pop("tts_pad_token_id"), "tts_pad_token_id is missing"),
        (
            "config.json",
            lambda c: c["talker_config"].pop("spk_id"),
            r"talker_config\.spk_id is missing",
        ),
        (
            "config.json",
            lambda c: c["talker_config"]["code_predictor_config"].pop("num_code_groups"),
            r"talker_config\.code_predictor_config\.num_code_groups is missing",
        ),
        (
            "config.json",
            lambda c: c["talker_config"]["rope_scaling"].update(mrope_section=[1, 1, 1]),
            "mrope_section",
        ),
        (
            "speech_tokenizer/config.json",
            lambda c: c["decoder_config"].update(upsample_rates=[8, 5, 4, 2]),
            "decode_upsample_rate",
        ),
        (
            "speech_tokenizer/config.json",
            lambda c: c.update(model_type="mimi"),
            "model_type",
        ),
        ("generation_config.json", lambda c: c.update(top_k="fifty"), "top_k"),
    ],
)
def test_bad_config_values_name_file_and_key(folders, tmp_path, rel, edit, message):
    root = _copy(folders["custom_voice"], tmp_path)
    _edit_config(root, rel, edit)
    with pytest.raises(Qwen3TTSCheckpointError, match=message) as err:
        Qwen3TTSCheckpoint.open(root)
    assert rel in str(err.value)


def test_base_without_speaker_encoder_config_is_rejected(folders, tmp_path):
    root = _copy(folders["base"], tmp_path)
    _edit_config(root, "config.json", lambda c: c.pop("speaker_encoder_config"))
    with pytest.raises(Qwen3TTSCheckpointError, match="speaker_encoder_config is missing"):
        Qwen3TTSCheckpoint.open(root, tts_model_type="base")


def test_wrong_tensor_shape_is_named(folders, tmp_path):
    from safetensors.torch import load_file, save_file

    root = _copy(folders["custom_voice"], tmp_path)
    tensors = load_file(str(root / "model.safetensors"))
    tensors["talker.codec_head.weight"] = tensors["talker.codec_head.weight"][:-1].clone()
    save_file(tensors, str(root / "model.safetensors"))
    ck = Qwen3TTSCheckpoint.open(root)
    with pytest.raises(Qwen3TTSCheckpointError, match=r"talker\.codec_head\.weight has shape"):
        ck.model_tensors()
    del tensors["talker.codec_head.weight"]
    save_file(tensors, str(root / "model.safetensors"))
    with pytest.raises(Qwen3TTSCheckpointError, match=r"talker\.codec_head\.weight is missing"):
        ck.model_tensors()
