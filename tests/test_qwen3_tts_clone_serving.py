"""Qwen3-TTS Base folders served with cloned voices, end to end, on the tiny Base fixture:
greedy codes and audio equal upstream ``generate_voice_clone`` (both ICL layouts: text longer
than the reference frames and shorter), text streamed into a running cloned-voice request equals
the whole text, rollouts of a cloned voice are re-scored, a multipart enrollment over the ASGI
app then ``/v1/audio/speech`` with the saved name, every bad upload's 4xx JSON, a Base request
without a voice, and the engine serving other requests while a voice is enrolled."""

from __future__ import annotations

import asyncio
import io
import threading
from contextlib import asynccontextmanager

import httpx
import numpy as np
import pytest
import soundfile as sf

from omnistep.audio import encode_all
from omnistep.core import (
    ExecutionProfile,
    InvalidRequestError,
    Modality,
    ModelInstance,
    Request,
    SamplingParams,
)
from omnistep.engine import AsyncEngine
from omnistep.models.qwen3_tts.card import Qwen3TTSOptions, build_card
from omnistep.models.qwen3_tts.clone import VoiceCloneEncoder, VoiceClonePrompt
from omnistep.models.qwen3_tts.loader import Qwen3TTSCheckpoint
from omnistep.models.qwen3_tts.prompt import build_prompt
from omnistep.models.qwen3_tts.talker import CloneRows
from omnistep.models.toy.card import build_card as build_toy
from omnistep.parity import collect
from omnistep.server import ServerConfig, build_app
from tests.qwen3_tts_ref.assets import write_reference_qwen3_tts_many
from tests.qwen3_tts_ref.env import call_reference
from tests.serving import abort_all
from tests.test_qwen3_tts_clone import chirp

REF = "tests.qwen3_tts_ref.upstream_clone"
TRANSCRIPT = "Hi there."
LONG = "Please leave the package by the blue door, and ring twice."
SHORT = "Hi there."
HOP = 1920
VOICES = "/v1/audio/voices"
SPEECH = "/v1/audio/speech"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_tts_clone_serving")
    infos = write_reference_qwen3_tts_many({root / v: v for v in ("base", "custom_voice")}, seed=3)
    return {info.variant: info.root for info in infos}


@pytest.fixture(scope="module")
def clip():
    return chirp(24000, 2.0, seed=2)  # 25 reference frames: len(k) = 26


@pytest.fixture(scope="module")
def spec(folders, clip):
    encoder = VoiceCloneEncoder.from_pretrained(folders["base"])
    return encoder(clip, 24000, TRANSCRIPT).to_spec()


def _engine(path, **options) -> AsyncEngine:
    card = build_card(str(path), Qwen3TTSOptions(kv_cache_gb=0.01, **options))
    return AsyncEngine([ModelInstance.load(card)])


async def _run(engine, **fields):
    return await collect(engine, Request("qwen3-tts", profile=ExecutionProfile.ROLLOUT, **fields))


def _codes(collected) -> np.ndarray:
    return np.array([r.tokens for r in collected.trajectories["decode"]])


# ------------------------------------------------------------------ the prompt and parity


def test_icl_layouts(folders, spec):
    """Both streaming layouts of upstream ``generate_icl_prompt`` and the text track."""
    config = Qwen3TTSCheckpoint.open(folders["base"]).config
    voice = VoiceClonePrompt.from_spec(spec)
    rows = CloneRows(voice.speaker_embedding, voice.ref_codes)
    ids = config.ids
    ref = [7, 8, 9]
    k = rows.num_frames + 1
    for n, longer in ((k, True), (3, False)):
        text = list(range(100, 100 + n))
        parts = build_prompt(config, [1, 2, 3, *text, 0, 0, 0, 0, 0], clone=rows, ref_ids=ref)
        p = parts.prompt
        assert p.clone is rows and p.codec_ids.count(-3) == rows.num_frames
        assert p.codec_ids[3:8] == (
            ids.codec_nothink,
            ids.codec_think_bos,
            ids.codec_think_eos,
            -2,
            ids.codec_pad,
        )
        assert p.text_ids[:8] == (
            1,
            2,
            3,
            ids.tts_pad,
            ids.tts_pad,
            ids.tts_pad,
            ids.tts_pad,
            ids.tts_bos,
        )
        assert p.codec_ids[8] == ids.codec_bos and len(p.text_ids) == 8 + k
        t = [*ref, *text, ids.tts_eos]
        if longer:
            assert list(p.text_ids[8:]) == t[:k] and parts.trailing == tuple(t[k:])
            assert parts.streams_text and parts.consumed == k - len(ref)
        else:
            assert list(p.text_ids[8:]) == t + [ids.tts_pad] * (k - len(t))
            assert parts.trailing == () and not parts.streams_text
    # a streamed text shorter than the layout needs cannot be built yet
    with pytest.raises(ValueError, match="needs"):
        build_prompt(
            config, [1, 2, 3, 100, 0, 0, 0, 0, 0], clone=rows, ref_ids=ref, text_complete=False
        )
    # the content key holds the voice: same text, another voice -> another key
    other = CloneRows(voice.speaker_embedding + 1, voice.ref_codes)
    a = build_prompt(config, [1, 2, 3, 100, 0, 0, 0, 0, 0], clone=rows, ref_ids=ref).prompt
    b = build_prompt(config, [1, 2, 3, 100, 0, 0, 0, 0, 0], clone=other, ref_ids=ref).prompt
    assert a.text_ids == b.text_ids and a.codec_ids == b.codec_ids and a.key() != b.key()


CASES = [(LONG, "english"), (SHORT, "auto")]
"""Text longer than the reference frames (text track after the prompt), and shorter (the
whole text in the prompt)."""


@pytest.fixture(scope="module")
def upstream(folders, spec):
    voice = VoiceClonePrompt.from_spec(spec)
    common = {
        "root": folders["base"],
        "ref_code": voice.ref_codes,
        "ref_spk_embedding": voice.speaker_embedding,
        "ref_text": voice.ref_text,
        "max_new_tokens": 12,  # generate_voice_clone's default layout: streaming text
    }
    requests = [{**common, "text": t, "language": lang.capitalize()} for t, lang in CASES]
    results = call_reference(f"{REF}:generate_clone_many", requests=requests)
    return dict(zip(CASES, results, strict=True))


@pytest.mark.parametrize(("text", "language"), CASES)
async def test_greedy_codes_and_audio_equal_upstream_generate_voice_clone(
    folders, spec, upstream, text, language
):
    voice = VoiceClonePrompt.from_spec(spec)
    ref = upstream[(text, language)]
    engine = _engine(folders["base"])
    try:
        got = await _run(
            engine,
            text=text,
            voice=spec,
            language=language,
            seed=1,
            sampling=SamplingParams(temperature=0, max_new_tokens=12),
        )
    finally:
        await engine.shutdown()
    n = len(ref["codes"])
    assert n >= 8
    codes = _codes(got)
    assert codes.shape == ref["codes"].shape  # max_new_tokens 12: 11 frames on both sides
    np.testing.assert_array_equal(codes, ref["codes"])
    assert ref["cut"] == voice.num_frames * HOP  # upstream cuts exactly the reference's samples
    assert got.audio.shape == ref["wav"].shape == (n * HOP,)
    np.testing.assert_allclose(got.audio, ref["wav"], atol=1e-4, rtol=0)
    assert np.abs(ref["wav"]).max() > 1e-2


# ------------------------------------------------------------------ engine


@pytest.fixture
async def base(folders):
    engine = _engine(folders["base"])
    yield engine
    await engine.shutdown()


async def test_text_streamed_into_a_cloned_voice_equals_the_whole_text(base, spec):
    fields = {"voice": spec, "seed": 3, "sampling": SamplingParams(max_new_tokens=30)}
    whole = await _run(base, text=LONG, **fields)
    stream = base.add_request(Request("qwen3-tts", text="", text_input=True, **fields))
    audio: list[np.ndarray] = []

    async def feed():
        for i, word in enumerate(LONG.split(" ")):
            stream.append_text(word if i == 0 else " " + word)
            await asyncio.sleep(0.05)
        stream.end_text()

    async def read():
        async for chunk in stream:
            if chunk.modality is Modality.AUDIO and chunk.audio.size:
                audio.append(chunk.audio)

    await asyncio.gather(feed(), read())
    np.testing.assert_array_equal(np.concatenate(audio), whole.audio)
    # both prefilled the voice's rows apart; the second forked the rows the first kept
    assert base.resolve("qwen3-tts").components["talker"].num_kept_prefixes == 1


async def test_aborted_cloned_voice_requests_leave_no_kv_blocks(base, spec):
    """50 requests of one cloned voice with different texts, aborted: the engine reports no
    KV block held (the voice's kept rows count as free) and nothing else live."""
    streams = [
        base.add_request(Request("qwen3-tts", text=f"Call {i} of fifty.", voice=spec, seed=i))
        for i in range(50)
    ]
    await abort_all(base, streams, 0.3)
    assert base.stats() == dict.fromkeys(base.stats(), 0)
    talker = base.resolve("qwen3-tts").components["talker"]
    assert talker.num_kept_prefixes == 1 and talker.kept_prefix_blocks > 0
    assert talker.drop_prefixes() == 1 and talker.blocks.num_used_blocks == 0


async def test_forgetting_a_voice_drops_its_kept_prefix(base, spec):
    """What DELETE /v1/audio/voices runs after deleting a saved clone: the engine pauses the
    model and the card drops the voice's kept rows; a later request of the voice still runs
    (and keeps them again); an unreadable spec is ignored."""
    talker = base.resolve("qwen3-tts").components["talker"]
    short = SamplingParams(max_new_tokens=6)  # random weights rarely stop on their own
    await _run(base, text="Keep my voice.", voice=spec, seed=1, sampling=short)
    assert talker.num_kept_prefixes == 1
    await base.forget_voice("qwen3-tts", "not a voice spec")
    assert talker.num_kept_prefixes == 1
    await base.forget_voice("qwen3-tts", spec)
    assert talker.num_kept_prefixes == 0 and talker.blocks.num_used_blocks == 0
    again = await _run(base, text="Keep my voice.", voice=spec, seed=1, sampling=short)
    assert again.audio.size > 0 and talker.num_kept_prefixes == 1


@pytest.mark.parametrize("layout", [None, True], ids=["default", "non_streaming"])
async def test_cloned_voice_rollout_is_rescored(folders, spec, layout):
    """In the default (streaming-text) layout and in the non-streaming one."""
    engine = _engine(folders["base"], batch_invariant=True)
    try:
        req = Request(
            "qwen3-tts",
            text=LONG,
            voice=spec,
            seed=4,
            profile=ExecutionProfile.ROLLOUT,
            sampling=SamplingParams(max_new_tokens=7),
            non_streaming_mode=layout,
        )
        got = await collect(engine, req)
        records = got.trajectories["decode"]
        recorded = np.array([r.logprobs for r in records], dtype=np.float32)
        assert recorded.shape == (6, 16) and np.any(recorded < 0)
        prompt = got.rollout_info["decode"]["prompt"]
        assert prompt.clone is not None and prompt.clone.num_frames == 25
        # non-streaming: the whole text in the prompt, tts_pad every step
        assert (len(set(prompt.replay_text)) == 1) == bool(layout)
        model = engine.resolve("qwen3-tts")
        scored = model.loops["decode"].score(model, req, prompt, [r.tokens for r in records])
        np.testing.assert_allclose(scored.detach().numpy(), recorded, atol=1e-6, rtol=0)
    finally:
        await engine.shutdown()


async def test_base_requests_need_a_cloned_voice(base, spec):
    card = base.resolve("qwen3-tts").card
    assert card.voices == () and card.default_voice is None
    for voice in (None, "alloy", "qwen3-tts-clone:1:@@@"):
        with pytest.raises(InvalidRequestError, match="POST /v1/audio/voices") as err:
            base.add_request(Request("qwen3-tts", text="hi", voice=voice))
        assert err.value.param == "voice"
    card.validate_voice(spec)
    with pytest.raises(InvalidRequestError, match="voice"):
        card.validate_voice("alloy")


async def test_the_engine_serves_other_requests_while_a_voice_is_enrolled(base, spec, clip):
    """The enrollment is held inside the encoder until a speech request has finished: the
    request completes while ``clone_voice`` is still running."""
    encoder = base.resolve("qwen3-tts").components["encoder"]
    release, entered = threading.Event(), threading.Event()
    enroll = encoder.enroll

    def held(*args):
        entered.set()
        assert release.wait(60)
        return enroll(*args)

    encoder.enroll = held
    try:
        task = asyncio.ensure_future(base.clone_voice("qwen3-tts", clip, 24000, TRANSCRIPT))
        while not entered.is_set():
            await asyncio.sleep(0.01)
        got = await _run(
            base, text=SHORT, voice=spec, seed=1, sampling=SamplingParams(max_new_tokens=4)
        )
        assert got.audio.size and not task.done()
        release.set()
        assert await task == spec  # the same clip gives the same voice
    finally:
        release.set()
        del encoder.enroll
    with pytest.raises(InvalidRequestError) as err:
        await base.clone_voice("qwen3-tts", clip[:12000], 24000, TRANSCRIPT)
    assert err.value.code == "audio_too_short"


async def test_enrollment_reaches_an_encoder_running_elsewhere(base, spec, clip):
    """The card's enroller goes through ``call_component``: with the encoder a
    ``RemoteComponent`` stand-in (as under the Ray executor) it makes the same voice."""
    from omnistep.engine.ray_executor import RemoteComponent

    model = base.resolve("qwen3-tts")
    calls = []

    class Elsewhere:
        def call_all(self, model_id, name, method, args):
            calls.append((model_id, name, method))
            return [getattr(model.components[name], method)(*args)]

    stand_in = RemoteComponent(Elsewhere(), model.card.card_id, "encoder")
    remote = ModelInstance.assemble(model.card, {**model.components, "encoder": stand_in})
    assert model.card.voice_enroller(remote, clip, 24000, TRANSCRIPT) == spec
    assert calls == [("qwen3-tts", "encoder", "enroll")]


# ------------------------------------------------------------------ HTTP


@asynccontextmanager
async def client(folders, db):
    engine = AsyncEngine(
        [
            ModelInstance.load(build_card(str(folders["base"]), Qwen3TTSOptions(kv_cache_gb=0.01))),
            ModelInstance.load(build_toy()),
        ]
    )
    app = build_app(engine, ServerConfig(voices_db=str(db)))
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            c.app = app
            yield c
    finally:
        await engine.shutdown()


def _wav(samples: np.ndarray, rate: int) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, samples, rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def _upload(name="alice", data=b"", model="qwen3-tts", transcript=TRANSCRIPT, filename="a.wav"):
    fields = {"name": name, "model": model, "consent": "cons_123"}
    if transcript is not None:
        fields["transcript"] = transcript
    files = (
        {"audio_sample": (filename, data, "application/octet-stream")} if data is not None else None
    )
    return {"data": fields, "files": files}


def _error(r, status, code=None, param=None):
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if code is not None:
        assert error["code"] == code, error
    if param is not None:
        assert error["param"] == param, error
    return error


def _speech(voice, text=SHORT):
    return {
        "model": "qwen3-tts",
        "input": text,
        "voice": voice,
        "seed": 5,
        "temperature": 0,
        "max_new_tokens": 6,
        "response_format": "pcm",
    }


async def test_multipart_enrollment_then_speech_by_name(folders, clip, tmp_path):
    stereo16k = np.stack([clip[::3], 0.5 * clip[1::3]], axis=1)  # 16 kHz, two channels
    data = _wav(stereo16k, 16000)
    async with client(folders, tmp_path / "v.db") as c:
        r = await c.post(VOICES, **_upload(data=data))
        assert r.status_code == 201, r.text
        saved = r.json()
        assert saved["type"] == "audio_sample" and saved["transcript"] == TRANSCRIPT
        assert "voice" not in saved and saved["model"] == "qwen3-tts"
        listed = (await c.get(VOICES + "?model=qwen3-tts")).json()["data"]
        assert [v for v in listed if not v["builtin"]] == [saved]
        # the saved spec is the clip as decoded (16-bit PCM, channels averaged) and cloned
        stored = c.app.state.voices.get("qwen3-tts", "alice").voice
        decoded, rate = sf.read(io.BytesIO(data), dtype="float32")
        encoder = VoiceCloneEncoder.from_pretrained(folders["base"])
        assert stored == encoder(decoded.mean(axis=1), rate, TRANSCRIPT).to_spec()
        # the name speaks as its spec; another format (mp3) enrolls too
        by_name = await c.post(SPEECH, json=_speech("alice"))
        by_spec = await c.post(SPEECH, json=_speech(stored))
        assert by_name.status_code == 200, by_name.text
        assert by_name.content == by_spec.content and len(by_name.content) == 5 * HOP * 2
        mp3 = encode_all("mp3", [clip], 24000)
        r = await c.post(VOICES, **_upload(name="bob", data=mp3, filename="b.mp3"))
        assert r.status_code == 201, r.text
        other = await c.post(SPEECH, json=_speech("bob"))
        assert other.status_code == 200 and other.content != by_name.content
        # a Base request without a voice says how to make one
        error = _error(await c.post(SPEECH, json=_speech(None)), 400, param="voice")
        assert "POST /v1/audio/voices" in error["message"]
        assert "'ref_audio'" in error["message"] and "'ref_text'" in error["message"]  # inline


async def test_bad_uploads_are_4xx(folders, clip, tmp_path):
    ok = _wav(clip, 24000)
    async with client(folders, tmp_path / "v.db") as c:
        cases = [
            (_upload(data=b""), 400, "empty_file", "audio_sample"),
            (_upload(data=b"this is not audio at all"), 400, "invalid_audio", "audio_sample"),
            (_upload(data=_wav(clip[:12000], 24000)), 400, "audio_too_short", "audio_sample"),
            (
                _upload(data=_wav(np.zeros(8000 * 61, np.float32), 8000)),
                400,
                "audio_too_long",
                "audio_sample",
            ),
            (
                _upload(data=_wav(np.zeros(4000 * 121, np.float32), 4000)),
                400,
                "audio_too_long",
                "audio_sample",
            ),
            (_upload(data=ok, transcript=None), 400, "missing_required_parameter", "transcript"),
            (_upload(data=ok, transcript="   "), 400, "missing_required_parameter", "transcript"),
            (_upload(data=ok, transcript="hi\x00there"), 400, "invalid_value", "transcript"),
            (_upload(data=ok, transcript="x" * 4097), 400, "invalid_value", "transcript"),
            (_upload(data=ok, transcript="..."), 400, "invalid_value", "transcript"),
            (_upload(data=None), 400, "missing_required_parameter", "audio_sample"),
            (_upload(data=ok, model="toy"), 400, "voice_cloning_unsupported", "model"),
            (_upload(data=ok, model="nope"), 404, "model_not_found", "model"),
            (_upload(name="a b", data=ok), 400, "invalid_name", "name"),
        ]
        for kwargs, status, code, param in cases:
            _error(await c.post(VOICES, **kwargs), status, code, param)
        assert (await c.post(VOICES, **_upload(data=ok))).status_code == 201
        _error(await c.post(VOICES, **_upload(data=ok)), 409, "voice_exists", "name")
        # the JSON form still works, and a clone spec is not a spec the toy takes
        r = await c.post(VOICES, json={"name": "n", "model": "toy", "voice": "default"})
        assert r.status_code == 201, r.text
        _error(await c.post(VOICES, content=b"not json"), 400)
        names = [v["name"] for v in (await c.get(VOICES)).json()["data"] if not v["builtin"]]
        assert names == ["alice", "n"]
