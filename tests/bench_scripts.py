"""What the tests of ``bench/`` scripts share: a script loaded as a module, a script run as the
README runs it (a subprocess with the repository on its path), and the check every reported
figure gets (present, finite, positive: the tests never assert how large a timing is)."""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]


def load(name: str) -> ModuleType:
    """``bench/{name}.py`` imported as the module ``bench_{name}`` (``bench/`` is no package;
    each script puts its folder on the path for its siblings)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(name: str, *args: str, omp_threads: int | None = 1, timeout: float = 600) -> str:
    """Run ``bench/{name}.py ARGS`` in a subprocess of this interpreter (the repository on
    ``PYTHONPATH``; ``OMP_NUM_THREADS`` set when ``omp_threads`` is given); its stdout.

    Raises:
        AssertionError: it exited non-zero (the message: its output's tails).
        subprocess.TimeoutExpired: it ran past ``timeout`` seconds.
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    if omp_threads is not None:
        env["OMP_NUM_THREADS"] = str(omp_threads)
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / f"{name}.py"), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def positive(x: object) -> bool:
    """Whether ``x`` is a finite number above 0 (no bool)."""
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) and x > 0


#: The speech benches' figures reported once per concurrency level (keys "1", "4", "8").
PER_LEVEL = ("omnistep_audio_s_per_s", "omnistep_ttfa_p99_s", "omnistep_rtf")
#: The speech benches' three targets: (a) TTFA C=1 ratio, (b) audio-s/s ratio, (c) p99 cliff.
SPEECH_TARGETS = ((0.25, "<="), (4.0, ">="), (1.5, "<="))


def check_figures(
    figures: dict,
    scalars: tuple[str, ...],
    per_level: tuple[str, ...] = PER_LEVEL,
    levels: tuple[str, ...] = ("1", "4", "8"),
) -> None:
    """Assert each of ``scalars`` is a positive figure and each of ``per_level`` holds one
    positive figure per concurrency level in ``levels`` (no more, no fewer).

    Raises:
        AssertionError: naming the first key that fails.
        KeyError: a key is missing from ``figures``.
    """
    for key in scalars:
        assert positive(figures[key]), key
    for key in per_level:
        assert sorted(figures[key], key=int) == list(levels), key
        assert all(positive(v) for v in figures[key].values()), key


def check_targets(targets: list[dict], expected: tuple[tuple[float, str], ...]) -> None:
    """Assert the bench's ``targets`` are ``expected``'s (target, op) pairs in order, each with a
    positive measured ``value`` and a boolean ``met``.

    Raises:
        AssertionError: a target differs or a value is missing/non-positive.
    """
    assert [(t["target"], t["op"]) for t in targets] == list(expected)
    assert all(positive(t["value"]) and isinstance(t["met"], bool) for t in targets)
