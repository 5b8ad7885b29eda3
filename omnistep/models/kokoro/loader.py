"""The files of a Kokoro-82M v1.0 folder, as Kokoro-FastAPI and kokoro-onnx users have it.

Layout (kokoro-onnx's release ``model-files-v1.0``)::

    FOLDER/kokoro-v1.0.onnx        full-precision ONNX export (about 310 MB), or
    FOLDER/kokoro-v1.0.int8.onnx   its int8 quantization (92,361,271 bytes)
    FOLDER/voices-v1.0.bin         voice packs: an npz of float32 [510, 1, 256] arrays by name

When both models are there, ``kokoro-v1.0.onnx`` wins: it is the file kokoro-onnx's README
tells users to download, and the int8 file trades some quality for size. To serve the int8
file from such a folder, give its path instead of the folder's (``--model
kokoro=FOLDER/kokoro-v1.0.int8.onnx``): a path to an ``.onnx`` file serves that file with the
``voices-v1.0.bin`` beside it.

The graph must be the kokoro-onnx v1.0 export: inputs ``tokens`` int64 ``[1, T]`` (the
phoneme ids with a 0 pad at both ends, ``T <= 512``), ``style`` float32 ``[1, 256]``, ``speed``
float32 ``[1]``; output ``audio`` float32 ``[N]`` at 24 kHz. It has no random ops (checked on the
int8 file: Kokoro's iSTFTNet source noise is not in the export), so the audio is a pure function
of the inputs; a graph with random ops is refused, since the same seed would not give the same
audio.

Sources: kokoro-onnx ``src/kokoro_onnx/__init__.py`` (``Kokoro.__init__``: ``np.load`` of the
voices file; ``_create_audio``: inputs), ``config.py`` (``MAX_PHONEME_LENGTH = 510``, 24 kHz);
hexgrad/kokoro ``kokoro/model.py`` (``len(input_ids) + 2 <= context_length``, 512).

Imports: stdlib, numpy, onnx, ``omnistep.core``.
"""

from __future__ import annotations

import functools
import importlib.resources
import json
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto

from omnistep.core.errors import ModelFilesError

MODEL_FILES = ("kokoro-v1.0.onnx", "kokoro-v1.0.int8.onnx")
"""The model file names a folder may hold, in order of preference (the first found wins)."""
VOICES_FILE = "voices-v1.0.bin"
"""The voice packs file name."""
SAMPLE_RATE = 24_000
"""Output samples per second, Hz."""
MAX_PHONEMES = 510
"""Phoneme ids per call, pads excluded: the model's 512 positions less the two 0 pads."""
STYLE_ROWS = 510
"""Rows of a voice pack: one style vector per phoneme count (1..510)."""
STYLE_DIM = 256
"""Length of a style vector."""
RANDOM_OPS = frozenset(
    {"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial",
     "Bernoulli"}
)  # fmt: skip
"""ONNX ops that draw random numbers inside the graph."""

_EXPECTED = (
    f"expected a Kokoro v1.0 folder with {MODEL_FILES[0]} or {MODEL_FILES[1]} and {VOICES_FILE} "
    "(kokoro-onnx's release model-files-v1.0)"
)


@dataclass(frozen=True, slots=True)
class KokoroFiles:
    """The files of a Kokoro folder.

    Attributes:
        model: the ONNX model file.
        voices: the voice packs file (``voices-v1.0.bin``) beside it.
    """

    model: Path
    voices: Path


def kokoro_files(path: str | Path) -> KokoroFiles:
    """The model and voices files at ``path``: a folder (its ``kokoro-v1.0.onnx``, else its
    ``kokoro-v1.0.int8.onnx``) or one ``.onnx`` file, with ``voices-v1.0.bin`` beside it.

    Raises:
        ModelFilesError: ``path`` does not exist; a folder without a model file or without
            ``voices-v1.0.bin``; a file that is not ``.onnx`` (the message names what is
            missing and what is expected).
    """
    path = Path(path)
    if path.is_file():
        if path.suffix != ".onnx":
            raise ModelFilesError(f"kokoro model {path} is not an .onnx file ({_EXPECTED})")
        model, folder = path, path.parent
    elif path.is_dir():
        folder = path
        found = [folder / name for name in MODEL_FILES if (folder / name).is_file()]
        if not found:
            onnx_files = sorted(p.name for p in folder.glob("*.onnx"))
            held = f"; it holds {', '.join(onnx_files)}" if onnx_files else ""
            raise ModelFilesError(
                f"kokoro folder {folder} has no {MODEL_FILES[0]} or {MODEL_FILES[1]} "
                f"({_EXPECTED}{held})"
            )
        model = found[0]
    else:
        raise ModelFilesError(f"kokoro folder {path} not found ({_EXPECTED})")
    voices = folder / VOICES_FILE
    if not voices.is_file():
        raise ModelFilesError(
            f"kokoro folder {folder} has no {VOICES_FILE} beside {model.name} "
            f"(expected the voice packs: an npz of float32 [{STYLE_ROWS}, 1, {STYLE_DIM}] "
            "arrays, kokoro-onnx's voices-v1.0.bin)"
        )
    return KokoroFiles(model, voices)


def load_voice_packs(path: str | Path) -> dict[str, np.ndarray]:
    """The voice packs of ``voices-v1.0.bin`` (an npz): name -> float32 ``[510, 256]`` (row
    ``n - 1`` is the style for ``n`` phonemes), in the file's order.

    Raises:
        ModelFilesError: not an npz; no packs; a pack not ``[510, 1, 256]`` (or ``[510,
            256]``), not a float array, or with NaN/inf (the message names the pack).
    """
    expected = f"expected an npz of float32 [{STYLE_ROWS}, 1, {STYLE_DIM}] voice packs"
    try:
        npz = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise ModelFilesError(
            f"kokoro voices {path} is not an npz file: {exc} ({expected})"
        ) from None
    if not isinstance(npz, np.lib.npyio.NpzFile):
        raise ModelFilesError(f"kokoro voices {path} is a single array, not an npz ({expected})")
    try:
        with npz:
            raw = {name: npz[name] for name in npz.files}
    except (OSError, ValueError, zipfile.BadZipFile) as exc:
        raise ModelFilesError(f"kokoro voices {path}: unreadable pack: {exc}") from None
    if not raw:
        raise ModelFilesError(f"kokoro voices {path} holds no voice packs ({expected})")
    packs: dict[str, np.ndarray] = {}
    for name, pack in raw.items():
        shape = tuple(pack.shape)
        if shape == (STYLE_ROWS, 1, STYLE_DIM):
            pack = pack[:, 0, :]
        if pack.shape != (STYLE_ROWS, STYLE_DIM) or pack.dtype.kind != "f":
            raise ModelFilesError(
                f"kokoro voice pack '{name}' in {path} is {pack.dtype} {list(shape)} ({expected})"
            )
        pack = np.ascontiguousarray(pack, dtype=np.float32)
        if not np.isfinite(pack).all():
            raise ModelFilesError(f"kokoro voice pack '{name}' in {path} holds NaN or inf")
        packs[name] = pack
    return packs


def check_graph(model_path: str | Path) -> None:
    """Check that ``model_path`` is a Kokoro v1.0 ONNX export this family runs: inputs
    ``tokens`` (int64), ``style`` (float32, last dim 256), ``speed`` (float32); one float32
    output; no random ops.

    Raises:
        ModelFilesError: unreadable ONNX; other inputs or dtypes (e.g. the ``input_ids`` /
            int32 ``speed`` exports); random ops (the message names them).
    """
    try:
        model = onnx.load(str(model_path), load_external_data=False)
    except Exception as exc:  # noqa: BLE001 - onnx raises DecodeError, OSError, ...
        raise ModelFilesError(
            f"kokoro model {model_path} is not a readable ONNX file: {exc}"
        ) from None
    graph = model.graph
    initializers = {t.name for t in graph.initializer}
    inputs = {i.name: i.type.tensor_type for i in graph.input if i.name not in initializers}
    want = {"tokens": TensorProto.INT64, "style": TensorProto.FLOAT, "speed": TensorProto.FLOAT}
    got = {name: TensorProto.DataType.Name(t.elem_type).lower() for name, t in inputs.items()}
    if set(inputs) != set(want) or any(inputs[n].elem_type != t for n, t in want.items()):
        raise ModelFilesError(
            f"kokoro model {model_path} has inputs {got}; expected tokens int64 [1, T], "
            "style float32 [1, 256], speed float32 [1] (kokoro-onnx's v1.0 export)"
        )
    style_dims = inputs["style"].shape.dim
    if not style_dims or style_dims[-1].dim_value not in (0, STYLE_DIM):
        raise ModelFilesError(f"kokoro model {model_path}: style is not [1, {STYLE_DIM}]")
    if len(graph.output) != 1 or graph.output[0].type.tensor_type.elem_type != TensorProto.FLOAT:
        raise ModelFilesError(f"kokoro model {model_path}: expected one float32 audio output")
    random = sorted({n.op_type for n in _all_nodes(graph) if n.op_type in RANDOM_OPS})
    if random:
        raise ModelFilesError(
            f"kokoro model {model_path} draws noise inside the graph ({', '.join(random)}), so "
            "the same seed would not give the same audio; kokoro-onnx's v1.0 exports have no "
            "random ops"
        )


def _all_nodes(graph):
    """Every node of ``graph`` and of its subgraphs (If/Loop bodies)."""
    for node in graph.node:
        yield node
        for attr in node.attribute:
            if attr.g.node:
                yield from _all_nodes(attr.g)
            for sub in attr.graphs:
                yield from _all_nodes(sub)


@functools.cache
def kokoro_vocab() -> dict[str, int]:
    """Kokoro v1.0's phoneme -> id map (hexgrad's ``config.json`` ``"vocab"``, 114 symbols), read
    from hibari-tts's ``hibari/assets/vocab.json``, which is that map (the alphabet its G2P
    writes). The folder layout has no vocab file: kokoro-onnx ships the same map in its package.

    Raises:
        ModuleNotFoundError: hibari-tts is not installed.
    """
    text = (importlib.resources.files("hibari") / "assets" / "vocab.json").read_text("utf-8")
    data = json.loads(text)
    return dict(data.get("vocab", data))
