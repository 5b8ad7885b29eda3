"""``bench/voxcpm.py --quick`` (the tiny folder, weights written by upstream's ``VoxCPM2Model``,
4 patches): every figure reported, the same work on both sides (equal stop steps and, given the
same LocDiT noise, upstream's waveform within 1e-4 of omnistep's), the reference's first audio
taken from its streaming generate's first chunk; the published sizes as ``voxcpm``'s config
classes give them.

The numbers are timings of a tiny model on a shared machine: the test asserts that every
figure is present, finite and positive, never how large a timing is.
"""

import json
from pathlib import Path

import pytest

from tests.bench_scripts import SPEECH_TARGETS, check_figures, check_targets, load, positive, run

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench" / "voxcpm.py"
FRAMES = 4  # patches
PATCH_S = 7680 / 48000

families = load("families")


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("voxcpm_bench")
    out = tmp / "voxcpm.json"
    args = ["--quick", "--root", str(tmp), "--out", str(out), "--threads", "1"]
    stdout = run("voxcpm", *args, omp_threads=1)
    assert "targets" in stdout and "streaming generate's first chunk" in stdout
    return json.loads(out.read_text())


def test_quick_run_reports_every_figure(result):
    assert result["args"]["quick"] and result["args"]["concurrency"] == [1, 4, 8]
    assert list(result["families"]) == ["voxcpm2"]
    fam = result["families"]["voxcpm2"]
    assert fam["frames"] == FRAMES
    parts = fam["checkpoint"]["parameters"]
    assert sorted(parts) == ["audio_vae_decoder", "audio_vae_encoder", "lm", "locdit"]
    assert all(positive(n) for n in parts.values())
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
    # (a) is omnistep's C=1 TTFA over the reference's streaming first chunk
    (rnd,) = fam["raw"]["rounds"]
    ref = rnd["reference"]
    assert figures["reference_first_audio_s"] == pytest.approx(ref["first_audio_s"])
    streamed = ref["streaming_call"]
    assert streamed["chunks"] == FRAMES and streamed["samples"] == FRAMES * 7680
    assert 0 < streamed["first_s"] < streamed["seconds"]
    assert targets[0]["value"] == pytest.approx(
        figures["omnistep_ttfa_c1_s"] / ref["first_audio_s"], rel=1e-3
    )
    # omnistep's first audio came after one AR step (the first patch)
    first = figures["omnistep_before_first_audio_c1"]
    assert first["ar_calls"] == 1 and 0 < first["ar_s"] < first["first_audio_s"]


def test_quick_run_did_the_same_work_on_both_sides(result):
    raw = result["families"]["voxcpm2"]["raw"]
    (rnd,) = raw["rounds"]
    for c in (1, 4, 8):
        burst = rnd["ours"][str(c)]
        assert len(burst["requests"]) == c
        for req in burst["requests"]:  # the stop head never stops: the cap ends it
            assert req["frames"] == FRAMES and req["audio_s"] == pytest.approx(FRAMES * PATCH_S)
            assert 0 < req["ttfa_s"] <= req["total_s"]
        assert set(burst["split_s"]) == {"lm", "vae"}
        assert all(positive(v) for v in burst["split_s"].values())
    ref = rnd["reference"]
    assert [r["text"] for r in ref["requests"]] == list(range(8))
    assert all(r["frames"] == FRAMES for r in ref["requests"])
    assert all(r["audio_s"] == pytest.approx(FRAMES * PATCH_S) for r in ref["requests"])
    assert all(positive(v) for v in ref["split_s"].values())
    work = raw["work_check"]
    assert work["steps"] == [FRAMES, FRAMES] and work["leading_steps_equal"] == FRAMES
    wave = work["waveform"]  # the same LocDiT noise: the same waveform
    assert wave["samples"] == [FRAMES * 7680] * 2 and wave["noises_left"] == 0
    assert wave["max_abs_diff"] < 1e-4 < wave["reference_peak"]
    assert raw["reference"]["torch_threads"] == 1 and raw["reference"]["dtype"] == "torch.float32"


def test_published_sizes_at_reduced_depth():
    """The widths ``voxcpm``'s config classes (and the published LM block) give, 3 layers in
    each stack."""
    config = families.FAMILIES["voxcpm2"].sizes(quick=False, layers=3)["config"]
    lm = config["lm_config"]
    assert (lm["hidden_size"], lm["intermediate_size"], lm["num_hidden_layers"]) == (2048, 6144, 3)
    assert (lm["num_attention_heads"], lm["num_key_value_heads"], lm["kv_channels"]) == (16, 2, 128)
    assert (config["patch_size"], config["feat_dim"], config["residual_lm_num_layers"]) == (
        4,
        64,
        3,
    )
    assert config["scalar_quantization_latent_dim"] == 512 and config["residual_lm_no_rope"]
    for part in ("encoder_config", "dit_config"):
        block = config[part]
        assert (block["hidden_dim"], block["ffn_dim"], block["num_heads"]) == (1024, 4096, 16)
        assert block["num_layers"] == 3 and block["kv_channels"] == 128
    vae = config["audio_vae_config"]
    assert (vae["encoder_dim"], vae["decoder_dim"], vae["latent_dim"]) == (128, 2048, 64)
    assert (vae["sample_rate"], vae["out_sample_rate"]) == (16000, 48000)
    assert families.FAMILIES["voxcpm2"].sizes(quick=True, layers=3) == {"config": {}}
