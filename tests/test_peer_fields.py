"""The peers' request fields on ``/v1/audio/speech`` and ``/v1/rollouts`` (tiny Qwen3-TTS
folders, ASGI app): requests shaped as SGLang-Omni's ``benchmark_tts_speed.py`` and vllm-omni's
``openai_speech_client.py`` send them (``ref_audio`` as a path, a data URL, base64 or a URL;
``ref_text``; ``task_type``; ``max_new_tokens`` as the frame cap), the refusals (paths and URLs
the server does not allow, bad clips, task types a model does not serve), a repeated inline
clip that reuses the enrolled voice and its kept prompt rows (counted), ``response_format:
"ogg"``, and rollouts that name a saved voice."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import functools
import http.server
import io
import json
import threading
from contextlib import asynccontextmanager

import httpx
import numpy as np
import pytest
import soundfile as sf
from starlette.testclient import TestClient

from omnistep.core import InvalidRequestError, ModelInstance
from omnistep.engine import AsyncEngine
from omnistep.models.qwen3_tts.card import Qwen3TTSOptions, build_card
from omnistep.models.qwen3_tts.clone import VoiceCloneEncoder
from omnistep.models.qwen3_tts.tiny import write_tiny_qwen3_tts
from omnistep.models.toy.card import build_card as build_toy
from omnistep.server import ServerConfig, build_app
from omnistep.server.speech_stream import PATH
from omnistep.server.voice_fields import MediaPolicy, card_task_types, read_ref_audio
from tests.test_qwen3_tts_clone import chirp

SPEECH = "/v1/audio/speech"
ROLLOUTS = "/v1/rollouts"
HOP = 1920
TRANSCRIPT = "Hi there."
TEXT = "Please leave the package by the door."
BASE_NAME = "Qwen/Qwen3-TTS-12Hz-1.7B-Base"  # what vllm-omni's client sends for task Base
CUSTOM_NAME = "Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("peer_fields")
    variants = ("base", "custom_voice", "voice_design")
    return {v: write_tiny_qwen3_tts(root / v, v, seed=3).root for v in variants}


@pytest.fixture(scope="module")
def wav(tmp_path_factory):
    """A 2 s reference clip as a 16-bit WAV file (bytes and path, in the media directory)."""
    media = tmp_path_factory.mktemp("media")
    data = _wav(chirp(24000, 2.0, seed=2), 24000)
    (media / "ref.wav").write_bytes(data)
    return data, media / "ref.wav"


@pytest.fixture(scope="module")
def spec(folders, wav):
    """The voice the clip gives, made without the server (the clip as the WAV holds it)."""
    samples, rate = sf.read(io.BytesIO(wav[0]), dtype="float32")
    return VoiceCloneEncoder.from_pretrained(folders["base"])(samples, rate, TRANSCRIPT).to_spec()


def _wav(samples: np.ndarray, rate: int) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, samples, rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def _card(path, name, card_id="qwen3-tts"):
    card = build_card(str(path), Qwen3TTSOptions(kv_cache_gb=0.01))
    return dataclasses.replace(card, card_id=card_id, aliases=(name,))


@asynccontextmanager
async def client(folders, tmp_path, custom=False, **config):
    """The ASGI app serving the Base folder (as ``BASE_NAME``) and the toy; with ``custom``
    the CustomVoice folder too (card id ``qwen3-tts-custom``, as ``CUSTOM_NAME``)."""
    cards = [_card(folders["base"], BASE_NAME), build_toy()]
    if custom:
        cards.append(_card(folders["custom_voice"], CUSTOM_NAME, "qwen3-tts-custom"))
    engine = AsyncEngine([ModelInstance.load(card) for card in cards])
    app = build_app(engine, ServerConfig(voices_db=str(tmp_path / "v.db"), **config))
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            c.app = app
            yield c
    finally:
        await engine.shutdown()


def _error(r, status, code=None, param=None):
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if code is not None:
        assert error["code"] == code, error
    if param is not None:
        assert error["param"] == param, error
    return error


def _frames(wav_bytes: bytes) -> int:
    """Frames in a 24 kHz 16-bit WAV body, read as SGLang-Omni's client reads its duration."""
    return (len(wav_bytes) - 44) // 2 // HOP


def _sglang_payload(model, ref_audio, **gen_kwargs):
    """``benchmarks/tasks/tts_speed.py::_build_tts_payload`` (SGLang-Omni), non-streaming."""
    payload = {"model": model, "input": TEXT, "response_format": "wav"}
    payload["ref_audio"] = ref_audio
    payload["ref_text"] = TRANSCRIPT
    for key, value in gen_kwargs.items():
        if value is not None:
            payload[key] = value
    return payload


def _vllm_payload(model, ref_audio=None, task_type="Base", **extra):
    """``examples/online_serving/qwen3_tts/openai_speech_client.py`` (vllm-omni)."""
    payload = {"model": model, "input": TEXT, "voice": "Vivian", "response_format": "wav"}
    payload["task_type"] = task_type
    payload["language"] = "English"
    payload["max_new_tokens"] = 3
    if ref_audio is not None:
        payload["ref_audio"] = ref_audio
        payload["ref_text"] = TRANSCRIPT
    return {**payload, **extra}


def _data_url(data: bytes) -> str:
    return "data:audio/wav;base64," + base64.b64encode(data).decode()


def _count_calls(obj, name: str) -> list:
    """Wrap ``obj.name`` so that each call is recorded (the arguments' count)."""
    calls: list = []
    method = getattr(obj, name)

    @functools.wraps(method)
    def counted(*args, **kwargs):
        calls.append(len(args))
        return method(*args, **kwargs)

    setattr(obj, name, counted)
    return calls


# ------------------------------------------------------------------ the peers' clients


async def test_sglang_benchmark_request_clones_from_a_path(folders, wav, spec, tmp_path):
    """SGLang-Omni's benchmark body (``ref_audio`` a file path, ``max_new_tokens``) on a Base
    server that allows the clip's directory: the same audio as naming the voice's spec."""
    data, path = wav
    async with client(folders, tmp_path, allowed_local_media_path=str(path.parent)) as c:
        body = _sglang_payload(BASE_NAME, str(path), max_new_tokens=4, temperature=0.0)
        r = await c.post(SPEECH, json=body)
        assert r.status_code == 200, r.text
        assert r.headers["content-type"] == "audio/wav"
        assert _frames(r.content) == 3  # max_new_tokens 4: 3 frames, as upstream counts
        by_spec = {k: v for k, v in body.items() if k not in ("ref_audio", "ref_text")}
        ref = await c.post(SPEECH, json={**by_spec, "voice": spec})
        assert ref.status_code == 200 and r.content == ref.content
        # a relative path is taken under the allowed directory; the clip is enrolled once
        again = await c.post(SPEECH, json={**body, "ref_audio": path.name})
        assert again.content == r.content
        cache = c.app.state.inline_voices
        assert (cache.num_enrolled, cache.num_reused) == (1, 1)


async def test_vllm_omni_client_request_clones_from_a_data_url(folders, wav, spec, tmp_path):
    data, _ = wav
    async with client(folders, tmp_path) as c:
        r = await c.post(SPEECH, json=_vllm_payload(BASE_NAME, _data_url(data), seed=5))
        assert r.status_code == 200, r.text
        audio, rate = sf.read(io.BytesIO(r.content), dtype="float32")
        # max_new_tokens 3: 2 frames, as upstream counts (docs/models/qwen3_tts.md)
        assert rate == 24000 and audio.shape == (2 * HOP,) and np.abs(audio).max() > 0
        # "voice": "Vivian" is ignored beside ref_audio; the spec gives the same samples
        body = {**_vllm_payload(BASE_NAME, seed=5), "voice": spec}
        assert (await c.post(SPEECH, json=body)).content == r.content
        # bare base64 (no data: prefix) is the same clip
        b64 = base64.b64encode(data).decode()
        assert (await c.post(SPEECH, json=_vllm_payload(BASE_NAME, b64, seed=5))).content == (
            r.content
        )
        # task_type left out with ref_audio given: Base, as vllm-omni infers
        body = _vllm_payload(BASE_NAME, _data_url(data), seed=5)
        del body["task_type"]
        assert (await c.post(SPEECH, json=body)).content == r.content
        assert c.app.state.inline_voices.num_enrolled == 1


async def test_a_url_is_fetched_with_allow_remote_media(folders, wav, tmp_path):
    data, path = wav
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(path.parent))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    try:
        async with client(folders, tmp_path, allow_remote_media=True) as c:
            by_url = await c.post(SPEECH, json=_vllm_payload(BASE_NAME, f"{url}/ref.wav", seed=2))
            assert by_url.status_code == 200, by_url.text
            inline = await c.post(SPEECH, json=_vllm_payload(BASE_NAME, _data_url(data), seed=2))
            assert inline.content == by_url.content
            assert c.app.state.inline_voices.num_enrolled == 1  # the same bytes: one clone
            missing = _vllm_payload(BASE_NAME, f"{url}/nope.wav")
            _error(await c.post(SPEECH, json=missing), 400, "fetch_failed", "ref_audio")
        with pytest.raises(InvalidRequestError) as err:
            await read_ref_audio(
                f"{url}/ref.wav", MediaPolicy(allow_remote_media=True, max_bytes=1000)
            )
        assert err.value.code == "audio_too_large"
    finally:
        httpd.shutdown()
        httpd.server_close()


# ------------------------------------------------------------------ refusals


async def test_refusals_are_400_openai_errors(folders, wav, tmp_path):
    data, path = wav
    short = _data_url(_wav(chirp(24000, 0.5, seed=1), 24000))
    outside = tmp_path / "elsewhere.wav"
    outside.write_bytes(data)
    media = path.parent
    cases = [
        # no flags: no paths, no URLs
        ({"ref_audio": str(path)}, "local_media_disabled", "ref_audio"),
        ({"ref_audio": "https://example.com/ref.wav"}, "remote_media_disabled", "ref_audio"),
        ({"ref_audio": "data:audio/wav,RIFF"}, "invalid_value", "ref_audio"),
        ({"ref_audio": "data:audio/wav;base64,@@@@"}, "invalid_base64", "ref_audio"),
        ({"ref_audio": _data_url(b"not audio at all")}, "invalid_audio", "ref_audio"),
        ({"ref_audio": short}, "audio_too_short", "ref_audio"),
        ({"ref_text": None}, "missing_required_parameter", "ref_text"),
        ({"ref_text": "   "}, "missing_required_parameter", "ref_text"),
        ({"ref_audio": None}, "missing_required_parameter", "ref_audio"),
        ({"task_type": "VoiceDesign"}, "unsupported_task_type", "task_type"),
        ({"task_type": "CustomVoice"}, "unsupported_task_type", "task_type"),
        ({"x_vector_only_mode": True}, "unsupported_value", "x_vector_only_mode"),
        ({"model": "toy", "task_type": None}, "voice_cloning_unsupported", "ref_audio"),
    ]
    async with client(folders, tmp_path) as c:
        for change, code, param in cases:
            body = {k: v for k, v in {**_vllm_payload(BASE_NAME, _data_url(data)), **change}.items()
                    if v is not None}  # fmt: skip
            _error(await c.post(SPEECH, json=body), 400, code, param)
        # the same checks on /v1/rollouts
        roll = {"model": BASE_NAME, "inputs": [TEXT], "ref_audio": str(path), "ref_text": "x"}
        _error(await c.post(ROLLOUTS, json=roll), 400, "local_media_disabled", "ref_audio")
        _error(
            await c.post(SPEECH, json=_vllm_payload(BASE_NAME, "x" * 10)), 400, param="ref_audio"
        )
        assert c.app.state.inline_voices.num_enrolled == 0
    async with client(folders, tmp_path, allowed_local_media_path=str(media)) as c:
        for ref, code in [
            (str(outside), "local_media_forbidden"),
            ("../" + outside.name, "local_media_forbidden"),
            ("/etc/passwd", "local_media_forbidden"),
            (f"file://{outside}", "local_media_forbidden"),
            (str(media / "missing.wav"), "file_not_found"),
        ]:
            _error(await c.post(SPEECH, json=_vllm_payload(BASE_NAME, ref)), 400, code, "ref_audio")
        ok = await c.post(SPEECH, json=_vllm_payload(BASE_NAME, f"file://{path}", seed=1))
        assert ok.status_code == 200, ok.text


async def test_task_type_is_checked_against_the_model(folders, tmp_path):
    """Each Qwen3-TTS variant serves its own task type; VoiceDesign on a CustomVoice model is a
    400; CustomVoice there runs; a toy (named voices) serves CustomVoice only."""
    for variant, task in [("base", "Base"), ("custom_voice", "CustomVoice"),
                          ("voice_design", "VoiceDesign")]:  # fmt: skip
        assert card_task_types(build_card(str(folders[variant]))) == [task]
    async with client(folders, tmp_path, custom=True) as c:
        design = _vllm_payload(CUSTOM_NAME, task_type="VoiceDesign", instructions="A calm voice")
        error = _error(await c.post(SPEECH, json=design), 400, "unsupported_task_type", "task_type")
        assert "CustomVoice" in error["message"]
        r = await c.post(SPEECH, json=_vllm_payload(CUSTOM_NAME, task_type="CustomVoice", seed=1))
        assert r.status_code == 200, r.text
        assert _frames(r.content) == 2  # max_new_tokens 3: 2 frames, as upstream counts
        toy = {"model": "toy", "input": "hello", "response_format": "pcm"}
        assert (await c.post(SPEECH, json={**toy, "task_type": "CustomVoice"})).status_code == 200
        _error(
            await c.post(SPEECH, json={**toy, "task_type": "Base"}), 400, "unsupported_task_type"
        )
        _error(await c.post(SPEECH, json={**toy, "task_type": "Clone"}), 400, param="task_type")


# ------------------------------------------------------------------ reuse of the voice


async def test_a_repeated_inline_clip_reuses_the_voice_and_its_kept_rows(folders, wav, tmp_path):
    """Three requests with one clip and two texts, two of them at once: the encoders run once
    and the voice's prompt rows are computed once (the talker's prefix prefill runs once; the
    other requests fork the kept rows). Another transcript of the same clip is another
    voice."""
    data, _ = wav
    async with client(folders, tmp_path) as c:
        model = c.app.state.engine.resolve(BASE_NAME)
        enrolls = _count_calls(model.components["encoder"], "enroll")
        talker = model.components["talker"]
        prefixes = _count_calls(talker.prefixes, "compute")
        body = {**_vllm_payload(BASE_NAME, _data_url(data), seed=1), "max_new_tokens": 1}
        # two at once (the second waits for the first's enrollment), then one more
        pair = [c.post(SPEECH, json={**body, "input": t}) for t in (TEXT, "Another one here.")]
        replies = [*await asyncio.gather(*pair), await c.post(SPEECH, json=body)]
        assert [r.status_code for r in replies] == [200] * 3
        assert len(enrolls) == 1 and len(prefixes) == 1 and talker.num_kept_prefixes == 1
        assert c.app.state.inline_voices.num_reused == 2
        other = {**body, "ref_text": "Hello you."}
        assert (await c.post(SPEECH, json=other)).status_code == 200
        assert len(enrolls) == 2 and len(prefixes) == 2 and talker.num_kept_prefixes == 2


# ------------------------------------------------------------------ ogg, rollouts


async def test_ogg_is_ogg_opus(folders, tmp_path):
    async with client(folders, tmp_path) as c:
        body = {"model": "toy", "input": "hello there", "seed": 3}
        ogg = await c.post(SPEECH, json={**body, "response_format": "ogg"})
        opus = await c.post(SPEECH, json={**body, "response_format": "opus"})
        assert ogg.status_code == 200, ogg.text
        assert ogg.headers["content-type"] == "audio/ogg" and ogg.content[:4] == b"OggS"
        assert ogg.content == opus.content and len(ogg.content) > 1000


async def test_rollouts_resolve_saved_voices_and_inline_clips(folders, wav, spec, tmp_path):
    """A saved voice's name on /v1/rollouts runs its spec (it was taken as a spec itself:
    400), and an inline clip the same voice."""
    data, _ = wav
    async with client(folders, tmp_path) as c:
        c.app.state.voices.add("qwen3-tts", "alice", spec, "audio_sample", TRANSCRIPT)
        roll = {"model": BASE_NAME, "inputs": [TEXT], "n": 2, "seed": 7, "max_new_tokens": 3}
        named = await c.post(ROLLOUTS, json={**roll, "voice": "alice"})
        assert named.status_code == 200, named.text
        by_spec = await c.post(ROLLOUTS, json={**roll, "voice": spec})
        inline = await c.post(ROLLOUTS, json={**roll, "ref_audio": _data_url(data),
                                              "ref_text": TRANSCRIPT})  # fmt: skip
        samples = named.json()["groups"][0]["samples"]
        # max_new_tokens 3: 2 frames, as upstream counts
        assert len(samples) == 2 and samples[0]["loops"]["decode"]["num_steps"] == 2
        assert samples == by_spec.json()["groups"][0]["samples"]
        assert samples == inline.json()["groups"][0]["samples"]
        assert samples[0]["loops"]["decode"]["tokens"] != samples[1]["loops"]["decode"]["tokens"]


def test_websocket_session_clones_inline(folders, wav, tmp_path):
    """``session.config`` of ``/v1/audio/speech/stream`` takes the same fields: the turn's PCM
    equals ``/v1/audio/speech``'s for the same clip, text and seed."""
    data, _ = wav
    engine = AsyncEngine([ModelInstance.load(_card(folders["base"], BASE_NAME))])
    app = build_app(engine, ServerConfig(voices_db=str(tmp_path / "v.db")))
    fields = {"model": BASE_NAME, "seed": 4, "max_new_tokens": 3, "ref_text": TRANSCRIPT}
    fields["ref_audio"] = _data_url(data)
    with TestClient(app) as c:
        speech = c.post(SPEECH, json={**fields, "input": TEXT, "response_format": "pcm"})
        assert speech.status_code == 200, speech.text
        with c.websocket_connect(PATH) as ws:
            ws.send_json({"type": "session.config", **fields})
            ws.send_json({"type": "input.text", "text": TEXT})
            ws.send_json({"type": "input.done"})
            audio = b""
            while True:
                message = ws.receive()
                if message.get("bytes") is not None:
                    audio += message["bytes"]
                elif json.loads(message["text"])["type"] == "audio.done":
                    break
        # max_new_tokens 3: 2 frames, as upstream counts
        assert audio == speech.content and len(audio) == 2 * HOP * 2
        with c.websocket_connect(PATH) as ws:
            ws.send_json({"type": "session.config", **fields, "task_type": "VoiceDesign"})
            assert ws.receive_json()["error"]["code"] == "unsupported_task_type"
            assert ws.receive()["code"] == 1008
    assert app.state.inline_voices.num_enrolled == 1
