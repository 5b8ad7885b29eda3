"""Qwen2.5-Omni's audio tower, vision encoder and TMRoPE positions against transformers, on the
tiny random checkpoint in the published layout (both encoders included; tests/qwen_omni_ref
runs the reference)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from omnistep.core import MediaItem, MediaKind
from omnistep.models.qwen2_5_omni import tiny as assets
from omnistep.models.qwen2_5_omni.audio_encoder import num_audio_tokens
from omnistep.models.qwen2_5_omni.encoders import OmniEncoders
from omnistep.runners.mrope import MediaTokenIds, rope_index
from tests.qwen_omni_ref import reference

TOL = 1e-4


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return assets.write_tiny_qwen_omni(tmp_path_factory.mktemp("omni_enc") / "ckpt", seed=0)


@pytest.fixture(scope="module")
def encoders(root: Path) -> OmniEncoders:
    return OmniEncoders.from_folder(root)


def _clips() -> list[np.ndarray]:
    """Three clips of different lengths: 3 s + 77 samples (two 200-frame chunks and a short
    one), 0.5 s (one short chunk), 5 s."""
    rng = np.random.default_rng(0)
    t = np.arange(16000 * 5) / 16000
    speechy = (0.3 * np.sin(2 * np.pi * 220 * t) * (1 + np.sin(2 * np.pi * 3 * t))).astype(
        np.float32
    )
    return [
        (0.1 * rng.standard_normal(16000 * 3 + 77)).astype(np.float32),
        (0.1 * rng.standard_normal(8000)).astype(np.float32),
        speechy,
    ]


def _images() -> list[np.ndarray]:
    """Images whose grids take one window, several windows, and one below the minimum size."""
    rng = np.random.default_rng(1)
    sizes = ((60, 90), (200, 130), (28, 28))
    return [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in sizes]


def test_log_mel_equals_the_processor_padding_to_n_samples(encoders):
    features, mask = reference.mel_features(_clips())
    for clip, full, keep in zip(_clips(), features, mask, strict=True):
        ours = encoders.features.log_mel(clip)
        frames = int(keep.sum())
        assert ours.shape == (128, frames) == (128, -(-clip.size // 160))
        np.testing.assert_array_equal(ours, full[:, :frames].numpy())


def test_audio_tower_matches_get_audio_features(root, encoders):
    clips = _clips()
    ref = reference.audio_features(root, clips)
    ours = encoders.encode_audio(clips)
    frames = [-(-c.size // 160) for c in clips]
    assert [r.shape[0] for r in ours] == [num_audio_tokens(n) for n in frames] == [75, 12, 125]
    for a, b in zip(ours, ref, strict=True):
        assert a.shape == b.shape and a.abs().max() > 0.1
        assert (a - b).abs().max().item() < TOL
    # one batch of three equals three batches of one (chunks are independent)
    alone = [encoders.encode_audio([c])[0] for c in clips]
    for a, b in zip(ours, alone, strict=True):
        assert (a - b).abs().max().item() < 1e-5


def test_audio_media_items_are_checked(encoders):
    item = MediaItem.of(MediaKind.AUDIO, _clips()[1], sample_rate=16000)
    assert torch.equal(encoders.encode_audio([item])[0], encoders.encode_audio([item.data])[0])
    with pytest.raises(ValueError, match="16000 Hz"):
        encoders.encode_audio([MediaItem.of(MediaKind.AUDIO, item.data, sample_rate=24000)])
    with pytest.raises(ValueError, match="non-empty"):
        encoders.encode_audio([np.zeros(0, np.float32)])


def test_vision_encoder_matches_get_image_features(root, encoders):
    images = _images()
    ref = reference.image_features(root, images)
    ours = encoders.encode_images(images)
    assert encoders.image_grids(images) == [(1, 4, 6), (1, 14, 10), (1, 4, 4)]
    assert [r.shape[0] for r in ours] == [6, 35, 4]  # 28x28 is scaled up to min_pixels
    for a, b in zip(ours, ref, strict=True):
        assert a.shape == b.shape and a.abs().max() > 0.1
        assert (a - b).abs().max().item() < TOL
    alone = [encoders.encode_images([i])[0] for i in images]
    for a, b in zip(ours, alone, strict=True):
        assert (a - b).abs().max().item() < 1e-5


def test_rope_index_matches_get_rope_index(root):
    info = assets.read_info(root)
    ids = MediaTokenIds.from_config(info.config)
    t = info.ids
    text = [5, 6, 7]
    audio_frames = [301, 50]
    audio_tokens = [num_audio_tokens(n) for n in audio_frames]  # 75, 12
    image_grid, video_grid = (1, 4, 6), (4, 4, 6)  # video: 4 temporal patches, 1 s each

    def audio(n: int) -> list[int]:
        return [t.audio_bos, *[t.audio] * n, t.audio_eos]

    def vision(token: int, grid: tuple[int, int, int]) -> list[int]:
        return [t.vision_bos, *[token] * (grid[0] * grid[1] * grid[2] // 4), t.vision_eos]

    prompt = [
        *text,
        *audio(audio_tokens[0]),
        *text,
        *vision(t.image, image_grid),
        *vision(t.video, video_grid),
        *audio(audio_tokens[1]),
        *text,
    ]
    ref, ref_delta = reference.rope_index(
        root, prompt, [image_grid], [video_grid], audio_frames, [1.0]
    )
    ours, delta = rope_index(prompt, ids, audio_tokens, [image_grid], [video_grid], [1.0])
    assert ours.shape == (3, len(prompt))
    np.testing.assert_array_equal(ours, ref.numpy())
    assert delta == ref_delta and delta > 0  # the video's time axis outruns its tokens
    # the video's temporal patches (6 tokens each) sit 25 positions (one second) apart in time
    first = prompt.index(t.video)
    assert ours[0, first + 6] - ours[0, first] == 25 and ours[0, first + 5] == ours[0, first]
    # audio only: consecutive positions, as upstream's text path gives
    only = [*text, *audio(audio_tokens[1]), *text]
    ours, delta = rope_index(only, ids, audio_tokens[1:])
    np.testing.assert_array_equal(ours, np.broadcast_to(np.arange(len(only)), (3, len(only))))
    assert delta == 0
    with pytest.raises(ValueError, match="placeholders"):
        rope_index(only, ids)


# ------------------------------------------------------------------ thinker prefill with media
@pytest.fixture(scope="module")
def thinker(root: Path):
    from omnistep.kv import KVCacheConfig
    from omnistep.models.qwen2_5_omni.loader import QwenOmniFiles
    from omnistep.models.qwen2_5_omni.thinker import load_thinker

    files = QwenOmniFiles.locate(root)
    kv = KVCacheConfig(num_blocks=16, block_size=16)
    return load_thinker(files.tensors("thinker."), files.config(), kv)


def _video() -> MediaItem:
    """5 frames at 2 fps (3 temporal patches: the last frame repeats), 60x90 pixels."""
    rng = np.random.default_rng(2)
    frames = rng.integers(0, 256, (5, 60, 90, 3), dtype=np.uint8)
    return MediaItem.of(MediaKind.VIDEO, frames, fps=2.0)


def test_vision_encoder_on_video_matches_get_video_features(root, encoders):
    video = _video()
    patches, grid, seconds = encoders.features.video_patches(video.data, video.fps)
    assert grid[0] == 3 and seconds == 1.0 and patches.shape == (grid[0] * grid[1] * grid[2], 1176)
    # temporal slot k of group g holds frame 2g + k: group 0 differs between its slots
    slots = patches.reshape(patches.shape[0], 3, 2, 14 * 14)
    assert not np.array_equal(slots[: grid[1] * grid[2], :, 0], slots[: grid[1] * grid[2], :, 1])
    last = slots[2 * grid[1] * grid[2] :]  # frame 4 and its repeat
    np.testing.assert_array_equal(last[:, :, 0], last[:, :, 1])
    ref = reference.video_features(root, patches, [grid])
    (ours,) = encoders.encode_videos([video])
    assert ours.shape == ref[0].shape == (grid[0] * grid[1] * grid[2] // 4, 64)
    assert (ours - ref[0]).abs().max().item() < TOL


PROMPTS = {
    "audio": [{"type": "audio"}, {"type": "text", "text": "What is said?"}],
    "image": [
        {"type": "text", "text": "Describe "},
        {"type": "image"},
        {"type": "text", "text": " please."},
    ],
    "video": [{"type": "video"}, {"type": "text", "text": "What happens?"}],
}


@pytest.mark.parametrize("kind", ["audio", "image", "video"])
def test_thinker_prefill_with_media_matches_transformers(root, encoders, thinker, kind):
    from omnistep.models.qwen2_5_omni.media_prompt import build_media_prompt, prefill_logits

    info = assets.read_info(root)
    item = {
        "audio": lambda: MediaItem.of(MediaKind.AUDIO, _clips()[0], sample_rate=16000),
        "image": lambda: MediaItem.of(MediaKind.IMAGE, _images()[1]),
        "video": _video,
    }[kind]()
    template = reference.prompt_ids(root, [{"role": "user", "content": PROMPTS[kind]}]).tolist()
    ids = MediaTokenIds.from_config(info.config)
    prompt = build_media_prompt(thinker, encoders, ids, template, [item])
    placeholder = {"audio": ids.audio, "image": ids.image, "video": ids.video}[kind]
    # video: 3 temporal patches of 20 x 28 (upscaled to the processor's 128 x 28 x 28 minimum)
    rows = {"audio": 75, "image": 35, "video": 3 * 20 * 28 // 4}[kind]
    assert prompt.input_ids.count(placeholder) == rows
    assert len(prompt.input_ids) == len(template) - 1 + rows
    clips = [item.data] if kind == "audio" else []
    images = [item.data] if kind == "image" else []
    video = None
    if kind == "video":
        patches, grid, seconds = encoders.features.video_patches(item.data, item.fps)
        video = (patches, [grid], [seconds])
    ref = reference.thinker_media_logits(root, prompt.input_ids, clips, images, video)
    ours = prefill_logits(thinker, prompt)
    assert ours.shape == ref.shape == (len(prompt.input_ids), info.ids.text_vocab)
    assert (ours - ref).abs().max().item() < TOL
    assert torch.equal(ours[-1].argmax(), ref[-1].argmax())
    if kind != "audio":  # the 3D positions matter: 1-D positions give other logits
        assert prompt.rope_delta != 0
        flat = dataclasses.replace(
            prompt, positions=np.tile(np.arange(len(prompt.input_ids)), (3, 1))
        )
        assert (prefill_logits(thinker, flat) - ref).abs().max().item() > 1e-3
