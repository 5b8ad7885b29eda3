"""``use_audio_in_video``: a video's audio track read with PyAV, its tokens interleaved with
the frames' in 2-second chunks, checked against transformers on the tiny Qwen2.5-Omni folder
(the processor's placeholder layout, ``get_rope_index``'s positions, the thinker's logits and
greedy text), and the request fields that ask for it on ``/v1/chat/completions``."""

from __future__ import annotations

import io
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest
import torch

from omnistep.core import (
    ChatMessage,
    ExecutionProfile,
    MediaKind,
    Modality,
    ModelInstance,
    Request,
    SamplingParams,
)
from omnistep.engine import AsyncEngine
from omnistep.models.qwen2_5_omni.card import QwenOmniOptions, build_card
from omnistep.models.qwen2_5_omni.tiny import write_tiny_qwen_omni
from omnistep.parity import collect
from omnistep.runners.mrope import MediaTokenIds, chunk_bounds
from omnistep.server.media import MediaLimits, decode_video_item
from tests.qwen_omni_ref import reference
from tests.test_chat_media import URL, data_url, served

TOL = 1e-4
SOURCE = "messages[0].content[0]"


def video_file(seconds: float = 2.5, fps: int = 2, audio_rate: int | None = 44100) -> bytes:
    """An MP4 (MPEG-4 part 2 video, AAC audio when ``audio_rate``) of random 60 x 90 frames
    and a noisy 300 Hz tone, written with PyAV."""
    rng = np.random.default_rng(2)
    frames = rng.integers(0, 256, (int(seconds * fps), 60, 90, 3), dtype=np.uint8)
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        video = out.add_stream("mpeg4", rate=fps)
        video.width, video.height, video.pix_fmt = 90, 60, "yuv420p"
        video.time_base = Fraction(1, fps)
        audio = out.add_stream("aac", rate=audio_rate, layout="mono") if audio_rate else None
        for i, rgb in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")
            frame.pts = i
            out.mux(video.encode(frame))
        out.mux(video.encode(None))
        if audio is not None:
            t = np.arange(int(seconds * audio_rate)) / audio_rate
            wave = 0.3 * np.sin(2 * np.pi * 300 * t) + 0.05 * rng.standard_normal(t.size)
            samples = wave.astype(np.float32)[None]
            frame = av.AudioFrame.from_ndarray(samples, format="flt", layout="mono")
            frame.sample_rate, frame.pts = audio_rate, 0
            out.mux(audio.encode(frame))
            out.mux(audio.encode(None))
    return buf.getvalue()


def test_chunks_follow_the_processor_rule():
    """A new chunk at each multiple of 50 reached, one multiple per token (transformers'
    ``get_chunked_index``: a jump over two chunks opens them one token apart)."""
    assert chunk_bounds([0, 0, 25, 25, 50, 50], 50) == [(0, 4), (4, 6)]
    assert chunk_bounds(list(range(63)), 50) == [(0, 50), (50, 63)]
    assert chunk_bounds([0, 0, 100, 100, 100], 50) == [(0, 2), (2, 3), (3, 5)]
    assert MediaTokenIds(1, 2, 3).tokens_per_chunk == 50


def test_decoding_keeps_the_track_at_16k_and_refuses_a_silent_video():
    item = decode_video_item(video_file(), SOURCE, MediaLimits(), audio_rate=16000)
    assert item.kind is MediaKind.VIDEO and item.data.shape == (5, 60, 90, 3)
    track = item.audio
    assert track is not None and track.kind is MediaKind.AUDIO and track.sample_rate == 16000
    assert abs(track.data.shape[0] / 16000 - 2.5) < 0.1 and np.abs(track.data).max() > 0.1
    plain = decode_video_item(video_file(), SOURCE, MediaLimits())
    assert plain.audio is None and plain.sha256 != item.sha256  # the track is in the hash
    from omnistep.core import InvalidRequestError

    with pytest.raises(InvalidRequestError) as err:
        decode_video_item(video_file(audio_rate=None), SOURCE, MediaLimits(), audio_rate=16000)
    assert err.value.param == SOURCE and err.value.code == "video_without_audio"


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return write_tiny_qwen_omni(tmp_path_factory.mktemp("omni_aiv") / "ckpt")


@pytest.fixture(scope="module")
def model(root):
    options = QwenOmniOptions(kv_cache_gb=0.02, talker_max_new_tokens=4)
    return ModelInstance.load(build_card(str(root), options))


async def test_video_with_its_audio_matches_transformers(model, root):
    """The prompt's ids equal the processor's layout, its positions ``get_rope_index``'s with
    ``use_audio_in_video=True``, greedy tokens equal and logits within 1e-4, the talker's
    prefill logits (on those positions) within 1e-4 of its forward; the rollout records the
    video's and the track's hashes."""
    item = decode_video_item(video_file(), SOURCE, MediaLimits(), audio_rate=16000)
    question = "What happens?"
    req = Request(
        "qwen2.5-omni",
        messages=(ChatMessage("user", question, parts=(item, question)),),
        seed=0,
        sampling=SamplingParams(temperature=0.0, max_new_tokens=8),
        profile=ExecutionProfile.ROLLOUT,
        output_modalities=frozenset({Modality.TEXT, Modality.AUDIO}),
        voice="Chelsie",
    )
    eng = AsyncEngine([model])
    out = await collect(eng, req)
    await eng.shutdown()
    prompt = out.rollout_info["think"]["prompt"]
    assert prompt.media == (item.sha256, item.audio.sha256)
    tokens = [r.tokens[0] for r in out.trajectories["think"]]

    encoders = model.components["encoder"].encode.__self__
    patches, grid, seconds = encoders.features.video_patches(item.data, item.fps)
    _, mask = reference.mel_features([item.audio.data])
    frames = int(mask.sum())
    num_audio = ((frames - 1) // 2 + 1 - 2) // 2 + 1
    assert grid[0] == 3 and num_audio > 50  # two chunks of each
    messages = [
        {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": question}]}
    ]
    template = reference.prompt_ids(root, messages).tolist()
    cfg = reference.load_reference(root)[0].config.thinker_config
    at = template.index(cfg.video_token_index)
    block = reference.audio_in_video_placeholder(root, grid, seconds, num_audio)
    assert list(prompt.ids) == template[:at] + block + template[at + 1 :]

    positions, delta = reference.rope_index(
        root,
        prompt.ids,
        video_grid_thw=[grid],
        audio_seqlens=[frames],
        second_per_grids=[seconds],
        use_audio_in_video=True,
    )
    assert np.array_equal(prompt.positions, positions.numpy()) and prompt.rope_delta == delta

    ref = reference.thinker_media_greedy(
        root,
        prompt.ids,
        len(tokens),
        clips=[item.audio.data],
        video=(patches, [grid], [seconds]),
        use_audio_in_video=True,
    )
    assert tokens == ref.token_ids.tolist() and len(tokens) >= 2
    ours = model.components["thinker"].teacher_forced_logits(prompt, tokens[:-1], incremental=True)
    assert (ours[:, 0] - ref.logits).abs().max().item() < TOL
    assert torch.isfinite(ref.logits).all() and out.audio.size > 0

    talker_ref = reference.talker_media_prefill_logits(
        root,
        ref,
        "Chelsie",
        video_grid_thw=[grid],
        video_second_per_grid=[seconds],
        audio_feature_lengths=[frames],
        use_audio_in_video=True,
    )
    talker_prompt = out.rollout_info["talk"]["prompt"]
    assert talker_prompt.rope_delta == prompt.rope_delta
    ours = model.components["talker"].teacher_forced_logits(talker_prompt)[0, 0]
    assert (ours - talker_ref).abs().max().item() < TOL


@pytest.mark.parametrize(
    "fields",
    [{"mm_processor_kwargs": {"use_audio_in_video": True}}, {"use_audio_in_video": True}],
)
async def test_chat_fields_ask_for_the_track(tmp_path, fields):
    """vLLM's ``mm_processor_kwargs`` and SGLang-Omni's top-level field both read the track;
    without them the video comes alone; a silent video with the flag is a 400 naming it."""
    part = {"type": "video_url", "video_url": {"url": data_url(video_file(), "video/mp4")}}
    silent = {
        "type": "video_url",
        "video_url": {"url": data_url(video_file(audio_rate=None), "video/mp4")},
    }
    body = {"model": "toy", "max_tokens": 2, "seed": 1}
    async with served(True, tmp_path) as (client, seen):
        for content, asked in (([part], True), ([part], False), ([silent], False)):
            payload = {**body, "messages": [{"role": "user", "content": content}]}
            r = await client.post(URL, json={**payload, **(fields if asked else {})})
            assert r.status_code == 200, r.text
            (video,) = seen[-1].media
            assert (video.audio is not None) is asked
            if asked:
                assert video.audio.sample_rate == 16000 and video.audio.source == SOURCE
        payload = {**body, "messages": [{"role": "user", "content": [silent]}]}
        r = await client.post(URL, json={**payload, **fields})
        assert r.status_code == 400
        error = r.json()["error"]
        assert error["param"] == SOURCE and error["code"] == "video_without_audio"
        r = await client.post(
            URL, json={**payload, "mm_processor_kwargs": {"use_audio_in_video": 1}}
        )
        assert r.status_code == 400
