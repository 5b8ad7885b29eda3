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
