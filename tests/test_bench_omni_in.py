"""bench/omni_in.py's argument parsing and sizes, and one small run of its measurements
(a, b, c, d) on the tiny checkpoint (the full-width run is a measurement, not a test)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "bench_omni_in", Path(__file__).resolve().parents[1] / "bench" / "omni_in.py"
)
bench_omni_in = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_omni_in)


def test_defaults_sizes_and_bad_values_exit() -> None:
    args = bench_omni_in.parse_args([])
    assert (args.concurrency, args.clip_seconds, args.parts) == (8, 10.0, ["a", "b", "c", "d"])
    full = bench_omni_in.sizes_of(bench_omni_in.parse_args(["--size", "audio-full"]))
    assert (full.audio_d_model, full.audio_heads, full.audio_ffn, full.audio_layers) == (
        1280,
        20,
        5120,
        2,
    )
    assert bench_omni_in.sizes_of(args).audio_d_model == 32  # tiny: the test sizes
    for bad in (["--parts", "e"], ["--concurrency", "0"], ["--clip-seconds", "301"]):
        with pytest.raises(SystemExit):
            bench_omni_in.parse_args(bad)


def test_a_small_run_writes_every_measurement(tmp_path) -> None:
    out = tmp_path / "omni_in.json"
    argv = ["--root", str(tmp_path / "ckpt"), "--out", str(out), "--rounds", "1"]
    small = ["--question-seconds", "1", "--history-seconds", "2", "--clip-seconds", "1"]
    small += ["--concurrency", "2"]
    record = bench_omni_in.main([*argv, *small, "--thinker-tokens", "2", "--talker-tokens", "8"])
    assert json.loads(out.read_text())["summary"] == record["summary"]
    (row,) = record["rounds"]
    assert 0 < row["omnistep_a"]["ttfa_s"] <= row["omnistep_a"]["total_s"]
    assert row["omnistep_a"]["audio_s"] > 0 and row["transformers_a"]["audio_s"] > 0
    assert len(row["concurrent_b"]) == 2 and all(r["audio_s"] > 0 for r in row["concurrent_b"])
    turn = row["second_turn_c"]
    # the second turn took turn 1's full blocks from the cache; the replay computed them all
    assert turn["kept"]["cached_rows"] > 0 and turn["recomputed"]["cached_rows"] == 0
    assert (
        turn["kept"]["prefill_rows"] + turn["kept"]["cached_rows"]
        == turn["recomputed"]["prefill_rows"]
    )
    assert turn["rows_ratio"] < 1 and record["summary"]["second_turn_rows_ratio"] < 1
    assert sum(row["concurrent_d"]["encoder_calls"]) == 2
    assert row["sequential_d"]["encoder_calls"] == [1, 1]  # one clip per ENCODE call
    summary = record["summary"]
    assert summary["encoder_speedup"] == pytest.approx(
        summary["encoder_sequential_s"] / summary["encoder_concurrent_wall_s"]
    )
