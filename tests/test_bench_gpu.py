"""The benchmarks' ``--device`` option on the CPU, and ``bench/gpu.sh``'s checks (no GPU here).

``bench/ar_decode.py`` and ``bench/rollout.py`` run once each, as ``bench/gpu.sh --quick``
runs them (the servable tiny checkpoint, a few tokens), with ``--device cpu``; the tests assert
that every figure the GPU run reports is present, positive and says where it ran, never on a
timing's size. ``bench/gpu.sh`` itself is checked where it must stop: no CUDA and no
``--allow-cpu``. Its whole dry run (``--allow-cpu --quick``) takes a minute: run it by hand.
"""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
TOKENS = 4

_spec = importlib.util.spec_from_file_location("bench_gpu_support", BENCH / "gpu_support.py")
gpu_support = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_support)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


def _run(args: list[str], timeout: int = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], cwd=REPO, env=_env(), capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip


def _positive(x: object) -> bool:
    return isinstance(x, int | float) and math.isfinite(x) and x > 0


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    """Both benchmarks on the CPU, tiny sizes, into one folder (as gpu.sh's $OUT)."""
    out = tmp_path_factory.mktemp("gpu_bench")
    root = out / "ckpt"  # written by the first benchmark, reused by the second
    common = ["--device", "cpu", "--size", "tiny", "--root", str(root), "--threads", "1"]
    for script, extra in (
        ("ar_decode.py", ["--concurrency", "1,2", "--rounds", "1"]),
        ("rollout.py", ["--inputs", "2", "--n", "2", "--update-reps", "1"]),
    ):
        name = script.removesuffix(".py")
        args = [str(BENCH / script), *common, *extra, "--tokens", str(TOKENS)]
        done = _run([*args, "--out", str(out / f"{name}.json")])
        assert done.returncode == 0, (
            f"{script} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        )
    return out


@pytest.mark.slow  # runs both benchmarks (~40-100 s): `pytest -m slow tests/test_bench_gpu.py`
def test_ar_decode_device_option_reports_every_figure(results):
    res = json.loads((results / "ar_decode.json").read_text())
    assert res["args"]["device"] == "cpu" and res["machine"]["device"] == "cpu"
    assert res["args"]["size"] == "tiny"
    raw = res["raw"]
    floors = raw["rounds"][0]["gemm_floor"]
    assert sorted(floors, key=int) == ["1", "2", "8"]  # 1, the upstream batch, C max
    for floor in floors.values():
        assert floor["device"] == "cpu" and floor["gemms"] == 14  # 2 layers x 7 linears
        assert _positive(floor["ms_per_step"]) and floor["reps"] == 3
    assert all(_positive(v) for v in res["gemm_floor_ms_per_step"].values())
    for c in ("1", "2"):
        burst = raw["rounds"][0]["ours"][c]
        assert burst["all_exact"] and burst["frames"] == int(c) * TOKENS
        assert _positive(burst["tok_s"]) and _positive(burst["ttfa_p50_s"])
        assert burst["exec"]["gpt"]["ar_token"]["calls"] >= TOKENS - 1
    assert raw["omnistep_default"]["device"] == "cpu"
    # every section ran (none recorded an error)
    assert raw["batch_invariant"]["device"] == "cpu"
    assert sorted(raw["batch_invariant"]["bursts"]) == ["1", "2"]
    assert sorted(raw["lookahead"], key=int) == ["8", "16", "32"]
    assert all("bursts" in v and "error" not in v for v in raw["lookahead"].values())
    for key in ("upstream_single", "upstream_batch"):
        assert _positive(raw["rounds"][0][key]["tok_s"])
    assert _positive(raw["rounds"][0]["upstream_stream"]["ttfa_s"])
    assert [t["name"][:3] for t in res["targets"]] == ["(a)", "(b)", "(b)", "(c)"]
    assert all(_positive(t["value"]) for t in res["targets"])
    assert all(_positive(v) for v in res["gpt_only_tok_s"].values())


@pytest.mark.slow  # runs both benchmarks (~40-100 s): `pytest -m slow tests/test_bench_gpu.py`
def test_rollout_device_option_reports_every_figure(results):
    res = json.loads((results / "rollout.json").read_text())
    assert res["args"]["device"] == "cpu" and res["device"]["device"] == "cpu"
    ours, total = res["ours"], 2 * 2
    for key in ("floor_ms", "floor_f_linear_ms", "standalone_step_ms"):
        assert sorted(ours[key], key=int) == ["1", str(total)]
        assert all(_positive(v) for v in ours[key].values()), key
    groups, independent = ours["groups"], ours["independent"]
    assert groups["frames"] == total * TOKENS
    assert _positive(groups["tok_s"]) and _positive(independent["tok_s"])
    assert _positive(groups["step_ms_16"]) and _positive(ours["single_step_ms_1"])
    # a group prefills each input once: half the prompt rows of 2 inputs x 2 samples
    assert 0 < groups["prefill_rows"] < independent["prefill_rows"]
    update = ours["update_weights"]
    assert update["tensors"] > 0 and update["bytes"] > 0 and _positive(update["seconds_median"])
    assert _positive(res["upstream"]["single"]["tok_s"])
    assert _positive(res["upstream"]["lockstep"]["tok_s"])
    assert res["ratios"]["prefill_rows_saved"] == pytest.approx(0.5)
    assert all(_positive(v) for v in res["ratios"].values())


@pytest.mark.slow  # runs both benchmarks (~40-100 s): `pytest -m slow tests/test_bench_gpu.py`
def test_summary_collects_the_headline_figures(results):
    assert gpu_support.main(["summary", str(results), "--steps", "ar_decode=0", "rollout=124"]) == 0
    summary = json.loads((results / "gpu_summary.json").read_text())
    assert summary["steps"] == {"ar_decode": 0, "rollout": 124}
    assert len(summary["ar_decode"]["targets"]) == 4
    assert summary["ar_decode"]["section_errors"] == {}
    assert summary["rollout"]["update_weights_s"] > 0
    assert sorted(summary["rollout"]["upstream_tok_s"]) == ["lockstep", "single"]
    text = (results / "gpu_summary.txt").read_text()
    assert text.startswith("steps: ar_decode ok, rollout TIMED OUT\n")
    assert "(a) ours C=1 tok/s / upstream single" in text and "update_weights" in text


def test_summary_names_missing_results(tmp_path):
    summary = gpu_support.summarize(tmp_path, {"ar_decode": 1})
    assert "missing" in summary["ar_decode"] and "missing" in summary["rollout"]
    text = gpu_support.summary_text(summary)
    assert "ar_decode FAILED (exit 1)" in text and "rollout: no result" in text


def test_device_cuda_without_a_gpu_is_one_clear_error(tmp_path):
    if _cuda_here():
        pytest.skip("this machine has CUDA")
    done = _run([str(BENCH / "rollout.py"), "--device", "cuda", "--out", str(tmp_path / "x")])
    assert done.returncode != 0
    assert "DeviceUnavailableError" in done.stderr and "use --device cpu" in done.stderr
    assert not (tmp_path / "x").exists()


def test_gpu_sh_stops_without_cuda_unless_allowed(tmp_path):
    if _cuda_here():
        pytest.skip("this machine has CUDA")
    env = {**_env(), "PYTHON": sys.executable, "OUT": str(tmp_path)}
    done = subprocess.run(
        ["bash", str(BENCH / "gpu.sh")], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 3, done.stdout + done.stderr
    assert "CUDA is not available" in done.stderr and "--allow-cpu" in done.stderr
    # the log (in $OUT from the start) says what each python's torch is
    log = (tmp_path / "gpu.log").read_text()
    assert f"{sys.executable}: torch " in log and "sees a GPU: False" in log
    assert not (tmp_path / "ar_decode.json").exists()


def test_gpu_sh_rejects_unknown_options():
    done = subprocess.run(["bash", str(BENCH / "gpu.sh"), "--fast"], capture_output=True, text=True)
    assert done.returncode == 2 and "unknown option '--fast'" in done.stderr


def test_wheel_pins_follow_the_makefile(tmp_path):
    pins = gpu_support.wheel_pins()
    reference = gpu_support.reference_pins()
    # the upstream reference packages carry the Makefile's own pins
    assert pins["ChatTTS"] == reference["chattts"] and pins["vocos"] == reference["vocos"]
    assert all("==" in spec for spec in pins.values())
    makefile = tmp_path / "Makefile"
    makefile.write_text("REFERENCE_PKGS := chattts==1.0 vocos \\\n\tx==2\n")
    with pytest.raises(ValueError, match="'vocos' is not name==version"):
        gpu_support.reference_pins(makefile)
    makefile.write_text("REFERENCE_PKGS := chattts==1.0 \\\n\tvocos==2\n")
    assert gpu_support.reference_pins(makefile) == {"chattts": "chattts==1.0", "vocos": "vocos==2"}
    with pytest.raises(ValueError, match="lacks"):
        gpu_support.wheel_pins(makefile)


def test_nothing_is_missing_in_the_test_venv():
    # every package the GPU run needs is one the test venv has (make install-test)
    assert gpu_support.missing_modules(gpu_support.required()) == []
    assert gpu_support.missing_modules(["no_such_module_xyz"]) == ["no_such_module_xyz"]


def _cuda_here() -> bool:
    import torch

    return torch.cuda.is_available()


def test_venv_specs_come_from_the_test_extra(tmp_path):
    assert [s.split(">")[0] for s in gpu_support.venv_specs()] == ["einops", "numba"]
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project.optional-dependencies]\ntest = ["einops==0.8", "pytest"]\n')
    with pytest.raises(ValueError, match="lacks \\['numba'\\]"):
        gpu_support.venv_specs(pyproject)
