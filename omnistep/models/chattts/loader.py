"""Locate and read a ChatTTS checkpoint folder in the official repository layout.

Layout (2noise/ChatTTS): ``asset/gpt/config.json`` + ``asset/gpt/model.safetensors`` (the Llama
backbone), ``asset/Embed.safetensors`` (``emb_text``, ``emb_code.{j}``, weight-normed
``head_text`` / ``head_code.{j}``), ``asset/Decoder.safetensors``, ``asset/DVAE.safetensors``,
``asset/Vocos.safetensors``, ``asset/tokenizer/`` (BERT tokenizer files). Optional (not in the
published folder; older layouts had it): ``asset/spk_stat.pt`` (``[2 * hidden]`` std then mean),
the speaker statistics; upstream 0.2.5 keeps them in its package config instead, and omnistep
ships the same (``speaker.shipped_spk_stat``), used when the file is absent.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from omnistep.runners.locate import checkpoint_folder

REQUIRED = (
    "asset/gpt/config.json",
    "asset/gpt/model.safetensors",
    "asset/Embed.safetensors",
    "asset/Decoder.safetensors",
    "asset/DVAE.safetensors",
    "asset/Vocos.safetensors",
    "asset/tokenizer",
)


@dataclass(frozen=True)
class ChatTTSFiles:
    """Paths of a checked checkpoint folder."""

    root: Path

    @classmethod
    def locate(cls, root: str | Path) -> ChatTTSFiles:
        """Check that every required file exists.

        Raises:
            ModelFilesError: (a FileNotFoundError) naming the first missing file, or the
                folder itself, and the files expected.
        """
        layout = f"expected the official layout: {', '.join(REQUIRED)}"
        return cls(checkpoint_folder(root, "ChatTTS", layout, REQUIRED))

    @property
    def asset(self) -> Path:
        return self.root / "asset"

    def tensors(self, rel: str) -> dict[str, torch.Tensor]:
        """All tensors of a safetensors file under the folder (on CPU)."""
        from safetensors.torch import load_file

        return load_file(str(self.root / rel), device="cpu")

    def shapes(self, rel: str) -> dict[str, tuple[int, ...]]:
        """Name -> shape of every tensor of a safetensors file under the folder, read from its
        header only (no tensor is loaded)."""
        from safetensors import safe_open

        with safe_open(str(self.root / rel), framework="pt", device="cpu") as f:
            return {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}  # noqa: SIM118

    def spk_stat(self) -> torch.Tensor | None:
        """``asset/spk_stat.pt`` as float32 (flattened; ``[2 * hidden]`` expected, checked by
        ``speaker.speaker_statistics``), or None when absent."""
        path = self.asset / "spk_stat.pt"
        if not path.exists():
            return None
        return torch.load(path, map_location="cpu", weights_only=True).float().reshape(-1)
