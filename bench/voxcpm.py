"""VoxCPM2's benchmark (issue 30, item 5): ``bench/families.py``'s ``voxcpm2`` entry (omnistep's
``voxcpm`` card vs upstream ``voxcpm`` 2.0.3's own ``generate`` in the same run; what it
measures and how: "VoxCPM2" in that module's docstring), results in
``bench/results/voxcpm.json`` by default.

::

    PYTHONPATH=. .venv/bin/python bench/voxcpm.py                # 2 layers per stack, 12 patches
    PYTHONPATH=. .venv/bin/python bench/voxcpm.py --layers 4 --frames 25 --rounds 2
    PYTHONPATH=. .venv/bin/python bench/voxcpm.py --quick        # tiny folder, 4 patches

Every option of ``bench/families.py`` applies (``--frames`` counts patches: 160 ms of 48 kHz
audio each).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from families import REPO, main  # noqa: E402

DEFAULT_OUT = REPO / "bench" / "results" / "voxcpm.json"

if __name__ == "__main__":
    sys.exit(main(["--families", "voxcpm2", "--out", str(DEFAULT_OUT), *sys.argv[1:]]))
