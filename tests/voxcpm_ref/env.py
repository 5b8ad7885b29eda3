"""Run functions of the VoxCPM2 reference (``voxcpm`` 2.0.3) in a subprocess.

The Makefile installs the package and librosa (with what librosa imports that the venv lacks)
``--no-deps`` into the overlay ``.ref/voxcpm``: the package declares gradio, funasr, modelscope,
torchaudio, torchcodec and datasets, none of which ``voxcpm.model.voxcpm2`` imports. A
subprocess of the venv's python puts the overlay first on its path and registers bare
``voxcpm`` and ``voxcpm.model`` packages over the overlay's folders, so their ``__init__``s do
not run (``voxcpm/__init__`` imports ``core.py``, the hub/modelscope pipeline;
``voxcpm/model/__init__`` imports the VoxCPM1 model, which needs torchaudio). Nothing is stubbed;
tqdm's progress bars are off.
The round trip is ``tests/ref_overlay.py``'s.

Usage::

    from tests.voxcpm_ref.env import call_reference
    out = call_reference("tests.voxcpm_ref.upstream:write_checkpoint", root=path)
"""

from __future__ import annotations

import sys

from tests.ref_overlay import REPO, Overlay, ReferenceRunError

__all__ = ["OVERLAY", "REF_DIR", "REPO", "ReferenceRunError", "call_reference"]

OVERLAY = Overlay(
    folder="voxcpm",
    package="voxcpm",
    env_module="tests.voxcpm_ref.env",
    bare_packages=("voxcpm", "voxcpm.model"),
    env=(("TQDM_DISABLE", "1"),),
)
REF_DIR = OVERLAY.ref_dir
call_reference = OVERLAY.call
"""``call_reference(target, timeout=600, **kwargs)``: ``Overlay.call`` (one fresh subprocess)."""

if __name__ == "__main__":
    OVERLAY.serve_main(sys.argv[1:])
