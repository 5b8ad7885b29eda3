"""Tiny Qwen3-TTS folders whose weights upstream ``qwen-tts`` draws (test helper).

The configs and tokenizer come from ``omnistep.models.qwen3_tts.tiny.write_configs`` (the
published layout); the two safetensors files are written by the reference subprocess
(``tests.qwen3_tts_ref.upstream.write_weights``: upstream's modules under
``torch.manual_seed(seed)``), so parity tests compare omnistep with upstream on weights that
upstream itself initialised. Needs ``make install-test``'s ``.ref/qwen-tts``.
``omnistep.models.qwen3_tts.tiny.write_tiny_qwen3_tts`` writes the same files without it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from omnistep.models.qwen3_tts.tiny import TINY_SIZES, Qwen3TTSInfo, Qwen3TTSSizes, write_configs


def write_reference_qwen3_tts(
    root: str | Path,
    variant: str = "custom_voice",
    seed: int = 0,
    model_size: str | None = None,
    sizes: Qwen3TTSSizes = TINY_SIZES,
) -> Qwen3TTSInfo:
    """A tiny folder of ``variant`` under ``root`` with upstream-initialised weights (several
    seconds; ``write_reference_qwen3_tts_many`` writes several with one subprocess).

    Raises:
        ValueError: unknown ``variant`` / ``model_size``.
    """
    return write_reference_qwen3_tts_many({root: variant}, seed, model_size, sizes)[0]


def write_reference_qwen3_tts_many(
    folders: dict[str | Path, str],
    seed: int = 0,
    model_size: str | None = None,
    sizes: Qwen3TTSSizes = TINY_SIZES,
) -> list[Qwen3TTSInfo]:
    """``write_reference_qwen3_tts`` for each ``root -> variant`` of ``folders`` (in that
    order), with one reference subprocess for all the weights."""
    from tests.qwen3_tts_ref.env import call_reference

    infos = [write_configs(Path(r), v, model_size, sizes) for r, v in folders.items()]
    shapes = call_reference(
        "tests.qwen3_tts_ref.upstream:write_weights_many",
        roots=[info.root for info in infos],
        seed=seed,
    )
    return [
        dataclasses.replace(info, tensor_shapes=s) for info, s in zip(infos, shapes, strict=True)
    ]
