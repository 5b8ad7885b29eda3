"""bench/moe.py's argument parsing and expert grouping, and one tiny run (the full-width run is
a measurement, not a test)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

_spec = importlib.util.spec_from_file_location(
    "bench_moe", Path(__file__).resolve().parents[1] / "bench" / "moe.py"
)
bench_moe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_moe)


def test_defaults_are_the_thinker_widths_and_bad_values_exit() -> None:
    args = bench_moe.parse_args([])
    assert (args.hidden, args.inner, args.top_k, args.rows) == (2048, 768, 8, 16)
    assert args.experts == 32 and args.device == "cpu" and not args.batch_invariant
    assert bench_moe.parse_args(["--experts", "128", "--shared", "512"]).shared == 512
    for bad in (["--top-k", "40"], ["--rows", "0"], ["--dtype", "int8"]):
        with pytest.raises(SystemExit):
            bench_moe.parse_args(bad)


def test_expert_groups_list_each_active_expert_with_its_rows() -> None:
    ids = torch.tensor([[3, 0], [0, 5], [5, 3]])
    groups = bench_moe.expert_groups(ids, 6)
    assert [(e, rows.tolist()) for e, rows in groups] == [(0, [0, 1]), (3, [0, 2]), (5, [1, 2])]


def test_a_tiny_run_writes_its_record(tmp_path) -> None:
    out = tmp_path / "moe.json"
    argv = ["--hidden", "64", "--inner", "32", "--experts", "4", "--top-k", "2", "--reps", "1"]
    bench_moe.main([*argv, "--batch-invariant", "--threads", "1", "--out", str(out)])
    record = json.loads(out.read_text())
    assert set(record["times"]) == {"step", "floor", "step_batch_invariant"}
    assert record["times"]["floor"]["ratio_wall"] == 1.0
    assert 1 <= record["active_experts"] <= 4 and record["ratio_basis"] == "ratio_cpu"
