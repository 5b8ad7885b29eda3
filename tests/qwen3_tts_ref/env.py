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
    # (every call_reference shares one subprocess for the whole run)

    with ReferenceSession() as ref:  # one process for many calls (a model loaded once)
        ref.call("tests.qwen3_tts_ref.upstream_bench:load", root=path, threads=2)
        out = ref.call("tests.qwen3_tts_ref.upstream_bench:synthesize", text="hi", ...)
"""

from __future__ import annotations

import atexit
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


def call_reference(target: str, **kwargs: Any) -> Any:
    """Call ``target`` (``"package.module:function"``) with ``kwargs`` in the reference
    subprocess shared by the whole test run (``shared_session``): importing torch, transformers
    and qwen_tts costs ~5 s per process, which the 13 call sites of the suite paid each before.
    The functions called this way keep nothing in module globals between calls (each loads its
    model from ``root`` and seeds torch itself), so sharing the process changes no result.

    Returns:
        The function's return value (unpickled).

    Raises:
        FileNotFoundError: the overlay ``.ref/qwen-tts`` is not installed (``make install-test``).
        ReferenceRunError: the function raised or the subprocess died (message: its stderr).
    """
    return shared_session().call(target, **kwargs)


_SHARED: ReferenceSession | None = None


def shared_session() -> ReferenceSession:
    """The process-wide ``ReferenceSession`` (started on first use, a new one if the last
    died; closed at exit)."""
    global _SHARED
    if _SHARED is None or _SHARED.proc.poll() is not None:
        if _SHARED is not None:
            _SHARED.close()
        _SHARED = ReferenceSession()
        atexit.register(_SHARED.close)
    return _SHARED


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REF_DIR), str(REPO)])
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def _check_overlay() -> None:
    if not (REF_DIR / "qwen_tts").is_dir():
        raise FileNotFoundError(f"{REF_DIR} has no qwen_tts: run `make install-test` first")


class ReferenceSession:
    """A long-lived reference subprocess: ``call`` runs functions in it one after another, and
    what they keep in module globals (a loaded model) stays between calls (``call_reference``
    starts a new process per call). The subprocess waits on its stdin between calls (no CPU).

    Requests and replies are pickled over the subprocess's stdin and a duplicate of its
    original stdout; its own prints go to its stderr, which is kept in a temporary file and
    quoted when a call fails. Use as a context manager (or call ``close``).

    Raises (from ``__init__``): FileNotFoundError: the overlay ``.ref/qwen-tts`` is missing.
    """

    def __init__(self) -> None:
        _check_overlay()
        # kept open for the session's life (the subprocess writes to it); closed by close()
        self._stderr = tempfile.TemporaryFile(prefix="qwen3-ref-session-")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.qwen3_tts_ref.env", "--serve"],
            cwd=REPO,
            env=_child_env(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stderr_tail(self, chars: int = 4000) -> str:
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")[-chars:]

    def call(self, target: str, **kwargs: Any) -> Any:
        """Run ``target`` (``"package.module:function"``) with ``kwargs`` in the subprocess.

        Raises:
            ReferenceRunError: the function raised (its traceback) or the subprocess died (its
                stderr tail).
        """
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            pickle.dump((target, kwargs), self.proc.stdin)
            self.proc.stdin.flush()
            status, value = pickle.load(self.proc.stdout)
        except (BrokenPipeError, EOFError, pickle.UnpicklingError) as exc:
            self.proc.wait(timeout=30)
            raise ReferenceRunError(
                f"{target}: the reference subprocess died (rc={self.proc.returncode}, "
                f"{type(exc).__name__}):\n{self.stderr_tail()}"
            ) from exc
        if status != "ok":
            raise ReferenceRunError(f"{target} failed:\n{value}")
        return value

    def close(self) -> None:
        """End the subprocess (EOF on its stdin; killed if it has not ended after 30 s)."""
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._stderr.close()

    def __enter__(self) -> ReferenceSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _serve() -> None:
    """The ``ReferenceSession`` side: answer pickled ``(target, kwargs)`` requests until EOF."""
    import importlib
    import traceback

    install_stubs()
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # prints of the reference (fd 1) go to stderr, never into the replies
    requests = sys.stdin.buffer
    while True:
        try:
            target, kwargs = pickle.load(requests)
        except EOFError:
            break
        try:
            module_name, _, func_name = target.partition(":")
            func = getattr(importlib.import_module(module_name), func_name)
            reply = ("ok", func(**kwargs))
        except Exception:
            reply = ("error", traceback.format_exc())
        pickle.dump(reply, replies)
        replies.flush()


if __name__ == "__main__":
    _serve()
