"""Run functions of the VoxCPM2 reference (``voxcpm`` 2.0.3) in a subprocess.

The Makefile installs the package and librosa (with what librosa imports that the venv lacks)
``--no-deps`` into the overlay ``.ref/voxcpm``: the package declares gradio, funasr, modelscope,
torchaudio, torchcodec and datasets, none of which ``voxcpm.model.voxcpm2`` imports. A
subprocess of the venv's python puts the overlay first on its path and registers bare
``voxcpm`` and ``voxcpm.model`` packages over the overlay's folders, so their ``__init__``s do
not run (``voxcpm/__init__`` imports ``core.py``, the hub/modelscope pipeline;
``voxcpm/model/__init__`` imports the VoxCPM1 model, which needs torchaudio). Nothing is stubbed.
Arguments and the return value cross the process boundary by pickle.

Usage::

    from tests.voxcpm_ref.env import call_reference
    out = call_reference("tests.voxcpm_ref.upstream:write_checkpoint", root=path)
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
REF_DIR = REPO / ".ref" / "voxcpm"
BARE_PACKAGES = ("voxcpm", "voxcpm.model")


class ReferenceRunError(RuntimeError):
    """The reference subprocess failed; the message carries its stderr tail."""


def bypass_package_init() -> None:
    """Register ``voxcpm`` and ``voxcpm.model`` as bare packages (subprocess only)."""
    import importlib.machinery
    import types

    for name in BARE_PACKAGES:
        if name in sys.modules:
            continue
        package = types.ModuleType(name)
        package.__path__ = [str(REF_DIR.joinpath(*name.split(".")))]
        package.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        sys.modules[name] = package


def call_reference(target: str, timeout: float = 600, **kwargs: Any) -> Any:
    """Call ``target`` (``"package.module:function"``) with ``kwargs`` in a fresh subprocess.

    Raises:
        FileNotFoundError: the overlay is not installed (``make install-test``).
        ReferenceRunError: the function raised or the subprocess died (message: its stderr).
    """
    if not (REF_DIR / "voxcpm").is_dir():
        raise FileNotFoundError(f"{REF_DIR} has no voxcpm: run `make install-test` first")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REF_DIR), str(REPO)])
    with tempfile.TemporaryDirectory(prefix="voxcpm-ref-") as tmp:
        request, reply = Path(tmp) / "request.pkl", Path(tmp) / "reply.pkl"
        request.write_bytes(pickle.dumps((target, kwargs)))
        done = subprocess.run(
            [sys.executable, "-m", "tests.voxcpm_ref.env", str(request), str(reply)],
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
