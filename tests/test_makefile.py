"""``make run`` and ``make test`` install once: a stamp file in the venv, redone when
pyproject.toml changes (``make -n`` shows what make would run, running nothing)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _dry_run(tmp_path: Path, target: str) -> str:
    """``make -n TARGET`` on a copy of the Makefile and pyproject.toml in ``tmp_path``."""
    done = subprocess.run(
        ["make", "-n", target, f"PYTHON={sys.executable}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(ROOT / name, tmp_path / name)
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").touch()
    for overlay in ("qwen-tts", "chatterbox"):
        (tmp_path / ".ref" / overlay).mkdir(parents=True)
    return tmp_path


def _age(path: Path, seconds: float) -> None:
    stamp = time.time() - seconds
    os.utime(path, (stamp, stamp))


def test_make_run_installs_once_until_pyproject_changes(checkout):
    first = _dry_run(checkout, "run")
    assert "pip install -q -e '.[voice]'" in first and "omnistep serve" in first
    (checkout / ".venv" / ".installed-run").touch()
    _age(checkout / "pyproject.toml", 60)
    again = _dry_run(checkout, "run")
    assert "pip install" not in again and "omnistep serve" in again
    (checkout / "pyproject.toml").touch()  # newer than the stamp: install again
    assert "pip install -q -e '.[voice]'" in _dry_run(checkout, "run")


def test_make_test_installs_once_and_counts_for_make_run(checkout):
    (checkout / ".ref" / "qwen-tts" / ".installed-2").touch()  # the reference overlays
    (checkout / ".ref" / "chatterbox" / ".installed-1").touch()
    first = _dry_run(checkout, "test")
    assert "pip install -q -e '.[voice,piper,chattts,test,dev]'" in first
    for name in (".installed-test", ".installed-run"):  # what the install touches
        (checkout / ".venv" / name).touch()
    for name in ("pyproject.toml", "Makefile"):
        _age(checkout / name, 60)
    again = _dry_run(checkout, "test")
    assert "pip install -q -e" not in again and "pytest" in again
    assert "pip install" not in _dry_run(checkout, "run")
