"""Locate and read a Qwen2.5-Omni checkpoint folder in the official Hugging Face layout.

Layout: ``config.json`` (``thinker_config``, ``talker_config``, ``token2wav_config``),
``model.safetensors.index.json`` with its shards (tensor names prefixed ``thinker.``,
``talker.``, ``token2wav.``; a single ``model.safetensors`` is accepted too), ``spk_dict.pt``
(voices, e.g. Chelsie and Ethan: ``cond``, ``ref_mel``, ``bos_token``), and the tokenizer files
with the chat template. Nothing is downloaded: a missing file is named in the error.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from omnistep.core import ModelFilesError
from omnistep.runners.locate import checkpoint_folder

REQUIRED = ("config.json", "spk_dict.pt", "tokenizer_config.json")
LAYOUT = (
    "expected the official layout: config.json, spk_dict.pt, tokenizer_config.json with the "
    "tokenizer files, model.safetensors.index.json with its shards (or model.safetensors)"
)


@dataclass(frozen=True)
class QwenOmniFiles:
    """A checked checkpoint folder."""

    root: Path

    @classmethod
    def locate(cls, root: str | Path) -> QwenOmniFiles:
        """Check the folder.

        Raises:
            ModelFilesError: (a FileNotFoundError) naming the first missing file, or the
                folder itself, and the files expected.
        """
        weights = ("model.safetensors.index.json", "model.safetensors")
        return cls(checkpoint_folder(root, "Qwen2.5-Omni", LAYOUT, REQUIRED, weights))

    def config(self) -> dict[str, Any]:
        return json.loads((self.root / "config.json").read_text())

    def generation_config(self) -> dict[str, Any]:
        path = self.root / "generation_config.json"
        return json.loads(path.read_text()) if path.exists() else {}

    def shards(self) -> list[Path]:
        """The weight files (each named shard must exist; else ModelFilesError)."""
        index = self.root / "model.safetensors.index.json"
        if not index.exists():
            return [self.root / "model.safetensors"]
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (self.root / n).exists()]
        if missing:
            raise ModelFilesError(f"Qwen2.5-Omni checkpoint {self.root} is missing {missing[0]}")
        return [self.root / n for n in names]

    def tensor_names(self) -> set[str]:
        """Every tensor name of the checkpoint, read from the index (or the file's header):
        no tensor is loaded."""
        index = self.root / "model.safetensors.index.json"
        if index.exists():
            return set(json.loads(index.read_text())["weight_map"])
        from safetensors import safe_open

        with safe_open(str(self.root / "model.safetensors"), framework="pt", device="cpu") as f:
            return set(f.keys())

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """All tensors whose name starts with ``prefix``, with the prefix removed."""
        from safetensors import safe_open

        out: dict[str, torch.Tensor] = {}
        for shard in self.shards():
            with safe_open(str(shard), framework="pt", device="cpu") as f:
                for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                    if key.startswith(prefix):
                        out[key[len(prefix) :]] = f.get_tensor(key)
        return out

    def speakers(self) -> dict[str, dict[str, Any]]:
        """``spk_dict.pt``: speaker name -> ``{cond, ref_mel, bos_token}``."""
        return torch.load(self.root / "spk_dict.pt", map_location="cpu", weights_only=True)
