"""The piper model side: frontend (text -> sentences -> ids) and the seeded ONNX voice component."""

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import onnxruntime as ort
import pytest

from omnistep.core.enums import WorkUnitKind
from omnistep.core.errors import InvalidRequestError
from omnistep.models.piper import voice as voice_module
from omnistep.models.piper.frontend import PiperFrontend
from omnistep.models.piper.voice import (
    PiperUnit,
    PiperVoiceComponent,
    VoiceSettings,
    default_voice_paths,
)

PARAGRAPH = "The sun rose over the harbour. Boats drifted out, one by one! Will it rain?"
CHUNK = WorkUnitKind.AUDIO_CHUNK


@pytest.fixture(scope="module")
def frontend() -> PiperFrontend:
    return PiperFrontend.from_config_path(default_voice_paths()[1])


@pytest.fixture(scope="module")
def voice() -> PiperVoiceComponent:
    return PiperVoiceComponent(device="cpu", num_threads=1)


@pytest.fixture(scope="module")
def sentences(frontend):
    return frontend.sentences(PARAGRAPH)


@pytest.fixture(scope="module")
def alone(voice, sentences) -> list[np.ndarray]:
    """Each sentence synthesized alone, seed = its index."""
    return [
        voice.execute(CHUNK, [voice.make_unit(s.phoneme_ids, seed=s.index)])[0].audio
        for s in sentences
    ]


def test_frontend_splits_paragraph_into_sentences(sentences):
    assert [s.index for s in sentences] == [0, 1, 2]
    assert [s.phonemes[-1] for s in sentences] == [".", "!", "?"]
    for s in sentences:
        # ^ _ p1 _ p2 _ ... $: BOS 1, PAD 0 after every phoneme, EOS 2.
        assert len(s.phoneme_ids) == 2 * len(s.phonemes) + 3
        assert s.phoneme_ids[:2] == (1, 0) and s.phoneme_ids[-1] == 2


def test_frontend_cuts_long_sentence_without_dropping_words(frontend):
    pieces = frontend.sentences("word " * 300)
    assert len(pieces) == 5
    assert all(len(p.phonemes) <= frontend.max_phonemes for p in pieces)
    assert sum(p.phonemes.count("wˈɜːd") for p in pieces) == 300


@pytest.mark.parametrize("text", ["", "   \n", "...", "?!", "-- ()"])
def test_nothing_speakable_raises(frontend, text):
    with pytest.raises(InvalidRequestError) as info:
        frontend.sentences(text)
    assert info.value.param == "input"


def test_without_noise_rewritten_graph_equals_stock(voice, sentences):
    ids = np.array([sentences[0].phoneme_ids], dtype=np.int64)
    stock = ort.InferenceSession(str(default_voice_paths()[0]), providers=["CPUExecutionProvider"])
    feeds = {
        "input": ids,
        "input_lengths": np.array([ids.shape[1]], dtype=np.int64),
        "scales": np.array([0.0, 1.0, 0.0], dtype=np.float32),
    }
    expected = stock.run(None, feeds)[0].reshape(-1)
    unit = voice.make_unit(sentences[0].phoneme_ids, seed=3, noise_scale=0.0, noise_w=0.0)
    assert np.array_equal(voice.execute(CHUNK, [unit])[0].audio, expected)


def test_same_seed_is_bit_identical_and_seeds_differ(voice, sentences, alone):
    ids = sentences[0].phoneme_ids
    again = voice.execute(CHUNK, [voice.make_unit(ids, seed=0)])[0].audio
    other = voice.execute(CHUNK, [voice.make_unit(ids, seed=1)])[0].audio
    assert np.array_equal(again, alone[0])
    assert again.shape != other.shape or not np.array_equal(again, other)


def test_output_is_plausible_speech(voice, sentences, alone):
    assert voice.sample_rate == 22050
    for s, audio in zip(sentences, alone, strict=True):
        assert audio.dtype == np.float32 and audio.ndim == 1
        assert audio.size % voice.hop_length == 0
        assert float(np.sqrt(np.mean(audio**2))) > 0.01
        assert float(np.max(np.abs(audio))) <= 1.0
        # measured ~0.05-0.06 s per phoneme symbol (stress marks and spaces included)
        assert 0.03 < audio.size / voice.sample_rate / len(s.phonemes) < 0.2


def test_speed_maps_to_length_scale(voice, sentences, alone):
    ids = sentences[2].phoneme_ids
    fast = voice.execute(CHUNK, [voice.make_unit(ids, seed=2, speed=2.0)])[0].audio
    assert voice.make_unit(ids, seed=2, speed=2.0).length_scale == voice.settings.length_scale / 2.0
    # Frames per id are ceil(w * length_scale) and about half the ids (pads) last under one
    # frame, so halving length_scale gives ~0.62x the samples, not 0.5x (measured 0.61-0.64).
    assert 0.55 < fast.size / alone[2].size < 0.7


def test_batch_of_three_equals_each_alone(voice, sentences, alone):
    units = [voice.make_unit(s.phoneme_ids, seed=s.index) for s in sentences]
    together = [out.audio for out in voice.execute(CHUNK, units)]
    assert len(together) == 3
    for a, b in zip(together, alone, strict=True):
        assert np.array_equal(a, b)


def test_padded_batch_is_close_to_alone(voice, sentences, alone):
    units = [voice.make_unit(s.phoneme_ids, seed=s.index) for s in sentences]
    padded = [out.audio for out in voice.run_batch(units)]
    for a, b in zip(padded, alone, strict=True):
        assert a.shape == b.shape
        assert float(np.max(np.abs(a - b))) < 1e-3


def test_short_noise_buffer_reruns_to_the_same_samples(voice, sentences, alone, monkeypatch):
    monkeypatch.setattr(voice_module, "FRAMES_PER_ID", 0.1)
    monkeypatch.setattr(voice_module, "MIN_NOISE_FRAMES", 1)
    unit = voice.make_unit(sentences[1].phoneme_ids, seed=1)
    assert voice_module._frame_bound(len(unit.phoneme_ids), 1.0) * 256 < alone[1].size
    assert np.array_equal(voice.execute(CHUNK, [unit])[0].audio, alone[1])


def test_all_cores_units_run_on_their_own_session_alone_or_concurrently(voice, sentences, alone):
    """Units marked ``all_cores`` run on the all-core session (its samples are those of a
    one-session voice with as many threads), the others on the half-core one, also when two
    run at once: the unit picks the session, never the load."""
    two = PiperVoiceComponent(device="cpu", num_threads=1, all_core_threads=2)
    assert two.intra_op_threads == {False: 1, True: 2}
    assert voice.intra_op_threads == {False: 1, True: 1}  # one session for every unit
    wide = PiperVoiceComponent(device="cpu", num_threads=2)
    ids = sentences[0].phoneme_ids
    first = two.make_unit(ids, seed=0, all_cores=True)
    expected = wide.execute(CHUNK, [wide.make_unit(ids, seed=0)])[0].audio
    assert np.array_equal(two.execute(CHUNK, [first])[0].audio, expected)
    rest = [two.make_unit(s.phoneme_ids, seed=s.index) for s in sentences[1:]]
    with ThreadPoolExecutor(2) as pool:
        outs = list(pool.map(lambda u: two.execute(CHUNK, [u])[0].audio, [first, *rest, first]))
    assert np.array_equal(outs[0], expected) and np.array_equal(outs[-1], expected)
    # alone it ran on the spinning twin; a twin without spinning gives the same samples
    pool = two._sessions._sessions  # SessionPool: (all_cores, spinning) -> session
    assert pool[True, True] is not pool[True, False]
    plain = dict.fromkeys(pool, pool[True, False])
    two._sessions._sessions = plain | {(False, False): pool[False, False]}
    assert np.array_equal(two.execute(CHUNK, [first])[0].audio, expected)
    for out, ref in zip(outs[1:-1], alone[1:], strict=True):
        assert np.array_equal(out, ref)  # the half-core session: the 1-thread voice's samples
    with pytest.raises(ValueError, match="all_cores"):
        two.run_batch([first, rest[0]])


def test_bad_units_and_kinds_are_rejected(voice):
    with pytest.raises(ValueError, match="seed"):
        PiperUnit((1, 0, 2), 1.0, 0.667, 0.8, seed=-1)
    with pytest.raises(ValueError, match="length_scale"):
        PiperUnit((1, 0, 2), 0.0, 0.667, 0.8, seed=0)
    with pytest.raises(ValueError, match="phoneme_ids"):
        PiperUnit((), 1.0, 0.667, 0.8, seed=0)
    with pytest.raises(ValueError, match="all_cores"):
        PiperUnit((1, 0, 2), 1.0, 0.667, 0.8, seed=0, all_cores=1)
    with pytest.raises(ValueError, match="AUDIO_CHUNK"):
        voice.execute(WorkUnitKind.PREFILL, [])


def test_first_sentence_is_cut_at_a_clause_for_the_first_unit():
    config = default_voice_paths()[1]
    text = (
        "When the morning train finally pulled into the station, the passengers, tired and "
        "hungry, hurried out onto the platform. Then it left."
    )
    whole = PiperFrontend.from_config_path(config).texts(text)
    cut = PiperFrontend.from_config_path(config, first_chunk_chars=60).texts(text)
    assert len(whole) == 2 and len(cut) == 4
    assert cut[:3] == [
        "When the morning train finally pulled into the station,",
        "the passengers, tired and hungry,",
        "hurried out onto the platform.",
    ]
    assert " ".join(cut).split() == " ".join(whole).split()  # no word dropped or repeated
    short = PiperFrontend.from_config_path(config, first_chunk_chars=60).texts("Hi, there.")
    assert short == ["Hi, there."]
    with pytest.raises(ValueError, match="first_chunk_chars"):
        PiperFrontend.from_config_path(config, first_chunk_chars=0)


def test_voice_settings_read_from_the_config_alone_match_the_component(voice):
    """What the sentence loop reads (also where the voice runs in another process) equals
    what the loaded voice has: the embedded voice's config values, and the same units."""
    settings = VoiceSettings.from_config_path(default_voice_paths()[1])
    assert settings == voice.settings
    assert (settings.sample_rate, settings.hop_length, settings.batched) == (22050, 256, False)
    assert (settings.noise_scale, settings.length_scale, settings.noise_w) == (0.667, 1.0, 0.8)
    ids = [1, 5, 0, 9]
    unit = settings.make_unit(ids, seed=4, speed=2.0)
    assert unit == voice.make_unit(ids, seed=4, speed=2.0)
    assert unit.length_scale == 0.5 and unit.phoneme_ids == (1, 5, 0, 9)
    with pytest.raises(ValueError, match="speed must be > 0"):
        settings.make_unit(ids, seed=4, speed=0.0)
