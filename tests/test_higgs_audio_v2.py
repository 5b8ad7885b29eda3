"""The ``higgs_audio_v2`` card on tiny folders in the transformers layout: the loader, the delay
pattern, logits / greedy codes / audio against transformers 5.x (``tests/higgs_ref``, in a
subprocess), seeds, batched == alone, chunked vocoder == whole decode, rollouts scored, the
weights command and the HTTP speech API."""

from __future__ import annotations

import asyncio
import json
import shutil

import numpy as np
import pytest
import torch

from omnistep.core import (
    ExecutionProfile,
    InvalidRequestError,
    ModelInstance,
    Request,
    SamplingParams,
)
from omnistep.engine import AsyncEngine
from omnistep.engine.collect import collect
from omnistep.kv import KVCacheConfig
from omnistep.models import registry
from omnistep.models.higgs_audio_v2 import tiny
from omnistep.models.higgs_audio_v2.card import HiggsOptions, build_card
from omnistep.models.higgs_audio_v2.codec import codec_from_checkpoint
from omnistep.models.higgs_audio_v2.lm import HiggsAudioV2LM
from omnistep.models.higgs_audio_v2.loader import HiggsCheckpoint, HiggsCheckpointError
from omnistep.models.higgs_audio_v2.prompt import PromptBuilder, ReferenceClip
from omnistep.sampling.delay import DelayPattern
from tests.higgs_ref.reference import call

TEXT = "hello world how is it today"
PATTERN = DelayPattern(8, 1024, 1025)
CLIP = torch.randint(0, 1024, (6, 8), generator=torch.Generator().manual_seed(7))
VOICE = json.dumps({"ref_text": "thank you", "codes": CLIP.tolist()})


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tiny.write_folder(tmp_path_factory.mktemp("higgs") / "ckpt")


@pytest.fixture(scope="module")
def eos_root(root, tmp_path_factory):
    """The tiny folder with codebook 2's EOS logit boosted, so greedy decoding stops by the
    delay pattern's EOS cascade within a few steps."""
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("higgs_eos") / "ckpt"
    shutil.copytree(root, out)
    tensors = load_file(str(out / "model.safetensors"))
    tensors["audio_lm_head.weight"][2 * 1026 + 1025] *= 3.0
    save_file(tensors, str(out / "model.safetensors"))
    return out


def _prompt(root, references=()):
    checkpoint = HiggsCheckpoint.open(root)
    return PromptBuilder(checkpoint.tokenizer(), PATTERN).build(TEXT, references)


def _engine(path, **options) -> AsyncEngine:
    card = build_card(str(path), HiggsOptions(kv_cache_gb=0.01, **options))
    return AsyncEngine([ModelInstance.load(card)])


async def _run(engine, **fields):
    req = Request("higgs-audio-v2", text=TEXT, profile=ExecutionProfile.ROLLOUT, **fields)
    return await collect(engine, req)


def _frames(got) -> np.ndarray:
    return np.array([r.tokens for r in got.trajectories["decode"]])


# ----------------------------------------------------------------------------- loader
def test_loader_names_a_missing_file_and_a_wrong_config(root, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(root, bad)
    (bad / "audio_tokenizer" / "model.safetensors").unlink()
    with pytest.raises(HiggsCheckpointError, match="audio_tokenizer.*model.safetensors"):
        HiggsCheckpoint.open(bad)
    (bad / "tokenizer.json").unlink()
    with pytest.raises(HiggsCheckpointError, match="missing tokenizer.json"):
        HiggsCheckpoint.open(bad)
    shutil.rmtree(bad)
    shutil.copytree(root, bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "model_type": "higgs_audio"}))
    with pytest.raises(HiggsCheckpointError, match="not 'higgs_audio_v2'"):
        HiggsCheckpoint.open(bad)


# ----------------------------------------------------------------------------- delay pattern
def test_delay_pattern_forces_bos_then_the_eos_cascade():
    p = DelayPattern(3, 10, 11)
    empty = torch.zeros(3, 0, dtype=torch.long)
    assert p.forced(0, empty) == [10, 10, 10]
    steps = [(10, 10, 10), (4, 10, 10), (5, 6, 10), (11, 7, 8)]  # codebook 0 EOS at step 3
    hist = torch.tensor(steps).T
    assert p.forced(1, hist[:, :1]) == [None, 10, 10]
    assert p.forced(3, hist[:, :3]) == [None, None, None]
    assert p.forced(4, hist) == [11, None, None]
    steps += [(11, 1, 2), (11, 11, 3)]
    assert p.forced(6, torch.tensor(steps).T[:, -3:]) == [11, 11, 11]
    with pytest.raises(ValueError, match="history"):
        p.forced(5, hist[:, -1:])
    # undelay: frame f codebook k is step f + k + 1's; the last frame's EOS clipped to 9
    assert p.undelay(steps).tolist() == [[4, 6, 8], [5, 7, 2], [11 - 2, 1, 3]]
    assert p.in_frame_order(steps) == [[4, 6, 8], [5, 7, 2], [11, 1, 3]]
    codes = torch.tensor([[1, 2, 3], [4, 5, 6]])
    delayed = p.delay(codes)
    assert delayed.tolist() == [
        [10, 10, 10],
        [1, 10, 10],
        [4, 2, 10],
        [11, 5, 3],
        [11, 11, 6],
        [11, 11, 11],
    ]
    assert p.forced_mask(steps) == [
        (False, False, False),
        (True, False, False),
        (True, True, False),
        (True, True, True),
        (False, True, True),
        (False, False, True),
    ]


# ----------------------------------------------------------------------------- reference parity
def test_logits_equal_transformers_with_a_reference_clip(root):
    prompt = _prompt(root, [ReferenceClip("thank you", CLIP)])
    ref = call(
        "logits", root=str(root), ids=list(prompt.ids), audio=[list(a) for a in prompt.audio]
    )
    lm = HiggsAudioV2LM.from_checkpoint(HiggsCheckpoint.open(root), KVCacheConfig(64, 16))
    from omnistep.loops.ar_decode import ARPrefillInput

    rows = lm._prefill_inputs(ARPrefillInput("s", prompt, (), (), None, None))
    with torch.no_grad():
        ours = lm._head(lm.llama.forward_dense(rows), "s").float().numpy()
    assert ours.shape == ref.shape == (len(prompt.ids), 8, 1026)
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)
    assert np.abs(ref).max() > 1.0


@pytest.mark.parametrize("voice", [None, VOICE], ids=["own_voice", "cloned"])
async def test_greedy_codes_and_audio_equal_transformers(eos_root, voice):
    """Greedy frames (BOS steps, the EOS cascade) equal ``generate``'s; the chunked audio
    equals ``HiggsAudioV2Processor.batch_decode`` of them within 1e-4."""
    refs = [ReferenceClip("thank you", CLIP)] if voice else []
    prompt = _prompt(eos_root, refs)
    ref = call(
        "generate",
        root=str(eos_root),
        ids=list(prompt.ids),
        audio=[list(a) for a in prompt.audio],
        max_new_tokens=60,
    )
    engine = _engine(eos_root)
    try:
        got = await _run(
            engine, voice=voice, seed=1, sampling=SamplingParams(temperature=0, max_new_tokens=60)
        )
    finally:
        await engine.shutdown()
    frames = _frames(got)
    assert 8 < len(ref["frames"]) < 60 and PATTERN.is_end(ref["frames"][-1])
    np.testing.assert_array_equal(frames, ref["frames"])
    assert got.rollout_info["decode"]["stop_reason"] == "eos"
    assert got.audio.shape == ref["wav"].shape == ((len(frames) - 1 - 8) * 960,)
    np.testing.assert_allclose(got.audio, ref["wav"], atol=1e-4, rtol=0)
    assert np.abs(ref["wav"]).max() > 1e-3


async def test_length_stop_equals_transformers(root):
    prompt = _prompt(root)
    ref = call("generate", root=str(root), ids=list(prompt.ids), audio=[], max_new_tokens=20)
    engine = _engine(root)
    try:
        got = await _run(engine, seed=1, sampling=SamplingParams(temperature=0, max_new_tokens=20))
    finally:
        await engine.shutdown()
    np.testing.assert_array_equal(_frames(got), ref["frames"])
    assert got.audio.shape == ref["wav"].shape == (12 * 960,)
    np.testing.assert_allclose(got.audio, ref["wav"], atol=1e-4, rtol=0)


def test_codec_decoder_and_chunks_equal_the_whole_decode(root):
    codes = torch.randint(0, 1024, (30, 8), generator=torch.Generator().manual_seed(3))
    ref = call("decode", root=str(root), codes=codes.numpy())
    decoder = codec_from_checkpoint(HiggsCheckpoint.open(root))
    with torch.no_grad():
        whole = decoder(codes[None])[0]
        ctx = decoder.context_frames()
        parts = [
            decoder.decode_chunk(codes[None, max(0, s - ctx) : s + 5 + ctx], s - max(0, s - ctx), 5)
            for s in range(0, 30, 5)
        ]
    np.testing.assert_allclose(whole.numpy(), ref, atol=1e-4, rtol=0)
    assert float((torch.cat(parts, 1)[0] - whole).abs().max()) <= 1e-5


def test_encoder_codes_equal_transformers(root):
    """Reference-clip encoding (HuBERT mean features, semantic and DAC encoders, RVQ) equals
    ``HiggsAudioV2TokenizerModel.encode``; the 24 -> 16 kHz resampler (torchaudio's formula,
    ours on both sides) is checked on a sine instead."""
    from omnistep.models.higgs_audio_v2.encoder import encoder_from_checkpoint, resample_sinc

    t = np.arange(48000) / 24000
    wave = (0.3 * np.sin(2 * np.pi * 220 * t) + 0.05 * np.sin(2 * np.pi * 3000 * t)).astype(
        np.float32
    )
    ref = call("encode", root=str(root), wave=wave)
    component = encoder_from_checkpoint(HiggsCheckpoint.open(root))
    codes = component.encoder(torch.from_numpy(wave)[None])[0].numpy()
    assert codes.shape == ref.shape == (50, 8)
    np.testing.assert_array_equal(codes, ref)
    spec = json.loads(component.enroll(wave, 24000, "thank you"))
    assert spec["ref_text"] == "thank you" and np.array_equal(spec["codes"], codes)
    sine = torch.from_numpy(np.sin(2 * np.pi * 440 * t).astype(np.float32))[None]
    out = resample_sinc(sine, 24000, 16000)[0].numpy()
    assert out.shape == (32000,)
    expected = np.sin(2 * np.pi * 440 * np.arange(32000) / 16000)
    assert np.abs(out[100:-100] - expected[100:-100]).max() < 1e-3


# ----------------------------------------------------------------------------- serving gates
async def test_seed_and_batch_parity(root):
    engine = _engine(root)
    try:
        fields = {"sampling": SamplingParams(max_new_tokens=24)}
        alone = [await _run(engine, seed=s, **fields) for s in (5, 6)]
        again = await _run(engine, seed=5, **fields)
        together = await asyncio.gather(
            *(_run(engine, seed=s, **fields) for s in (5, 6)),
            _run(engine, seed=9, voice=VOICE, sampling=SamplingParams(max_new_tokens=30)),
        )
    finally:
        await engine.shutdown()
    assert np.array_equal(again.audio, alone[0].audio)
    assert not np.array_equal(_frames(alone[0]), _frames(alone[1]))
    for a, b in zip(alone, together, strict=False):
        np.testing.assert_array_equal(_frames(a), _frames(b))
        np.testing.assert_allclose(a.audio, b.audio, atol=1e-5, rtol=0)
    assert max(engine.batch_sizes) > 1


async def test_batch_invariant_mode_gives_the_same_bytes_beside_others(root):
    """``batch_invariant``: a request's audio is bit-identical alone and beside a cloned-voice
    request (whose prefill mixes text and audio rows) and another seed."""
    engine = _engine(root, batch_invariant=True)
    try:
        fields = {"seed": 5, "sampling": SamplingParams(max_new_tokens=18)}
        alone = await _run(engine, **fields)
        together = await asyncio.gather(
            _run(engine, **fields),
            _run(engine, seed=8, voice=VOICE, sampling=SamplingParams(max_new_tokens=22)),
            _run(engine, seed=6, sampling=SamplingParams(max_new_tokens=18)),
        )
    finally:
        await engine.shutdown()
    np.testing.assert_array_equal(_frames(alone), _frames(together[0]))
    assert np.array_equal(alone.audio, together[0].audio)
    assert not np.array_equal(_frames(together[0]), _frames(together[2]))


async def test_rollout_logprobs_are_reproduced_by_score(root):
    engine = _engine(root, batch_invariant=True)
    try:
        req = Request(
            "higgs-audio-v2",
            text=TEXT,
            seed=4,
            profile=ExecutionProfile.ROLLOUT,
            sampling=SamplingParams(max_new_tokens=14),
        )
        got = await collect(engine, req)
        records = got.trajectories["decode"]
        info = got.rollout_info["decode"]
        recorded = np.array([r.logprobs for r in records], dtype=np.float32)
        mask = np.array(info["mask"])
        assert recorded.shape == mask.shape == (14, 8)
        assert not mask[0].any() and mask[1].tolist() == [True] + [False] * 7  # BOS steps
        assert np.all(recorded[~mask] == 0) and np.all(recorded[mask] < 0)
        model = engine.resolve("higgs-audio-v2")
        frames = [r.tokens for r in records]
        scored = model.loops["decode"].score(model, req, info["prompt"], frames)
        np.testing.assert_allclose(scored.detach().numpy(), recorded, atol=1e-6, rtol=0)
        by_frame = info["delay"].in_frame_order(recorded.tolist())
        assert len(by_frame) == 6 and by_frame[0][7] == recorded[8][7]
    finally:
        await engine.shutdown()


async def test_voices(root):
    engine = _engine(root)
    try:
        card = engine.resolve("higgs-audio-v2").card
        assert "alloy" in card.voices and card.default_voice == "default"
        card.voice_validator("alloy")
        card.voice_validator(VOICE)
        for bad in ("nobody", json.dumps({"ref_text": "x", "codes": [[1, 2]]})):
            with pytest.raises(InvalidRequestError) as err:
                card.voice_validator(bad)
            assert err.value.param == "voice"
    finally:
        await engine.shutdown()


def test_sampling_defaults_and_a_refused_repetition_penalty(root):
    from omnistep.models.higgs_audio_v2.card import _generation_defaults, make_sampling

    build = make_sampling(PATTERN, _generation_defaults(HiggsCheckpoint.open(root)))
    row = build(Request("higgs-audio-v2", text="x"))
    assert (row.temperature, row.top_k, row.top_p, row.delay) == (1.0, 50, 0.95, PATTERN)
    greedy = build(Request("higgs-audio-v2", text="x", sampling=SamplingParams(temperature=0)))
    assert greedy.is_greedy()
    with pytest.raises(InvalidRequestError) as err:
        build(Request("higgs-audio-v2", text="x", sampling=SamplingParams(repetition_penalty=1.1)))
    assert err.value.param == "repetition_penalty"


def test_weights_command_writes_a_folder_the_registry_serves(tmp_path):
    folder = registry.write_weights("higgs_audio_v2", tmp_path / "w")
    assert registry.resolve_model_spec(str(folder)) == f"higgs_audio_v2={folder}"
    card = registry.build_card(f"higgs_audio_v2={folder}")
    assert card.family == "higgs_audio_v2" and card.sample_rate == 24000


def _wav_bytes(pcm: np.ndarray, rate: int) -> bytes:
    import io
    import wave

    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())
    return buf.getvalue()


def test_served_over_http(root):
    """``omnistep serve --model higgs_audio_v2=DIR``: /v1/audio/speech (OpenAI and cloned
    voices), SSE streaming equal to the whole response, and 400s for a bad voice and for
    reference audio (not encodable yet)."""
    import base64

    import httpx

    from tests.serving import running_server

    with running_server("--model", f"higgs_audio_v2={root}", timeout=300) as url:
        body = {
            "model": "higgs-audio-v2",
            "input": TEXT,
            "voice": "alloy",
            "seed": 3,
            "max_new_tokens": 20,
            "response_format": "pcm",
        }
        pcm = httpx.post(url + "/v1/audio/speech", json=body, timeout=120)
        assert pcm.status_code == 200, pcm.text
        assert len(pcm.content) == 12 * 960 * 2  # 20 steps: 12 audio frames
        sse = httpx.post(
            url + "/v1/audio/speech", json={**body, "stream_format": "sse"}, timeout=120
        )
        deltas = [
            json.loads(line[6:])
            for line in sse.text.splitlines()
            if line.startswith("data: ") and "speech.audio.delta" in line
        ]
        assert b"".join(base64.b64decode(d["audio"]) for d in deltas) == pcm.content
        cloned = httpx.post(url + "/v1/audio/speech", json={**body, "voice": VOICE}, timeout=120)
        assert cloned.status_code == 200, cloned.text
        assert len(cloned.content) == len(pcm.content) and cloned.content != pcm.content
        bad = httpx.post(url + "/v1/audio/speech", json={**body, "voice": "nobody"}, timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "voice"
        t = np.arange(24000) / 24000
        wave = (0.3 * np.sin(2 * np.pi * 220 * t) * 32767).astype("<i2")
        clip = base64.b64encode(_wav_bytes(wave, 24000)).decode()
        ref = {**body, "voice": None, "ref_audio": f"data:audio/wav;base64,{clip}"}
        inline = httpx.post(
            url + "/v1/audio/speech", json={**ref, "ref_text": "thank you"}, timeout=120
        )
        assert inline.status_code == 200, inline.text
        assert len(inline.content) == len(pcm.content) and inline.content != pcm.content
        refused = httpx.post(url + "/v1/audio/speech", json=ref, timeout=60)  # no transcript
        assert refused.status_code == 400, refused.text


def test_offline_rollout_group_shares_its_prompt_and_scores(root):
    """``OmniEngine.rollout``: n samples of one text (the group shares the prompt's KV blocks)
    with their masks, each equal to its seed run alone; ``score`` reproduces the log-probs."""
    from omnistep.offline import OmniEngine

    sampling = SamplingParams(max_new_tokens=12)
    with OmniEngine(f"higgs_audio_v2={root}", kv_cache_gb=0.01) as eng:
        [group] = eng.rollout([TEXT], n=3, seed=20, sampling=sampling, progress=False)
        alone = eng.rollout([TEXT], n=1, seed=21, sampling=sampling, progress=False)[0]
        scored = eng.score(group)
    actions = [s.loops["decode"] for s in group.samples]
    assert all(a.tokens.shape == (12, 8) and a.mask.shape == (12, 8) for a in actions)
    assert not actions[0].mask[0].any() and actions[0].mask[9].all()
    np.testing.assert_array_equal(actions[1].tokens, alone.samples[0].loops["decode"].tokens)
    assert len({a.tokens.tobytes() for a in actions}) == 3
    for a, s in zip(actions, scored, strict=True):
        np.testing.assert_allclose(np.asarray(s["decode"]), a.logprobs, atol=1e-5, rtol=0)
