"""``bench/families.py --quick`` (each family's tiny folder, 4 frames) reports every figure,
did the same work on both sides (Higgs: greedy codes identical to transformers'; Chatterbox:
greedy T3 tokens identical to upstream ``T3.inference``'s, the same audio length per text), and
the long-lived reference ``Session``s keep state and report errors.

The numbers are timings of a tiny model on a shared machine: the test asserts that every
figure is present, finite and positive, never how large a timing is.
"""

import json
from pathlib import Path

import numpy as np
import pytest

from tests.bench_scripts import SPEECH_TARGETS, check_figures, check_targets, load, positive, run
from tests.higgs_ref.reference import Session

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench" / "families.py"
FRAMES = 4
DELAY = 8

bench = load("families")


def _quick_run(tmp: Path, family: str) -> dict:
    """``--quick`` for one family (one thread each side, OMP too)."""
    out = tmp / "families.json"
    args = ["--quick", "--families", family, "--root", str(tmp), "--out", str(out)]
    args += ["--threads", "1"]
    stdout = run("families", *args, omp_threads=1)
    assert "targets" in stdout and "audio-s/s C=8" in stdout
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    return _quick_run(tmp_path_factory.mktemp("families_bench"), "higgs_audio_v2")


@pytest.fixture(scope="module")
def chatterbox_result(tmp_path_factory) -> dict:
    return _quick_run(tmp_path_factory.mktemp("families_bench_chatterbox"), "chatterbox")


def _check_figures(result: dict, name: str) -> dict:
    """Every figure of family ``name`` present, finite and positive; its figures."""
    assert result["args"]["quick"] and result["args"]["concurrency"] == [1, 4, 8]
    assert list(result["families"]) == [name]
    fam = result["families"][name]
    assert all(positive(n) for n in fam["checkpoint"]["parameters"].values())
    figures = fam["figures"]
    check_figures(
        figures,
        (
            "ttfa_c1_ratio",
            "audio_per_s_ratio",
            "ttfa_p99_cliff_ratio",
            "cpu_per_audio_s_ratio",
            "omnistep_ttfa_c1_s",
            "reference_first_audio_s",
            "reference_audio_s_per_s",
            "reference_rtf",
        ),
    )
    targets = result["targets"]
    check_targets(targets, SPEECH_TARGETS)
    assert all(len(t["paired"]) == 1 for t in targets)
    # (a) is the C=1 TTFA over the reference's whole first call, as printed
    assert targets[0]["value"] == pytest.approx(
        figures["omnistep_ttfa_c1_s"] / figures["reference_first_audio_s"], rel=1e-3
    )
    return figures


def test_quick_run_reports_every_figure(result):
    fam = result["families"]["higgs_audio_v2"]
    assert fam["frames"] == FRAMES and fam["max_new_tokens"] == FRAMES + DELAY
    figures = _check_figures(result, "higgs_audio_v2")
    # 4 frames < first chunk + look-ahead: the first audio came after every step
    first = figures["omnistep_before_first_audio_c1"]
    assert first["ar_calls"] == FRAMES + DELAY  # the prefill (step 1) and 11 AR_TOKEN steps
    assert 0 < first["ar_s"] < first["first_audio_s"] and first["first_vocoder_s"] > 0


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
        assert all(positive(v) for v in burst["split_s"].values())
    ref = rnd["reference"]
    assert [r["text"] for r in ref["requests"]] == list(range(8))
    assert all(r["frames"] == FRAMES for r in ref["requests"])
    assert all(r["audio_s"] == pytest.approx(FRAMES * 0.04) for r in ref["requests"])
    assert all(positive(v) for v in ref["split_s"].values())
    # greedy delayed steps of TEXTS[0]: omnistep's equal transformers' generate, every one
    steps = FRAMES + DELAY
    assert raw["work_check"] == {"steps": [steps, steps], "leading_steps_equal": steps}
    assert raw["reference"]["torch_threads"] == 1 and raw["reference"]["dtype"] == "torch.float32"


def test_chatterbox_quick_run_reports_every_figure(chatterbox_result):
    fam = chatterbox_result["families"]["chatterbox"]
    assert fam["frames"] == FRAMES and fam["max_new_tokens"] == FRAMES  # no delay pattern
    assert sorted(fam["checkpoint"]["parameters"]) == ["hift", "s3gen_flow", "t3"]
    figures = _check_figures(chatterbox_result, "chatterbox")
    # the flow starts when T3 has finished: the first audio came after all of T3's calls
    first = figures["omnistep_before_first_audio_c1"]
    assert first["ar_calls"] == FRAMES  # the prefill (token 1) and 3 steps
    assert 0 < first["ar_s"] < first["first_audio_s"] and first["first_vocoder_s"] > 0


def test_chatterbox_quick_run_did_the_same_work_on_both_sides(chatterbox_result):
    raw = chatterbox_result["families"]["chatterbox"]["raw"]
    (rnd,) = raw["rounds"]
    ref = rnd["reference"]
    assert [r["text"] for r in ref["requests"]] == list(range(8))
    assert all(r["frames"] == FRAMES for r in ref["requests"])  # no stop id within 4 steps
    ref_audio = {r["text"]: r["audio_s"] for r in ref["requests"]}
    for c in (1, 4, 8):
        burst = rnd["ours"][str(c)]
        assert len(burst["requests"]) == c
        for req in burst["requests"]:  # the same greedy tokens give the same audio length
            assert req["frames"] == FRAMES
            assert req["audio_s"] == pytest.approx(ref_audio[req["text"]]) and req["audio_s"] > 0
            assert 0 < req["ttfa_s"] <= req["total_s"]
        assert burst["exec"]["t3"]["ar_token"]["calls"] >= FRAMES - 1
        assert set(burst["split_s"]) == {"t3", "s3gen", "hift"}
        assert all(positive(v) for v in burst["split_s"].values())
    assert set(ref["split_s"]) == {"t3", "s3gen", "hift"}
    assert all(positive(v) for v in ref["split_s"].values())
    # greedy T3 tokens of TEXTS[0] (CFG 0.5): omnistep's equal upstream T3.inference's
    assert raw["work_check"] == {"steps": [FRAMES, FRAMES], "leading_steps_equal": FRAMES}
    assert raw["reference"]["torch_threads"] == 1 and raw["reference"]["dtype"] == "torch.float32"


def test_chatterbox_published_sizes_at_reduced_depth():
    from omnistep.models.chatterbox.t3 import T3Config

    sizes = bench.FAMILIES["chatterbox"].sizes(quick=False, layers=3)
    assert sizes["t3"] == {"num_hidden_layers": 3, "intermediate_size": 4096}
    t3 = T3Config(**sizes["t3"])  # upstream Llama_520M: width 1024, 16 heads of 64
    assert (t3.hidden_size, t3.head_dim, t3.num_hidden_layers) == (1024, 64, 3)
    z = sizes["s3gen"]  # S3Token2Wav's arguments
    assert (z["linear_units"], z["num_blocks"]) == (2048, 6)
    assert (z["channels"], z["n_blocks"], z["num_mid_blocks"], z["num_heads"]) == (256, 4, 12, 8)
    assert (z["base_channels"], z["f0_channels"]) == (512, 512)
    assert bench.FAMILIES["chatterbox"].sizes(quick=True, layers=3)["s3gen"] == {}


def test_chatterbox_reference_session_reports_errors_and_answers_again():
    from tests.chatterbox_ref.bench_ref import Session as ChatterboxSession

    with ChatterboxSession() as ref:
        with pytest.raises(RuntimeError, match="KeyError"):  # nothing loaded yet
            ref.call("bench_generate", text_ids=[1], max_new_tokens=1, cfg_weight=0.5,
                     exaggeration=0.5, seed=0)  # fmt: skip
        assert ref.proc.poll() is None
    assert ref.proc.returncode == 0


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
