"""Comparison run: omnistep vs. each card's alternative, one benchmark after another, one table.

What it measures
----------------
Nothing of its own. The per-card benchmarks already run omnistep and the alternative side by side
in alternating rounds and write their target ratios to JSON:

* ``speech``: the sentence voices (hibari, kokoro, piper), omnistep over HTTP vs. each voice's own
  runtime (``Hibari``, kokoro-onnx's ``Kokoro``, ``PiperVoice``) (``speech.py``);
* ``ar_decode``: the ``chattts`` card vs. the upstream ``chattts`` package (``ar_decode.py``);
* ``omni``: the ``qwen2.5-omni`` card vs. transformers' ``generate`` (``omni.py``).

This script runs the selected ones as subprocesses, in sequence, on this machine (``PYTHONPATH``
set to this checkout), each writing ``<out-dir>/<name>.json`` and its stderr to
``<out-dir>/<name>.stderr.log``, and records the 1/5/15-minute load averages just before and just
after each. It then reads the JSON files and prints one table: per card, each target's name, the
benchmark's headline value (medians over the rounds), the target, met or missed, and the paired
(same-round) ratios. A benchmark that exits non-zero (or writes no readable JSON) is listed as
failed with the tail of its stderr; the others still run. The table goes to
``bench/results/compare.json`` (``--json``).

Defaults are the quick ones: ``--rounds 2`` for every benchmark (their own defaults: speech 3,
ar_decode 2, omni 3), speech at C = 1,8,16 (its default), ar_decode at C = 1,16 (no target uses
its C = 4 level); everything else is the benchmark's default. ``--args NAME=ARGS`` appends
arguments to one benchmark's command line (later flags win); ``--out`` is always set by this
script.

How to run
----------
::

    .venv/bin/python bench/compare.py                          # all three, 2 rounds each
    .venv/bin/python bench/compare.py --only speech,omni --rounds 3
    .venv/bin/python bench/compare.py --only ar_decode --args ar_decode="--tokens 96 --threads 1"
    .venv/bin/python bench/compare.py --report-only --out-dir bench/results   # no runs

``--report-only`` reads ``<out-dir>/<name>.json`` as they are (e.g. the benchmarks' own default
outputs in ``bench/results/``); the load averages then come from the files (speech stores both,
the others only the one at their end). Exit status: 0 if every selected benchmark produced its
JSON (whether or not the targets are met), 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT_DIR = ROOT / "bench" / "results" / "compare"
DEFAULT_JSON = ROOT / "bench" / "results" / "compare.json"
CARDS = {  # benchmark name -> (card, alternative)
    "speech": (
        "sentence voices (hibari, kokoro, piper)",
        "each voice's own runtime (Hibari, kokoro-onnx Kokoro, PiperVoice)",
    ),
    "ar_decode": ("chattts", "upstream chattts Chat.infer"),
    "omni": ("qwen2.5-omni", "transformers generate"),
}
QUICK_ARGS = {"speech": ["--concurrency", "1,8,16"], "ar_decode": ["--concurrency", "1,16"]}
TAIL_LINES = 15


def load_avg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def bench_command(name: str, rounds: int, json_path: Path, extra: list[str]) -> list[str]:
    """The benchmark's command line: quick defaults, then ``extra``; ``--out`` last (ours)."""
    script = str(ROOT / "bench" / f"{name}.py")
    args = ["--rounds", str(rounds), *QUICK_ARGS.get(name, []), *extra]
    return [sys.executable, script, *args, "--out", str(json_path)]


def run_benchmark(cmd: list[str], json_path: Path, log_path: Path) -> dict:
    """Run ``cmd`` (stdout shown, stderr to ``log_path``); exit code, seconds, load averages."""
    json_path.unlink(missing_ok=True)  # a failed run must not leave an older result behind
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    before = load_avg()
    start = time.perf_counter()
    with log_path.open("w") as err:
        try:
            returncode = subprocess.run(cmd, cwd=ROOT, env=env, stderr=err).returncode
        except OSError as exc:  # the command could not start
            err.write(f"{type(exc).__name__}: {exc}\n")
            returncode = 127
    seconds = round(time.perf_counter() - start, 1)
    tail = log_path.read_text(errors="replace").splitlines()[-TAIL_LINES:]
    return {
        "command": cmd,
        "returncode": returncode,
        "seconds": seconds,
        "loadavg_before": before,
        "loadavg_after": load_avg(),
        "stderr_log": str(log_path),
        "stderr_tail": "\n".join(tail),
    }


def targets_of(data: dict) -> list[dict]:
    """The target rows of one benchmark JSON (its ``targets``, a list of dicts as
    ``bench/common.py``'s ``target_row`` and ``ratio_line`` of ar_decode.py / omni.py build
    them): name, value, op, target, met, paired."""
    keys = ("name", "value", "op", "target", "met", "paired")
    return [{k: t.get(k) for k in keys} for t in data["targets"]]


def file_loadavg(data: dict) -> tuple[list | None, list | None]:
    """Load averages a benchmark stored itself: (at its start, at its end), None if absent."""
    load = data.get("loadavg") if isinstance(data.get("loadavg"), dict) else {}
    return load.get("start"), load.get("end", data.get("loadavg_end"))


def entry(name: str, json_path: Path, run: dict | None) -> dict:
    """One benchmark's row group: status, run details, targets."""
    card, alternative = CARDS[name]
    out = {"name": name, "card": card, "alternative": alternative, "json": str(json_path)}
    out.update(run or {})
    out.update(status="failed", error=None, targets=[])
    if run is not None and run["returncode"] != 0:
        out["error"] = f"exit status {run['returncode']}"
        return out
    try:
        data = json.loads(json_path.read_text())
        out["targets"] = targets_of(data)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        out["error"] = f"no usable JSON at {json_path}: {type(exc).__name__}: {exc}"
        return out
    if run is None:
        out["loadavg_before"], out["loadavg_after"] = file_loadavg(data)
    out["status"] = "ok"
    return out


def _num(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def _load(x: list | None) -> str:
    return "-" if not x else " ".join(f"{v:.2f}" for v in x)


def format_table(entries: list[dict]) -> str:
    head = f"{'card / target':<60} {'value':>7}  {'target':<8} {'result':<7} paired per round"
    lines = [head, "-" * len(head)]
    for e in entries:
        seconds = f", {e['seconds']:.0f} s" if e.get("seconds") is not None else ""
        lines.append(f"{e['name']}: {e['card']} vs. {e['alternative']}  [{e['status']}{seconds}]")
        lines.append(
            f"  load avg (1/5/15 min) before {_load(e.get('loadavg_before'))}, "
            f"after {_load(e.get('loadavg_after'))}"
        )
        if e["status"] != "ok":
            lines.append(f"  FAILED: {e['error']}")
            lines += [f"  | {line}" for line in (e.get("stderr_tail") or "").splitlines()]
            continue
        for t in e["targets"]:
            paired = ", ".join(_num(p, ".2f") for p in t["paired"]) or "-"
            result = "met" if t["met"] else "MISSED"
            target = f"{t['op']} {t['target']:g}"
            lines.append(
                f"  {t['name']:<58} {_num(t['value']):>7}  {target:<8} {result:<7} {paired}"
            )
    return "\n".join(lines)


def parse_extra(items: list[str], names: list[str]) -> dict[str, list[str]]:
    extra: dict[str, list[str]] = {n: [] for n in names}
    for item in items:
        name, sep, args = item.partition("=")
        if not sep or name not in CARDS:
            raise argparse.ArgumentTypeError(f"--args wants NAME=ARGS with NAME in {list(CARDS)}")
        extra.setdefault(name, []).extend(shlex.split(args))
    return extra


def main(argv: list[str] | None = None, commands: dict[str, list[str]] | None = None) -> int:
    """``commands`` (name -> argv) replaces the benchmark command lines; tests use it."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--only", default=",".join(CARDS), help="comma-separated subset of " + ",".join(CARDS)
    )
    ap.add_argument("--rounds", type=int, default=2, help="passed to every benchmark (default 2)")
    ap.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR, help="per-benchmark JSON")
    ap.add_argument("--json", type=Path, default=DEFAULT_JSON, help="the combined table")
    ap.add_argument(
        "--args",
        action="append",
        default=[],
        metavar="NAME=ARGS",
        help="more arguments for one benchmark, e.g. omni='--threads 2' (repeatable)",
    )
    ap.add_argument("--report-only", action="store_true", help="read existing JSON, run nothing")
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    if not names or any(n not in CARDS for n in names):
        ap.error(f"--only takes a subset of {','.join(CARDS)}")
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    try:
        extra = parse_extra(args.args, names)
    except argparse.ArgumentTypeError as exc:
        ap.error(str(exc))

    if not args.report_only:
        args.out_dir.mkdir(parents=True, exist_ok=True)
    entries = []
    for name in names:
        json_path = args.out_dir / f"{name}.json"
        run = None
        if not args.report_only:
            cmd = (commands or {}).get(name) or bench_command(
                name, args.rounds, json_path, extra[name]
            )
            print(f"== {name}: {shlex.join(cmd)}  (load {load_avg()})", flush=True)
            run = run_benchmark(cmd, json_path, args.out_dir / f"{name}.stderr.log")
        entries.append(entry(name, json_path, run))

    print()
    print("omnistep vs. the alternative per card (value: the benchmark's headline ratio, medians")
    print("over the rounds; paired: the same ratio per round)")
    print(format_table(entries))
    result = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "mode": "report-only" if args.report_only else "run",
        "out_dir": str(args.out_dir),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "benchmarks": entries,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.json}")
    return 0 if all(e["status"] == "ok" for e in entries) else 1


if __name__ == "__main__":
    sys.exit(main())
