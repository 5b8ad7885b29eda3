"""The Qwen2.5-Omni card on a tiny official-layout checkpoint: the thinker's text and the
streamed thinker -> talker cascade against transformers on the same weights."""

import asyncio
import dataclasses
from pathlib import Path

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
from omnistep.engine import AsyncEngine
from omnistep.models.qwen2_5_omni.card import QwenOmniOptions, build_card
from omnistep.parity import collect
from omnistep.sampling import SamplingRow
from tests.qwen_omni_ref import reference
from tests.qwen_omni_ref.assets import write_tiny_qwen_omni

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


async def test_cascade_audio_matches_transformers_token2wav(model, root):
    """Text -> thinker -> talker -> DiT ODE steps -> chunked BigVGAN, all streamed, equals
    transformers' token2wav on the same codes, speaker and seed (noise drawn from the seed)."""
    import numpy as np

    req = _request(audio=True, seed=7)
    (stream,), _ = await _run(model, [req])
    codes = [r.tokens[0] for r in stream.trajectories["talk"]]
    eos = set(model.loops["talk"].config.eos_token_ids)
    audio_codes = [c for c in codes if c not in eos]
    assert len(audio_codes) >= 4
    eng = AsyncEngine([model])
    out = await collect(eng, dataclasses.replace(req, request_id="again", profile=req.profile))
    await eng.shutdown()
    wave = reference.token2wav(root, torch.tensor(audio_codes), "Chelsie", seed=7).numpy()
    assert out.audio.size == wave.size == 480 * len(audio_codes)
    assert len(out.chunks) > 1, "BigVGAN output streams in chunks"
    assert np.abs(out.audio - wave).max() <= 1e-4


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


async def test_chat_token_cap_limits_text_not_speech(model):
    """max_tokens caps the thinker (the text the caller counts), not the talker's codes."""
    req = dataclasses.replace(
        _request(audio=True, seed=2), sampling=SamplingParams(temperature=0.0, max_new_tokens=3)
    )
    (stream,), _ = await _run(model, [req])
    assert len(stream.trajectories["think"]) <= 3
    assert len(stream.trajectories["talk"]) > 3
