"""Run functions of the Chatterbox reference (``chatterbox-tts`` 0.1.7) in a subprocess.

The Makefile installs the package alone (``--no-deps``) into the overlay ``.ref/chatterbox``: it
pins torch 2.6, transformers 5.2, diffusers, librosa, resemble-perth and gradio, none of which
the T3 path needs. A subprocess of the venv's python (its torch 2.13, transformers 5.x) puts the
overlay first on its path and registers an empty ``chatterbox`` package whose ``__path__`` is the
overlay's folder, so ``chatterbox.models.t3`` imports without the package ``__init__`` (which
imports every pipeline: ``tts.py`` needs librosa and ``perth``, the watermarker). Nothing else is
stubbed. Arguments and the return value cross the process boundary by pickle.

Usage::

    from tests.chatterbox_ref.env import call_reference
    out = call_reference("tests.chatterbox_ref.upstream_t3:greedy", root=path, ...)
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
REF_DIR = REPO / ".ref" / "chatterbox"


class ReferenceRunError(RuntimeError):
    """The reference subprocess failed; the message carries its stderr tail."""


def bypass_package_init() -> None:
    """Register ``chatterbox`` as a bare package over the overlay folder (subprocess only)."""
    import importlib.machinery
    import types

    if "chatterbox" in sys.modules:
        return
    package = types.ModuleType("chatterbox")
    package.__path__ = [str(REF_DIR / "chatterbox")]
    package.__spec__ = importlib.machinery.ModuleSpec("chatterbox", None, is_package=True)
    sys.modules["chatterbox"] = package


def bare_package(name: str, folder: str) -> None:
    """Register ``name`` as a bare package over ``folder`` of the overlay's ``chatterbox`` (its
    ``__init__`` not run; subprocess only): ``chatterbox.models.s3gen``'s would import
    torchaudio."""
    import importlib.machinery
    import types

    bypass_package_init()
    if name in sys.modules:
        return
    package = types.ModuleType(name)
    package.__path__ = [str(REF_DIR / "chatterbox" / folder)]
    package.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    sys.modules[name] = package


def call_reference(target: str, timeout: float = 600, **kwargs: Any) -> Any:
    """Call ``target`` (``"package.module:function"``) with ``kwargs`` in a fresh subprocess.

    Raises:
        FileNotFoundError: the overlay is not installed (``make install-test``).
        ReferenceRunError: the function raised or the subprocess died (message: its stderr).
    """
    if not (REF_DIR / "chatterbox").is_dir():
        raise FileNotFoundError(f"{REF_DIR} has no chatterbox: run `make install-test` first")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REF_DIR), str(REPO)])
    with tempfile.TemporaryDirectory(prefix="chatterbox-ref-") as tmp:
        request, reply = Path(tmp) / "request.pkl", Path(tmp) / "reply.pkl"
        request.write_bytes(pickle.dumps((target, kwargs)))
        done = subprocess.run(
            [sys.executable, "-m", "tests.chatterbox_ref.env", str(request), str(reply)],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if done.returncode != 0 or not reply.exists():
            raise ReferenceRunError(
                f"{target} failed (rc={done.returncode}):\n{done.stderr[-4000:]}"
            )
        return pickle.loads(reply.read_bytes())


def _main(request: str, reply: str) -> None:
    import importlib

    bypass_package_init()
    target, kwargs = pickle.loads(Path(request).read_bytes())
    module_name, _, func_name = target.partition(":")
    value = getattr(importlib.import_module(module_name), func_name)(**kwargs)
    Path(reply).write_bytes(pickle.dumps(value))


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2])
