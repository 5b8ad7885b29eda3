"""The ``voxcpm`` card end to end on a tiny folder whose weights upstream's ``VoxCPM2Model``
wrote: the engine's waveform equals upstream ``generate`` (zero-shot and cloned from an inline
reference clip) within 1e-4 with the same LocDiT noise, C1 (same seed, same bytes), C3 (a
request beside two others), streamed == whole bytes over ``/v1/audio/speech``, saved voices,
and 400s for bad input.

Noise: the card draws each step's LocDiT noise from the request's generator
(``make_generator(seed)``; per step the sampler's one uniform for the stop decision, then the
``[C, P]`` normal noise, ``VoxCPMAR._noise``). The test draws the same sequence from the same
seed and hands it to upstream's ``torch.randn`` (``tests/voxcpm_ref/upstream.py``), so the
serving path runs unchanged."""

from __future__ import annotations

import base64
import dataclasses
import io
from contextlib import asynccontextmanager

import httpx
import numpy as np
import pytest
import soundfile as sf
import torch

from omnistep.audio import encode_all
from omnistep.core import ModelInstance, Request
from omnistep.engine import AsyncEngine
from omnistep.models.voxcpm.card import VoxCPMOptions, build_card
from omnistep.models.voxcpm.frontend import SPEC_PREFIX
from omnistep.models.voxcpm.tiny import write_tiny_voxcpm
from omnistep.parity import collect, run_interleaved
from omnistep.sampling import make_generator
from tests.voxcpm_ref.env import call_reference

TEXT = "the cat 你好"
CLONE_TEXT = "a cat"
MAX_LEN = 6
FEAT, PATCH = 16, 4
SEED, CLONE_SEED = 11, 12
CLIP_SAMPLES = 16000 + 1234
SPEECH = "/v1/audio/speech"


def _noises(seed: int, steps: int = MAX_LEN) -> list[np.ndarray]:
    """The LocDiT noises the card draws for a request of ``seed`` (see the module docstring)."""
    gen = make_generator(seed, "cpu")
    out = []
    for _ in range(steps):
        torch.rand(1, generator=gen)  # the stop decision's uniform (greedy rows draw too)
        out.append(torch.randn(FEAT, PATCH, generator=gen).numpy())
    return out


def _clip() -> np.ndarray:
    t = np.arange(CLIP_SAMPLES) / 16000
    rng = np.random.default_rng(3)
    wave = 0.3 * np.sin(2 * np.pi * 220 * t) + 0.2 * np.sin(2 * np.pi * 1330 * t)
    return (wave + 0.05 * rng.standard_normal(CLIP_SAMPLES)).astype(np.float32)


def _wav_bytes(samples: np.ndarray, rate: int) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, samples, rate, format="WAV", subtype="FLOAT")
    return buf.getvalue()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_voxcpm(tmp_path_factory.mktemp("voxcpm_serving"))


@pytest.fixture(scope="module")
def reference(folder) -> dict:
    clip_path = folder / "clip.wav"
    sf.write(clip_path, _clip(), 16000, subtype="FLOAT")
    common = {"max_len": MAX_LEN, "inference_timesteps": 10, "cfg_value": 2.0}
    return call_reference(
        "tests.voxcpm_ref.upstream:write_and_generate",
        root=str(folder),
        clone={
            "text": CLONE_TEXT,
            "noises": _noises(CLONE_SEED),
            "reference_wav": str(clip_path),
            **common,
        },
        text=TEXT,
        noises=_noises(SEED),
        **common,
    )


def _engine(folder, **options) -> AsyncEngine:
    options = {"kv_cache_gb": 0.01, **options}
    card = build_card(str(folder), VoxCPMOptions(max_len=MAX_LEN, **options))
    return AsyncEngine([ModelInstance.load(card)])


def _req(text=TEXT, seed=SEED, **fields) -> Request:
    return Request("voxcpm2", text=text, seed=seed, **fields)


async def test_waveform_equals_upstream_generate(folder, reference):
    """Zero-shot and cloned (the clip enrolled as a voice), each alone, then C1 and C3."""
    engine = _engine(folder)
    try:
        plain = await collect(engine, _req())
        assert plain.sample_rate == 48000
        want = reference["waveform"]
        assert plain.audio.shape == want.shape, (plain.audio.shape, want.shape)
        assert float(np.abs(plain.audio - want).max()) < 1e-4
        spec = await engine.clone_voice("voxcpm2", _clip(), 16000, "ignored")
        assert spec.startswith(SPEC_PREFIX)
        cloned = await collect(engine, _req(CLONE_TEXT, CLONE_SEED, voice=spec))
        want = reference["clone"]["waveform"]
        assert cloned.audio.shape == want.shape
        assert float(np.abs(cloned.audio - want).max()) < 1e-4
        # C1: the same seed gives the same samples; C3: beside two others, within tolerance
        again = await collect(engine, _req())
        assert np.array_equal(again.audio, plain.audio)
        busy = await run_interleaved(
            engine, [_req(), _req("other words", 3), _req(CLONE_TEXT, CLONE_SEED, voice=spec)]
        )
        assert float(np.abs(busy[0].audio - plain.audio).max()) < 1e-4
        assert float(np.abs(busy[2].audio - cloned.audio).max()) < 1e-4
        assert len(busy[1].audio) % (PATCH * 1920) == 0
    finally:
        await engine.shutdown()


async def test_first_audio_after_the_first_patch(folder, reference):
    engine = _engine(folder)
    try:
        got = await collect(engine, _req())
        audio = [c for c in got.chunks if getattr(c, "audio", None) is not None]
        assert len(audio[0].audio) == PATCH * 1920  # one patch: 4 latent frames at 48 kHz
    finally:
        await engine.shutdown()


@asynccontextmanager
async def client(folder, db):
    from omnistep.server import ServerConfig, build_app

    engine = _engine(folder)
    app = build_app(engine, ServerConfig(voices_db=str(db)))
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://test"
        ) as c:
            yield c
    finally:
        await engine.shutdown()


def _served(waveform: np.ndarray) -> np.ndarray:
    """``waveform`` (48 kHz) through the server's WAV encoder (24 kHz, float), decoded."""
    data = encode_all("wav", [waveform.astype(np.float32)], 48000)
    return sf.read(io.BytesIO(data), dtype="float32")[0]


def _speech(**fields):
    body = {"model": "voxcpm2", "input": TEXT, "seed": SEED, "response_format": "pcm"}
    return {**body, **fields}


async def test_speech_endpoint(folder, reference, tmp_path):
    """Whole vs streamed bytes, OpenAI voice names, inline and saved clones, 400s."""
    async with client(folder, tmp_path / "v.db") as c:
        wav = await c.post(SPEECH, json=_speech(response_format="wav"))
        assert wav.status_code == 200, wav.text
        samples, rate = sf.read(io.BytesIO(wav.content), dtype="float32")
        want = _served(reference["waveform"])  # upstream's 48 kHz audio as the server sends it
        assert rate == 24000 and len(samples) == len(want)
        assert float(np.abs(samples - want).max()) < 1e-4
        whole = await c.post(SPEECH, json=_speech())  # pcm: 24 kHz int16
        assert whole.status_code == 200 and len(whole.content) == 2 * len(samples)
        async with c.stream("POST", SPEECH, json=_speech(stream_format="audio")) as r:
            assert r.status_code == 200
            streamed = b"".join([chunk async for chunk in r.aiter_bytes()])
        assert streamed == whole.content
        alloy = await c.post(SPEECH, json=_speech(voice="alloy"))
        assert alloy.content == whole.content  # every OpenAI name is the zero-shot voice
        ref = base64.b64encode(_wav_bytes(_clip(), 16000)).decode()
        body = _speech(
            input=CLONE_TEXT,
            seed=CLONE_SEED,
            ref_audio=ref,
            ref_text="a clip",
            response_format="wav",
        )
        inline = await c.post(SPEECH, json=body)
        assert inline.status_code == 200, inline.text
        samples, _ = sf.read(io.BytesIO(inline.content), dtype="float32")
        want = _served(reference["clone"]["waveform"])
        assert len(samples) == len(want) and float(np.abs(samples - want).max()) < 1e-4
        files = {"audio_sample": ("a.wav", _wav_bytes(_clip(), 16000), "audio/wav")}
        data = {"name": "alice", "model": "voxcpm2", "consent": "c", "transcript": "a clip"}
        saved = await c.post("/v1/audio/voices", data=data, files=files)
        assert saved.status_code == 201, saved.text
        body = _speech(input=CLONE_TEXT, seed=CLONE_SEED, voice="alice", response_format="wav")
        by_name = await c.post(SPEECH, json=body)
        assert by_name.status_code == 200 and by_name.content == inline.content
        for fields, param in (
            ({"voice": "nobody"}, "voice"),
            ({"voice": SPEC_PREFIX + "@@@"}, "voice"),
            ({"input": ""}, "input"),
            ({"response_format": "nope"}, "response_format"),
        ):
            r = await c.post(SPEECH, json=_speech(**fields))
            assert r.status_code == 400, (fields, r.text)
            assert r.json()["error"]["param"] == param, r.json()


async def test_preemption_replays_the_patches(folder, reference, monkeypatch):
    """A KV pool of 7 blocks of 4 rows for three requests of up to 15 rows: one is
    preempted, and its replayed prefill (prompt + kept patches) gives the same audio as
    alone, the first one within 1e-4 of upstream."""
    from omnistep.models.voxcpm.config import VoxCPMConfig
    from omnistep.models.voxcpm.loop import VoxCPMLoop

    config = VoxCPMConfig.from_file(folder / "config.json")
    base, res = config.base_lm(), config.residual_lm()
    layers = base.num_hidden_layers + res.num_hidden_layers
    block = 2 * layers * 4 * base.num_key_value_heads * base.head_dim * 4
    preempted = []
    advance = VoxCPMLoop.advance

    def counting(self, state, result):
        preempted.append(result.output.preempted)
        return advance(self, state, result)

    monkeypatch.setattr(VoxCPMLoop, "advance", counting)
    small = _engine(folder, kv_cache_gb=7.5 * block / 2**30, block_size=4)
    roomy = _engine(folder)
    reqs = [_req(), _req(seed=SEED + 1), _req(seed=SEED + 2)]
    try:
        tight = await run_interleaved(small, reqs)
        assert any(preempted)
        for got, req in zip(tight, reqs, strict=True):
            alone = await collect(roomy, dataclasses.replace(req, request_id=f"{req.seed}/alone"))
            assert len(got.audio) == len(alone.audio)
            assert float(np.abs(got.audio - alone.audio).max()) < 1e-4
        assert float(np.abs(tight[0].audio - reference["waveform"]).max()) < 1e-4
    finally:
        await small.shutdown()
        await roomy.shutdown()


def test_audiovae_weight_updates_take_upstreams_names(folder, reference):
    """The AudioVAE's update targets are the tensors of upstream's own ``audiovae.pth``
    (weight-normed convs as ``weight_g`` / ``weight_v``), same names and shapes; sending a
    conv its own published ``g`` and ``v`` keeps the decoder's weight (as loaded), and twice
    ``g`` doubles it."""
    raw = torch.load(folder / "audiovae.pth", map_location="cpu", weights_only=True)
    model = ModelInstance.load(build_card(str(folder), VoxCPMOptions(kv_cache_gb=0.01)))
    specs = {
        k: v for k, v in model.weight_specs().items() if k.split(".")[0] in ("decoder", "encoder")
    }
    assert {specs[k][0] for k in specs} == {"vae", "encoder"}
    for name, (_, shape, _) in specs.items():
        assert name in raw and tuple(raw[name].shape) == shape, name
    published = {k for k in raw if k.startswith("decoder.") and "sr_bin" not in k}
    assert published == {k for k in specs if k.startswith("decoder.")}
    normed = sorted(k[: -len("_g")] for k in specs if k.endswith(".weight_g"))
    assert len(normed) > 10
    base = normed[0]
    module = dict(model.components["vae"].decoder.named_parameters())[base[len("decoder.") :]]
    loaded = module.detach().clone()
    g, v = raw[f"{base}_g"], raw[f"{base}_v"]
    model.update_weights({f"{base}_g": g, f"{base}_v": v}, 1)
    assert torch.equal(module, loaded)  # the loader folds the same way
    model.update_weights({f"{base}_g": 2 * g}, 2)
    torch.testing.assert_close(module, 2 * loaded, rtol=1e-6, atol=1e-7)
