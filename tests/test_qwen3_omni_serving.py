"""The ``qwen3_omni`` card end to end on the tiny checkpoint: talker codes equal to transformers'
``Qwen3OmniMoeForConditionalGeneration.generate`` (greedy, reply cut at its token cap and reply
ended by EOS) and the waveform within 1e-4; the streamed code2wav chunks equal to the whole
decode within 1e-5; ``/v1/chat/completions`` with text and audio (streamed == whole bytes, C1),
C3 codes bit-identical beside other requests under ``batch_invariant``, 400s for bad input, the
registry and ``omnistep weights``."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import functools
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from starlette.testclient import TestClient

from omnistep.core import (
    ChatMessage,
    ExecutionProfile,
    Modality,
    ModelInstance,
    Request,
    SamplingParams,
)
from omnistep.engine import AsyncEngine
from omnistep.models import registry
from omnistep.models.qwen3_omni.card import Qwen3OmniOptions, build_card
from omnistep.runners import locate
from omnistep.server import ServerConfig, build_app

MESSAGES = (ChatMessage("system", "be brief"), ChatMessage("user", "hello there, say something"))
THINKER_TOKENS = 12
TALKER_TOKENS = 20  # transformers' talker_max_new_tokens: 19 frames


@functools.cache
def _reference(folder: Path, eos: int) -> tuple[list[int], list[tuple[int, ...]], np.ndarray]:
    """transformers' greedy generate: (reply ids, talker frames, waveform)."""
    from transformers import AutoTokenizer, Qwen3OmniMoeForConditionalGeneration

    tok = AutoTokenizer.from_pretrained(folder)
    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(folder).eval()
    chat = [{"role": m.role, "content": m.content} for m in MESSAGES]
    ids = tok(tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))
    ids = torch.tensor([ids["input_ids"]])
    seen = {}
    decode = model.code2wav.chunked_decode

    def spy(codes, **kw):
        seen["codes"] = codes.clone()
        return decode(codes, **kw)

    model.code2wav.chunked_decode = spy
    sequences, wave = model.generate(
        ids,
        speaker="ethan",
        thinker_max_new_tokens=THINKER_TOKENS,
        thinker_do_sample=False,
        thinker_eos_token_id=eos,
        talker_do_sample=False,
        talker_max_new_tokens=TALKER_TOKENS,
    )
    frames = [tuple(f) for f in seen["codes"][0].T.tolist()]
    return sequences[0, ids.shape[1] :].tolist(), frames, wave[0, 0].numpy()


def _request(seed: int = 0, audio: bool = True, text: str | None = None, **kw) -> Request:
    outputs = {Modality.TEXT, Modality.AUDIO} if audio else {Modality.TEXT}
    messages = MESSAGES if text is None else (ChatMessage("user", text),)
    return Request(
        "qwen3-omni",
        messages=messages,
        seed=seed,
        sampling=SamplingParams(temperature=0.0, max_new_tokens=THINKER_TOKENS),
        profile=ExecutionProfile.ROLLOUT,
        output_modalities=frozenset(outputs),
        voice="ethan",
        **kw,
    )


async def _run(model: ModelInstance, requests: list[Request]):
    engine = AsyncEngine([model])
    streams = [engine.add_request(r) for r in requests]

    async def drain(stream):
        audio, text = [], ""
        async for chunk in stream:
            text += chunk.text or ""
            if chunk.audio is not None:
                audio.append(chunk.audio)
        return text, np.concatenate(audio) if audio else np.zeros(0, np.float32)

    outs = await asyncio.gather(*(drain(s) for s in streams))
    await engine.shutdown()
    return streams, outs


def _greedy(folder: Path, **kw) -> ModelInstance:
    opts = Qwen3OmniOptions(
        kv_cache_gb=0.02, talker_max_new_tokens=TALKER_TOKENS, talker_greedy=True, **kw
    )
    return ModelInstance.load(build_card(str(folder), opts))


@pytest.fixture(scope="module")
def eos_folder(qwen3_omni_folder, tmp_path_factory) -> tuple[Path, int]:
    """A copy of the tiny folder whose generation_config ends the thinker at the third token of
    its greedy reply (a token not sampled before it), so the reply ends by EOS."""
    from omnistep.models.qwen3_omni.tiny import tokenizer_files

    im_end = tokenizer_files()[1].im_end
    reply, _, _ = _reference(qwen3_omni_folder, im_end)
    eos = next(t for i, t in enumerate(reply) if i >= 2 and t not in reply[:i])
    folder = tmp_path_factory.mktemp("qwen3_omni_eos") / "ckpt"
    shutil.copytree(qwen3_omni_folder, folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos]}))
    return folder, eos


@pytest.mark.parametrize("ending", ["length", "eos"])
def test_codes_and_wave_match_transformers_generate(qwen3_omni_folder, eos_folder, ending):
    from omnistep.models.qwen3_omni.tiny import tokenizer_files

    folder, eos = (
        eos_folder if ending == "eos" else (qwen3_omni_folder, tokenizer_files()[1].im_end)
    )
    reply, frames, wave = _reference(folder, eos)
    model = _greedy(folder)
    (stream,), ((_, ours),) = asyncio.run(_run(model, [_request()]))
    text_ids = [r.tokens[0] for r in stream.trajectories["think"]]
    codes = [tuple(r.tokens) for r in stream.trajectories["talk"]]
    if ending == "eos":
        assert text_ids == reply and reply[-1] == eos and len(reply) == 3
    else:
        assert text_ids == reply and len(reply) == THINKER_TOKENS
    assert codes[: len(frames)] == frames and len(frames) >= 4
    # transformers drops the EOS frame; ours records it (codebook 0 EOS) as the last action
    assert len(codes) in (len(frames), len(frames) + 1)
    assert ours.shape == wave.shape
    np.testing.assert_allclose(ours, wave, atol=1e-4, rtol=0)
    assert np.abs(wave).max() > 0.05
    # the streamed chunks (1, 8, 16... frames) equal code2wav's whole decode
    decoder = model.components["code2wav"].decoder
    whole = decoder.decode(torch.tensor(frames)[None])[0].numpy()
    np.testing.assert_allclose(ours, whole, atol=1e-5, rtol=0)
    for name in ("thinker", "talker"):
        assert model.components[name].blocks.num_used_blocks == 0


def test_talker_runs_one_token_behind_the_thinker(qwen3_omni_folder):
    """The talker's prefill runs once the reply's first token exists, long before the thinker
    is done: speech frames come while the text is being written."""
    model = _greedy(qwen3_omni_folder, first_audio_alone=False)
    calls: list[str] = []
    for name in ("thinker", "talker"):
        component = model.components[name]
        original = component.execute

        def wrapped(kind, payloads, _name=name, _original=original):
            calls.append(_name)
            return _original(kind, payloads)

        component.execute = wrapped
    asyncio.run(_run(model, [_request()]))
    last_thinker = max(i for i, c in enumerate(calls) if c == "thinker")
    first_talker = calls.index("talker")
    assert first_talker < last_thinker - 5, calls


@pytest.fixture(scope="module")
def invariant_model(qwen3_omni_folder) -> ModelInstance:
    opts = Qwen3OmniOptions(kv_cache_gb=0.02, talker_max_new_tokens=10, batch_invariant=True)
    return ModelInstance.load(build_card(str(qwen3_omni_folder), opts))


def test_codes_identical_beside_other_requests(invariant_model):
    """C3 under batch_invariant: a sampled request's text, codes and samples alone equal those
    beside two other requests (other prompts, seeds and voices), to the bit."""
    model = invariant_model
    sampled = SamplingParams(temperature=0.8, max_new_tokens=6)

    def req(seed, text=None, voice="ethan"):
        return dataclasses.replace(_request(seed, text=text), sampling=sampled, voice=voice)

    (alone,), ((_, wave_alone),) = asyncio.run(_run(model, [req(3)]))
    others = [req(3), req(11, "tell me more", "chelsie"), req(5, "what now?", "aiden")]
    streams, outs = asyncio.run(_run(model, others))
    for loop in ("think", "talk"):
        got = [r.tokens for r in streams[0].trajectories[loop]]
        assert got == [r.tokens for r in alone.trajectories[loop]] and len(got) >= 2
    assert np.array_equal(outs[0][1], wave_alone) and wave_alone.size > 0
    others_codes = [r.tokens for r in streams[1].trajectories["talk"]]
    assert others_codes != [r.tokens for r in alone.trajectories["talk"]]


def test_rollout_logprobs_are_reproduced_by_score(invariant_model):
    """C2: ``score`` on a rollout's recorded prompts (the talker's with its per-step text ids)
    recomputes the thinker's and the talker's 16-codebook log-probs within 1e-6."""
    model = invariant_model
    req = dataclasses.replace(
        _request(2), sampling=SamplingParams(temperature=0.8, max_new_tokens=6)
    )
    engine = AsyncEngine([model])

    async def run():
        stream = engine.add_request(req)
        async for _ in stream:
            pass
        await engine.shutdown()
        return stream

    stream = asyncio.run(run())
    for loop in ("think", "talk"):
        records = stream.trajectories[loop]
        info = stream.rollout_info[loop]
        recorded = np.array([r.logprobs for r in records], dtype=np.float32)
        assert np.any(recorded < 0)
        frames = [r.tokens for r in records]
        scored = model.loops[loop].score(model, req, info["prompt"], frames)
        np.testing.assert_allclose(scored.detach().numpy(), recorded, atol=1e-6, rtol=0)
    assert recorded.shape[1] == 16 and len(info["prompt"].replay_text) == len(records) - 1


# ------------------------------------------------------------------ HTTP
@pytest.fixture(scope="module")
def client(qwen3_omni_folder, tmp_path_factory):
    card = registry.build_card(
        f"qwen3_omni={qwen3_omni_folder}", kv_cache_gb=0.02, talker_max_new_tokens=12
    )
    engine = AsyncEngine([ModelInstance.load(card)])
    db = tmp_path_factory.mktemp("qwen3_omni_voices") / "v.db"
    with TestClient(build_app(engine, ServerConfig(voices_db=str(db)))) as c:
        yield c


URL = "/v1/chat/completions"


def _body(**kw):
    return {
        "model": "qwen3_omni",
        "messages": [{"role": "user", "content": "say something"}],
        "seed": 7,
        "max_tokens": 8,
        "temperature": 0.7,
        **kw,
    }


def _audio_body(**kw):
    audio = {"voice": "chelsie", "format": "pcm16"}
    return _body(**{"modalities": ["text", "audio"], "audio": audio, **kw})


def _streamed(client, body) -> tuple[str, bytes]:
    with client.stream("POST", URL, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    deltas = [e["choices"][0]["delta"] for e in events if e.get("choices")]
    text = "".join(d.get("content") or "" for d in deltas)
    pieces = [(d.get("audio") or {}).get("data") for d in deltas]
    return text, b"".join(base64.b64decode(p) for p in pieces if p)


def test_served_under_the_folder_name_and_family(client, qwen3_omni_folder):
    ids = {m["id"] for m in client.get("/v1/models").json()["data"]}
    assert qwen3_omni_folder.name in ids
    r = client.post(URL, json=_body(model=qwen3_omni_folder.name))
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert message["content"] and "audio" not in message


def test_chat_audio_same_seed_same_bytes_streamed_equals_whole(client):
    first = client.post(URL, json=_audio_body()).json()
    second = client.post(URL, json=_audio_body()).json()
    audio = first["choices"][0]["message"]["audio"]
    data = base64.b64decode(audio["data"])
    assert data == base64.b64decode(second["choices"][0]["message"]["audio"]["data"])
    assert len(data) >= 2 * 1920  # pcm16: at least one frame of 24 kHz audio
    assert audio["transcript"] == first["choices"][0]["message"]["content"]
    text, streamed = _streamed(client, _audio_body())
    assert streamed == data and text == audio["transcript"]
    other = client.post(URL, json=_audio_body(seed=8)).json()["choices"][0]["message"]["audio"]
    assert base64.b64decode(other["data"]) != data


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (_audio_body(audio={"voice": "nobody", "format": "wav"}), "voice"),
        (
            _body(
                messages=[
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "what is this?"},
                            {
                                "type": "image_url",
                                "image_url": {"url": "data:image/png;base64,AAAA"},
                            },
                        ],
                    }
                ]
            ),
            None,
        ),
        (_body(messages=[]), "messages"),
    ],
)
def test_bad_input_is_a_400(client, body, param):
    r = client.post(URL, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    if param is not None:
        assert param in (error.get("param") or "")


def test_openai_voice_names_map_to_speakers(client):
    a = client.post(URL, json=_audio_body(audio={"voice": "nova", "format": "pcm16"})).json()
    b = client.post(URL, json=_audio_body()).json()  # chelsie
    assert (
        a["choices"][0]["message"]["audio"]["data"] == b["choices"][0]["message"]["audio"]["data"]
    )


# ------------------------------------------------------------------ registry
def test_weights_writer_and_folder_detection(tmp_path):
    folder = registry.write_weights("qwen3_omni", tmp_path / "Qwen3-Omni-tiny")
    assert locate.infer_family(folder)[0] == "qwen3_omni"
    card = registry.build_card(f"qwen3_omni={folder}")
    assert card.card_id == "Qwen3-Omni-tiny" and {"qwen3-omni", "qwen3_omni"} <= set(card.aliases)
    assert set(card.voices) == {"chelsie", "ethan", "aiden"} and card.default_voice == "ethan"


# ------------------------------------------------------------------ Thinking
def test_split_reasoning_partitions_at_the_end_marker():
    from omnistep.models.qwen3_omni.thinking import split_reasoning

    assert split_reasoning("a plan") == ("a plan", None)
    assert split_reasoning("<think>a plan</think>\n\nhi") == ("a plan", "\n\nhi")
    assert split_reasoning("a plan</think>") == ("a plan", "")


def test_thinking_loop_streams_reasoning_then_content(qwen3_omni_folder):
    """Text before ``</think>`` goes out as reasoning chunks, the rest as content, whatever
    the steps' boundaries."""
    from omnistep.core import StepResult
    from omnistep.loops.ar_decode import ARDecodeConfig, ARDecodeState, ARStepOutput
    from omnistep.models.qwen3_omni.frontend import load_tokenizer
    from omnistep.models.qwen3_omni.thinking import ThinkingLoop

    tok = load_tokenizer(str(qwen3_omni_folder))
    ids = tok("let me see</think>\n\nthe answer", add_special_tokens=False)["input_ids"]
    assert tok.convert_tokens_to_ids("</think>") in ids
    cfg = ARDecodeConfig("think", "thinker", "p", lambda r: None, detokenize=tok.decode)
    loop, state = ThinkingLoop(cfg), ARDecodeState("r", "think", needs_prefill=False)
    chunks = []
    for token in ids:
        loop.advance(state, StepResult(ARStepOutput((token,), (0.0,)), 1, 0.0))
        chunks += state.outbox
        state.outbox.clear()
    reasoning = "".join(c.text for c in chunks if c.reasoning)
    content = "".join(c.text for c in chunks if not c.reasoning)
    assert (reasoning, content) == ("let me see", "\n\nthe answer")
    assert chunks[0].reasoning and not chunks[-1].reasoning


def test_thinking_checkpoint_answers_text_with_reasoning_content(tmp_path):
    """The Thinking layout (no talker): text only, its reasoning in ``reasoning_content``
    (the tiny model never closes its reasoning: all of its reply is reasoning), streamed ==
    whole; asking for audio is a 400."""
    folder = registry.write_weights("qwen3_omni", tmp_path / "Thinking", variant="thinking")
    card = registry.build_card(f"qwen3_omni={folder}", kv_cache_gb=0.01)
    assert "talker" not in {c.name for c in card.components}
    engine = AsyncEngine([ModelInstance.load(card)])
    with TestClient(build_app(engine, ServerConfig(voices_db=str(tmp_path / "v.db")))) as c:
        body = _body(model="Thinking", max_tokens=6, temperature=0.0)
        message = c.post(URL, json=body).json()["choices"][0]["message"]
        assert message["reasoning_content"] and message["content"] == ""
        with c.stream("POST", URL, json={**body, "stream": True}) as r:
            lines = [line[6:] for line in r.iter_lines() if line.startswith("data: {")]
        deltas = [json.loads(line)["choices"] for line in lines]
        streamed = "".join(ch[0]["delta"].get("reasoning_content") or "" for ch in deltas if ch)
        assert streamed == message["reasoning_content"]
        assert c.post(URL, json=_audio_body(model="Thinking")).status_code == 400
