"""The README's two commands are the whole newcomer path: ``make test`` installs what the tests
need (Debian's chromium included) and CI runs nothing else."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _dry_run(target: str) -> str:
    """The commands ``make TARGET`` would run (``make -n``), as one string."""
    done = subprocess.run(
        ["make", "-n", "-s", target], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return done.stdout


def test_make_test_installs_chromium_before_running_the_suite():
    recipe = _dry_run("test")
    install = recipe.index("apt-get install")
    assert "chromium" in recipe[install : recipe.index("\n", install) + 200]
    assert install < recipe.index("-m pytest")


def test_ci_runs_exactly_make_test():
    commands = [
        line.strip()
        for line in (ROOT / ".ci" / "run").read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    assert commands[-1] == "make test"
    assert all(c.startswith(("set ", "cd ")) for c in commands[:-1]), commands
