"""Chatterbox's voice encoder against the reference's (chatterbox-tts 0.1.7 with real librosa
in the ``.ref/chatterbox`` overlay) on a random ``ve.safetensors`` it wrote: the mel within
1e-4 relative, the speaker embedding within 1e-4 (trimming, partial windows, LSTM)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omnistep.models.chatterbox.loader import ChatterboxCheckpointError, load_voice_encoder
from omnistep.models.chatterbox.voice_encoder import partial_starts, trim_silence
from tests.chatterbox_ref.env import call_reference

OTHER_FILES = ("s3gen.safetensors", "t3_cfg.safetensors", "tokenizer.json")


def _clips() -> list[np.ndarray]:
    """A 2.3 s clip with 0.4 s of near-silence at each end, and a 0.7 s one (one window)."""
    rng = np.random.default_rng(0)
    t = np.arange(int(1.5 * 16000)) / 16000
    voiced = 0.3 * np.sin(2 * np.pi * 180 * t) * (1 + 0.5 * np.sin(2 * np.pi * 3 * t))
    voiced += 0.05 * rng.standard_normal(t.size)
    quiet = 1e-4 * rng.standard_normal(int(0.4 * 16000))
    short = 0.2 * rng.standard_normal(int(0.7 * 16000))
    return [np.concatenate([quiet, voiced, quiet]).astype(np.float32), short.astype(np.float32)]


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    root = tmp_path_factory.mktemp("chatterbox-ve")
    ref = call_reference("tests.chatterbox_ref.upstream_ve:embed", root=str(root), wavs=_clips())
    for name in OTHER_FILES:
        (root / name).write_bytes(b"")
    return root, ref


def test_mel_matches_librosa(case):
    root, ref = case
    ve = load_voice_encoder(root)
    for wav, mel in zip(_clips(), ref["mels"], strict=True):
        ours = ve.mel(torch.from_numpy(wav)).numpy()
        assert ours.shape == mel.shape
        np.testing.assert_allclose(ours, mel, rtol=1e-4, atol=1e-6 * mel.max())


def test_embedding_matches_reference(case):
    root, ref = case
    ve = load_voice_encoder(root)
    embeds = [ve(wav).numpy() for wav in _clips()]
    for ours, theirs in zip(embeds, ref["embeds"], strict=True):
        assert ours.shape == (256,)
        np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)
    assert np.abs(embeds[0] - embeds[1]).max() > 1e-3  # different clips, different voices


def test_trim_and_windows():
    wav = _clips()[0]
    trimmed = trim_silence(wav)
    assert 1.4 * 16000 < trimmed.size < 1.9 * 16000  # the quiet ends are cut (hop 512 grid)
    assert trim_silence(np.zeros(16000, dtype=np.float32)).size in (0, 16000)
    starts, needed = partial_starts(100)
    assert starts == [0] and needed == 160
    starts, needed = partial_starts(400)
    assert starts[:3] == [0, 77, 154] and needed == 160 + 77 * (len(starts) - 1)


def test_silent_clip_and_missing_file(case, tmp_path):
    root, _ = case
    ve = load_voice_encoder(root)
    with pytest.raises(ValueError, match="silent"):
        ve(np.zeros(0, dtype=np.float32))
    for name in OTHER_FILES:
        (tmp_path / name).write_bytes(b"")
    with pytest.raises(ChatterboxCheckpointError, match="ve.safetensors"):
        load_voice_encoder(tmp_path)
