"""Chatterbox clones a reference clip, against ``chatterbox-tts`` 0.1.7 on a tiny folder its own
classes wrote (T3, S3Gen flow + HiFT, a tiny S3 tokenizer and CAMPPlus in
``s3gen.safetensors``, the voice encoder at its published size).

One reference subprocess per module (``upstream_clone.case``): upstream's features
(torchaudio's Kaldi fbank and resampler, the S3 tokenizer's log mel, S3Gen's mel), its S3
tokenizer and CAMPPlus on those same features, and ``prepare_conditionals`` of a WAV clip
(composed from its parts) followed by greedy ``T3.inference`` and the flow + HiFT with the same
seeds. Checked here: features within 1e-4, tokens identical, x-vector within 1e-4; the cloned
voice's fields against upstream's conditionals; a cloned request's T3 tokens identical and its
waveform within 1e-4; a saved voice and the inline ``ref_audio`` give the bytes of the spec;
bad clips are 400s."""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import pytest
import soundfile as sf
import torch

from omnistep.audio.decode import decode_audio
from omnistep.core import ModelInstance, Request, SamplingParams, derived_seed
from omnistep.engine import AsyncEngine
from omnistep.engine.collect import collect
from omnistep.models.chatterbox import clip_features as cf
from omnistep.models.chatterbox.card import ChatterboxOptions, build_card
from omnistep.models.chatterbox.clone import resample_like_librosa, voice_from_spec
from omnistep.models.chatterbox.frontend import FLOW_SEED_KEY, HIFT_SEED_KEY, punc_norm
from omnistep.models.chatterbox.loader import load_clone_encoders
from tests.chatterbox_ref.env import call_reference

TEXT = "hello there, how are you"
SEED, STEPS, CLIP_RATE = 7, 8, 22050
SPEECH = "/v1/audio/speech"


def _clip(seconds: float = 2.6, rate: int = CLIP_RATE) -> np.ndarray:
    """A voiced, speech-like clip: a gliding 120-180 Hz harmonic tone under a syllable-rate
    envelope, with noise, and 0.2 s of silence at both ends (the voice encoder trims it)."""
    g = np.random.default_rng(3)
    t = np.arange(int(seconds * rate)) / rate
    f0 = 150 + 30 * np.sin(2 * np.pi * 0.7 * t)
    phase = 2 * np.pi * np.cumsum(f0) / rate
    voiced = sum(np.sin(k * phase) / k for k in range(1, 8))
    envelope = 0.5 * (1 + np.sin(2 * np.pi * 4 * t)) ** 2
    wav = 0.15 * voiced * envelope + 0.01 * g.standard_normal(t.size)
    silence = np.zeros(int(0.2 * rate))
    return np.concatenate([silence, wav, silence]).astype(np.float32)


def _wav_bytes(samples: np.ndarray, rate: int) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, samples, rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    root = tmp_path_factory.mktemp("chatterbox-clone")
    wav_path = root / "clip.wav"
    wav_path.write_bytes(_wav_bytes(_clip(), CLIP_RATE))
    decoded = decode_audio(wav_path.read_bytes())
    wav24 = resample_like_librosa(decoded.samples, decoded.sample_rate, 24000)
    wav16 = cf.resample_sinc(torch.from_numpy(wav24), 24000, 16000).numpy()
    ref = call_reference(
        "tests.chatterbox_ref.upstream_clone:case",
        root=str(root),
        wav_path=str(wav_path),
        wav16=wav16,
        wav24=wav24,
        text=punc_norm(TEXT),
        max_new_tokens=STEPS,
        flow_seed=derived_seed(SEED, FLOW_SEED_KEY),
        hift_seed=derived_seed(SEED, HIFT_SEED_KEY),
    )
    return {"root": root, "wav16": wav16, "wav24": wav24, "decoded": decoded, **ref}


def test_features_equal_upstreams(case):
    ref = case["features"]
    x16, x24 = torch.from_numpy(case["wav16"]), torch.from_numpy(case["wav24"])
    ours = {
        "fbank": cf.kaldi_fbank(x16),
        "log_mel": cf.s3_log_mel(x16),
        "mel24": cf.s3gen_mel(x24),
        "resampled": cf.resample_sinc(x24, 24000, 16000),
    }
    for name, got in ours.items():
        want = ref[name]
        assert got.shape == want.shape, name
        assert np.abs(want).max() > 0.1, name
        np.testing.assert_allclose(got.numpy(), want, atol=1e-4, rtol=0, err_msg=name)


def test_tokenizer_and_campplus_equal_upstreams_on_the_same_features(case):
    tokenizer, campplus, _ = load_clone_encoders(case["root"])
    feats, ref = case["features"], case["encoders"]
    tokens = tokenizer(torch.from_numpy(feats["log_mel"])).tolist()
    assert len(tokens) == len(ref["tokens"]) > 10
    assert len(set(tokens)) > 3  # the quantizer is not stuck on one code
    assert tokens == ref["tokens"]
    xvector = campplus(torch.from_numpy(feats["fbank"])).numpy()
    assert xvector.shape == (192,) and np.abs(ref["xvector"]).max() > 0.1
    np.testing.assert_allclose(xvector, ref["xvector"], atol=1e-4, rtol=0)
    other = campplus(torch.from_numpy(feats["fbank"][: len(feats["fbank"]) // 2])).numpy()
    assert np.abs(other - xvector).max() > 1e-3  # another clip, another x-vector


def _engine(root) -> AsyncEngine:
    # the reference setting (one flow window, one HiFT call, upstream's noise layouts)
    card = build_card(str(root), ChatterboxOptions(kv_cache_gb=0.01, flow_chunk_tokens=0))
    return AsyncEngine([ModelInstance.load(card)])


def _request(voice: str, seed: int = SEED) -> Request:
    sampling = SamplingParams(max_new_tokens=STEPS, temperature=0.0, repetition_penalty=1.0)
    return Request("chatterbox", text=TEXT, seed=seed, voice=voice, sampling=sampling)


async def test_cloned_voice_speaks_as_upstream(case):
    """The enrolled voice's conditionals equal upstream ``prepare_conditionals``'s; greedy T3
    tokens identical to upstream ``T3.inference``'s with them; the waveform within 1e-4 of
    upstream's flow + HiFT with the cloned ``ref_dict`` and the same seeds."""
    engine = _engine(case["root"])
    decoded = case["decoded"]
    try:
        spec = await engine.clone_voice(
            "chatterbox", decoded.samples, decoded.sample_rate, "a clip"
        )
        got = await collect(engine, _request(spec))
    finally:
        await engine.shutdown()
    voice, ref = voice_from_spec(spec, 256), case["clone"]["conds"]
    np.testing.assert_allclose(voice.speaker.numpy(), ref["speaker_emb"], atol=1e-4, rtol=0)
    assert list(voice.prompt_tokens) == ref["prompt_tokens"] and len(ref["prompt_tokens"]) > 20
    assert voice.gen_tokens.tolist() == ref["gen"]["prompt_token"]
    np.testing.assert_allclose(voice.gen_mel.numpy(), ref["gen"]["prompt_feat"], atol=1e-4, rtol=0)
    np.testing.assert_allclose(
        voice.gen_embedding.numpy(), ref["gen"]["embedding"], atol=1e-4, rtol=0
    )
    want = case["clone"]["wav"]
    assert got.audio.shape == want.shape and np.abs(want).max() > 1e-3
    np.testing.assert_allclose(got.audio, want, atol=1e-4, rtol=0)


@pytest.fixture
async def client(case, tmp_path):
    from omnistep.server import ServerConfig, build_app

    engine = _engine(case["root"])
    app = build_app(engine, ServerConfig(voices_db=str(tmp_path / "voices.db")))
    try:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            yield http
    finally:
        await engine.shutdown()


def _speech(**fields) -> dict:
    body = {"model": "chatterbox", "input": TEXT, "seed": SEED, "response_format": "pcm"}
    return {**body, "max_new_tokens": 4, **fields}


def _inline(clip: bytes) -> dict:
    return _speech(ref_audio=base64.b64encode(clip).decode(), ref_text="a clip")


async def _save(client, name: str, clip: bytes) -> httpx.Response:
    files = {"audio_sample": ("a.wav", clip, "audio/wav")}
    form = {"name": name, "model": "chatterbox", "consent": "c", "transcript": "a clip"}
    return await client.post("/v1/audio/voices", data=form, files=files)


BAD_CLIPS = [
    (b"not audio at all" * 8, "invalid_audio"),
    (_wav_bytes(_clip()[: CLIP_RATE // 5], CLIP_RATE), "audio_too_short"),
    (_wav_bytes(np.zeros(CLIP_RATE, dtype=np.float32), CLIP_RATE), "invalid_audio"),
]
"""Clips refused by both routes: not audio, 0.2 s, silent."""


async def test_saved_voice_equals_the_inline_clip_and_bad_clips_are_400s(client):
    clip = _wav_bytes(_clip(), CLIP_RATE)
    inline = await client.post(SPEECH, json=_inline(clip))
    assert inline.status_code == 200, inline.text
    saved = await _save(client, "alice", clip)
    assert saved.status_code == 201, saved.text
    by_name = await client.post(SPEECH, json=_speech(voice="alice"))
    assert by_name.status_code == 200 and by_name.content == inline.content
    default = await client.post(SPEECH, json=_speech())
    assert default.status_code == 200 and default.content != inline.content
    for bad, code in BAD_CLIPS:
        r = await client.post(SPEECH, json=_inline(bad))
        assert r.status_code == 400 and r.json()["error"]["code"] == code, r.text
        assert r.json()["error"]["param"] == "ref_audio"
        r = await _save(client, "bob", bad)
        assert r.status_code == 400 and r.json()["error"]["code"] == code, r.text
    empty = await _save(client, "bob", b"")
    assert empty.status_code == 400 and empty.json()["error"]["code"] == "empty_file"
    damaged = await client.post(SPEECH, json=_speech(voice="chatterbox-voice:@@@"))
    assert damaged.status_code == 400 and damaged.json()["error"]["param"] == "voice"
    # /v1/rollouts takes the same voice fields: an inline clip samples what the saved voice
    # samples (same seed), and neither what the default voice does
    roll = {"model": "chatterbox", "inputs": [TEXT], "seed": SEED, "max_new_tokens": 4}

    async def tokens(**fields) -> list:
        r = await client.post("/v1/rollouts", json={**roll, **fields})
        assert r.status_code == 200, r.text
        return r.json()["groups"][0]["samples"][0]["loops"]["decode"]["tokens"]

    cloned = await tokens(ref_audio=base64.b64encode(clip).decode(), ref_text="a clip")
    assert cloned == await tokens(voice="alice") != await tokens()
