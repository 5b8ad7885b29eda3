"""Qwen2.5-Omni hears and sees: chat requests holding audio, an image or a video run through
the card (ENCODE units -> thinker prefill with TMRoPE -> talker -> token2wav) and match
transformers' ``Qwen2_5OmniForConditionalGeneration`` on a tiny random checkpoint in the
published layout (both encoders included)."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from omnistep.core import (
    Capability,
    ChatMessage,
    ExecutionProfile,
    InvalidRequestError,
    MediaItem,
    MediaKind,
    Modality,
    ModelInstance,
    Request,
    RequestAbortedError,
    SamplingParams,
    WorkUnitKind,
)
from omnistep.engine import AsyncEngine
from omnistep.models.qwen2_5_omni import card as omni_card
from omnistep.models.qwen2_5_omni.card import QwenOmniOptions, build_card
from omnistep.models.qwen2_5_omni.thinker import ThinkerPrompt
from omnistep.models.qwen2_5_omni.tiny import write_tiny_qwen_omni
from omnistep.parity import collect
from omnistep.sampling import SamplingRow
from tests.qwen_omni_ref import reference
from tests.serving import realtime_response, record_requests, served_in_process

TOL = 1e-4
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=10)
OPTIONS = QwenOmniOptions(
    kv_cache_gb=0.02,
    talker_max_new_tokens=16,
    talker_sampling=SamplingRow(temperature=0.0, min_keep=1),
    dit_chunking=None,  # whole-utterance DiT: transformers' token2wav
)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return write_tiny_qwen_omni(tmp_path_factory.mktemp("omni_hear") / "ckpt")


@pytest.fixture(scope="module")
def model(root):
    return ModelInstance.load(build_card(str(root), OPTIONS))


def _clip(seconds: float = 3.0, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (0.1 * rng.standard_normal(int(16000 * seconds) + 77)).astype(np.float32)


def _image(seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (200, 130, 3), dtype=np.uint8)


def _frames() -> np.ndarray:
    """5 frames at 2 fps, 60 x 90 (3 temporal patches: the last frame repeats)."""
    return np.random.default_rng(2).integers(0, 256, (5, 60, 90, 3), dtype=np.uint8)


def _item(kind: str, seed: int = 0) -> MediaItem:
    source = "messages[0].content[0]"
    if kind == "audio":
        return MediaItem.of(MediaKind.AUDIO, _clip(seed=seed), sample_rate=16000, source=source)
    if kind == "image":
        return MediaItem.of(MediaKind.IMAGE, _image(1 + seed), source=source)
    return MediaItem.of(MediaKind.VIDEO, _frames(), fps=2.0, source=source)


QUESTION = {"audio": "What is said?", "image": "Describe it.", "video": "What happens?"}


def _request(
    kind: str,
    audio_out: bool = False,
    seed: int = 0,
    item: MediaItem | None = None,
    sampling: SamplingParams = GREEDY,
    history: tuple[ChatMessage, ...] = (),
) -> Request:
    item = item or _item(kind)
    text = QUESTION[kind]
    message = ChatMessage("user", text, parts=(item, text))
    outputs = {Modality.TEXT, Modality.AUDIO} if audio_out else {Modality.TEXT}
    return Request(
        "qwen2.5-omni",
        messages=(*history, message),
        seed=seed,
        sampling=sampling,
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


def _reference_media(model, kind: str, item: MediaItem):
    """``(clips, images, video)`` as ``reference.thinker_media_greedy`` takes them."""
    if kind == "audio":
        return [item.data], [], None
    if kind == "image":
        return [], [item.data], None
    encoders = model.components["encoder"].encode.__self__
    patches, grid, seconds = encoders.features.video_patches(item.data, item.fps)
    return [], [], (patches, [grid], [seconds])


def test_card_declares_media_inputs(model):
    caps = model.card.capabilities
    assert {Capability.AUDIO_INPUT, Capability.IMAGE_INPUT, Capability.VIDEO_INPUT} <= caps
    assert model.card.media_sample_rate == 16000
    assert "encoder" in model.components and "encode" in model.loops


def test_a_folder_without_towers_takes_no_media(root, monkeypatch):
    from omnistep.models.qwen2_5_omni.loader import QwenOmniFiles

    real = QwenOmniFiles.tensor_names
    monkeypatch.setattr(
        QwenOmniFiles,
        "tensor_names",
        lambda self: {n for n in real(self) if not n.startswith("thinker.visual.")},
    )
    card = build_card(str(root), OPTIONS)
    card.validate()
    assert not {Capability.AUDIO_INPUT, Capability.IMAGE_INPUT} & card.capabilities
    assert "encoder" not in {c.name for c in card.components}
    assert omni_card.media_capabilities(QwenOmniFiles.locate(root)) == frozenset()


@pytest.mark.parametrize("kind", ["audio", "image", "video"])
async def test_thinker_with_media_matches_transformers(model, root, kind):
    """Greedy text equal and every step's logits within 1e-4 (the paged prefill with the
    encoder rows and TMRoPE positions, then decode steps at ``length + rope_delta``)."""
    req = _request(kind)
    (stream,), (text,) = await _run(model, [req])
    prompt = stream.rollout_info["think"]["prompt"]
    assert isinstance(prompt, ThinkerPrompt) and prompt.media == (req.media[0].sha256,)
    rows = {"audio": 75, "image": 35, "video": 3 * 20 * 28 // 4}[kind]
    assert sum(r.shape[0] for r in prompt.media_rows) == rows
    tokens = [r.tokens[0] for r in stream.trajectories["think"]]
    ref = reference.thinker_media_greedy(
        root, prompt.ids, len(tokens), *_reference_media(model, kind, req.media[0])
    )
    assert tokens == ref.token_ids.tolist() and len(tokens) >= 2
    if kind != "audio":
        assert prompt.rope_delta != 0  # the 3-row positions are in play
    thinker = model.components["thinker"]
    ours = thinker.teacher_forced_logits(prompt, tokens[:-1], incremental=True)[:, 0]
    assert ours.shape == ref.logits.shape
    assert (ours - ref.logits).abs().max().item() < TOL
    tok = model.card.program.nodes[0].fn.tokenizer
    assert text == tok.decode(tokens, skip_special_tokens=True)
    assert thinker.blocks.num_used_blocks == 0


async def test_spoken_answer_to_an_audio_prompt_matches_transformers(model, root):
    """Talker codes equal transformers' greedy talker on ``generate``'s hand-off (embeddings
    zeroed at the audio placeholders), and the waveform equals its token2wav on those codes,
    voice and seed, within 1e-4."""
    req = _request("audio", audio_out=True, seed=7)
    eng = AsyncEngine([model])
    out = await collect(eng, req)
    await eng.shutdown()
    stream_tokens = out.trajectories["think"]
    prompt = out.rollout_info["think"]["prompt"]
    tokens = [r.tokens[0] for r in stream_tokens]
    ref_thinker = reference.thinker_media_greedy(root, prompt.ids, len(tokens), [req.media[0].data])
    ref_talker = reference.talker_greedy(root, ref_thinker, "Chelsie", steps=16)
    codes = [r.tokens[0] for r in out.trajectories["talk"]]
    assert codes == ref_talker.codes.tolist()[: len(codes)] and len(codes) >= 4
    eos = set(model.loops["talk"].config.eos_token_ids)
    audio_codes = [c for c in codes if c not in eos]
    wave = reference.token2wav(root, torch.tensor(audio_codes), "Chelsie", seed=7).numpy()
    assert out.audio.size == wave.size == 480 * len(audio_codes)
    assert np.abs(out.audio - wave).max() <= TOL


# ------------------------------------------------------------------ scheduling and reuse
async def test_encoder_units_batch_across_requests_and_reuse_by_hash(model):
    """Three requests' clips run as ENCODE units of one batch (one kind); a later turn that
    repeats a clip (a chat resends its history) is answered from the encoder's cache."""
    encoder = model.components["encoder"]
    encoder.clear()
    encoded, reused = encoder.num_encoded, encoder.num_reused
    sizes: list[int] = []
    real = encoder.execute

    def recording(kind, payloads):
        sizes.append(len(payloads))
        return real(kind, payloads)

    encoder.execute = recording
    try:
        reqs = [
            _request(
                "audio", item=_item("audio", seed=s), sampling=SamplingParams(max_new_tokens=2)
            )
            for s in range(3)
        ]
        for i, r in enumerate(reqs):
            r.request_id = f"batch-{i}"
        await _run(model, reqs)
        assert max(sizes) >= 2 and sum(sizes) == 3 and encoder.num_encoded - encoded == 3
        # the next turn: the first turn's clip again, plus a new image
        first = reqs[0].messages[-1]
        history = (first, ChatMessage("assistant", "ok"))
        sizes.clear()
        follow = _request("image", history=history, sampling=SamplingParams(max_new_tokens=2))
        (stream,), _ = await _run(model, [follow])
        assert sizes == [1, 1] and encoder.num_encoded - encoded == 4
        assert encoder.num_reused - reused == 1
        prompt = stream.rollout_info["think"]["prompt"]
        assert prompt.media == (reqs[0].media[0].sha256, follow.media[-1].sha256)
    finally:
        del encoder.execute


async def test_other_requests_keep_decoding_while_an_encoder_runs(model):
    """A slow ENCODE batch holds back only its own request's prefill: a text chat's decode
    steps run while it computes."""
    import time

    encoder, thinker = model.components["encoder"], model.components["thinker"]
    encoder.clear()
    windows: list[tuple[float, float]] = []
    steps: list[float] = []
    real_encode, real_think = encoder.execute, thinker.execute

    def slow_encode(kind, payloads):
        start = time.monotonic()
        time.sleep(1.0)
        out = real_encode(kind, payloads)
        windows.append((start, time.monotonic()))
        return out

    def think(kind, payloads):
        out = real_think(kind, payloads)
        if str(kind) == "ar_token":
            steps.append(time.monotonic())
        return out

    encoder.execute, thinker.execute = slow_encode, think
    try:
        text = Request(
            "qwen2.5-omni",
            messages=(ChatMessage("user", "tell me a long story"),),
            seed=0,
            sampling=SamplingParams(temperature=0.0, max_new_tokens=40),
            output_modalities=frozenset({Modality.TEXT}),
        )
        eng = AsyncEngine([model])
        talking = eng.add_request(text)
        first = await anext(aiter(talking))  # the text chat is decoding
        assert first.text is not None
        media = eng.add_request(_request("audio", sampling=SamplingParams(max_new_tokens=2)))
        _ = [c async for c in media]
        rest = [c async for c in talking]
        await eng.shutdown()
    finally:
        del encoder.execute, thinker.execute
    assert len(media.trajectories["think"]) == 2 and rest and len(windows) == 1
    start, end = windows[0]
    assert sum(start < t < end for t in steps) >= 2


async def test_rollout_records_media_and_score_equals_recorded_logprobs(model):
    """C2 over a media prompt: the rollout records the media by hash (the encode loop's and
    the thinker prompt's), and ``score`` on the recorded prompt and tokens reproduces the
    recorded log-probs."""
    req = _request("image", sampling=SamplingParams(temperature=0.8, max_new_tokens=6), seed=4)
    (stream,), _ = await _run(model, [req])
    sha = req.media[0].sha256
    assert stream.rollout_info["encode"]["media"] == (sha,)
    info = stream.rollout_info["think"]
    assert info["prompt"].media == (sha,)
    records = stream.trajectories["think"]
    tokens = [r.tokens for r in records]
    recorded = torch.tensor([r.logprobs for r in records])
    loop = model.loops["think"]
    with torch.no_grad():
        scored = loop.score(model, req, info["prompt"], tokens)
    assert scored.shape == recorded.shape
    assert (scored.float() - recorded).abs().max().item() <= 1e-6


async def test_same_seed_same_bytes_and_codes_beside_other_requests(root):
    """C1 and C3 for a media prompt under --batch-invariant: the request alone, and again with
    the same seed beside another request (its own media, its units batched with these),
    gives the same thinker tokens, talker codes and audio bytes."""
    opts = dataclasses.replace(OPTIONS, batch_invariant=True, talker_max_new_tokens=6)
    bi = ModelInstance.load(build_card(str(root), opts))
    small = SamplingParams(temperature=0.0, max_new_tokens=4)
    reqs = [
        _request("audio", audio_out=True, seed=1, sampling=small),
        _request("audio", audio_out=True, seed=2, item=_item("audio", seed=5), sampling=small),
    ]
    eng = AsyncEngine([bi])
    alone = await collect(eng, reqs[0])
    together = await asyncio.gather(
        *(collect(eng, dataclasses.replace(r, request_id=f"{r.request_id}-b")) for r in reqs)
    )
    await eng.shutdown()
    for loop in ("think", "talk"):
        tokens = [r.tokens for r in alone.trajectories[loop]]
        assert tokens == [r.tokens for r in together[0].trajectories[loop]] and tokens
    assert alone.audio.size > 0 and alone.audio.tobytes() == together[0].audio.tobytes()
    assert together[1].audio.size > 0


# ------------------------------------------------------------------ bad input, aborts
async def test_bad_media_is_refused_naming_the_part(model):
    """Input the card path adds checks for (beyond the server's): audio longer than the
    feature extractor reads, audio at another rate; refused at submission."""
    eng = AsyncEngine([model])
    source = "messages[0].content[0]"
    long_clip = MediaItem.of(
        MediaKind.AUDIO, np.zeros(16000 * 300 + 1, np.float32), sample_rate=16000, source=source
    )
    other_rate = MediaItem.of(MediaKind.AUDIO, _clip(), sample_rate=24000, source=source)
    for item, code in ((long_clip, "audio_too_long"), (other_rate, "invalid_audio")):
        with pytest.raises(InvalidRequestError) as err:
            eng.add_request(_request("audio", item=item))
        assert err.value.param == source and err.value.code == code
        assert source in str(err.value)
    assert eng.stats() == dict.fromkeys(eng.stats(), 0)
    await eng.shutdown()


async def test_audio_too_short_for_the_tower_is_a_400_and_the_shortest_runs(model):
    """A clip of 320 samples (2 mel frames at hop 160) gives the tower no row: refused at
    submission as ``audio_too_short`` naming the part (it was a 500 from the encode step);
    321 samples (3 frames, one row) run."""
    eng = AsyncEngine([model])
    source = "messages[0].content[0]"
    for n in (1, 320):
        item = MediaItem.of(MediaKind.AUDIO, _clip()[:n], sample_rate=16000, source=source)
        with pytest.raises(InvalidRequestError) as err:
            eng.add_request(_request("audio", item=item))
        assert (err.value.param, err.value.code) == (source, "audio_too_short")
    assert eng.stats() == dict.fromkeys(eng.stats(), 0)
    shortest = MediaItem.of(MediaKind.AUDIO, _clip()[:321], sample_rate=16000, source=source)
    sampling = SamplingParams(temperature=0.0, max_new_tokens=2)
    stream = eng.add_request(_request("audio", item=shortest, sampling=sampling))
    assert "".join([c.text async for c in stream if c.text])
    await eng.shutdown()


async def test_text_spelling_a_media_placeholder_or_over_the_context_is_a_400(model):
    """Text holding the thinker's placeholder tokens (read by the tokenizer as the special
    tokens) is refused at submission, with media or without; it was a 500 from the ENCODE
    step ('placeholders ... do not match the media'). So is a prompt over the context."""
    eng = AsyncEngine([model])
    for text, items in (("<|AUDIO|>", (_item("audio"),)), ("<|IMAGE|> hi", ())):
        req = dataclasses.replace(
            _request("audio"), messages=(ChatMessage("user", text, parts=(*items, text)),)
        )
        with pytest.raises(InvalidRequestError) as err:
            eng.add_request(req)
        assert (err.value.param, err.value.code) == ("messages", "invalid_value")
        assert "placeholder" in str(err.value)
    # a prompt over the context: it was a 500 from the thinker's prefill
    long = dataclasses.replace(
        _request("audio"), messages=(ChatMessage("user", "hello world " * 20000),)
    )
    with pytest.raises(InvalidRequestError) as err:
        eng.add_request(long)
    assert (err.value.param, err.value.code) == ("messages", "context_length_exceeded")
    assert eng.stats() == dict.fromkeys(eng.stats(), 0)
    await eng.shutdown()


async def test_media_that_overflow_the_context_are_a_400_and_others_run(model, monkeypatch):
    """The expanded prompt (placeholders -> encoder rows) is checked against the context
    after ENCODE: ``context_length_exceeded`` (an InvalidRequestError: a 400), where the
    prefill's ValueError was a 500; a request beside it is unaffected. The limit is lowered
    to 60 tokens here (a 3 s clip expands to 75 rows) instead of sending 32k rows of media."""
    node = next(n for n in model.card.program.nodes if n.name == "media_prompt")
    monkeypatch.setattr(node.fn, "max_prompt_tokens", 60)
    eng = AsyncEngine([model])
    big = eng.add_request(_request("audio"))
    text_only = eng.add_request(
        dataclasses.replace(_request("audio"), messages=(ChatMessage("user", "Hello?"),))
    )
    with pytest.raises(InvalidRequestError) as err:
        _ = [c async for c in big]
    assert (err.value.param, err.value.code) == ("messages", "context_length_exceeded")
    assert "".join([c.text async for c in text_only if c.text])
    await eng.shutdown()


async def test_aborted_mixed_requests_leave_nothing(model):
    """Fifty requests with audio, images and video, half asking for speech, aborted in three
    waves (queued or encoding, in the thinker, in the talker): no KV block and no queued unit
    (encoder units included) is left (issue 27 item 7)."""
    eng = AsyncEngine([model])
    kinds = ("audio", "image", "video")
    streams = [
        eng.add_request(
            _request(
                kinds[i % 3],
                audio_out=i % 2 == 0,
                seed=i,
                item=_item(kinds[i % 3], seed=i),
                sampling=SamplingParams(temperature=0.0, max_new_tokens=40),
            )
        )
        for i in range(50)
    ]
    for wave, pause in ((range(0, 50, 3), 0.0), (range(1, 50, 3), 0.2), (range(2, 50, 3), 0.2)):
        await asyncio.sleep(pause)
        for i in wave:
            streams[i].cancel()
    spoken_cut = 0
    for i, stream in enumerate(streams):  # a text-only answer may end before its abort
        try:
            async for _ in stream:
                pass
        except RequestAbortedError:
            spoken_cut += i % 2 == 0
    assert spoken_cut == 25  # every spoken answer was cut mid-way
    for _ in range(1200):  # a batch running at the abort folds, then frees
        if not eng.stats()["running_batches"]:
            break
        await asyncio.sleep(0.05)
    assert eng.stats() == dict.fromkeys(eng.stats(), 0)
    await eng.shutdown()
    for name in ("thinker", "talker"):
        assert model.components[name].blocks.num_used_blocks == 0


# ------------------------------------------------------------------ /v1/chat/completions
async def test_chat_completions_answer_media_parts(model, tmp_path):
    """``input_audio`` and ``image_url`` parts reach the card through the server: answered
    with text and speech, the stream equal to the whole response; a part the card cannot
    read is a 400 naming it."""
    import base64
    import io
    import json

    import httpx
    import soundfile as sf

    from omnistep.server import ServerConfig, build_app
    from tests.test_chat_media import audio_file, audio_part, data_url, image_part, png, tone

    engine = AsyncEngine([model])
    app = build_app(engine, ServerConfig(voices_db=str(tmp_path / "voices.db")))
    clip = audio_file(tone(1.0, 24000), 24000)
    content = [audio_part(clip), {"type": "text", "text": "What is said?"}]
    body = {
        "model": "qwen2.5-omni",
        "messages": [{"role": "user", "content": content}],
        "modalities": ["text", "audio"],
        "audio": {"voice": "Chelsie", "format": "wav"},
        "max_tokens": 4,
        "temperature": 0,
        "seed": 3,
    }
    try:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test/") as client:
            r = await client.post("/v1/chat/completions", json=body, timeout=600)
            assert r.status_code == 200, r.text
            out = r.json()
            message = out["choices"][0]["message"]
            assert message["content"] and message["audio"]["transcript"] == message["content"]
            wave, rate = sf.read(io.BytesIO(base64.b64decode(message["audio"]["data"])))
            assert rate == 24000 and wave.size > 0
            # the 1 s clip became 25 audio tokens in the prompt (the template has one)
            assert out["usage"]["prompt_tokens"] >= 25
            r = await client.post(
                "/v1/chat/completions", json={**body, "stream": True}, timeout=600
            )
            assert r.status_code == 200
            chunks = [
                json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")
            ]
            deltas = [c["choices"][0]["delta"] for c in chunks if c.get("choices")]
            text = "".join(d.get("content") or "" for d in deltas)
            pieces = [(d.get("audio") or {}).get("data") for d in deltas]
            streamed, _ = sf.read(io.BytesIO(b"".join(base64.b64decode(p) for p in pieces if p)))
            assert text == message["content"]
            assert streamed.size == wave.size and np.abs(streamed - wave).max() == 0
            pixels = np.random.default_rng(1).integers(0, 255, (40, 60, 3), dtype=np.uint8)
            image = [image_part(data_url(png(pixels), "image/png")), {"type": "text", "text": "?"}]
            r = await client.post(
                "/v1/chat/completions",
                json={
                    **body,
                    "messages": [{"role": "user", "content": image}],
                    "modalities": ["text"],
                },
                timeout=600,
            )
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
            empty = [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]
            r = await client.post(
                "/v1/chat/completions",
                json={**body, "messages": [{"role": "user", "content": empty}]},
            )
            assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content[0]"
    finally:
        await engine.shutdown()


@pytest.mark.parametrize("kind", ["image", "video"])
async def test_talker_takes_the_media_positions(model, root, kind):
    """The talker's prefill on an image or video prompt (TMRoPE positions of the thinker's
    prompt, the embedding part zeroed at the placeholders) equals transformers' talker
    forward on ``generate``'s hand-off within 1e-4; 1-D positions would not."""
    req = _request(kind, audio_out=True, sampling=SamplingParams(temperature=0.0, max_new_tokens=2))
    (stream,), _ = await _run(model, [req])
    prompt = stream.rollout_info["think"]["prompt"]
    tokens = [r.tokens[0] for r in stream.trajectories["think"]]
    clips, images, video = _reference_media(model, kind, req.media[0])
    ref_thinker = reference.thinker_media_greedy(
        root, prompt.ids, len(tokens), clips, images, video
    )
    assert ref_thinker.token_ids.tolist() == tokens
    grids = [e.grid for e in prompt_encodings(model, req)]
    rope = {"image_grid_thw": grids} if kind == "image" else {"video_grid_thw": grids}
    if kind == "video":
        rope["video_second_per_grid"] = [video[2][0]]
    ref = reference.talker_media_prefill_logits(root, ref_thinker, "Chelsie", **rope)
    talker_prompt = stream.rollout_info["talk"]["prompt"]
    assert talker_prompt.positions is not None and talker_prompt.rope_delta == prompt.rope_delta
    talker = model.components["talker"]
    ours = talker.teacher_forced_logits(talker_prompt)[0, 0]
    assert (ours - ref).abs().max().item() < TOL
    flat = dataclasses.replace(talker_prompt, positions=None, rope_delta=0)
    assert (talker.teacher_forced_logits(flat)[0, 0] - ref).abs().max().item() > 1e-3


def prompt_encodings(model, req):
    """The encoder's outputs for a request's media (from its cache: already encoded)."""
    return model.components["encoder"].execute(WorkUnitKind.ENCODE, req.media)


# ------------------------------------------------------------------ /v1/audio/transcriptions
ASR_STEPS = 8


@pytest.fixture(scope="module")
def asr_model(root):
    """The tiny card with a short thinker cap (random weights rarely say ``<|im_end|>``)."""
    return ModelInstance.load(
        build_card(str(root), dataclasses.replace(OPTIONS, thinker_max_new_tokens=ASR_STEPS))
    )


def test_transcription_prompt_is_the_asr_cookbook_chat(asr_model):
    """System "You are a speech recognition model.", then the instruction naming the language
    (English by default) and the audio; an unknown language is a typed 400 error."""
    card = asr_model.card
    assert Capability.TRANSCRIPTION in card.capabilities
    audio = _item("audio")
    system, user = card.transcription_prompt(audio, None, "ignored vocabulary")
    assert (system.role, system.content) == ("system", "You are a speech recognition model.")
    instruction = "Transcribe the English audio into text without any punctuation marks."
    assert user.role == "user" and user.parts == (instruction, audio)
    _, user = card.transcription_prompt(audio, "de", None)
    assert user.parts[0] == "Transcribe the German audio into text without any punctuation marks."
    with pytest.raises(InvalidRequestError) as info:
        card.transcription_prompt(audio, "xx", None)
    assert info.value.param == "language"


async def test_sdk_transcription_equals_transformers_greedy_thinker(asr_model, root, tmp_path):
    """``client.audio.transcriptions.create`` on a 16 kHz float WAV returns exactly the text
    of transformers' greedy thinker ``generate`` on the cookbook chat with that clip, and
    ``/v1/models`` lists ``transcription`` for the card."""
    import io

    import httpx
    import openai
    import soundfile as sf

    from omnistep.server import ServerConfig, build_app

    samples = _clip(2.0, seed=5)
    wav = io.BytesIO()
    sf.write(wav, samples, 16000, format="WAV", subtype="FLOAT")
    engine = AsyncEngine([asr_model])
    app = build_app(engine, ServerConfig(voices_db=str(tmp_path / "voices.db")))
    try:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test/v1/") as http:
            client = openai.AsyncOpenAI(api_key="x", base_url="http://test/v1", http_client=http)
            listed = {m.id: m for m in (await client.models.list()).data}
            assert "transcription" in listed["qwen2.5-omni"].capabilities
            out = await client.audio.transcriptions.create(
                model="qwen2.5-omni", file=("clip.wav", wav.getvalue()), language="fr"
            )
            with pytest.raises(openai.BadRequestError) as info:
                await client.audio.transcriptions.create(
                    model="qwen2.5-omni", file=("clip.wav", wav.getvalue()), language="xx"
                )
            assert info.value.body["param"] == "language"
    finally:
        await engine.shutdown()
    instruction = "Transcribe the French audio into text without any punctuation marks."
    messages = [
        {"role": "system", "content": "You are a speech recognition model."},
        {"role": "user", "content": [{"type": "text", "text": instruction}, {"type": "audio"}]},
    ]
    expected = reference.audio_chat_text_greedy(root, messages, [samples], ASR_STEPS)
    assert out.text == expected.strip() and out.text


# ------------------------------------------------------------------ WS /v1/realtime
async def test_realtime_audio_turn_is_spoken_and_its_transcript_equals_the_chat_answer(
    asr_model, tmp_path
):
    """``client.realtime.connect`` on the tiny omni card: a committed audio turn gets
    ``response.output_audio.delta``s and a transcript equal to the chat API's greedy answer to
    the same history. The session's chat leads with the card's speech system prompt, verbatim,
    then the session's instructions as a second system message."""
    import base64
    import io

    import soundfile as sf

    from omnistep.models.qwen2_5_omni.card import SPEECH_SYSTEM_PROMPT

    engine = AsyncEngine([asr_model])
    sent = record_requests(engine)
    clip = (0.3 * np.sin(np.arange(36000) / 7.0)).astype(np.float32)  # 1.5 s at 24 kHz
    pcm = base64.b64encode((clip * 32767).astype("<i2").tobytes()).decode()
    try:
        async with served_in_process(engine, str(tmp_path / "voices.db")) as client:
            async with client.realtime.connect(model="qwen2.5-omni") as conn:
                await conn.session.update(
                    session={
                        "type": "realtime",
                        "instructions": "Be brief.",
                        "output_modalities": ["audio"],
                        "audio": {"input": {"turn_detection": None}, "output": {"voice": "Ethan"}},
                    }
                )
                events = await realtime_response(conn, pcm)
            assert events[-1].type == "response.done", events[-1]
            assert events[-1].response.status == "completed"
            audio = b"".join(
                base64.b64decode(e.delta) for e in events if e.type == "response.output_audio.delta"
            )
            transcript = "".join(
                e.delta for e in events if e.type == "response.output_audio_transcript.delta"
            )
            assert len(audio) > 0 and len(audio) % 2 == 0 and transcript
            (req,) = sent
            assert [(m.role, m.content) for m in req.messages[:2]] == [
                ("system", SPEECH_SYSTEM_PROMPT),
                ("system", "Be brief."),
            ]
            (heard,) = req.media  # the session's 16 kHz item, sent again through the chat API
            wav = io.BytesIO()
            sf.write(wav, heard.data, 16000, format="WAV", subtype="FLOAT")
            chat = await client.chat.completions.create(
                model="qwen2.5-omni",
                messages=[
                    {"role": "system", "content": SPEECH_SYSTEM_PROMPT},
                    {"role": "system", "content": "Be brief."},
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "input_audio",
                                "input_audio": {
                                    "data": base64.b64encode(wav.getvalue()).decode(),
                                    "format": "wav",
                                },
                            }
                        ],
                    },
                ],
                modalities=["text", "audio"],
                audio={"voice": "Ethan", "format": "wav"},
                temperature=0,
                seed=3,
            )
            assert sent[-1].media[0].sha256 == heard.sha256  # the same samples reached the card
            assert chat.choices[0].message.audio.transcript == transcript
    finally:
        await engine.shutdown()
