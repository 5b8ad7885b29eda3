"""``bench/qwen3_tts.py --quick`` (tiny sizes, 3 frames) reports every figure, and the
long-lived reference subprocess it uses (``ReferenceSession``) keeps state and reports errors.

The benchmark's numbers are timings of a tiny model on a shared machine: the test asserts that
every figure is present, finite and positive and that both sides made the frames asked for,
never how large a timing is.
"""

import json
import os
from pathlib import Path

import numpy as np
import pytest

from tests.bench_scripts import SPEECH_TARGETS, check_figures, check_targets, load, positive, run
from tests.qwen3_tts_ref.env import ReferenceRunError, ReferenceSession

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench" / "qwen3_tts.py"
FRAMES = 3

bench = load("qwen3_tts")


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("qwen3_tts_bench")
    out = tmp / "qwen3_tts.json"
    args = ["--quick", "--root", str(tmp / "ckpt"), "--out", str(out), "--threads", "1"]
    stdout = run("qwen3_tts", *args, omp_threads=None)
    assert "targets" in stdout and "frames/s C=8" in stdout
    return json.loads(out.read_text())


def test_quick_run_reports_every_figure(result):
    assert result["args"]["quick"] and result["args"]["frames"] == FRAMES
    assert result["args"]["concurrency"] == [1, 4, 8]
    assert result["checkpoint"]["layers"] == {"talker": 2, "code_predictor": 2, "codec_decoder": 2}
    assert all(positive(n) for n in result["checkpoint"]["parameters"].values())
    figures = result["figures"]
    check_figures(
        figures,
        (
            "ttfa_c1_ratio",
            "frames_per_s_ratio",
            "ttfa_p99_cliff_ratio",
            "ttfa_p50_cliff_ratio",
            "cpu_per_frame_ratio",
            "omnistep_ttfa_c1_s",
            "qwen_tts_first_utterance_s",
            "qwen_tts_frames_per_s",
            "qwen_tts_rtf",
        ),
        per_level=("omnistep_frames_per_s", "omnistep_ttfa_p99_s", "omnistep_rtf"),
    )
    check_targets(result["targets"], SPEECH_TARGETS)
    assert all(len(t["paired"]) == 1 for t in result["targets"])


def test_quick_run_did_the_same_work_on_both_sides(result):
    (rnd,) = result["raw"]["rounds"]
    for c in (1, 4, 8):
        burst = rnd["ours"][str(c)]
        assert len(burst["requests"]) == c
        for req in burst["requests"]:  # random weights: no EOS within 3 frames
            assert req["frames"] == FRAMES and req["audio_s"] == pytest.approx(FRAMES * 0.08)
            assert 0 < req["ttfa_s"] <= req["total_s"]
        assert all(positive(v) for v in burst["split_s"].values())
        assert burst["exec"]["talker"]["ar_token"]["calls"] >= FRAMES - 1
        assert burst["exec"]["codec"]["audio_chunk"]["units"] >= c
    ref = rnd["ref_sequential"]
    assert [r["text"] for r in ref["requests"]] == list(range(8))
    assert all(r["frames"] == FRAMES for r in ref["requests"])
    assert all(positive(v) for v in ref["split_s"].values())
    assert result["raw"]["work_check"] == {"frames": [FRAMES, FRAMES], "leading_frames_equal": 3}
    assert result["raw"]["qwen_tts"]["torch_threads"] == 1


def test_work_check_counts_the_leading_equal_frames():
    a = np.arange(5 * 16).reshape(5, 16)
    b = a.copy()
    b[3, 7] += 1
    assert bench.work_check(a, b) == {"frames": [5, 5], "leading_frames_equal": 3}
    assert bench.work_check(a, a[:4]) == {"frames": [5, 4], "leading_frames_equal": 4}
    assert bench.work_check(a[:0], a) == {"frames": [0, 5], "leading_frames_equal": 0}


def test_reference_session_keeps_state_and_reports_errors():
    with ReferenceSession() as ref:
        module = "tests.qwen3_tts_ref.env"
        assert ref.call(f"{module}:install_stubs") is None  # idempotent: stubs already there
        with pytest.raises(ReferenceRunError, match="no attribute 'missing'"):
            ref.call(f"{module}:missing")
        # the same process answers again, with the stubs it installed at start still in place
        assert ref.call("os:getpid") == ref.pid
        assert ref.call("os:getenv", key="PYTHONPATH").split(os.pathsep)[0].endswith("qwen-tts")
    assert ref.proc.returncode == 0
