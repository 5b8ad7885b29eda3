"""bench/dit_joins.py's pure helpers: the grid, joins, the near-join mask, what the first audio
waits for, and the error statistics (no model runs)."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import numpy as np
import pytest

from omnistep.models.qwen2_5_omni.dit import DiTChunking

PATH = Path(__file__).resolve().parents[1] / "bench" / "dit_joins.py"
_spec = importlib.util.spec_from_file_location("bench_dit_joins", PATH)
dit_joins = importlib.util.module_from_spec(_spec)
sys.modules["bench_dit_joins"] = dit_joins
_spec.loader.exec_module(dit_joins)


def test_grid_and_settings() -> None:
    settings = dit_joins.grid([1, 3, 6], [0, 1, 2, 4, 8], [0, 1, 2, 4])
    assert len(settings) == 60 and len(set(settings)) == 60
    assert settings[0] == DiTChunking(1, 1, 0, 0) and settings[-1] == DiTChunking(6, 6, 8, 4)
    assert dit_joins.parse_setting(" 3/3/2/1") == DiTChunking(3, 3, 2, 1)
    assert dit_joins.parse_setting("auto/auto/2/1") == DiTChunking()  # the card's default
    assert dit_joins.label(DiTChunking()) == "auto/auto/2/1"
    assert dit_joins.parse_setting("auto/6/2/1") == DiTChunking(None, 6, 2, 1)
    assert dit_joins.label(DiTChunking(6, 3, 0, 2)) == "6/3/0/2"
    with pytest.raises(ValueError, match="first/chunk/left/ahead"):
        dit_joins.parse_setting("3/3/2")


def test_joins_and_near_join_mask() -> None:
    windows = DiTChunking(3, 3, 2, 1).windows(60, 8)  # chunks [0, 24), [24, 48), [48, 60)
    assert dit_joins.join_frames(windows) == [24, 48]
    mask = dit_joins.near_join_mask(60, [24, 48], 8)
    assert np.flatnonzero(mask).tolist() == list(range(16, 32)) + list(range(40, 56))
    assert not dit_joins.near_join_mask(10, [], 8).any()


def test_first_audio_waits_for_the_vocoder_frames() -> None:
    # block 24 (official): one window of 3 chunk blocks + 1 look-ahead covers the 54 frames
    w = DiTChunking(3, 3, 2, 1).windows(300, 24)
    got = dit_joins.first_audio(w, repeats=2, vocoder_frames=54)
    assert got == {"codes_dit": 48, "codes_audio": 48, "frames_audio": 96, "windows_audio": 1}
    # chunks of one block start the DiT earlier but need three windows before the vocoder
    w = DiTChunking(1, 1, 2, 1).windows(300, 24)
    got = dit_joins.first_audio(w, repeats=2, vocoder_frames=54)
    assert got["codes_dit"] == 24 and got["codes_audio"] == 48 and got["windows_audio"] == 3
    assert got["frames_audio"] == 48 + 72 + 96  # windows [0, 48), [0, 72), [0, 96)
    # an utterance shorter than the vocoder's first chunk: every window
    w = DiTChunking(1, 1, 0, 0).windows(40, 8)
    assert dit_joins.first_audio(w, 2, 54)["windows_audio"] == 5


def test_error_statistics() -> None:
    stats = dit_joins.abs_stats(np.array([[-0.5, 0.1], [0.2, 0.0]]), scale=2.0)
    assert stats["max"] == 0.5 and math.isclose(stats["mean"], 0.2)
    assert stats["max_rel"] == 0.25 and math.isclose(stats["mean_rel"], 0.1)
    assert dit_joins.abs_stats(np.zeros((2, 0)), 1.0)["max"] is None
    ref = np.array([1.0, -1.0])
    assert math.isclose(dit_joins.snr_db(ref, np.array([1.1, -0.9])), 20.0)
    assert dit_joins.snr_db(ref, ref.copy()) == math.inf
    assert dit_joins.snr_db(ref[:0], ref[:0]) is None
    whole = np.array([[0.0, 2.0, 0.0, 2.0]] * 2)  # std 1
    mel = whole.copy()
    mel[:, 1] += 0.3  # an error on a near-join frame only
    near = np.array([False, True, True, False])
    wave = np.ones(8)
    e = dit_joins.errors(whole, mel, wave, wave + 0.01, near, hop=2)
    assert math.isclose(e["mel_near"]["max"], 0.3) and e["mel_else"]["max"] == 0.0
    assert e["mel_std"] == 1.0 and math.isclose(e["mel_near"]["max_rel"], 0.3)
    assert math.isclose(e["wave_max"], 0.01) and math.isclose(e["wave_snr_db"], 40.0)
    assert dit_joins._finite({"a": [math.inf, 1.0]}) == {"a": ["inf", 1.0]}
