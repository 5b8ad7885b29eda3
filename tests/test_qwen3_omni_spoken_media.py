"""Qwen3-Omni speaks answers to media prompts, on the tiny checkpoint: the talker's 16-codebook
frames for an audio prompt and an image prompt identical to transformers'
``Qwen3OmniMoeForConditionalGeneration.generate`` (greedy; its talker reads
``hidden_projection`` of the thinker's ``accept_hidden_layer`` states at the media tokens), the
waveform within 1e-4; the talker's positions for a prompt with a system turn equal
transformers' ``get_rope_index`` on the talker's ids; the media states matter; over HTTP a
media chat with ``modalities: ["text", "audio"]`` (streamed == whole bytes, a video with its
track); ``/v1/realtime`` with audio output on the Instruct card."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import functools
import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from starlette.testclient import TestClient

from omnistep.core import (
    ChatMessage,
    ExecutionProfile,
    MediaItem,
    MediaKind,
    Modality,
    ModelInstance,
    Request,
    SamplingParams,
)
from omnistep.engine import AsyncEngine
from omnistep.models.qwen3_omni.card import Qwen3OmniOptions, build_card
from omnistep.models.qwen3_omni.encoders import Qwen3OmniEncoders
from omnistep.models.qwen3_omni.frontend import load_tokenizer
from omnistep.models.qwen3_omni.loader import Qwen3OmniCheckpoint
from omnistep.models.qwen3_omni.talker import (
    TalkerIds,
    TalkerMedia,
    TalkerPrompt,
    build_talker_prompt,
)
from omnistep.runners.media_prompt import EncodedMedia, thinker_prompt
from omnistep.runners.mrope import MediaTokenIds
from omnistep.server import ServerConfig, build_app
from tests.media_files import mp4_b64 as _mp4
from tests.media_files import wav_bytes as _wav
from tests.serving import realtime_response, record_requests, served_in_process

THINKER_TOKENS = 8
TALKER_TOKENS = 12  # transformers' talker_max_new_tokens: 11 frames
SYSTEM = "be brief"
QUESTION = "What is this?"


def _clip(seconds: float, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (0.1 * rng.standard_normal(int(16000 * seconds) + 77)).astype(np.float32)


def _item(kind: str) -> MediaItem:
    if kind == "audio":
        return MediaItem.of(MediaKind.AUDIO, _clip(2.5), sample_rate=16000)
    pixels = np.random.default_rng(1).integers(0, 256, (200, 130, 3), dtype=np.uint8)
    return MediaItem.of(MediaKind.IMAGE, pixels)


@functools.cache
def _encoders(folder: Path) -> Qwen3OmniEncoders:
    return Qwen3OmniEncoders.from_checkpoint(Qwen3OmniCheckpoint.open(folder))


def _prompt(folder: Path, kind: str):
    """(``ThinkerPrompt`` of [system, user: media + question], the item, the media ids)."""
    config = Qwen3OmniCheckpoint.open(folder).config
    tok = load_tokenizer(str(folder))
    ids = MediaTokenIds.from_config(config, audio_end=tok.convert_tokens_to_ids("<|audio_end|>"))
    chat = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": [{"type": kind}, {"type": "text", "text": QUESTION}]},
    ]
    template = [
        int(i) for i in tok.apply_chat_template(chat, add_generation_prompt=True)["input_ids"]
    ]
    item = _item(kind)
    encoded: list[EncodedMedia] = _encoders(folder).encode_items([item])
    return thinker_prompt(template, ids, [item], encoded, 2), item, ids


def _ref_media_inputs(folder: Path, kind: str, item: MediaItem) -> dict:
    """transformers' media inputs for ``item`` (the processor's, as the media tests build
    them)."""
    feats = _encoders(folder).features
    if kind == "image":
        patches, grid = feats.image_patches(item.data)
        return {"pixel_values": torch.from_numpy(patches), "image_grid_thw": torch.tensor([grid])}
    from transformers import WhisperFeatureExtractor

    fe = WhisperFeatureExtractor(feature_size=128, sampling_rate=16000, hop_length=160, n_fft=400)
    out = fe(
        [item.data],
        sampling_rate=16000,
        padding=True,
        truncation=False,
        return_attention_mask=True,
        return_tensors="pt",
    )
    return {
        "input_features": out["input_features"],
        "feature_attention_mask": out["attention_mask"],
    }


@functools.cache
def _hf(folder: Path):
    from transformers import Qwen3OmniMoeForConditionalGeneration

    return Qwen3OmniMoeForConditionalGeneration.from_pretrained(folder).eval()


@functools.cache
def _reference(folder: Path, kind: str) -> tuple[list[int], list[tuple[int, ...]], np.ndarray]:
    """transformers' greedy ``generate`` on the media prompt: (reply ids, talker frames,
    waveform)."""
    from omnistep.models.qwen3_omni.tiny import tokenizer_files

    model = _hf(folder)
    prompt, item, _ = _prompt(folder, kind)
    ids = torch.tensor([prompt.ids])
    seen = {}
    decode = model.code2wav.chunked_decode

    def spy(codes, **kw):
        seen["codes"] = codes.clone()
        return decode(codes, **kw)

    model.code2wav.chunked_decode = spy
    try:
        sequences, wave = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            **_ref_media_inputs(folder, kind, item),
            speaker="ethan",
            thinker_max_new_tokens=THINKER_TOKENS,
            thinker_do_sample=False,
            thinker_eos_token_id=tokenizer_files()[1].im_end,
            talker_do_sample=False,
            talker_max_new_tokens=TALKER_TOKENS,
        )
    finally:
        model.code2wav.chunked_decode = decode
    frames = [tuple(f) for f in seen["codes"][0].T.tolist()]
    return sequences[0, ids.shape[1] :].tolist(), frames, wave[0, 0].numpy()


@pytest.fixture(scope="module")
def model(qwen3_omni_folder) -> ModelInstance:
    opts = Qwen3OmniOptions(
        kv_cache_gb=0.02, talker_max_new_tokens=TALKER_TOKENS, talker_greedy=True
    )
    return ModelInstance.load(build_card(str(qwen3_omni_folder), opts))


def _request(item: MediaItem, seed: int = 0) -> Request:
    return Request(
        "qwen3-omni",
        messages=(
            ChatMessage("system", SYSTEM),
            ChatMessage("user", QUESTION, parts=(item, QUESTION)),
        ),
        seed=seed,
        sampling=SamplingParams(temperature=0.0, max_new_tokens=THINKER_TOKENS),
        profile=ExecutionProfile.ROLLOUT,
        output_modalities=frozenset({Modality.TEXT, Modality.AUDIO}),
        voice="ethan",
    )


async def _run(model: ModelInstance, requests: list[Request]):
    engine = AsyncEngine([model])
    streams = [engine.add_request(r) for r in requests]

    async def drain(stream):
        audio = [c.audio async for c in stream if c.audio is not None]
        return np.concatenate(audio) if audio else np.zeros(0, np.float32)

    try:
        waves = await asyncio.gather(*(drain(s) for s in streams))
    finally:
        await engine.shutdown()
    return streams, waves


@pytest.mark.parametrize("kind", ["audio", "image"])
def test_spoken_media_answer_matches_transformers_generate(qwen3_omni_folder, model, kind):
    reply, frames, wave = _reference(qwen3_omni_folder, kind)
    (stream,), (ours,) = asyncio.run(_run(model, [_request(_item(kind))]))
    text_ids = [r.tokens[0] for r in stream.trajectories["think"]]
    codes = [tuple(r.tokens) for r in stream.trajectories["talk"]]
    assert text_ids == reply and len(reply) == THINKER_TOKENS
    assert codes[: len(frames)] == frames and len(frames) >= 4
    assert len(codes) in (len(frames), len(frames) + 1)  # ours records the EOS frame
    assert ours.shape == wave.shape
    np.testing.assert_allclose(ours, wave, atol=1e-4, rtol=0)
    assert np.abs(wave).max() > 0.05
    prompt: TalkerPrompt = stream.rollout_info["talk"]["prompt"]
    assert prompt.media_rows is not None and len(prompt.media_index) > 0
    for name in ("thinker", "talker"):
        assert model.components[name].blocks.num_used_blocks == 0


def test_talker_positions_are_transformers_rope_index_on_the_talker_ids(qwen3_omni_folder):
    """An image prompt after a system turn: the talker's prompt leaves the system turn out;
    its positions equal ``get_rope_index`` of transformers' talker on its ids."""
    prompt, item, media_ids = _prompt(qwen3_omni_folder, "image")
    config = Qwen3OmniCheckpoint.open(qwen3_omni_folder).config
    ids = TalkerIds.from_config(config)
    placeholders = sum(1 for t in prompt.ids if t in prompt.placeholder_ids)
    media = TalkerMedia(prompt.placeholder_ids, torch.zeros(placeholders, 32), prompt.positions)
    head = (ids.im_start, ids.assistant, prompt.ids[-1], 17)
    talker = build_talker_prompt(prompt.ids, head, ids.speakers["ethan"], ids, media)
    assert len(talker.text_ids) < len(prompt.ids)  # the system turn is left out
    assert len(talker.media_index) == placeholders
    talker_ids = torch.tensor([[*talker.text_ids[:-9], *[ids.tts_pad] * 9]])
    grid = _encoders(qwen3_omni_folder).features.image_patches(item.data)[1]
    ref = _hf(qwen3_omni_folder).talker
    with torch.no_grad():
        want, delta = ref.get_rope_index(
            talker_ids,
            image_grid_thw=torch.tensor([grid]),
            attention_mask=torch.ones_like(talker_ids),
        )
    np.testing.assert_array_equal(talker.positions, want[:, 0].long().numpy())
    assert talker.rope_delta == int(delta[0, 0]) != 0
    assert media_ids.image in talker.text_ids


def test_the_media_states_condition_the_talker(qwen3_omni_folder, model):
    """The talker's first logits move when the thinker's media states are replaced."""
    prompt, _, _ = _prompt(qwen3_omni_folder, "audio")
    config = Qwen3OmniCheckpoint.open(qwen3_omni_folder).config
    ids = TalkerIds.from_config(config)
    n = sum(1 for t in prompt.ids if t in prompt.placeholder_ids)
    rows = torch.randn(n, 32, generator=torch.Generator().manual_seed(0))
    head = (ids.im_start, ids.assistant, prompt.ids[-1], 17)
    talker = model.components["talker"]

    def logits(states: torch.Tensor) -> torch.Tensor:
        media = TalkerMedia(prompt.placeholder_ids, states, prompt.positions)
        built = build_talker_prompt(prompt.ids, head, ids.speakers["ethan"], ids, media)
        return talker.score_logits_batch([built], [[(0,) * 16]])[0][0, 0]

    first, other = logits(rows), logits(rows + 1.0)
    assert (first - other).abs().max() > 1e-3


# ------------------------------------------------------------------ over HTTP


@pytest.fixture(scope="module")
def client(model, tmp_path_factory):
    db = tmp_path_factory.mktemp("q3talk_voices") / "v.db"
    with TestClient(build_app(AsyncEngine([model]), ServerConfig(voices_db=str(db)))) as c:
        yield c


URL = "/v1/chat/completions"


def _streamed(client, body) -> tuple[str, bytes]:
    with client.stream("POST", URL, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    deltas = [e["choices"][0]["delta"] for e in events if e.get("choices")]
    text = "".join(d.get("content") or "" for d in deltas)
    pieces = [(d.get("audio") or {}).get("data") for d in deltas]
    return text, b"".join(base64.b64decode(p) for p in pieces if p)


@pytest.mark.parametrize("part", ["input_audio", "video_with_track"])
def test_media_chat_speaks_and_streamed_equals_whole(client, part):
    if part == "input_audio":
        wav = base64.b64encode(_wav(_clip(1.5))).decode()
        content = [
            {"type": "input_audio", "input_audio": {"data": wav, "format": "wav"}},
            {"type": "text", "text": QUESTION},
        ]
        extra = {}
    else:
        content = [{"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + _mp4()}}]
        extra = {"use_audio_in_video": True}
    body = {
        "model": "qwen3-omni",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 6,
        "temperature": 0,
        "seed": 3,
        "modalities": ["text", "audio"],
        "audio": {"voice": "alloy", "format": "pcm16"},
        **extra,
    }
    whole = client.post(URL, json=body)
    assert whole.status_code == 200, whole.text
    message = whole.json()["choices"][0]["message"]
    data = base64.b64decode(message["audio"]["data"])
    assert len(data) >= 2 * 1920 and message["audio"]["transcript"] == message["content"]
    text, streamed = _streamed(client, body)
    assert streamed == data and text == message["content"]


# ------------------------------------------------------------------ WS /v1/realtime
async def test_realtime_audio_turn_is_spoken_as_the_chat_api_speaks_it(model, tmp_path):
    """``client.realtime.connect`` on the Instruct card with audio output: a committed audio
    turn gets ``response.output_audio.delta``s equal, byte for byte, to the chat API's pcm16
    answer to the same history (greedy thinker and talker), and a transcript equal to its
    text."""
    import soundfile as sf

    engine = AsyncEngine([model])
    sent = record_requests(engine)
    clip = (0.3 * np.sin(np.arange(36000) / 7.0)).astype(np.float32)  # 1.5 s at 24 kHz
    pcm = base64.b64encode((clip * 32767).astype("<i2").tobytes()).decode()
    try:
        async with served_in_process(engine, str(tmp_path / "voices.db")) as client:
            async with client.realtime.connect(model="qwen3-omni") as conn:
                await conn.session.update(
                    session={
                        "type": "realtime",
                        "output_modalities": ["audio"],
                        "max_output_tokens": 6,
                        "audio": {"input": {"turn_detection": None}, "output": {"voice": "Ethan"}},
                    }
                )
                events = await realtime_response(conn, pcm)
            assert events[-1].type == "response.done", events[-1]
            audio = b"".join(
                base64.b64decode(e.delta) for e in events if e.type == "response.output_audio.delta"
            )
            transcript = "".join(
                e.delta for e in events if e.type == "response.output_audio_transcript.delta"
            )
            assert len(audio) >= 2 * 1920 and transcript
            (req,) = sent
            (heard,) = req.media
            wav = io.BytesIO()
            sf.write(wav, heard.data, 16000, format="WAV", subtype="FLOAT")
            part = {
                "type": "input_audio",
                "input_audio": {"data": base64.b64encode(wav.getvalue()).decode(), "format": "wav"},
            }
            chat = await client.chat.completions.create(
                model="qwen3-omni",
                messages=[
                    *[{"role": m.role, "content": m.content} for m in req.messages[:-1]],
                    {"role": "user", "content": [part]},
                ],
                modalities=["text", "audio"],
                audio={"voice": "ethan", "format": "pcm16"},
                temperature=0,
                max_tokens=6,
            )
            assert sent[-1].media[0].sha256 == heard.sha256
            assert chat.choices[0].message.audio.transcript == transcript
            assert base64.b64decode(chat.choices[0].message.audio.data) == audio
    finally:
        await engine.shutdown()


def test_request_without_media_still_speaks_the_text_prompt_layout(model):
    """A text chat's talker prompt has no media rows and no positions (plain rope)."""
    req = dataclasses.replace(
        _request(_item("audio")), messages=(ChatMessage("user", "hello there"),)
    )
    (stream,), (wave,) = asyncio.run(_run(model, [req]))
    prompt: TalkerPrompt = stream.rollout_info["talk"]["prompt"]
    assert prompt.media_rows is None and prompt.positions is None and wave.size > 0


def _salted(messages: tuple[ChatMessage, ...], salt: str) -> Request:
    return dataclasses.replace(_request(_item("audio")), messages=messages, cache_salt=salt)


async def _spoken(engine: AsyncEngine, request: Request):
    stream = engine.add_request(request)
    audio = [c.audio async for c in stream if c.audio is not None]
    return stream, np.concatenate(audio)


async def test_a_sessions_second_turn_speaks_from_cached_thinker_rows(qwen3_omni_folder, model):
    """A realtime session's second turn (salted: its first turn's blocks cached, their
    streamed thinker states kept) gives the talker both turns' audio states, equal to a fresh
    session's on the same history within 1e-4, and speaks the same answer."""
    thinker = model.components["thinker"]
    engine = AsyncEngine([model])
    try:
        first = (ChatMessage("user", "", parts=(_item("audio"),)),)
        turn1, _ = await _spoken(engine, _salted(first, "session-a"))
        second = MediaItem.of(MediaKind.AUDIO, _clip(1.2, seed=5), sample_rate=16000)
        history = (
            *first,
            ChatMessage("assistant", "", token_ids=tuple(turn1.text_ids)),
            ChatMessage("user", "", parts=(second,)),
        )
        cached = thinker.num_cached_rows
        turn2, audio2 = await _spoken(engine, _salted(history, "session-a"))
        assert thinker.num_cached_rows > cached  # the first turn's rows came from the cache
        fresh, audio3 = await _spoken(engine, _salted(history, "session-b"))
        assert turn2.text_ids == fresh.text_ids
        got, want = (s.rollout_info["talk"]["prompt"] for s in (turn2, fresh))
        clips = _encoders(qwen3_omni_folder).encode_items([first[0].parts[0], second])
        assert len(want.media_index) == sum(c.rows.shape[0] for c in clips)  # both turns'
        assert got.media_index == want.media_index
        torch.testing.assert_close(got.media_rows, want.media_rows, atol=1e-4, rtol=0)
        assert audio2.shape == audio3.shape and audio2.size > 0
        np.testing.assert_allclose(audio2, audio3, atol=1e-3)
    finally:
        await engine.shutdown()


def test_a_spoken_media_rollout_is_reproduced_by_score(qwen3_omni_folder):
    """C2 on an audio prompt: ``score`` on the rollout's recorded prompts (the talker's with
    its media rows, positions and per-step text ids) recomputes the sampled thinker's and
    talker's log-probs within 1e-6 (``batch_invariant``)."""
    opts = Qwen3OmniOptions(kv_cache_gb=0.02, talker_max_new_tokens=8, batch_invariant=True)
    model = ModelInstance.load(build_card(str(qwen3_omni_folder), opts))
    req = dataclasses.replace(
        _request(_item("audio"), seed=4),
        sampling=SamplingParams(temperature=0.8, max_new_tokens=5),
    )
    (stream,), _ = asyncio.run(_run(model, [req]))
    for loop in ("think", "talk"):
        records = stream.trajectories[loop]
        recorded = np.array([r.logprobs for r in records], dtype=np.float32)
        assert np.any(recorded < 0)
        prompt = stream.rollout_info[loop]["prompt"]
        frames = [r.tokens for r in records]
        scored = model.loops[loop].score(model, req, prompt, frames)
        np.testing.assert_allclose(scored.detach().numpy(), recorded, atol=1e-6, rtol=0)
    assert prompt.media_rows is not None and recorded.shape[1] == 16


@pytest.mark.parametrize("layer", [0, 1, 2])
def test_the_thinker_streams_transformers_hidden_states_at_the_talker_layer(
    qwen3_omni_folder, layer
):
    """``Qwen3OmniThinker.talker_layer`` ``k`` streams transformers' ``hidden_states[k]``
    (embeddings, a layer's output, the final normed state) for every prompt row, and the
    logits stay the thinker's."""
    from omnistep.core import WorkUnitKind
    from omnistep.kv import KVCacheConfig
    from omnistep.loops.ar_decode import ARPrefillInput
    from omnistep.models.qwen3_omni.thinker import load_thinker
    from omnistep.sampling import SamplingRow

    thinker = load_thinker(Qwen3OmniCheckpoint.open(qwen3_omni_folder), KVCacheConfig(64, 4))
    assert thinker.talker_layer == 1  # the tiny config's accept_hidden_layer
    thinker.talker_layer = layer
    tok = load_tokenizer(str(qwen3_omni_folder))
    ids = tok.apply_chat_template([{"role": "user", "content": "hello there"}])["input_ids"]
    unit = ARPrefillInput("s", tuple(ids), (), (), SamplingRow(temperature=0.0), None)
    (out,) = thinker.execute(WorkUnitKind.PREFILL, [unit])
    with torch.no_grad():
        ref = _hf(qwen3_omni_folder).thinker(
            input_ids=torch.tensor([ids]), output_hidden_states=True
        )
    torch.testing.assert_close(out.hidden, ref.hidden_states[layer][0], atol=1e-4, rtol=0)
    assert out.tokens[0] == int(ref.logits[0, -1].argmax())
