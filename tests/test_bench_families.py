"""``bench/families.py --quick`` (tiny Higgs folder, 4 frames) reports every figure, did the
same work on both sides (greedy codes identical to transformers'), and its long-lived
reference ``Session`` keeps state and reports errors.

The numbers are timings of a tiny model on a shared machine: the test asserts that every
figure is present, finite and positive, never how large a timing is.
"""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.higgs_ref.reference import Session

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench" / "families.py"
FRAMES = 4
DELAY = 8

_spec = importlib.util.spec_from_file_location("bench_families", BENCH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def _positive(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) and x > 0


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("families_bench")
    out = tmp / "families.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    args = ["--quick", "--root", str(tmp), "--out", str(out), "--threads", "1"]
    done = subprocess.run(
        [sys.executable, str(BENCH), *args], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert "targets" in done.stdout and "audio-s/s C=8" in done.stdout
    return json.loads(out.read_text())


def test_quick_run_reports_every_figure(result):
    assert result["args"]["quick"] and result["args"]["concurrency"] == [1, 4, 8]
    assert list(result["families"]) == ["higgs_audio_v2"]
    fam = result["families"]["higgs_audio_v2"]
    assert fam["frames"] == FRAMES and fam["max_new_tokens"] == FRAMES + DELAY
    assert all(_positive(n) for n in fam["checkpoint"]["parameters"].values())
    figures = fam["figures"]
    for key in (
        "ttfa_c1_ratio",
        "audio_per_s_ratio",
        "ttfa_p99_cliff_ratio",
        "cpu_per_audio_s_ratio",
        "omnistep_ttfa_c1_s",
        "reference_first_audio_s",
        "reference_audio_s_per_s",
        "reference_rtf",
    ):
        assert _positive(figures[key]), key
    for key in ("omnistep_audio_s_per_s", "omnistep_ttfa_p99_s", "omnistep_rtf"):
        assert sorted(figures[key], key=int) == ["1", "4", "8"]
        assert all(_positive(v) for v in figures[key].values()), key
    targets = result["targets"]
    assert [t["target"] for t in targets] == [0.25, 4.0, 1.5]
    assert [t["op"] for t in targets] == ["<=", ">=", "<="]
    assert all(_positive(t["value"]) and isinstance(t["met"], bool) for t in targets)
    assert all(len(t["paired"]) == 1 for t in targets)
    # 4 frames < first chunk + look-ahead: the first audio came after every step
    first = figures["omnistep_before_first_audio_c1"]
    assert first["ar_calls"] == FRAMES + DELAY  # the prefill (step 1) and 11 AR_TOKEN steps
    assert 0 < first["ar_s"] < first["first_audio_s"] and first["first_vocoder_s"] > 0
    # (a) is the C=1 TTFA over the reference's whole first call, as printed
    assert targets[0]["value"] == pytest.approx(
        figures["omnistep_ttfa_c1_s"] / figures["reference_first_audio_s"], rel=1e-3
    )


def test_quick_run_did_the_same_work_on_both_sides(result):
    raw = result["families"]["higgs_audio_v2"]["raw"]
    (rnd,) = raw["rounds"]
    for c in (1, 4, 8):
        burst = rnd["ours"][str(c)]
        assert len(burst["requests"]) == c
        for req in burst["requests"]:  # random weights: no EOS within 12 steps
            assert req["frames"] == FRAMES and req["audio_s"] == pytest.approx(FRAMES * 0.04)
            assert 0 < req["ttfa_s"] <= req["total_s"]
        assert burst["exec"]["lm"]["ar_token"]["calls"] >= FRAMES + DELAY - 1
        assert burst["exec"]["codec"]["audio_chunk"]["units"] >= c
        assert all(_positive(v) for v in burst["split_s"].values())
    ref = rnd["reference"]
    assert [r["text"] for r in ref["requests"]] == list(range(8))
    assert all(r["frames"] == FRAMES for r in ref["requests"])
    assert all(r["audio_s"] == pytest.approx(FRAMES * 0.04) for r in ref["requests"])
    assert all(_positive(v) for v in ref["split_s"].values())
    # greedy delayed steps of TEXTS[0]: omnistep's equal transformers' generate, every one
    steps = FRAMES + DELAY
    assert raw["work_check"] == {"steps": [steps, steps], "leading_steps_equal": steps}
    assert raw["reference"]["torch_threads"] == 1 and raw["reference"]["dtype"] == "torch.float32"


def test_work_check_counts_the_leading_equal_steps():
    a = np.arange(5 * 8).reshape(5, 8)
    b = a.copy()
    b[3, 7] += 1
    assert bench.work_check(a, b) == {"steps": [5, 5], "leading_steps_equal": 3}
    assert bench.work_check(a, a[:4]) == {"steps": [5, 4], "leading_steps_equal": 4}
    assert bench.work_check(a[:0], a) == {"steps": [0, 5], "leading_steps_equal": 0}


def test_published_sizes_are_transformers_defaults_at_reduced_depth():
    sizes = bench.FAMILIES["higgs_audio_v2"].sizes(quick=False, layers=3)
    lm, codec = sizes["lm"], sizes["codec"]
    assert (lm["hidden_size"], lm["intermediate_size"], lm["num_hidden_layers"]) == (3072, 8192, 3)
    assert (lm["num_attention_heads"], lm["num_key_value_heads"], lm["head_dim"]) == (24, 8, 128)
    assert lm["rope_parameters"]["rope_type"] == "llama3"
    acoustic = codec["acoustic_model_config"]
    assert acoustic["upsampling_ratios"] == [8, 5, 4, 2, 3]  # 960 samples: 25 frames/s
    assert (acoustic["decoder_hidden_size"], acoustic["hidden_size"]) == (1024, 256)
    assert (codec["codebook_size"], codec["codebook_dim"]) == (1024, 64)
    assert codec["semantic_model_config"]["hidden_size"] == 768
    assert bench.FAMILIES["higgs_audio_v2"].sizes(quick=True, layers=3) == {"lm": {}, "codec": None}


def test_reference_session_reports_errors_and_answers_again():
    """(The quick run above loads once and generates many times in one Session: its state.)"""
    with Session() as ref:
        with pytest.raises(RuntimeError, match="no attribute 'missing'"):
            ref.call("missing")
        with pytest.raises(RuntimeError, match="KeyError"):  # nothing loaded yet
            ref.call("bench_generate", ids=[1], audio=[], max_new_tokens=1)
        assert ref.proc.poll() is None  # the same process answers after errors
    assert ref.proc.returncode == 0
