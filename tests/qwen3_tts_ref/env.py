"""Run functions of the Qwen3-TTS reference (``qwen-tts`` 0.1.1) in a subprocess.

``qwen-tts`` pins transformers 4.57.3; omnistep runs transformers 5.x. The Makefile installs the
reference with its transformers, ``--no-deps``, into the overlay directory ``.ref/qwen-tts``; a
subprocess of the venv's python puts that overlay first on its path (so it imports the old
transformers and the venv's torch), installs stub modules for what ``qwen_tts`` imports at module
level but the paths we compare never call (gradio, sox, torchaudio), and calls one function.
librosa is real (the Makefile installs it, its dependencies the venv lacks and scipy into the
overlay): the voice-clone prompt uses its mel filters and ``resample``. Arguments and the return
value cross the process boundary by pickle: numpy arrays, numbers, strings, paths, lists and
dicts of them.

Usage::

    from tests.qwen3_tts_ref.env import call_reference
    codes = call_reference("tests.qwen3_tts_ref.upstream:generate", root=path, text="hi")
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
REF_DIR = REPO / ".ref" / "qwen-tts"

STUB_MODULES = (
    "gradio",
    "sox",
    "torchaudio",
    "torchaudio.compliance",
    "torchaudio.compliance.kaldi",
)
"""Modules ``qwen_tts`` imports at module level that the compared paths never call."""


class ReferenceRunError(RuntimeError):
    """The reference subprocess failed; the message carries its stderr tail."""


def install_stubs() -> None:
    """Put empty modules for ``STUB_MODULES`` in ``sys.modules`` (inside the subprocess only)."""
    import importlib.machinery
    import types

    for name in STUB_MODULES:
        if name in sys.modules:
            continue
        module = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
        sys.modules[name] = module


def call_reference(target: str, timeout: float = 600.0, **kwargs: Any) -> Any:
    """Call ``target`` (``"package.module:function"``) with ``kwargs`` in the reference subprocess.

    Returns:
        The function's return value (unpickled).

    Raises:
        FileNotFoundError: the overlay ``.ref/qwen-tts`` is not installed (``make install-test``).
        ReferenceRunError: the function raised or the subprocess died (message: its stderr).
    """
    if not (REF_DIR / "qwen_tts").is_dir():
        raise FileNotFoundError(f"{REF_DIR} has no qwen_tts: run `make install-test` first")
    with tempfile.TemporaryDirectory(prefix="qwen3-ref-") as tmp:
        args_path, out_path = Path(tmp) / "args.pkl", Path(tmp) / "out.pkl"
        args_path.write_bytes(pickle.dumps((target, kwargs)))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(REF_DIR), str(REPO)])
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        proc = subprocess.run(
            [sys.executable, "-m", "tests.qwen3_tts_ref.env", str(args_path), str(out_path)],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if proc.returncode != 0 or not out_path.exists():
            tail = proc.stderr[-4000:]
            raise ReferenceRunError(f"{target} failed (rc={proc.returncode}):\n{tail}")
        return pickle.loads(out_path.read_bytes())


def _main(args_path: str, out_path: str) -> None:
    import importlib

    install_stubs()
    target, kwargs = pickle.loads(Path(args_path).read_bytes())
    module_name, _, func_name = target.partition(":")
    func = getattr(importlib.import_module(module_name), func_name)
    result = func(**kwargs)
    Path(out_path).write_bytes(pickle.dumps(result))


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2])
