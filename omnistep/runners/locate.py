"""Where a ``--model`` name's weights are: the family of a folder (``infer_family``), the
local folder of a Hugging Face model id (``hub_snapshot``), and the one check of a family's
checkpoint folder every loader starts with (``checkpoint_folder``).

A folder's family is read from what the folder holds, never from substrings of its name:
``config.json``'s ``model_type`` / ``architectures``, or files only one family's layout has
(``LAYOUTS``, one row per family; a family added later adds its row). Hub ids resolve through
``huggingface_hub``: the local cache first (no network), ``HF_HUB_OFFLINE`` honoured, else
``snapshot_download`` with its progress bar.

Imports: the standard library, ``omnistep.core``; ``huggingface_hub`` inside ``hub_snapshot``.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from omnistep.core import InvalidRequestError, ModelFilesError


@dataclass(frozen=True)
class WeightsLayout:
    """How a folder of one family's weights is recognised.

    A folder matches when its ``config.json`` has one of ``model_types`` as ``model_type`` or
    one of ``architectures`` in ``architectures``; or when it holds every path of one of
    ``file_sets``; or when it holds exactly one ``*.onnx`` with ``companion_suffix`` beside it
    (``voice.onnx`` + ``voice.onnx.json``: the spec then names that file).
    """

    model_types: tuple[str, ...] = ()
    architectures: tuple[str, ...] = ()
    file_sets: tuple[tuple[str, ...], ...] = ()
    companion_suffix: str | None = None
    description: str = ""
    """What the layout looks like, for error messages."""


LAYOUTS: dict[str, WeightsLayout] = {
    "qwen3_tts": WeightsLayout(
        model_types=("qwen3_tts",),
        architectures=("Qwen3TTSForConditionalGeneration",),
        description="config.json with model_type qwen3_tts (Qwen/Qwen3-TTS-12Hz-*)",
    ),
    "higgs_audio_v2": WeightsLayout(
        model_types=("higgs_audio_v2",),
        architectures=("HiggsAudioV2ForConditionalGeneration",),
        description="config.json with model_type higgs_audio_v2 (transformers layout of "
        "bosonai/higgs-audio-v2-generation-3B-base)",
    ),
    "qwen2_5_omni": WeightsLayout(
        model_types=("qwen2_5_omni",),
        architectures=("Qwen2_5OmniForConditionalGeneration", "Qwen2_5OmniModel"),
        description="config.json with model_type qwen2_5_omni (Qwen/Qwen2.5-Omni-*)",
    ),
    "qwen3_omni": WeightsLayout(
        model_types=("qwen3_omni_moe",),
        architectures=("Qwen3OmniMoeForConditionalGeneration",),
        description="config.json with model_type qwen3_omni_moe (Qwen/Qwen3-Omni-30B-A3B-*)",
    ),
    "voxcpm": WeightsLayout(
        file_sets=(
            ("config.json", "audiovae.safetensors"),
            ("config.json", "audiovae.pth"),
        ),
        description="config.json with audiovae.safetensors or audiovae.pth (openbmb/VoxCPM2)",
    ),
    "chattts": WeightsLayout(
        file_sets=(("asset/gpt/config.json", "asset/Embed.safetensors"),),
        description="asset/gpt/config.json and asset/Embed.safetensors (2Noise/ChatTTS)",
    ),
    "chatterbox": WeightsLayout(
        file_sets=(("t3_cfg.safetensors", "s3gen.safetensors", "ve.safetensors"),),
        description="t3_cfg.safetensors, s3gen.safetensors and ve.safetensors "
        "(ResembleAI/chatterbox)",
    ),
    "kokoro": WeightsLayout(
        file_sets=(
            ("kokoro-v1.0.onnx", "voices-v1.0.bin"),
            ("kokoro-v1.0.int8.onnx", "voices-v1.0.bin"),
        ),
        description="kokoro-v1.0[.int8].onnx and voices-v1.0.bin (kokoro-onnx)",
    ),
    "piper": WeightsLayout(
        companion_suffix=".onnx.json",
        description="one VOICE.onnx with VOICE.onnx.json (a Piper voice)",
    ),
}
"""Family -> how its weights folder looks. Families without a row (hibari, toy) take no path."""

HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")
"""A Hugging Face model id, ``ORG/NAME`` (huggingface_hub validates it further)."""


def infer_family(path: str | Path) -> tuple[str, str]:
    """The family whose layout the folder (or file) ``path`` has, and the path its spec takes
    (the folder, or for piper the voice's ``.onnx`` file).

    Raises:
        ModelFilesError: ``path`` does not exist, or matches no family's layout, or several
            (the message lists every family's layout).
    """
    path = Path(path).expanduser()
    if not path.exists():
        raise ModelFilesError(f"model path {path} not found")
    if path.is_file():
        return _infer_file(path)
    found = _config_family(path) or [
        (family, str(path)) for family, layout in LAYOUTS.items() if _has_files(path, layout)
    ]
    if not found:
        found = _companion_matches(path)
    if len(found) != 1:
        what = "matches no family's layout" if not found else "matches several families"
        raise ModelFilesError(f"cannot tell the model family of {path}: it {what}; {_expected()}")
    return found[0]


def _expected() -> str:
    """Every family's layout, and how to name the family yourself."""
    rows = "; ".join(f"{family}: {layout.description}" for family, layout in LAYOUTS.items())
    return f"expected one of: {rows} (or give the family: --model FAMILY=PATH)"


def _config_family(folder: Path) -> list[tuple[str, str]]:
    """The families ``config.json`` names (none without the file)."""
    config = folder / "config.json"
    if not config.is_file():
        return []
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelFilesError(f"{config} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        return []
    model_type = data.get("model_type")
    archs = data.get("architectures") or []
    archs = archs if isinstance(archs, list) else []
    found = [
        (family, str(folder))
        for family, layout in LAYOUTS.items()
        if model_type in layout.model_types or any(a in layout.architectures for a in archs)
    ]
    if not found and (model_type or archs):
        raise ModelFilesError(
            f"{config} names model_type {model_type!r} (architectures {archs}), which no "
            f"omnistep family serves; {_expected()}"
        )
    return found


def _has_files(folder: Path, layout: WeightsLayout) -> bool:
    return any(all((folder / rel).exists() for rel in rels) for rels in layout.file_sets)


def _companion_matches(folder: Path) -> list[tuple[str, str]]:
    """Families with a companion-file layout whose ``*.onnx`` the folder holds exactly once."""
    found = []
    for family, layout in LAYOUTS.items():
        if layout.companion_suffix is None:
            continue
        voices = [
            p for p in sorted(folder.glob("*.onnx")) if _companion(p, layout.companion_suffix)
        ]
        if len(voices) == 1:
            found.append((family, str(voices[0])))
    return found


def _companion(onnx: Path, suffix: str) -> bool:
    return onnx.with_name(onnx.name[: -len(".onnx")] + suffix).is_file()


def _infer_file(path: Path) -> tuple[str, str]:
    """The family of a single weights file (piper's ``.onnx``, kokoro's ``.onnx``)."""
    if path.suffix == ".onnx":
        for family, layout in LAYOUTS.items():
            if layout.companion_suffix and _companion(path, layout.companion_suffix):
                return family, str(path)
            if any(
                path.name in rels and _has_files(path.parent, layout) for rels in layout.file_sets
            ):
                return family, str(path)
    raise ModelFilesError(f"cannot tell the model family of the file {path}; {_expected()}")


def checkpoint_folder(
    root: str | Path,
    family: str,
    layout: str,
    required: tuple[str, ...] = (),
    one_of: tuple[str, ...] = (),
    *,
    files_only: bool = False,
    error: type[ModelFilesError] = ModelFilesError,
) -> Path:
    """The checkpoint folder ``root`` of a family's loader, checked: it is a folder, holds
    every path of ``required`` and, when ``one_of`` is given, at least one of its paths.

    Args:
        family: the model's name in messages (``"Qwen2.5-Omni"``).
        layout: what the folder should hold, shown in brackets after each message.
        files_only: the required paths must be files (not merely exist).
        error: the ``ModelFilesError`` subclass the family raises.

    Raises:
        ModelFilesError (``error``): the folder is missing or a file, or the first missing
            path of ``required`` (then ``one_of``) is named.
    """
    path = Path(root).expanduser()
    if not path.is_dir():
        what = "is not a folder" if path.exists() else "not found"
        raise error(f"{family} checkpoint folder {path} {what} ({layout})")
    for rel in required:
        if not ((path / rel).is_file() if files_only else (path / rel).exists()):
            raise error(f"{family} checkpoint {path} is missing {rel} ({layout})")
    if one_of and not any((path / rel).exists() for rel in one_of):
        alternatives = " or ".join(one_of[1:])
        raise error(
            f"{family} checkpoint {path} is missing {one_of[0]} (or {alternatives}) ({layout})"
        )
    return path


def is_hub_id(name: str) -> bool:
    """Whether ``name`` reads as a Hugging Face model id (``ORG/NAME``) and is no local path."""
    return HUB_ID.fullmatch(name) is not None and not Path(name).expanduser().exists()


def hub_offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` is set to a true value (huggingface_hub's reading of it)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def hub_snapshot(repo_id: str, cache_dir: str | Path | None = None) -> Path:
    """The local folder of the Hugging Face model ``repo_id``: its snapshot in the cache
    (``$HF_HOME/hub``, or ``cache_dir``) when there is one, without any network access; else,
    unless ``HF_HUB_OFFLINE`` is set, downloaded by ``snapshot_download`` (which shows a
    progress bar).

    Raises:
        InvalidRequestError: ``repo_id`` is not a valid model id.
        ModelFilesError: not cached and offline, or the download failed (no such model, gated,
            no network): the message says which and what to do.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, cache_dir=cache_dir, local_files_only=True))
    except HFValidationError as exc:
        raise InvalidRequestError(f"bad model id {repo_id!r}: {exc}", param="model") from None
    except LocalEntryNotFoundError:
        pass
    if hub_offline():
        raise ModelFilesError(
            f"{repo_id} is no local path and not in the Hugging Face cache, and HF_HUB_OFFLINE "
            f"is set: download it where there is a network (hf download {repo_id}) and copy "
            "the cache, or unset HF_HUB_OFFLINE"
        )
    try:
        return Path(snapshot_download(repo_id, cache_dir=cache_dir))
    except Exception as exc:  # noqa: BLE001 - every hub/network failure becomes one clear line
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelFilesError(
            f"{repo_id} is no local path, and downloading it from the Hugging Face Hub failed "
            f"({type(exc).__name__}: {reason}); check the path or id, your network and, for "
            "gated models, HF_TOKEN"
        ) from None
