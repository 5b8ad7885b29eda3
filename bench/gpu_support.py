"""What ``bench/gpu.sh`` needs besides the benchmarks: packages on a machine with no index, and
the summary of the figures. Standard library only (it runs before any package is checked).

The GPU benchmarks (``bench/ar_decode.py``, ``bench/rollout.py``) import omnistep from the
checkout (``PYTHONPATH``; no install), torch, the ChatTTS family's packages and the upstream
``chattts`` reference with what it imports (``REQUIRED``). A lent GPU machine has a python3
with a CUDA torch and most of these, but reaches no package index: the few it lacks travel as
wheels, downloaded here first (``prepare``, on a machine that reaches PyPI), carried with the
working tree (the device tool's ``carry``) and installed there with ``--no-index`` into a
folder put on ``PYTHONPATH`` (``install``). Where an index is reachable, ``install`` falls back
to it for whatever the wheels did not provide.

Commands::

    python bench/gpu_support.py missing                  # import names absent; exit 3 if any
    python bench/gpu_support.py venv-specs               # what a fresh venv adds to .[chattts]
    python bench/gpu_support.py prepare .whl [--python-version 3.12]
    python bench/gpu_support.py install .whl /tmp/site   # only what is missing
    python bench/gpu_support.py summary OUT_DIR          # gpu_summary.{txt,json} from the JSON

Pins: the upstream reference packages are read from the Makefile's ``REFERENCE_PKGS`` (one
list for ``make install-test`` and this); the rest are the versions the CPU venv runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
MAKEFILE = REPO / "Makefile"
PYPROJECT = REPO / "pyproject.toml"
#: Distributions of the ``test`` extra that the benchmarks import beside ``.[chattts]``
#: (``venv_specs``: what a fresh venv installs with ``pip install -e '.[chattts]'``).
TEST_EXTRA_FOR_BENCH = ("einops", "numba")

#: Import names the benchmarks need that the machine must bring: never installed here (torch
#: is the machine's own CUDA build; the others come with it, or with ``pip install -e .``).
MACHINE = (
    "torch",
    "numpy",
    "transformers",
    "tokenizers",
    "safetensors",
    "huggingface_hub",
    "tqdm",
    "numba",
    "einops",
    "yaml",
    "sympy",
)

#: Import name -> pip requirement of what a GPU machine's image may lack (a wheel each). The
#: upstream reference packages get their pins from the Makefile (``reference_pins``).
EXTRA_PINS = {
    "einx": "einx==0.4.3",
    "frozendict": "frozendict==2.5.1",  # einx's
    "loguru": "loguru==0.7.3",  # vector-quantize-pytorch's
    "pybase16384": "pybase16384==0.3.9",  # speaker strings, both sides
    "_cffi_backend": "cffi==2.1.1",  # pybase16384's fallback backend
}
#: Import name -> distribution name of the upstream reference packages (Makefile pins).
REFERENCE_MODULES = {
    "ChatTTS": "chattts",
    "vocos": "vocos",
    "vector_quantize_pytorch": "vector-quantize-pytorch",
    "torch_einops_utils": "torch-einops-utils",
}
#: manylinux tags a lent GPU machine (x86-64, glibc >= 2.28) installs.
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux_2_5_x86_64",
    "manylinux1_x86_64",
)


def canonical(name: str) -> str:
    """A distribution name as wheel files spell it: lower case, runs of ``-_.`` -> ``_``."""
    return re.sub(r"[-_.]+", "_", name).lower()


def reference_pins(makefile: Path = MAKEFILE) -> dict[str, str]:
    """Distribution name -> ``name==version`` of the Makefile's ``REFERENCE_PKGS``.

    Raises:
        ValueError: the Makefile has no ``REFERENCE_PKGS :=`` list of ``name==version``.
    """
    text = makefile.read_text(encoding="utf-8").replace("\\\n", " ")
    match = re.search(r"^REFERENCE_PKGS\s*:=\s*(.+)$", text, re.MULTILINE)
    if not match:
        raise ValueError(f"{makefile}: no REFERENCE_PKGS := line")
    pins = {}
    for spec in match.group(1).split():
        name, sep, version = spec.partition("==")
        if not sep or not version:
            raise ValueError(f"{makefile}: REFERENCE_PKGS entry {spec!r} is not name==version")
        pins[name] = spec
    return pins


def wheel_pins(makefile: Path = MAKEFILE) -> dict[str, str]:
    """Import name -> pinned requirement of every package that may travel as a wheel."""
    ref = reference_pins(makefile)
    missing = [d for d in REFERENCE_MODULES.values() if d not in ref]
    if missing:
        raise ValueError(f"{makefile}: REFERENCE_PKGS lacks {missing}")
    return {**{m: ref[d] for m, d in REFERENCE_MODULES.items()}, **EXTRA_PINS}


def venv_specs(pyproject: Path = PYPROJECT) -> list[str]:
    """The ``test`` extra's requirements of ``TEST_EXTRA_FOR_BENCH``, as pyproject.toml pins
    them: with ``.[chattts]``, the minimal install of a fresh venv for the benchmarks.

    Raises:
        ValueError: pyproject.toml's ``test`` extra lacks one of them.
    """
    import tomllib

    extra = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
    tests = extra["optional-dependencies"]["test"]
    specs = {canonical(re.split(r"[<>=!~\[; ]", spec, maxsplit=1)[0]): spec for spec in tests}
    missing = [name for name in TEST_EXTRA_FOR_BENCH if canonical(name) not in specs]
    if missing:
        raise ValueError(f"{pyproject}: the test extra lacks {missing}")
    return [specs[canonical(name)] for name in TEST_EXTRA_FOR_BENCH]


def missing_modules(names: list[str] | tuple[str, ...]) -> list[str]:
    """The import names ``importlib.util.find_spec`` cannot find (nothing is imported)."""
    return [name for name in names if importlib.util.find_spec(name) is None]


def required() -> list[str]:
    """Every import name the GPU benchmarks need (``MACHINE`` then the wheel packages)."""
    return [*MACHINE, *wheel_pins()]


def prepare(dest: Path, python_version: str = "3.12") -> list[Path]:
    """Download (or, for an sdist-only pure-Python package such as chattts 0.2.5, build) one
    wheel per ``wheel_pins`` requirement for CPython ``python_version`` on x86-64 Linux into
    ``dest``; runs this interpreter's pip, so it needs a reachable index. Returns the wheels.

    Raises:
        RuntimeError: pip found no wheel and could not build one.
    """
    dest.mkdir(parents=True, exist_ok=True)
    platforms = [arg for tag in PLATFORMS for arg in ("--platform", tag)]
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    for spec in wheel_pins().values():
        name = canonical(spec.partition("==")[0])
        version = spec.partition("==")[2]
        if list(dest.glob(f"{name}-{version}-*.whl")):
            continue
        download = [*pip, "download", "--no-deps", "--only-binary=:all:", "-d", str(dest)]
        tags = ["--python-version", python_version, "--implementation", "cp", *platforms]
        got = subprocess.run([*download, *tags, spec], capture_output=True, text=True)
        if got.returncode == 0:
            continue
        # no wheel on the index: build one (pure Python only, so it runs on any 3.x)
        print(f"no {spec} wheel for CPython {python_version} on the index: building one")
        if subprocess.run([*pip, "wheel", "--no-deps", "-w", str(dest), spec]).returncode:
            raise RuntimeError(
                f"no wheel of {spec} could be downloaded or built: {got.stderr.strip()}"
            )
        built = list(dest.glob(f"{name}-{version}-*.whl"))
        if not built or not all(w.name.endswith("-py3-none-any.whl") for w in built):
            raise RuntimeError(f"{spec}: the built wheel {built} is not pure Python")
    return sorted(dest.glob("*.whl"))


def install(wheels: Path | None, target: Path) -> list[str]:
    """Install what the benchmarks miss into ``target`` (pip ``--target``, no dependencies):
    first the wheels in ``wheels`` that provide a missing module (``--no-index``), then, for
    what is still missing, the pinned requirement from the index, where one is reachable.
    ``target`` must be on ``PYTHONPATH`` of the benchmarks. Returns the import names still
    missing (``MACHINE`` ones are never installed here)."""
    pins = wheel_pins()
    absent = missing_modules(list(pins))
    if not absent:
        return missing_modules(list(MACHINE))
    target.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(target))
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check", "install"]
    pip += ["--no-deps", "--no-compile", "--upgrade", "--target", str(target)]
    if wheels is not None and wheels.is_dir():
        files = []
        for module in absent:
            name, _, version = pins[module].partition("==")
            files += sorted(wheels.glob(f"{canonical(name)}-{version}-*.whl"))
        if files:
            print(f"installing {len(files)} carried wheel(s) into {target}", flush=True)
            subprocess.run([*pip, "--no-index", *map(str, files)], check=False)
    importlib.invalidate_caches()
    absent = missing_modules(absent)
    if absent:
        # fail fast where no index answers (a GPU machine): no retries, a short timeout
        print(f"from the package index (if reachable): {[pins[m] for m in absent]}", flush=True)
        fetch = [*pip, "--retries", "0", "--timeout", "10", *(pins[m] for m in absent)]
        try:
            subprocess.run(fetch, check=False, timeout=240)
        except subprocess.TimeoutExpired:
            print("the package index did not answer in time", flush=True)
        importlib.invalidate_caches()
    return missing_modules(list(pins) + list(MACHINE))


# ----------------------------------------------------------------------------- summary


def _fmt(x: Any, spec: str = ".3g") -> str:
    return "-" if not isinstance(x, int | float) else format(x, spec)


def summarize(out_dir: Path, steps: dict[str, int] | None = None) -> dict[str, Any]:
    """The headline figures of ``ar_decode.json`` and ``rollout.json`` in ``out_dir`` (absent
    files are reported as such): device, targets, GEMM floors, step times, update time;
    ``steps``: each step of ``gpu.sh`` and its exit status (124: stopped at its time limit)."""
    summary: dict[str, Any] = {"steps": dict(steps or {})}
    ar_path, ro_path = out_dir / "ar_decode.json", out_dir / "rollout.json"
    if ar_path.exists():
        ar = json.loads(ar_path.read_text())
        raw = ar.get("raw", {})
        summary["ar_decode"] = {
            "machine": ar.get("machine"),
            "args": ar.get("args"),
            "targets": ar.get("targets"),
            "gemm_floor_ms_per_step": ar.get("gemm_floor_ms_per_step"),
            "gpt_only_tok_s": ar.get("gpt_only_tok_s"),
            "table": ar.get("table"),
            "section_errors": {
                k: v["error"]
                for k, v in [
                    ("upstream", raw.get("upstream", {})),
                    ("batch_invariant", raw.get("batch_invariant", {})),
                    *((f"lookahead={la}", v) for la, v in raw.get("lookahead", {}).items()),
                ]
                if isinstance(v, dict) and "error" in v
            },
            "seconds": ar.get("seconds"),
        }
    else:
        summary["ar_decode"] = {"missing": str(ar_path)}
    if ro_path.exists():
        ro = json.loads(ro_path.read_text())
        ours = ro.get("ours", {})
        up = ro.get("upstream") or {}
        summary["rollout"] = {
            "device": ro.get("device"),
            "args": ro.get("args"),
            "ratios": ro.get("ratios"),
            "floor_ms": ours.get("floor_ms"),
            "floor_f_linear_ms": ours.get("floor_f_linear_ms"),
            "standalone_step_ms": ours.get("standalone_step_ms"),
            "groups": {k: ours.get("groups", {}).get(k) for k in ("tok_s", "step_ms_16")},
            "independent_tok_s": ours.get("independent", {}).get("tok_s"),
            "single_step_ms_1": ours.get("single_step_ms_1"),
            "update_weights_s": ours.get("update_weights", {}).get("seconds_median"),
            "upstream_tok_s": {
                k: up[k]["tok_s"] for k in ("single", "lockstep") if isinstance(up.get(k), dict)
            },
            "upstream_error": up.get("error"),
            "seconds": ro.get("seconds"),
        }
    else:
        summary["rollout"] = {"missing": str(ro_path)}
    return summary


def summary_text(summary: dict[str, Any]) -> str:
    """``summarize``'s figures as the lines of ``gpu_summary.txt``."""
    lines = [
        "steps: "
        + ", ".join(
            f"{name} {'ok' if rc == 0 else 'TIMED OUT' if rc == 124 else f'FAILED (exit {rc})'}"
            for name, rc in summary.get("steps", {}).items()
        )
    ]
    ar = summary["ar_decode"]
    if "missing" in ar:
        lines.append(f"ar_decode: no result ({ar['missing']} absent)")
    else:
        lines.append(f"ar_decode on {ar['machine']}, args {ar['args']} ({ar['seconds']} s)")
        for t in ar["targets"] or []:
            met = "MET" if t["met"] else "missed"
            lines.append(
                f"  {t['name']:<52} {_fmt(t['value'], '.3f'):>8} "
                f"(target {t['op']} {t['target']}) {met}"
            )
        floors = ar["gemm_floor_ms_per_step"] or {}
        lines.append(
            "  GPT weight-GEMM floor per step (ms): "
            + ", ".join(f"{m} rows {_fmt(v)}" for m, v in floors.items())
        )
        gpt = ar["gpt_only_tok_s"] or {}
        lines.append(
            f"  GPT alone tok/s: omnistep {_fmt(gpt.get('omnistep'), '.1f')}, "
            f"upstream {_fmt(gpt.get('upstream'), '.1f')}"
        )
        for row in ar["table"] or []:
            lines.append(
                f"  {row['side']:<9} {row['config']:<26} C={row['C']:<3} N={row['N']:<4} "
                f"tok/s {_fmt(row['tok_s'], '.1f'):>7}  TTFA p50 {_fmt(row['ttfa_p50_s'])} s"
            )
        for name, err in ar["section_errors"].items():
            lines.append(f"  section {name} FAILED: {err}")
    ro = summary["rollout"]
    if "missing" in ro:
        lines.append(f"rollout: no result ({ro['missing']} absent)")
    else:
        lines.append(f"rollout on {ro['device']}, args {ro['args']} ({ro['seconds']} s)")
        for name, value in (ro["ratios"] or {}).items():
            lines.append(f"  {name:<38} {_fmt(value, '.3f')}")
        for key in ("floor_ms", "floor_f_linear_ms", "standalone_step_ms"):
            values = ro[key] or {}
            lines.append(f"  {key}: " + ", ".join(f"{r} rows {_fmt(v)}" for r, v in values.items()))
        lines.append(
            f"  groups {_fmt(ro['groups']['tok_s'], '.1f')} tok/s (step "
            f"{_fmt(ro['groups']['step_ms_16'])} ms), independent "
            f"{_fmt(ro['independent_tok_s'], '.1f')} tok/s, 1-row step "
            f"{_fmt(ro['single_step_ms_1'])} ms, update_weights {_fmt(ro['update_weights_s'])} s"
        )
        lines.append(f"  upstream tok/s: {ro['upstream_tok_s']}")
        if ro["upstream_error"]:
            lines.append(f"  upstream FAILED: {ro['upstream_error']}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("missing", help="print the import names absent here; exit 3 if any")
    sub.add_parser("venv-specs", help="print what a fresh venv installs beside .[chattts]")
    p = sub.add_parser("prepare", help="download the wheels a GPU machine may lack")
    p.add_argument("dest", type=Path)
    p.add_argument("--python-version", default="3.12", help="the GPU machine's python")
    p = sub.add_parser("install", help="install what is missing into a --target folder")
    p.add_argument("wheels", type=Path, help="folder of carried wheels (may be absent)")
    p.add_argument("target", type=Path)
    p = sub.add_parser("summary", help="gpu_summary.txt and .json from the benchmarks' JSON")
    p.add_argument("out_dir", type=Path)
    p.add_argument("--steps", nargs="*", default=[], help="NAME=EXIT_STATUS of gpu.sh's steps")
    args = ap.parse_args(argv)
    if args.command == "missing":
        absent = missing_modules(required())
        print(" ".join(absent))
        return 3 if absent else 0
    if args.command == "venv-specs":
        print(" ".join(venv_specs()))
        return 0
    if args.command == "prepare":
        wheels = prepare(args.dest, args.python_version)
        print(f"{len(wheels)} wheels in {args.dest}: " + " ".join(w.name for w in wheels))
        return 0
    if args.command == "install":
        absent = install(args.wheels, args.target)
        if absent:
            print(f"still missing: {' '.join(absent)}", file=sys.stderr)
            return 3
        return 0
    steps = {name: int(rc) for name, _, rc in (s.partition("=") for s in args.steps)}
    summary = summarize(args.out_dir, steps)
    (args.out_dir / "gpu_summary.json").write_text(json.dumps(summary, indent=1))
    text = summary_text(summary)
    (args.out_dir / "gpu_summary.txt").write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
