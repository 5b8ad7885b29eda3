"""The piper voice (`--model piper`) end to end: engine parity gates, the real server, the OpenAI
client, ASR."""

import base64
import io
import json

import av
import httpx
import numpy as np
import pytest
import soundfile as sf
from openai import OpenAI

from omnistep.core import OPENAI_VOICES, InvalidRequestError, ModelInstance, Request
from omnistep.engine import AsyncEngine
from omnistep.models.piper.card import FIRST_CHUNK_CHARS, build_card, default_voice_paths
from omnistep.models.piper.frontend import PiperFrontend
from omnistep.parity import collect, run_alone, run_interleaved
from tests.serving import running_server

PARAGRAPH = (
    "The quick brown fox jumps over the lazy dog. "
    "Our library opens at nine in the morning. "
    "Please bring your own bag when you go shopping."
)
SENTENCES = [s.strip() + "." for s in PARAGRAPH.split(".") if s.strip()]


@pytest.fixture(scope="module")
def model():
    return ModelInstance.load(build_card())


@pytest.fixture
async def engine(model):
    eng = AsyncEngine([model])
    yield eng
    await eng.shutdown()


@pytest.fixture(scope="module")
def base():
    with running_server("--model", "piper") as url:
        yield url


async def test_card_ids_and_voices(model):
    card = model.card
    assert card.model_ids == ("piper", "tts-1", "tts-1-hd", "gpt-4o-mini-tts")
    assert set(OPENAI_VOICES) <= set(card.voices) and card.default_voice == "joe"
    assert card.sample_rate == 22050


async def test_one_chunk_per_sentence_and_seeded(engine):
    a = await collect(engine, Request("tts-1", text=PARAGRAPH, seed=5))
    b = await collect(engine, Request("piper", text=PARAGRAPH, seed=5, voice="nova"))
    c = await collect(engine, Request("piper", text=PARAGRAPH, seed=6))
    assert len(a.chunks) == 3
    assert np.array_equal(a.audio, b.audio), "same text and seed must give identical samples"
    assert not np.array_equal(a.audio, c.audio)
    assert 4.0 < a.audio.size / a.sample_rate < 12.0


async def test_interleaved_equals_alone(engine):
    reqs = [Request("piper", text=s * (i + 1), seed=i) for i, s in enumerate(SENTENCES)]
    alone = await run_alone(engine, reqs)
    together = await run_interleaved(engine, reqs)
    for a, b in zip(alone, together, strict=True):
        assert np.array_equal(a.audio, b.audio)


class _RecordingSession:
    """Stands in for one of the voice's onnxruntime sessions: records each call, then runs it."""

    def __init__(self, session, key: tuple[bool, bool], calls: list):
        self.session, self.key, self.calls = session, key, calls

    def run(self, outputs, feeds):
        self.calls.append(self.key)
        return self.session.run(outputs, feeds)


async def test_first_unit_runs_on_every_core_alone_or_interleaved(engine, model, monkeypatch):
    """A request's first unit runs on the all-core session (its spinning twin when nothing
    runs beside it) and its other units on the half-core one, whatever runs beside it, so its
    samples do not depend on the load."""
    voice = model.components["voice"]
    calls: list[tuple[bool, bool]] = []
    pool = voice._sessions  # the voice's SessionPool
    sessions = {k: _RecordingSession(s, k, calls) for k, s in pool._sessions.items()}
    monkeypatch.setattr(pool, "_sessions", sessions)
    reqs = [Request("piper", text=PARAGRAPH, seed=i) for i in range(3)]
    alone = await run_alone(engine, reqs)
    assert calls == [(True, True), (False, False), (False, False)] * 3
    calls.clear()
    together = await run_interleaved(engine, reqs)
    # which first units had company depends on timing; which session kind never does
    assert sorted(all_cores for all_cores, _ in calls) == [False] * 6 + [True] * 3
    for a, b in zip(alone, together, strict=True):
        assert np.array_equal(a.audio, b.audio)


async def test_speed_changes_duration(engine):
    # speed maps to length_scale = 1 / speed; VITS rounds each phoneme's frames up (ceil) and
    # many ids (the pads between phonemes) last under one frame, so durations scale a little
    # less than 1 / speed (measured: 1.74x at speed 0.5, 0.63x at 2.0, 0.50x at 4.0).
    normal = await collect(engine, Request("piper", text=PARAGRAPH, seed=1))
    fast = await collect(engine, Request("piper", text=PARAGRAPH, seed=1, speed=2.0))
    slow = await collect(engine, Request("piper", text=PARAGRAPH, seed=1, speed=0.5))
    assert 0.5 <= fast.audio.size / normal.audio.size <= 0.65
    assert 1.6 <= slow.audio.size / normal.audio.size <= 2.0


async def test_unknown_voice_and_unspeakable_input(engine):
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request(Request("piper", text="hi", voice="bob"))
    assert info.value.param == "voice"
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request(Request("piper", text="... ?"))
    assert info.value.param == "input"
    with pytest.raises(InvalidRequestError) as info:  # espeak refuses NUL
        engine.add_request(Request("piper", text="a\x00b"))
    assert info.value.param == "input"


NUMBERS = "Pay $12.50 on 2024-03-15."
"""Text whose normalised form ("twelve dollars and fifty cents", "March fifteenth") espeak
would not produce from the raw text ("dollar twelve point five zero", "dash zero three")."""


def _frontend() -> PiperFrontend:
    return PiperFrontend.from_config_path(
        default_voice_paths()[1], first_chunk_chars=FIRST_CHUNK_CHARS
    )


def _phoneme_ids(sentences) -> int:
    return sum(len(s.phoneme_ids) for s in sentences)


async def test_normalization_can_be_turned_off_per_request(engine):
    """Numbers are read as words by default; ``normalize_text=False`` passes the text as is,
    through the card's frontend node (the request's usage counts the phoneme ids it made)."""
    frontend = _frontend()
    words = "Pay twelve dollars and fifty cents on March fifteenth, twenty twenty four."
    assert frontend.texts(NUMBERS) == [words]
    assert frontend.texts(NUMBERS, normalize_text=False) == [NUMBERS]
    on, off = frontend.sentences(NUMBERS), frontend.sentences(NUMBERS, normalize_text=False)
    assert [s.phonemes for s in on] == [s.phonemes for s in frontend.sentences(words)]
    assert [s.phonemes for s in off] != [s.phonemes for s in on]
    default = engine.add_request(Request("piper", text=NUMBERS, seed=1))
    raw = engine.add_request(Request("piper", text=NUMBERS, seed=1, normalize_text=False))
    assert default.usage["input_tokens"] == _phoneme_ids(on)
    assert raw.usage["input_tokens"] == _phoneme_ids(off)
    for stream in (default, raw):
        stream.cancel()


def test_normalization_options_through_the_server(base):
    """Kokoro-FastAPI's ``normalization_options``: ``normalize: false`` reaches the frontend;
    its other known fields and unknown ones are accepted."""

    def input_tokens(**extra) -> int:
        body = {"model": "tts-1", "input": NUMBERS, "seed": 1, "stream_format": "sse", **extra}
        r = httpx.post(base + "/v1/audio/speech", json=body, timeout=60)
        assert r.status_code == 200, r.text
        events = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: ")]
        return events[-1]["usage"]["input_tokens"]

    frontend = _frontend()
    words = _phoneme_ids(frontend.sentences(NUMBERS))
    raw = _phoneme_ids(frontend.sentences(NUMBERS, normalize_text=False))
    assert words != raw
    assert input_tokens() == words
    assert input_tokens(normalization_options={"normalize": True}) == words
    kokoro = {"normalize": False, "unit_normalization": True, "phone_normalization": False}
    assert input_tokens(normalization_options=kokoro) == raw
    assert input_tokens(normalization_options={"normalize": False, "future_option": 1}) == raw


def _decode(data: bytes, fmt: str) -> tuple[np.ndarray, int]:
    if fmt == "pcm":
        return np.frombuffer(data, "<i2").astype(np.float32) / 32768, 24000
    if fmt == "wav":
        return sf.read(io.BytesIO(data), dtype="float32")
    with av.open(io.BytesIO(data)) as container:
        frames = [f.to_ndarray().reshape(-1) for f in container.decode(audio=0)]
        rate = container.streams.audio[0].rate
    return np.concatenate(frames), rate


@pytest.fixture(scope="module")
def reference_seconds(base):
    r = httpx.post(
        base + "/v1/audio/speech",
        timeout=60,
        json={
            "model": "tts-1",
            "input": PARAGRAPH,
            "response_format": "pcm",
            "seed": 2,
            "stream": False,
        },
    )
    return len(r.content) / 2 / 24000


@pytest.mark.parametrize("fmt", ["mp3", "opus", "aac", "flac", "wav", "pcm"])
def test_openai_client_every_format(base, fmt, reference_seconds):
    client = OpenAI(base_url=base + "/v1", api_key="unused")
    full = client.audio.speech.create(
        model="tts-1", voice="alloy", input=PARAGRAPH, response_format=fmt, extra_body={"seed": 2}
    )
    with client.audio.speech.with_streaming_response.create(
        model="tts-1", voice="alloy", input=PARAGRAPH, response_format=fmt, extra_body={"seed": 2}
    ) as response:
        streamed = b"".join(response.iter_bytes(4096))
    assert streamed == full.content
    samples, rate = _decode(full.content, fmt)
    assert samples.size / rate == pytest.approx(reference_seconds, rel=0.05)
    assert np.sqrt(np.mean(samples**2)) > 0.02


def test_stream_equals_full_and_sse(base):
    body = {"model": "tts-1", "input": PARAGRAPH, "response_format": "pcm", "seed": 9}
    full = httpx.post(base + "/v1/audio/speech", json={**body, "stream": False}, timeout=60)
    pieces = []
    with httpx.stream("POST", base + "/v1/audio/speech", json=body, timeout=60) as r:
        pieces = list(r.iter_raw())
    assert b"".join(pieces) == full.content
    sse = httpx.post(base + "/v1/audio/speech", json={**body, "stream_format": "sse"}, timeout=60)
    events = [json.loads(x[6:]) for x in sse.text.splitlines() if x.startswith("data: ")]
    types = [e["type"] for e in events]
    assert types[-1] == "speech.audio.done" and len(types) >= 4  # a delta per sentence at least
    assert set(types[:-1]) == {"speech.audio.delta"}
    audio = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    assert audio == full.content
    assert events[-1]["usage"]["input_tokens"] > 50


def test_intelligible_through_the_server(base, asr):
    r = httpx.post(
        base + "/v1/audio/speech",
        timeout=60,
        json={
            "model": "tts-1",
            "voice": "echo",
            "input": PARAGRAPH,
            "response_format": "wav",
            "seed": 4,
            "stream": False,
        },
    )
    samples, rate = sf.read(io.BytesIO(r.content), dtype="float32")
    hypothesis = asr.transcribe(samples, rate)
    assert asr.wer(PARAGRAPH, hypothesis) <= 0.15, hypothesis
