"""``bench/qwen3_omni.py --quick`` (the tiny folder, 4 reply tokens, 4 talker frames, the
reference over 3 texts) reports every figure and did the same work on both sides (greedy text
ids and 16-codebook frames equal to transformers' ``generate``); the published-width config
has the published widths.

The numbers are timings of a tiny model on a shared machine: the test asserts that every
figure is present, finite and positive, never how large a timing is.
"""

import json
import math
from pathlib import Path

import pytest

from tests.bench_scripts import SPEECH_TARGETS, check_figures, check_targets, load, positive, run

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench" / "qwen3_omni.py"
FRAMES = 4
TOKENS = 4
REF_TEXTS = 3

bench = load("qwen3_omni")


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("qwen3_omni_bench")
    out = tmp / "qwen3_omni.json"
    args = ["--quick", "--root", str(tmp), "--out", str(out), "--threads", "1"]
    args += ["--moe-reps", "3", "--reference-texts", str(REF_TEXTS), "--json"]
    stdout = run("qwen3_omni", *args, omp_threads=1)
    assert "targets" in stdout and "(d) MoE step at 16 rows" in stdout
    record = json.loads(out.read_text())
    # --json prints the same record
    assert '"targets"' in stdout and f'"seconds": {record["seconds"]}' in stdout
    return record


def test_quick_run_reports_every_figure(result):
    assert result["args"]["quick"] and result["args"]["concurrency"] == [1, 4, 8]
    assert result["args"]["frames"] == FRAMES and result["args"]["text_tokens"] == TOKENS
    params = result["checkpoint"]["parameters"]
    assert all(positive(params[k]) for k in ("thinker_text", "talker", "code2wav"))
    figures = result["figures"]
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
            "moe_step_floor_ratio",
            "moe_talker_step_floor_ratio",
        ),
    )
    targets = result["targets"]
    check_targets(targets, (*SPEECH_TARGETS, (1.3, "<=")))
    # (a) is the C=1 TTFA over the reference's whole first call, as printed
    assert targets[0]["value"] == pytest.approx(
        figures["omnistep_ttfa_c1_s"] / figures["reference_first_audio_s"], rel=1e-3
    )
    # (d): step and floor timed on the same routing; the ratio is theirs (CPU time here)
    d = result["moe"]["thinker"]
    assert d["ratio_basis"] == "ratio_cpu" and d["active_experts"] >= 2
    assert d["ratio"] == pytest.approx(d["times"]["step"]["cpu_s"] / d["times"]["floor"]["cpu_s"],
                                       rel=1e-2)  # fmt: skip
    assert targets[3]["value"] == pytest.approx(d["ratio"], abs=1e-4)
    first = figures["omnistep_before_first_audio_c1"]  # the talker's calls before it
    assert first["ar_calls"] >= 1 and 0 < first["ar_s"] < first["first_audio_s"]


def test_quick_run_did_the_same_work_on_both_sides(result):
    raw = result["raw"]
    (rnd,) = raw["rounds"]
    for c in (1, 4, 8):
        burst = rnd["ours"][str(c)]
        assert len(burst["requests"]) == c
        for req in burst["requests"]:  # random weights: no codec EOS within 4 frames
            assert req["frames"] == FRAMES
            assert req["audio_s"] == pytest.approx((FRAMES * 1920 - 555) / 24000)
            assert 0 < req["ttfa_s"] <= req["total_s"]
        assert set(burst["split_s"]) == {"thinker", "talker", "code2wav"}
        assert all(positive(v) for v in burst["split_s"].values())
    ref = rnd["reference"]
    assert [r["text"] for r in ref["requests"]] == list(range(REF_TEXTS))  # --reference-texts
    assert all(r["frames"] == FRAMES for r in ref["requests"])
    assert all(r["audio_s"] == pytest.approx((FRAMES * 1920 - 555) / 24000)
               for r in ref["requests"])  # fmt: skip
    assert all(positive(v) for v in ref["split_s"].values())
    # greedy reply ids and 16-codebook frames of TEXTS[0]: equal to transformers' generate
    assert raw["work_check"] == {
        "text_tokens": [TOKENS, TOKENS],
        "text_equal": True,
        "steps": [FRAMES, FRAMES],
        "leading_steps_equal": FRAMES,
    }
    assert raw["reference"]["torch_threads"] == 1 and raw["reference"]["dtype"] == "torch.float32"


def test_work_check_compares_text_and_frames():
    import numpy as np

    family = bench.Qwen3OmniFamily()
    codes = np.arange(5 * 16).reshape(5, 16)
    other = codes.copy()
    other[2, 15] += 1
    ours = {"text": [1, 2, 3], "codes": codes}
    assert family.work_check(ours, {"text": [1, 2, 4], "codes": other}) == {
        "text_tokens": [3, 3],
        "text_equal": False,
        "steps": [5, 5],
        "leading_steps_equal": 2,
    }
    assert family.work_check(ours, ours)["text_equal"] is True
    # a stream of T frames is T * 1920 - 555 samples
    assert family.frames_of(None, 24 * 1920 - 555) == 24 and family.frames_of(None, 0) == 0


def test_published_widths_at_reduced_depth():
    cfg = bench.published_config(layers=3, talker_layers=2, experts=16)
    text = cfg["thinker_config"]["text_config"]
    assert (text["hidden_size"], text["num_hidden_layers"], text["num_experts"]) == (2048, 3, 16)
    assert (text["num_attention_heads"], text["num_key_value_heads"], text["head_dim"]) == (
        32, 4, 128)  # fmt: skip
    assert (text["moe_intermediate_size"], text["num_experts_per_tok"]) == (768, 8)
    assert text["rope_parameters"]["mrope_section"] == [24, 20, 20] and text["norm_topk_prob"]
    talker = cfg["talker_config"]["text_config"]
    assert (talker["hidden_size"], talker["num_hidden_layers"], talker["num_experts"]) == (
        1024, 2, 16)  # fmt: skip
    assert (talker["num_attention_heads"], talker["num_key_value_heads"]) == (16, 2)
    assert talker["moe_intermediate_size"] == 384
    assert talker["shared_expert_intermediate_size"] == 768
    assert talker["vocab_size"] == 3072 and not talker["norm_topk_prob"]
    cp = cfg["talker_config"]["code_predictor_config"]
    assert (cp["hidden_size"], cp["num_hidden_layers"], cp["intermediate_size"]) == (1024, 5, 3072)
    assert (cp["num_code_groups"], cp["vocab_size"]) == (16, 2048)
    wav = cfg["code2wav_config"]
    assert (wav["hidden_size"], wav["num_hidden_layers"], wav["decoder_dim"]) == (1024, 8, 1536)
    assert math.prod(wav["upsample_rates"] + wav["upsampling_ratios"]) == 1920
    assert bench.Qwen3OmniFamily().sizes(quick=True, layers=3) == {}
