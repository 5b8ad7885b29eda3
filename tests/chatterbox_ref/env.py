"""Run functions of the Chatterbox reference (``chatterbox-tts`` 0.1.7) in a subprocess.

The Makefile installs the package alone (``--no-deps``) into the overlay ``.ref/chatterbox``: it
pins torch 2.6, transformers 5.2, diffusers, librosa, resemble-perth and gradio, none of which
the T3 path needs. A subprocess of the venv's python (its torch 2.13, transformers 5.x) puts the
overlay first on its path and registers an empty ``chatterbox`` package whose ``__path__`` is the
overlay's folder, so ``chatterbox.models.t3`` imports without the package ``__init__`` (which
imports every pipeline: ``tts.py`` needs librosa and ``perth``, the watermarker). Nothing else is
stubbed; tqdm's progress bars are off. The round trip is ``tests/ref_overlay.py``'s.

Usage::

    from tests.chatterbox_ref.env import call_reference
    out = call_reference("tests.chatterbox_ref.upstream_t3:greedy", root=path, ...)
"""

from __future__ import annotations

import sys

from tests.ref_overlay import REPO, Overlay, ReferenceRunError

__all__ = ["OVERLAY", "REF_DIR", "REPO", "ReferenceRunError", "bare_package", "call_reference"]

OVERLAY = Overlay(
    folder="chatterbox",
    package="chatterbox",
    env_module="tests.chatterbox_ref.env",
    bare_packages=("chatterbox",),
    env=(("TQDM_DISABLE", "1"), ("PYTHONWARNINGS", "ignore::FutureWarning")),
)
REF_DIR = OVERLAY.ref_dir
call_reference = OVERLAY.call
"""``call_reference(target, timeout=600, **kwargs)``: ``Overlay.call`` (one fresh subprocess)."""


def bare_package(name: str, folder: str) -> None:
    """Register ``name`` as a bare package over ``folder`` of the overlay's ``chatterbox`` (its
    ``__init__`` not run; subprocess only): ``chatterbox.models.s3gen``'s would import
    torchaudio."""
    OVERLAY.prepare()
    OVERLAY.bare_package(name, REF_DIR / "chatterbox" / folder)


if __name__ == "__main__":
    OVERLAY.serve_main(sys.argv[1:])
