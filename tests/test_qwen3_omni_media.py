"""Qwen3-Omni hears: the audio tower as ENCODE units and audio chat parts through the
``qwen3_omni`` card, against transformers' ``Qwen3OmniMoeThinkerForConditionalGeneration``
(its ``audio_tower`` and the thinker on an audio prompt) on the tiny checkpoint; the Captioner
variant; ``/v1/audio/transcriptions`` and ``/v1/chat/completions`` with ``input_audio``."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from starlette.testclient import TestClient

from omnistep.core import (
    Capability,
    ChatMessage,
    InvalidRequestError,
    MediaItem,
    MediaKind,
    Modality,
    ModelInstance,
    Request,
    SamplingParams,
)
from omnistep.engine import AsyncEngine
from omnistep.kv import KVCacheConfig
from omnistep.models.qwen3_omni.audio_encoder import AudioEncoderConfig, Qwen3AudioEncoder
from omnistep.models.qwen3_omni.card import Qwen3OmniOptions, build_card, variant
from omnistep.models.qwen3_omni.encoders import Qwen3OmniEncoders
from omnistep.models.qwen3_omni.frontend import load_tokenizer
from omnistep.models.qwen3_omni.loader import Qwen3OmniCheckpoint
from omnistep.models.qwen3_omni.thinker import load_thinker
from omnistep.models.qwen3_omni.tiny import write_tiny_qwen3_omni
from omnistep.runners.media_prompt import EncodedMedia, thinker_prompt
from omnistep.runners.mrope import MediaTokenIds
from omnistep.server import ServerConfig, build_app
from tests.media_files import mp4_b64 as _mp4
from tests.media_files import png_b64 as _png
from tests.media_files import wav_bytes as _wav
from tests.serving import realtime_response, record_requests, served_in_process

TOL = 1e-4
OPTIONS = Qwen3OmniOptions(kv_cache_gb=0.02, talker_greedy=True)
QUESTION = "What is said?"


def _clip(seconds: float = 2.5, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (0.1 * rng.standard_normal(int(16000 * seconds) + 77)).astype(np.float32)


def _audio(seconds: float = 2.5, seed: int = 0) -> MediaItem:
    data = _clip(seconds, seed)
    return MediaItem.of(MediaKind.AUDIO, data, sample_rate=16000, source="messages[0].content[0]")


@pytest.fixture(scope="module")
def ref(qwen3_omni_folder):
    """transformers' thinker on the same weights."""
    from transformers import Qwen3OmniMoeForConditionalGeneration

    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(qwen3_omni_folder)
    return model.thinker.eval()


@pytest.fixture(scope="module")
def encoders(qwen3_omni_folder):
    return Qwen3OmniEncoders.from_checkpoint(Qwen3OmniCheckpoint.open(qwen3_omni_folder))


def _ref_features(clip: np.ndarray):
    """``input_features`` ``[1, 128, T]`` and ``feature_attention_mask`` ``[1, T]`` as
    ``Qwen3OmniMoeProcessor`` computes them (its ``audio_kwargs`` on the Whisper extractor)."""
    from transformers import WhisperFeatureExtractor

    fe = WhisperFeatureExtractor(feature_size=128, sampling_rate=16000, hop_length=160, n_fft=400)
    out = fe(
        [clip],
        sampling_rate=16000,
        padding=True,
        truncation=False,
        return_attention_mask=True,
        return_tensors="pt",
    )
    return out["input_features"], out["attention_mask"]


def _chat_ids(folder: Path, parts: list) -> list[int]:
    tok = load_tokenizer(str(folder))
    content = [
        {"type": "text", "text": p} if isinstance(p, str) else {"type": "audio"} for p in parts
    ]
    chat = [{"role": "user", "content": content}]
    return [int(i) for i in tok.apply_chat_template(chat, add_generation_prompt=True)["input_ids"]]


# ------------------------------------------------------------------ the audio tower
def test_audio_tower_matches_transformers_clip_by_clip(qwen3_omni_folder, ref, encoders):
    """Rows of clips of 37 frames (one short chunk), 100 (one full), 250 and 1000 (chunks and
    windows), batched together, equal transformers' tower on each clip alone."""
    torch.manual_seed(0)
    mels = [torch.randn(128, t) for t in (37, 100, 250, 1000)]
    with torch.no_grad():
        ours = encoders.audio(mels)
        for mel, got in zip(mels, ours, strict=True):
            lens = torch.tensor([mel.shape[1]])
            want = ref.model.audio_tower(mel, feature_lens=lens).last_hidden_state
            assert got.shape == want.shape == (encoders.audio.config.output_length(lens), 32)
            torch.testing.assert_close(got, want, atol=TOL, rtol=0)
    assert AudioEncoderConfig().window_rows == 104 and AudioEncoderConfig().output_length(100) == 13


def test_features_are_the_processors(encoders):
    clip = _clip(1.3)
    want, mask = _ref_features(clip)
    got = encoders.log_mel(clip)
    assert got.shape[1] == int(mask.sum()) == clip.size // 160
    torch.testing.assert_close(got, want[0][:, mask[0].bool()], atol=1e-6, rtol=0)


def test_a_bad_mel_is_a_value_error():
    enc = Qwen3AudioEncoder(
        AudioEncoderConfig(
            d_model=16,
            encoder_layers=1,
            encoder_attention_heads=2,
            encoder_ffn_dim=8,
            output_dim=8,
            downsample_hidden_size=4,
        )
    )
    with pytest.raises(ValueError, match="mel frames"):
        enc([torch.zeros(80, 10)])


# ------------------------------------------------------------------ the thinker on audio
def _audio_prompt(folder, encoders, clips):
    config = Qwen3OmniCheckpoint.open(folder).config
    tok = load_tokenizer(str(folder))
    ids = MediaTokenIds.from_config(config, audio_end=tok.convert_tokens_to_ids("<|audio_end|>"))
    template = _chat_ids(folder, [*[None] * len(clips), QUESTION])
    media = [MediaItem.of(MediaKind.AUDIO, c, sample_rate=16000) for c in clips]
    encoded = [EncodedMedia(r) for r in encoders.encode_audio(clips)]
    return thinker_prompt(template, ids, media, encoded, 2), template


def _ref_inputs(folder, prompt, clips):
    feats = [_ref_features(c) for c in clips]
    width = max(f.shape[2] for f, _ in feats)
    features = torch.cat([torch.nn.functional.pad(f, (0, width - f.shape[2])) for f, _ in feats])
    mask = torch.cat([torch.nn.functional.pad(m, (0, width - m.shape[1])) for _, m in feats])
    return {
        "input_ids": torch.tensor([prompt.ids]),
        "input_features": features,
        "feature_attention_mask": mask,
        "attention_mask": torch.ones(1, len(prompt.ids), dtype=torch.long),
    }


def test_thinker_logits_on_an_audio_prompt_match_transformers(qwen3_omni_folder, ref, encoders):
    # two clips with full chunks: transformers pads a batch's chunks to its longest, so a clip
    # under one chunk (100 frames) beside them would get other rows there (audio_encoder)
    clips = [_clip(2.5), _clip(1.3, seed=3)]
    prompt, template = _audio_prompt(qwen3_omni_folder, encoders, clips)
    assert len(prompt.ids) > len(template) + 30
    thinker = load_thinker(Qwen3OmniCheckpoint.open(qwen3_omni_folder), KVCacheConfig(64, 8))
    generated = [5, 77, 300]
    inputs = _ref_inputs(qwen3_omni_folder, prompt, clips)
    inputs["input_ids"] = torch.cat([inputs["input_ids"], torch.tensor([generated])], 1)
    inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    with torch.no_grad():
        want = ref(**inputs).logits[0, len(prompt.ids) - 1 :].float()
    for incremental in (False, True):
        got = thinker.teacher_forced_logits(prompt, generated, incremental=incremental)[:, 0]
        torch.testing.assert_close(got, want, atol=TOL, rtol=0)
    assert want.std() > 0.1
    # the audio rows matter: the same template with silence gives other logits
    quiet = [np.zeros_like(c) + 1e-3 for c in clips]
    other, _ = _audio_prompt(qwen3_omni_folder, encoders, quiet)
    assert (thinker.teacher_forced_logits(other)[0, 0] - want[0]).abs().max() > 1e-2


# ------------------------------------------------------------------ through the card
@pytest.fixture(scope="module")
def model(qwen3_omni_folder):
    return ModelInstance.load(build_card(str(qwen3_omni_folder), OPTIONS))


def _request(item: MediaItem, max_tokens: int = 8) -> Request:
    return Request(
        "qwen3-omni",
        messages=(ChatMessage("user", QUESTION, parts=(item, QUESTION)),),
        sampling=SamplingParams(temperature=0.0, max_new_tokens=max_tokens),
        output_modalities=frozenset({Modality.TEXT}),
    )


async def _texts(model, reqs):
    eng = AsyncEngine([model])
    streams = [eng.add_request(r) for r in reqs]

    async def drain(stream):
        return "".join([c.text async for c in stream if c.text])

    try:
        return await asyncio.gather(*(drain(s) for s in streams))
    finally:
        await eng.shutdown()


def test_card_hears_and_greedy_text_matches_transformers(qwen3_omni_folder, model, ref, encoders):
    caps = model.card.capabilities
    assert {Capability.AUDIO_INPUT, Capability.TRANSCRIPTION} <= caps
    assert {Capability.IMAGE_INPUT, Capability.VIDEO_INPUT} <= caps
    assert model.card.media_sample_rate == 16000
    items = [_audio(2.5), _audio(1.1, seed=5)]
    texts = asyncio.run(_texts(model, [_request(i, 8) for i in items]))  # batched together
    tok = load_tokenizer(str(qwen3_omni_folder))
    for item, text in zip(items, texts, strict=True):
        prompt, _ = _audio_prompt(qwen3_omni_folder, encoders, [item.data])
        with torch.no_grad():
            out = ref.generate(
                **_ref_inputs(qwen3_omni_folder, prompt, [item.data]),
                max_new_tokens=8,
                do_sample=False,
            )
        want = tok.decode(out[0, len(prompt.ids) :], skip_special_tokens=True)
        assert text == want and len(want) > 0
    assert model.components["encoder"].num_encoded == 2


def test_audio_too_short_for_the_tower_is_a_400_and_the_shortest_runs(model):
    """200 samples are too few for the log-mel's reflect padding (n_fft / 2), fewer than 160
    make no frame: ``audio_too_short`` naming the part at submission (it was a 500 from the
    encode step); 201 samples run."""
    source = "messages[0].content[0]"
    too_short = MediaItem.of(MediaKind.AUDIO, _clip()[:200], sample_rate=16000, source=source)
    with pytest.raises(InvalidRequestError) as err:
        asyncio.run(_texts(model, [_request(too_short)]))
    assert (err.value.param, err.value.code) == (source, "audio_too_short")
    shortest = MediaItem.of(MediaKind.AUDIO, _clip()[:201], sample_rate=16000, source=source)
    (text,) = asyncio.run(_texts(model, [_request(shortest, 2)]))
    assert text


def test_text_spelling_a_media_placeholder_is_a_400(model):
    """``<|audio_pad|>`` in the text beside one clip: two placeholders for one item, refused
    at submission (it was a 500 from the ENCODE step)."""
    text = "<|audio_pad|> what is said?"
    req = Request(
        "qwen3-omni",
        messages=(ChatMessage("user", text, parts=(_audio(), text)),),
        sampling=SamplingParams(temperature=0.0, max_new_tokens=2),
    )
    with pytest.raises(InvalidRequestError) as err:
        asyncio.run(_texts(model, [req]))
    assert (err.value.param, err.value.code) == ("messages", "invalid_value")


# ------------------------------------------------------------------ the Captioner
@pytest.fixture(scope="module")
def captioner(tmp_path_factory) -> Path:
    return write_tiny_qwen3_omni(
        tmp_path_factory.mktemp("q3cap") / "Qwen3-Omni-30B-A3B-Captioner", variant="captioner"
    )


def test_captioner_folder_is_detected_and_takes_one_clip_only(captioner):
    ckpt = Qwen3OmniCheckpoint.open(captioner)
    assert not ckpt.has_talker
    assert variant(ckpt, load_tokenizer(str(captioner))) == "captioner"
    card = build_card(str(captioner), OPTIONS)
    assert card.card_id == "Qwen3-Omni-30B-A3B-Captioner"
    assert Capability.CHAT_AUDIO not in card.capabilities
    assert {Capability.AUDIO_INPUT, Capability.TRANSCRIPTION} <= card.capabilities
    model = ModelInstance.load(card)
    caption = Request(
        card.card_id,
        messages=(ChatMessage("user", "", parts=(_audio(),)),),
        sampling=SamplingParams(temperature=0.0, max_new_tokens=6),
    )
    (text,) = asyncio.run(_texts(model, [caption]))
    assert len(text) > 0
    for bad in (
        ChatMessage("user", QUESTION, parts=(_audio(), QUESTION)),  # a text prompt
        ChatMessage("user", "", parts=(_audio(), _audio(seed=1))),  # two clips
        ChatMessage("user", "hello"),  # no clip
    ):
        req = Request(card.card_id, messages=(bad,), sampling=caption.sampling)
        with pytest.raises(InvalidRequestError) as err:
            asyncio.run(_texts(model, [req]))
        assert err.value.code == "captioner_input"


# ------------------------------------------------------------------ over HTTP


@pytest.fixture(scope="module")
def client(qwen3_omni_folder, captioner, model, tmp_path_factory):
    # served beside the Instruct card under its folder's name only (both alias qwen3-omni)
    cap = ModelInstance.load(dataclasses.replace(build_card(str(captioner), OPTIONS), aliases=()))
    db = tmp_path_factory.mktemp("q3media_voices") / "v.db"
    with TestClient(build_app(AsyncEngine([model, cap]), ServerConfig(voices_db=str(db)))) as c:
        yield c


def test_chat_with_input_audio_and_transcriptions_over_http(client):
    wav = base64.b64encode(_wav(_clip(1.5))).decode()
    part = {"type": "input_audio", "input_audio": {"data": wav, "format": "wav"}}
    body = {
        "model": "qwen3-omni",
        "max_tokens": 6,
        "temperature": 0,
        "messages": [{"role": "user", "content": [part, {"type": "text", "text": QUESTION}]}],
    }
    first = client.post("/v1/chat/completions", json=body)
    assert first.status_code == 200, first.text
    answer = first.json()["choices"][0]["message"]["content"]
    assert answer and first.json()["usage"]["prompt_tokens"] > 30  # the expanded prompt
    assert (
        client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
        == answer
    )
    spoken = client.post(
        "/v1/chat/completions",
        json={
            **body,
            "modalities": ["text", "audio"],
            "audio": {"voice": "alloy", "format": "wav"},
        },
    )
    assert spoken.status_code == 200, spoken.text  # spoken: tests/test_qwen3_omni_spoken_media.py
    assert spoken.json()["choices"][0]["message"]["audio"]["data"]
    with_track = {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + _mp4()}}
    heard = client.post(
        "/v1/chat/completions",
        json={
            **body,
            "messages": [{"role": "user", "content": [with_track]}],
            "use_audio_in_video": True,
        },
    )
    assert heard.status_code == 200, heard.text
    assert heard.json()["choices"][0]["message"]["content"]
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + _png()}}
    seen = client.post(
        "/v1/chat/completions",
        json={
            **body,
            "messages": [{"role": "user", "content": [image, {"type": "text", "text": "?"}]}],
        },
    )
    assert seen.status_code == 200, seen.text
    assert seen.json()["choices"][0]["message"]["content"]
    for model in ("qwen3-omni", "Qwen3-Omni-30B-A3B-Captioner"):
        files = {"file": ("a.wav", _wav(_clip(1.2, seed=2)), "audio/wav")}
        out = client.post("/v1/audio/transcriptions", data={"model": model}, files=files)
        assert out.status_code == 200, out.text
        assert isinstance(out.json()["text"], str) and out.json()["text"]


def test_weights_writes_the_captioner_variant(tmp_path):
    from omnistep.models.qwen3_omni.tiny import FOLDER_VARIANTS, write_folder

    assert "captioner" in FOLDER_VARIANTS
    root = write_folder(tmp_path / "cap", "captioner")
    config = json.loads((root / "config.json").read_text())
    assert config["enable_audio_output"] is False
    assert not any(
        "talker" in k
        for k in json.loads((root / "model.safetensors.index.json").read_text())["weight_map"]
    )
    shutil.rmtree(root)


# ------------------------------------------------------------------ WS /v1/realtime
async def test_realtime_audio_turn_answers_as_the_chat_api_does(model, tmp_path):
    """``client.realtime.connect`` on the Instruct card with a text-only session: a committed
    audio turn's ``response.output_text.delta``s equal the chat API's greedy answer to the same
    16 kHz clip."""

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
                        "output_modalities": ["text"],
                        "max_output_tokens": 6,
                        "audio": {"input": {"turn_detection": None}},
                    }
                )
                events = await realtime_response(conn, pcm)
            assert events[-1].type == "response.done", events[-1]
            # the random tiny thinker does not stop before its 6 tokens
            assert events[-1].response.status == "incomplete"
            assert events[-1].response.status_details.reason == "max_output_tokens"
            text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
            assert text
            (heard,) = sent[0].media
            wav = io.BytesIO()
            sf.write(wav, heard.data, 16000, format="WAV", subtype="FLOAT")
            part = {
                "type": "input_audio",
                "input_audio": {"data": base64.b64encode(wav.getvalue()).decode(), "format": "wav"},
            }
            chat = await client.chat.completions.create(
                model="qwen3-omni",
                messages=[
                    *[{"role": m.role, "content": m.content} for m in sent[0].messages[:-1]],
                    {"role": "user", "content": [part]},
                ],
                temperature=0,
                max_tokens=6,
            )
            assert sent[-1].media[0].sha256 == heard.sha256
            assert chat.choices[0].message.content == text
    finally:
        await engine.shutdown()


# ------------------------------------------------------------------ seeing
def _image(seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (200, 130, 3), dtype=np.uint8)


def _frames() -> np.ndarray:
    """5 frames at 2 fps, 40 x 60 (3 temporal patches: the last frame repeats)."""
    return np.random.default_rng(2).integers(0, 256, (5, 40, 60, 3), dtype=np.uint8)


def _sdpa_calls(monkeypatch) -> list[tuple[int, bool]]:
    """Records ``(key length, had a mask)`` of every SDPA call."""
    calls: list[tuple[int, bool]] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        calls.append((k.shape[-2], attn_mask is not None))
        return sdpa(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    return calls


def test_encoders_attend_per_frame_and_window_without_a_square_mask(encoders, monkeypatch):
    """Memory: the towers attend within each frame / audio window, never over an ``[N, N]``
    mask of all rows of a batch. A 5900 x 5900 PNG (under --max-image-pixels) is 65,536
    patches; its dense mask and the SDPA's float copy took 20 GiB and the server was
    OOM-killed. Two images and a 3-frame video: no call sees more keys than one frame has."""
    calls = _sdpa_calls(monkeypatch)
    grids = [(1, 6, 8), (1, 4, 4), (3, 4, 4)]
    patches = torch.randn(sum(t * h * w for t, h, w in grids), 3 * 2 * 16 * 16)
    with torch.no_grad():
        encoders.vision(patches, grids)
    assert calls and all(not masked for _, masked in calls)
    assert max(n for n, _ in calls) == 48
    calls.clear()
    with torch.no_grad():
        encoders.audio([torch.randn(128, t) for t in (1000, 250)])  # 130 and 33 rows
    assert calls and all(not masked for _, masked in calls)
    assert max(n for n, _ in calls) == encoders.audio.config.window_rows


def test_vision_encoder_matches_transformers(ref, encoders):
    torch.manual_seed(0)
    grids = [(1, 6, 8), (3, 4, 4)]
    patches = torch.randn(sum(t * h * w for t, h, w in grids), 3 * 2 * 16 * 16)
    with torch.no_grad():
        rows, deepstack = encoders.vision(patches, grids)
        want = ref.model.visual(patches, grid_thw=torch.tensor(grids))
    torch.testing.assert_close(rows, want.pooler_output, atol=TOL, rtol=0)
    assert len(deepstack) == len(want.deepstack_features) == 1
    for got, exp in zip(deepstack, want.deepstack_features, strict=True):
        torch.testing.assert_close(got, exp, atol=TOL, rtol=0)


def _vision_prompt(folder, encoders, kind):
    config = Qwen3OmniCheckpoint.open(folder).config
    tok = load_tokenizer(str(folder))
    ids = MediaTokenIds.from_config(config, audio_end=tok.convert_tokens_to_ids("<|audio_end|>"))
    chat = [{"role": "user", "content": [{"type": kind}, {"type": "text", "text": "Describe it."}]}]
    template = [
        int(i) for i in tok.apply_chat_template(chat, add_generation_prompt=True)["input_ids"]
    ]
    if kind == "image":
        item = MediaItem.of(MediaKind.IMAGE, _image())
    else:
        item = MediaItem.of(MediaKind.VIDEO, _frames(), fps=2.0)
    (encoded,) = encoders.encode_items([item])
    return thinker_prompt(template, ids, [item], [encoded], 2), item


@pytest.mark.parametrize("kind", ["image", "video"])
def test_thinker_logits_on_image_and_video_prompts_match_transformers(
    qwen3_omni_folder, ref, encoders, kind
):
    prompt, item = _vision_prompt(qwen3_omni_folder, encoders, kind)
    assert len(prompt.deepstack) == 1 and prompt.positions[1].max() > prompt.positions[1].min()
    feats = encoders.features
    generated = [5, 77, 300]
    ids = torch.tensor([[*prompt.ids, *generated]])
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if kind == "image":
        patches, grid = feats.image_patches(item.data)
        inputs |= {
            "pixel_values": torch.from_numpy(patches),
            "image_grid_thw": torch.tensor([grid]),
        }
    else:
        patches, grid, seconds = feats.video_patches(item.data, 2.0)
        inputs |= {
            "pixel_values_videos": torch.from_numpy(patches),
            "video_grid_thw": torch.tensor([grid]),
            "video_second_per_grid": torch.tensor([seconds]),
        }
    thinker = load_thinker(Qwen3OmniCheckpoint.open(qwen3_omni_folder), KVCacheConfig(128, 8))
    with torch.no_grad():
        want = ref(**inputs).logits[0, len(prompt.ids) - 1 :].float()
    for incremental in (False, True):
        got = thinker.teacher_forced_logits(prompt, generated, incremental=incremental)[:, 0]
        torch.testing.assert_close(got, want, atol=TOL, rtol=0)
    # the deepstack features matter: without them the logits move
    bare = dataclasses.replace(
        prompt, deepstack=tuple(torch.zeros_like(d) for d in prompt.deepstack)
    )
    assert (thinker.teacher_forced_logits(bare)[0, 0] - want[0]).abs().max() > 1e-3


def test_thinker_logits_on_a_video_with_its_audio_match_transformers(
    qwen3_omni_folder, ref, encoders
):
    """``use_audio_in_video``: frames and track interleaved by temporal position
    (``MediaTokenIds.interleave == "time"``), positions as transformers' ``get_rope_index``."""
    ckpt = Qwen3OmniCheckpoint.open(qwen3_omni_folder)
    tok = load_tokenizer(str(qwen3_omni_folder))
    ids = dataclasses.replace(
        MediaTokenIds.from_config(
            ckpt.config, audio_end=tok.convert_tokens_to_ids("<|audio_end|>")
        ),
        interleave="time",
    )
    chat = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What?"}]}]
    template = [
        int(i) for i in tok.apply_chat_template(chat, add_generation_prompt=True)["input_ids"]
    ]
    track = MediaItem.of(MediaKind.AUDIO, _clip(2.6, seed=7), sample_rate=16000)
    video = MediaItem.of(MediaKind.VIDEO, _frames(), fps=2.0, audio=track)
    encoded = [*encoders.encode_items([video]), *encoders.encode_items([track])]
    prompt = thinker_prompt(template, ids, [video, track], encoded, 2)
    audio_rows = encoded[1].rows.shape[0]
    assert prompt.ids.count(ids.audio) == audio_rows > 0 and prompt.ids.count(ids.audio_start) == 1
    kinds = [t for t in prompt.ids if t in (ids.video, ids.audio)]
    assert kinds.index(ids.audio) < len(kinds) - kinds[::-1].index(ids.video) - 1  # interleaved
    patches, grid, seconds = encoders.features.video_patches(video.data, 2.0)
    features, mask = _ref_features(track.data)
    generated = [5, 77]
    input_ids = torch.tensor([[*prompt.ids, *generated]])
    inputs = {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "pixel_values_videos": torch.from_numpy(patches),
        "video_grid_thw": torch.tensor([grid]),
        "video_second_per_grid": torch.tensor([seconds]),
        "input_features": features,
        "feature_attention_mask": mask,
        "use_audio_in_video": True,
    }
    with torch.no_grad():
        positions, _ = ref.model.get_rope_index(
            input_ids[:, : len(prompt.ids)],
            None,
            torch.tensor([grid]),
            torch.ones(1, len(prompt.ids), dtype=torch.long),
            True,
            mask.sum(-1),
            torch.tensor([seconds]),
        )
        want = ref(**inputs).logits[0, len(prompt.ids) - 1 :].float()
    np.testing.assert_array_equal(prompt.positions, positions[:, 0].long().numpy())
    thinker = load_thinker(ckpt, KVCacheConfig(128, 8))
    got = thinker.teacher_forced_logits(prompt, generated)[:, 0]
    torch.testing.assert_close(got, want, atol=TOL, rtol=0)
