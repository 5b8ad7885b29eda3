"""The Qwen2.5-Omni card on a tiny official-layout checkpoint: the thinker's text and the
streamed thinker -> talker cascade against transformers on the same weights."""

import asyncio
import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from omnistep.core import (
    ChatMessage,
    ExecutionProfile,
    Modality,
    ModelInstance,
    Request,
    SamplingParams,
)
from omnistep.engine import AsyncEngine, EngineConfig
from omnistep.models.qwen2_5_omni.card import QwenOmniOptions, build_card
from omnistep.models.qwen2_5_omni.dit import DiTChunking
from omnistep.models.qwen2_5_omni.tiny import write_tiny_qwen_omni
from omnistep.parity import collect
from omnistep.runners.flow_matching import frame_noise
from omnistep.sampling import SamplingRow
from tests.qwen_omni_ref import reference
from tests.serving import abort_all

MESSAGES = [{"role": "user", "content": "hello there, how are you today?"}]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return write_tiny_qwen_omni(tmp_path_factory.mktemp("qwen") / "ckpt")


@pytest.fixture(scope="module")
def model(root):
    opts = QwenOmniOptions(
        kv_cache_gb=0.02,
        talker_max_new_tokens=16,
        talker_sampling=SamplingRow(temperature=0.0, min_keep=1),
    )
    return ModelInstance.load(build_card(str(root), opts))


LONG = SamplingParams(temperature=0.0, max_new_tokens=40)
REPLY = SamplingParams(temperature=0.0, max_new_tokens=64)
MEDIUM = SamplingParams(temperature=0.0, max_new_tokens=16)
LONG_OPTIONS = QwenOmniOptions(
    kv_cache_gb=0.02,
    talker_max_new_tokens=64,
    talker_sampling=SamplingRow(temperature=0.0, min_keep=1),
)


@pytest.fixture(scope="module")
def long_model(root):
    """Chunked DiT (the default schedule), talker capped at 64 codes (4+ DiT windows)."""
    return ModelInstance.load(build_card(str(root), LONG_OPTIONS))


@pytest.fixture(scope="module")
def whole(root):
    opts = dataclasses.replace(LONG_OPTIONS, talker_max_new_tokens=16, dit_chunking=None)
    return ModelInstance.load(build_card(str(root), opts))


def _request(audio: bool, seed: int = 0, text: str = MESSAGES[0]["content"]) -> Request:
    outputs = {Modality.TEXT, Modality.AUDIO} if audio else {Modality.TEXT}
    return Request(
        "qwen2.5-omni",
        messages=(ChatMessage("user", text),),
        seed=seed,
        sampling=GREEDY,
        profile=ExecutionProfile.ROLLOUT,
        output_modalities=frozenset(outputs),
        voice="Chelsie",
    )


async def _run(model, reqs):
    eng = AsyncEngine([model])
    streams = [eng.add_request(r) for r in reqs]

    async def drain(stream):
        return "".join([c.text async for c in stream if c.text])

    texts = await asyncio.gather(*(drain(s) for s in streams))
    await eng.shutdown()
    return streams, texts


async def test_thinker_text_matches_transformers(model, root):
    ref = reference.thinker_greedy(root, MESSAGES, steps=12)
    (stream,), (text,) = await _run(model, [_request(audio=False)])
    tokens = [r.tokens[0] for r in stream.trajectories["think"]]
    assert tokens == ref.token_ids.tolist()[: len(tokens)] and len(tokens) >= 2
    tok = model.card.program.nodes[0].fn.tokenizer
    assert text == tok.decode(tokens, skip_special_tokens=True)
    assert "talk" not in stream.trajectories, "text-only chat must not run the talker"
    assert model.components["thinker"].blocks.num_used_blocks == 0


async def test_talker_codes_match_transformers_through_the_stream(model, root):
    ref_thinker = reference.thinker_greedy(root, MESSAGES, steps=12)
    ref = reference.talker_greedy(root, ref_thinker, "Chelsie", steps=16)
    (stream,), _ = await _run(model, [_request(audio=True)])
    codes = [r.tokens[0] for r in stream.trajectories["talk"]]
    expected = ref.codes.tolist()
    assert codes[: len(expected)] == expected[: len(codes)] and len(codes) >= 4
    assert model.components["talker"].blocks.num_used_blocks == 0


async def test_talker_starts_before_the_thinker_finishes(model):
    calls = []
    for name in ("thinker", "talker"):
        component = model.components[name]
        original = component.execute

        def wrapped(kind, payloads, _name=name, _original=original):
            calls.append(_name)
            return _original(kind, payloads)

        component.execute = wrapped
    try:
        await _run(model, [_request(audio=True)])
    finally:
        for name in ("thinker", "talker"):
            del model.components[name].execute
    first_talker = calls.index("talker")
    assert "thinker" in calls[first_talker + 1 :], "the talker must overlap the thinker"


async def test_cascade_interleaved_equals_alone(model):
    reqs = [
        _request(audio=True, seed=s, text=t)
        for s, t in [(1, "hello there"), (2, "what is the weather like in paris today"), (3, "hi")]
    ]
    alone = [(await _run(model, [r]))[0][0] for r in reqs]
    together, _ = await _run(model, reqs)
    for a, b in zip(alone, together, strict=True):
        for loop in ("think", "talk"):
            assert [r.tokens for r in a.trajectories[loop]] == [
                r.tokens for r in b.trajectories[loop]
            ]


def test_missing_weights_are_named(root, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(root, broken)
    (broken / "spk_dict.pt").unlink()
    with pytest.raises(FileNotFoundError, match="spk_dict.pt"):
        build_card(str(broken))


def _talker_codes(model, stream) -> list[int]:
    eos = set(model.loops["talk"].config.eos_token_ids)
    return [r.tokens[0] for r in stream.trajectories["talk"] if r.tokens[0] not in eos]


def _offline_token2wav(model, codes: list[int], voice: str, seed: int, chunking):
    """The same weights run offline: mel ``[frames, mel]`` of ``DiT.sample_chunked`` and of
    ``DiT.sample`` (whole), and BigVGAN's wave of the chunked mel."""
    dit = model.components["dit"].dit
    speaker = model.card.program.nodes[0].fn.speakers[voice]  # the frontend's spk_dict entry
    cond = torch.as_tensor(speaker["cond"]).float()
    ref_mel = torch.as_tensor(speaker["ref_mel"]).float()
    tokens = torch.tensor([codes])
    noise = frame_noise(seed, 2 * len(codes), dit.config.mel_dim)[None]
    chunked = dit.sample_chunked(tokens, cond, ref_mel, noise, chunking)
    whole = dit.sample(tokens, cond, ref_mel, noise)
    with torch.inference_mode():
        wave = model.components["bigvgan"].decoder(chunked)[0].numpy()
    return chunked[0].T, whole[0].T, wave


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


async def test_cascade_audio_matches_transformers_token2wav(whole, root):
    """With the whole-utterance DiT (``dit_chunking=None``): text -> thinker -> talker -> DiT
    ODE steps -> chunked BigVGAN, all streamed, equals transformers' token2wav on the same
    codes, speaker and seed (noise drawn from the seed)."""
    req = _request(audio=True, seed=7)
    (stream,), _ = await _run(whole, [req])
    audio_codes = _talker_codes(whole, stream)
    assert len(audio_codes) >= 4
    eng = AsyncEngine([whole])
    out = await collect(eng, dataclasses.replace(req, request_id="again", profile=req.profile))
    await eng.shutdown()
    wave = reference.token2wav(root, torch.tensor(audio_codes), "Chelsie", seed=7).numpy()
    assert out.audio.size == wave.size == 480 * len(audio_codes)
    assert len(out.chunks) > 1, "BigVGAN output streams in chunks"
    assert np.abs(out.audio - wave).max() <= 1e-4


async def test_streamed_dit_chunks_equal_the_offline_chunked_decode(long_model):
    """The default: the DiT denoises windows as the talker streams codes; the mel of every
    window equals ``DiT.sample_chunked`` (the same windows offline) on the same weights, and
    differs from the whole-utterance decode (the joins are real); the audio equals BigVGAN of
    that mel."""
    dit = long_model.components["dit"]
    results = []
    original = dit.execute

    def spy(kind, payloads):
        outputs = original(kind, payloads)
        results.extend(o.result for o in outputs if o.done)
        return outputs

    dit.execute = spy
    try:
        req = dataclasses.replace(_request(audio=True, seed=5), sampling=LONG)
        eng = AsyncEngine([long_model])
        out = await collect(eng, req)
        await eng.shutdown()
    finally:
        del dit.execute
    codes = _talker_codes(long_model, out)
    block = dit.dit.config.block_size
    chunking = LONG_OPTIONS.dit_chunking.covering(20 + 34, block)  # the vocoder's first chunk
    assert chunking == DiTChunking(7, 18, 2, 1)  # 56 frames of 8, then 144
    windows = chunking.windows(2 * len(codes), block)
    assert len(codes) >= 48 and len(windows) == len(results) >= 2
    streamed = torch.cat(
        [
            r[w.out_start - w.start : w.out_end - w.start]
            for r, w in zip(results, windows, strict=True)
        ]
    )  # [frames, mel]
    offline, whole, wave = _offline_token2wav(long_model, codes, "Chelsie", 5, chunking)
    print(
        f"\nstreamed mel vs offline chunked: {max_diff(streamed, offline):.3g}, vs whole: "
        f"{max_diff(streamed, whole):.3g}"
    )
    assert max_diff(streamed, offline) <= 1e-6
    assert max_diff(streamed, whole) > 1e-5  # this fixture's DiT: ~2e-5 at the joins
    assert "denoise" not in out.trajectories  # the ODE records nothing (no SDE noise)
    assert out.audio.size == wave.size and np.abs(out.audio - wave).max() <= 1e-5


async def test_first_audio_comes_before_the_last_text_delta(long_model):
    """A reply of >= 32 tokens: speech starts while the thinker is still writing. (The first
    audio needs BigVGAN's first chunk and its receptive field, 20 + 34 mel frames: the first
    DiT chunk holds them, 7 of this fixture's 8-frame blocks plus one of look-ahead, 32 codes;
    3 of the official 24-frame blocks plus one, 48 codes.)"""
    req = dataclasses.replace(_request(audio=True, seed=5), sampling=REPLY)
    # One worker in ready order: the units' order depends on the program alone, not on a race
    # between DiT steps and thinker steps on two workers of a loaded machine.
    eng = AsyncEngine([long_model], EngineConfig(num_workers=1, scheduling="fcfs"))
    out = await collect(eng, req)
    await eng.shutdown()
    kinds = [c.modality for c in out.chunks if (c.text or c.audio is not None)]
    first_audio = kinds.index(Modality.AUDIO)
    last_text = len(kinds) - 1 - kinds[::-1].index(Modality.TEXT)
    assert len(out.trajectories["think"]) >= 32
    assert first_audio < last_text, kinds


async def test_same_seed_same_bytes_and_batched_equals_alone_bit_for_bit(root):
    """C1 and C3 on the chunked path under --batch-invariant: a request alone twice and the
    same request among others give the same audio, to the bit."""
    opts = dataclasses.replace(LONG_OPTIONS, batch_invariant=True)
    model = ModelInstance.load(build_card(str(root), opts))
    texts = ["hello there", "what is the weather like in paris today", "hi"]
    reqs = [
        dataclasses.replace(_request(audio=True, seed=s, text=t), sampling=MEDIUM)
        for s, t in zip((1, 2, 3), texts, strict=True)
    ]
    eng = AsyncEngine([model])
    alone = [await collect(eng, r) for r in reqs]
    again = await collect(eng, dataclasses.replace(reqs[1], request_id="again"))
    together = await asyncio.gather(
        *(collect(eng, dataclasses.replace(r, request_id=r.request_id + "-b")) for r in reqs)
    )
    await eng.shutdown()
    assert alone[1].audio.size > 0 and np.array_equal(again.audio, alone[1].audio)
    for a, b in zip(alone, together, strict=True):
        assert a.audio.size == b.audio.size > 0 and np.array_equal(a.audio, b.audio)


async def test_aborted_requests_free_everything(long_model):
    eng = AsyncEngine([long_model])
    streams = [
        eng.add_request(dataclasses.replace(_request(audio=True, seed=i), sampling=LONG))
        for i in range(50)
    ]
    await abort_all(eng, streams, 0.5)
    assert eng.stats() == dict.fromkeys(eng.stats(), 0)
    await eng.shutdown()
    for name in ("thinker", "talker"):
        assert long_model.components[name].blocks.num_used_blocks == 0


def test_chat_completions_with_audio_through_the_server(root):
    import base64
    import io

    import soundfile as sf
    from openai import OpenAI

    from tests.serving import running_server

    with running_server("--model", f"qwen2_5_omni={root}", "--kv-cache-gb", "0.02") as base:
        client = OpenAI(base_url=base + "/v1", api_key="unused")
        kwargs = dict(
            model="qwen2.5-omni",
            messages=MESSAGES,
            modalities=["text", "audio"],
            audio={"voice": "Ethan", "format": "wav"},
            seed=3,
            max_tokens=8,
            temperature=0,
        )
        full = client.chat.completions.create(**kwargs)
        message = full.choices[0].message
        assert message.content and message.audio.transcript == message.content
        wave, rate = sf.read(io.BytesIO(base64.b64decode(message.audio.data)), dtype="float32")
        assert rate == 24000 and wave.size > 0 and wave.size % 480 == 0
        events = list(client.chat.completions.create(stream=True, **kwargs))
        text = "".join(e.choices[0].delta.content or "" for e in events if e.choices)
        pieces = [getattr(e.choices[0].delta, "audio", None) for e in events if e.choices]
        data = b"".join(base64.b64decode(p.data) for p in pieces if p and p.data)
        streamed, _ = sf.read(io.BytesIO(data), dtype="float32")
        assert text == message.content
        assert streamed.size == wave.size and abs(streamed - wave).max() == 0
        text_only = client.chat.completions.create(
            model="qwen2.5-omni", messages=MESSAGES, seed=3, max_tokens=8, temperature=0
        )
        assert text_only.choices[0].message.content == message.content
        assert text_only.choices[0].message.audio is None
        # the family name given to --model is a name of the model too
        by_family = client.chat.completions.create(
            model="qwen2_5_omni", messages=MESSAGES, seed=3, max_tokens=8, temperature=0
        )
        assert by_family.choices[0].message.content == message.content
        assert by_family.model == "qwen2_5_omni"
        listed = [m.id for m in client.models.list()]
        assert listed == ["qwen2.5-omni", "qwen2_5_omni"]
        assert client.models.retrieve("qwen2_5_omni").root == "qwen2.5-omni"
        _rollouts_return_dit_sde_steps(base)


def _rollouts_return_dit_sde_steps(base: str) -> None:
    """``POST /v1/rollouts`` with ``flow_noise_level``: each sample carries its DiT's SDE
    steps (JSON and safetensors agree); out-of-range noise levels are 400s."""
    import httpx
    from safetensors.numpy import load

    body = {"model": "qwen2.5-omni", "inputs": ["hello there"], "n": 2, "seed": 4,
            "max_new_tokens": 6, "flow_noise_level": 0.7, "voice": "Chelsie",
            "audio_format": "wav"}  # fmt: skip
    reply = httpx.post(base + "/v1/rollouts", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    samples = reply.json()["groups"][0]["samples"]
    for sample in samples:
        steps = sample["denoise"]["denoise"]
        assert steps["noise_level"] == 0.7 and steps["num_steps"] % 9 == 0
        assert len(steps["logprobs"]) == len(steps["x"]) == len(steps["t"]) == steps["num_steps"]
        start, _, _, end = steps["window"][0]
        assert np.asarray(steps["x_next"][0]).shape == (end - start, 80)
        assert all(0 <= t < u <= 1 for t, u in zip(steps["t"], steps["t_next"], strict=True))
    assert (
        samples[0]["denoise"]["denoise"]["logprobs"] != samples[1]["denoise"]["denoise"]["logprobs"]
    )
    tensors = httpx.post(
        base + "/v1/rollouts", json=body, headers={"Accept": "application/x-safetensors"},
        timeout=120,
    )  # fmt: skip
    assert tensors.status_code == 200, tensors.text
    arrays = load(tensors.content)
    for k, sample in enumerate(samples):
        steps = sample["denoise"]["denoise"]
        np.testing.assert_array_equal(arrays[f"g0.s{k}.denoise.logprobs"], steps["logprobs"])
        np.testing.assert_array_equal(
            arrays[f"g0.s{k}.denoise.0.mean"], np.float32(steps["mean"][0])
        )
    for bad in (-0.1, 4.5, "loud"):
        reply = httpx.post(
            base + "/v1/rollouts", json={**body, "flow_noise_level": bad}, timeout=60
        )
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "flow_noise_level"


async def test_chat_token_cap_limits_text_not_speech(model):
    """max_tokens caps the thinker (the text the caller counts), not the talker's codes."""
    req = dataclasses.replace(
        _request(audio=True, seed=2), sampling=SamplingParams(temperature=0.0, max_new_tokens=3)
    )
    (stream,), _ = await _run(model, [req])
    assert len(stream.trajectories["think"]) <= 3
    assert len(stream.trajectories["talk"]) > 3
