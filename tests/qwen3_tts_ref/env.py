"""Run functions of the Qwen3-TTS reference (``qwen-tts`` 0.1.1) in a subprocess.

``qwen-tts`` pins transformers 4.57.3; omnistep runs transformers 5.x. The Makefile installs the
reference with its transformers, ``--no-deps``, into the overlay directory ``.ref/qwen-tts``; a
subprocess of the venv's python puts that overlay first on its path (so it imports the old
transformers and the venv's torch), installs stub modules for what ``qwen_tts`` imports at module
level but the paths we compare never call (gradio, sox, torchaudio), and calls one function.
librosa is real (the Makefile installs it, its dependencies the venv lacks and scipy into the
overlay): the voice-clone prompt uses its mel filters and ``resample``. Arguments and the return
value cross the process boundary by pickle: numpy arrays, numbers, strings, paths, lists and
dicts of them. The round trip is ``tests/ref_overlay.py``'s.

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
import sys
from typing import Any

from tests import ref_overlay
from tests.ref_overlay import REPO, Overlay, ReferenceRunError

__all__ = [
    "OVERLAY",
    "REF_DIR",
    "REPO",
    "ReferenceRunError",
    "ReferenceSession",
    "call_reference",
    "install_stubs",
    "shared_session",
]

STUB_MODULES = (
    "gradio",
    "sox",
    "torchaudio",
    "torchaudio.compliance",
    "torchaudio.compliance.kaldi",
)
"""Modules ``qwen_tts`` imports at module level that the compared paths never call."""

OVERLAY = Overlay(
    folder="qwen-tts",
    package="qwen_tts",
    env_module="tests.qwen3_tts_ref.env",
    stub_modules=STUB_MODULES,
    env=(("TOKENIZERS_PARALLELISM", "false"),),
)
REF_DIR = OVERLAY.ref_dir
install_stubs = OVERLAY.prepare
"""Put empty modules for ``STUB_MODULES`` in ``sys.modules`` (inside the subprocess only)."""


class ReferenceSession(ref_overlay.ReferenceSession):
    """A long-lived qwen-tts reference subprocess (``tests.ref_overlay.ReferenceSession`` of
    ``OVERLAY``): a model loaded by one call stays for the next.

    Raises (from ``__init__``): FileNotFoundError: the overlay ``.ref/qwen-tts`` is missing.
    """

    def __init__(self) -> None:
        super().__init__(OVERLAY)


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


if __name__ == "__main__":
    OVERLAY.serve_main(sys.argv[1:])
