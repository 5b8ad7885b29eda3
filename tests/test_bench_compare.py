"""``bench/compare.py``: the combined table from canned benchmark JSON, and failed runs.

No benchmark runs here: the JSON files are small copies of what ``bench/speech.py``,
``bench/ar_decode.py`` and ``bench/omni.py`` write, and the "benchmarks" are tiny commands.
"""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[1] / "bench" / "compare.py"
_spec = importlib.util.spec_from_file_location("bench_compare", PATH)
compare = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compare)


def speech_json() -> dict:
    """The keys of bench/speech.py's result the table uses, as that script builds them."""
    return {
        "text": "...",
        "voices": [{"voice": "piper", "levels": [{"concurrency": 1, "ttfa_p50_s": 1.75}]}],
        "targets": [
            target("piper: TTFA p50 (C=1) / own first sentence", 0.7324, "<=", 1.1, True,
                   [0.82, 0.73, 0.71]),
            target("piper: audio-s/s (C=8) / own sequential audio-s/s", 0.91, ">=", 1.0, False,
                   [1.07, 0.85, 0.91]),
            target("piper: underruns (C=8, EDF)", 0.0, "<=", 0, True, [0.0, 0.0, 0.0]),
        ],
        "loadavg": {"start": [3.66, 2.82, 3.18], "end": [6.06, 4.81, 3.93]},
        "machine": {"cpus": 2},
    }  # fmt: skip


def target(name: str, value: float | None, op: str, goal: float, met: bool, paired: list) -> dict:
    """One entry of a ``targets`` list (ar_decode.py / omni.py ``ratio_line``, common.py's
    ``target_row``)."""
    return {"name": name, "value": value, "op": op, "target": goal, "met": met, "paired": paired}


def ar_decode_json() -> dict:
    return {
        "machine": {"cpus": 2, "torch_threads": 2},
        "args": {"concurrency": "1,16", "tokens": 128, "rounds": 2},
        "table": [{"side": "omnistep", "config": "default", "C": 1, "tok_s": 7.6}],
        "targets": [
            target("(a) ours C=1 tok/s / upstream single", 1.0288, ">=", 1.0, True, [1.06, 0.99]),
            target("(b) ours C=16 tok/s / upstream single", 5.0137, ">=", 10.0, False, [5.7, 4.3]),
            target("(b) ours C=16 tok/s / upstream batch 8", 1.474, ">=", 2.5, False, [1.4, 1.5]),
            target(
                "(c) ours TTFA C=1 / upstream stream TTFA", 0.2681, "<=", 0.25, False, [0.2, 0.3]
            ),
        ],
        "raw": {"rounds": []},
        "seconds": 666.2,
        "loadavg_end": [3.14, 2.95, 2.88],
    }


def omni_json() -> dict:
    return {
        "machine": {"cpus": 2, "torch_threads": 1},
        "args": {"concurrency": "1,8", "rounds": 3},
        "table": [],
        "targets": [
            target("(a) C=8 audio-s/s: omnistep / transformers sequential", 1.2394, ">=", 4.0,
                   False, [1.5589, 1.0252, 1.108]),
            target("(b) C=1 TTFA: omnistep / transformers first generate", None, "<", 1.0,
                   False, [0.9859, None, 0.5906]),
        ],
        "cpu_efficiency_ratio": 1.1,
        "raw": {"rounds": []},
        "seconds": 120.0,
        "loadavg_end": [2.25, 2.34, 3.13],
    }  # fmt: skip


def write_all(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in (("speech", speech_json()), ("ar_decode", ar_decode_json())):
        (folder / f"{name}.json").write_text(json.dumps(data, indent=2))
    (folder / "omni.json").write_text(json.dumps(omni_json(), indent=1))


def by_name(result: dict) -> dict[str, dict]:
    return {b["name"]: b for b in result["benchmarks"]}


def test_report_only_reads_every_benchmark(tmp_path, capsys):
    write_all(tmp_path / "res")
    out = tmp_path / "compare.json"
    rc = compare.main(["--report-only", "--out-dir", str(tmp_path / "res"), "--json", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["mode"] == "report-only"
    benches = by_name(result)
    assert list(benches) == ["speech", "ar_decode", "omni"]
    assert all(b["status"] == "ok" and b["error"] is None for b in benches.values())

    speech = benches["speech"]["targets"]
    assert speech == speech_json()["targets"]
    assert [t["met"] for t in speech] == [True, False, True]
    assert benches["speech"]["loadavg_before"] == [3.66, 2.82, 3.18]
    assert benches["speech"]["loadavg_after"] == [6.06, 4.81, 3.93]

    ar = benches["ar_decode"]
    assert ar["targets"] == ar_decode_json()["targets"]
    assert [t["met"] for t in ar["targets"]] == [True, False, False, False]
    assert ar["loadavg_before"] is None and ar["loadavg_after"] == [3.14, 2.95, 2.88]
    assert benches["omni"]["targets"][1]["value"] is None  # NaN written as null by omni.py

    text = capsys.readouterr().out
    line = next(x for x in text.splitlines() if "(b) ours C=16 tok/s / upstream batch 8" in x)
    assert "1.474  >= 2.5" in line and line.endswith("MISSED  1.40, 1.50")
    assert "0.732  <= 1.1" in text and "met" in text
    assert "piper: underruns (C=8, EDF)" in text
    assert "before 3.66 2.82 3.18, after 6.06 4.81 3.93" in text
    assert "0.99, -, 0.59" in text  # a missing paired value
    assert "FAILED" not in text


def test_a_failed_benchmark_is_reported_and_the_others_still_run(tmp_path, capsys):
    canned = tmp_path / "canned"
    write_all(canned)
    res = tmp_path / "res"
    res.mkdir()
    (res / "speech.json").write_text(json.dumps(speech_json()))  # stale, from an earlier run
    fail = "import sys; sys.stderr.write('loading voice\\nRuntimeError: boom\\n'); sys.exit(3)"
    copy = "import shutil, sys; shutil.copy(sys.argv[1], sys.argv[2])"
    commands = {
        "speech": [sys.executable, "-c", fail],
        "omni": [sys.executable, "-c", copy, str(canned / "omni.json"), str(res / "omni.json")],
    }
    out = tmp_path / "compare.json"
    argv = ["--only", "speech,omni", "--out-dir", str(res), "--json", str(out)]
    assert compare.main(argv, commands=commands) == 1

    benches = by_name(json.loads(out.read_text()))
    assert list(benches) == ["speech", "omni"]
    speech = benches["speech"]
    assert speech["status"] == "failed" and speech["returncode"] == 3
    assert speech["error"] == "exit status 3" and speech["targets"] == []
    assert speech["stderr_tail"].splitlines()[-1] == "RuntimeError: boom"
    assert not (res / "speech.json").exists()  # the stale result is gone
    assert (res / "speech.stderr.log").read_text().endswith("RuntimeError: boom\n")

    omni = benches["omni"]
    assert omni["status"] == "ok" and omni["returncode"] == 0
    assert omni["targets"] == omni_json()["targets"]
    for b in benches.values():  # measured around each run by compare.py itself
        assert len(b["loadavg_before"]) == 3 and len(b["loadavg_after"]) == 3
        assert b["seconds"] >= 0 and b["command"] == commands[b["name"]]

    text = capsys.readouterr().out
    assert "speech: sentence voices" in text and "[failed" in text
    assert "FAILED: exit status 3" in text and "  | RuntimeError: boom" in text
    assert "(a) C=8 audio-s/s: omnistep / transformers sequential" in text


def test_zero_exit_without_json_is_a_failure(tmp_path):
    out = tmp_path / "compare.json"
    commands = {"ar_decode": [sys.executable, "-c", "print('done')"]}
    argv = ["--only", "ar_decode", "--out-dir", str(tmp_path / "res"), "--json", str(out)]
    assert compare.main(argv, commands=commands) == 1
    ar = json.loads(out.read_text())["benchmarks"][0]
    assert ar["status"] == "failed" and ar["returncode"] == 0
    assert ar["error"].startswith("no usable JSON at")


def test_a_command_that_cannot_start(tmp_path):
    out = tmp_path / "compare.json"
    commands = {"omni": [str(tmp_path / "no-such-program")]}
    argv = ["--only", "omni", "--out-dir", str(tmp_path / "res"), "--json", str(out)]
    assert compare.main(argv, commands=commands) == 1
    omni = json.loads(out.read_text())["benchmarks"][0]
    assert omni["status"] == "failed" and omni["returncode"] == 127
    assert omni["stderr_tail"].startswith("FileNotFoundError")


def test_report_only_with_a_missing_file(tmp_path, capsys):
    res = tmp_path / "res"
    write_all(res)
    (res / "omni.json").unlink()
    (res / "ar_decode.json").write_text("{not json")
    out = tmp_path / "compare.json"
    assert compare.main(["--report-only", "--out-dir", str(res), "--json", str(out)]) == 1
    benches = by_name(json.loads(out.read_text()))
    assert benches["speech"]["status"] == "ok"
    assert benches["omni"]["status"] == benches["ar_decode"]["status"] == "failed"
    assert "FileNotFoundError" in benches["omni"]["error"]
    assert "JSONDecodeError" in benches["ar_decode"]["error"]
    assert "returncode" not in benches["omni"]  # nothing was run


def test_command_lines(tmp_path):
    out = tmp_path / "ar_decode.json"
    cmd = compare.bench_command("ar_decode", 2, out, ["--tokens", "96", "--concurrency", "1,4"])
    assert cmd[0] == sys.executable and cmd[1].endswith("bench/ar_decode.py")
    # quick defaults first, the user's extra args after them (argparse: the last one wins)
    assert cmd[2:] == [
        "--rounds", "2", "--concurrency", "1,16", "--tokens", "96", "--concurrency", "1,4",
        "--out", str(out),
    ]  # fmt: skip
    speech = compare.bench_command("speech", 1, tmp_path / "s.json", [])
    assert speech[2:6] == ["--rounds", "1", "--concurrency", "1,8,16"]
    assert compare.bench_command("omni", 3, tmp_path / "o.json", [])[2:4] == ["--rounds", "3"]
    extra = compare.parse_extra(["speech=--baseline-reps 1 --concurrency 1"], ["speech"])
    assert extra == {"speech": ["--baseline-reps", "1", "--concurrency", "1"]}


@pytest.mark.parametrize(
    "argv",
    [["--only", "speech,nope"], ["--only", ","], ["--rounds", "0"], ["--args", "nope=--x 1"]],
)
def test_bad_arguments(argv, tmp_path):
    with pytest.raises(SystemExit) as exc:
        compare.main([*argv, "--report-only", "--json", str(tmp_path / "c.json")])
    assert exc.value.code == 2
