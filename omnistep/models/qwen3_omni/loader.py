"""Locate and read a Qwen3-Omni checkpoint folder in the published Hugging Face layout
(Qwen/Qwen3-Omni-30B-A3B-Instruct, -Thinking, -Captioner).

Layout: ``config.json`` (``model_type`` ``qwen3_omni_moe``; ``thinker_config`` with
``text_config`` / ``audio_config`` / ``vision_config``, ``talker_config`` with ``text_config`` /
``code_predictor_config``, ``code2wav_config``; the Thinking and Captioner checkpoints ship
the thinker only, ``enable_audio_output`` false), ``model.safetensors.index.json`` with its
shards (tensor names prefixed ``thinker.``, ``talker.``, ``code2wav.``; a single
``model.safetensors`` is accepted too), and the tokenizer files (``tokenizer_config.json``,
``vocab.json``, ``merges.txt``). Nothing is downloaded: a missing or wrong file is named in
the error (``Qwen3OmniCheckpointError``).

Imports: the standard library, torch, safetensors, ``omnistep.core``, ``omnistep.layers``,
``omnistep.runners.locate``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from omnistep.core import ModelFilesError
from omnistep.layers.codec_decoder import CodecDecoder, CodecDecoderConfig, load_codec_decoder
from omnistep.runners.locate import checkpoint_folder

MODEL_TYPE = "qwen3_omni_moe"
REQUIRED = ("config.json", "tokenizer_config.json", "vocab.json", "merges.txt")
WEIGHTS = ("model.safetensors.index.json", "model.safetensors")
LAYOUT = (
    "expected the official layout: config.json (model_type qwen3_omni_moe), "
    "tokenizer_config.json, vocab.json, merges.txt, model.safetensors.index.json with its "
    "shards (or model.safetensors)"
)
SUB_CONFIGS = {
    "thinker_config": ("text_config",),
    "talker_config": ("text_config", "code_predictor_config"),
    "code2wav_config": (),
}
"""Sub-config -> the configs nested in it that config.json must hold (the talker's and
code2wav's only with ``enable_audio_output``)."""


class Qwen3OmniCheckpointError(ModelFilesError, ValueError):
    """A Qwen3-Omni checkpoint folder is missing a file or holds a wrong one (named)."""


@dataclass(frozen=True)
class Qwen3OmniCheckpoint:
    """A checked checkpoint folder: ``config`` is its parsed ``config.json``."""

    root: Path
    config: dict[str, Any]

    @classmethod
    def open(cls, root: str | Path) -> Qwen3OmniCheckpoint:
        """Check the folder and read its config.

        Raises:
            Qwen3OmniCheckpointError: the folder or a required file is missing, config.json
                is not JSON or not a Qwen3-Omni config (wrong ``model_type``, a sub-config
                missing), or the index names a shard that is not there.
        """
        path = checkpoint_folder(
            root, "Qwen3-Omni", LAYOUT, REQUIRED, WEIGHTS, error=Qwen3OmniCheckpointError
        )
        config = _read_json(path / "config.json")
        if config.get("model_type") != MODEL_TYPE:
            raise Qwen3OmniCheckpointError(
                f"{path / 'config.json'}: model_type is {config.get('model_type')!r}, expected "
                f"{MODEL_TYPE!r} ({LAYOUT})"
            )
        audio_out = config.get("enable_audio_output", True)
        for name, nested in SUB_CONFIGS.items():
            if name != "thinker_config" and not audio_out:
                continue
            sub = config.get(name)
            missing = [k for k in nested if not isinstance((sub or {}).get(k), dict)]
            if not isinstance(sub, dict) or missing:
                what = name if not isinstance(sub, dict) else f"{name}.{missing[0]}"
                raise Qwen3OmniCheckpointError(f"{path / 'config.json'} has no {what} ({LAYOUT})")
        checkpoint = cls(path, config)
        checkpoint.shards()
        return checkpoint

    @property
    def has_talker(self) -> bool:
        """Whether the checkpoint holds the talker and code2wav (``enable_audio_output``)."""
        return bool(self.config.get("enable_audio_output", True))

    def generation_config(self) -> dict[str, Any]:
        """``generation_config.json`` ({} when the folder has none)."""
        path = self.root / "generation_config.json"
        return _read_json(path) if path.exists() else {}

    def shards(self) -> list[Path]:
        """The weight files, in name order.

        Raises:
            Qwen3OmniCheckpointError: the index is not JSON, has no ``weight_map``, or names a
                shard that is not in the folder.
        """
        index = self.root / WEIGHTS[0]
        if not index.exists():
            return [self.root / WEIGHTS[1]]
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise Qwen3OmniCheckpointError(f"{index} has no weight_map ({LAYOUT})")
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not (self.root / n).is_file()]
        if missing:
            raise Qwen3OmniCheckpointError(
                f"Qwen3-Omni checkpoint {self.root} is missing {missing[0]} (named in {index.name})"
            )
        return [self.root / n for n in names]

    def tensor_names(self) -> list[str]:
        """Every tensor name of the checkpoint (the index's ``weight_map``, else the single
        file's keys), sorted.

        Raises:
            Qwen3OmniCheckpointError: as ``shards``, or a file that is not safetensors.
        """
        index = self.root / WEIGHTS[0]
        if index.exists():
            self.shards()
            return sorted(_read_json(index)["weight_map"])
        from safetensors import SafetensorError, safe_open

        shard = self.shards()[0]
        try:
            with safe_open(str(shard), framework="pt", device="cpu") as f:
                return sorted(f.keys())
        except (SafetensorError, OSError) as exc:
            raise Qwen3OmniCheckpointError(f"{shard}: not a safetensors file ({exc})") from exc

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """Every tensor whose name starts with ``prefix``, by its full name, on the CPU.

        Raises:
            Qwen3OmniCheckpointError: a shard is not a safetensors file (named).
        """
        from safetensors import SafetensorError, safe_open

        out: dict[str, torch.Tensor] = {}
        for shard in self.shards():
            try:
                with safe_open(str(shard), framework="pt", device="cpu") as f:
                    for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                        if key.startswith(prefix):
                            out[key] = f.get_tensor(key)
            except (SafetensorError, OSError) as exc:
                raise Qwen3OmniCheckpointError(f"{shard}: not a safetensors file ({exc})") from exc
        return out

    def code2wav_config(self) -> CodecDecoderConfig:
        """``code2wav_config`` as the shared codec decoder's config (``code_embedding``).

        Raises:
            Qwen3OmniCheckpointError: the checkpoint has no talker, or a bad value (named).
        """
        self.need_talker("code2wav")
        try:
            return CodecDecoderConfig.from_code2wav(self.config["code2wav_config"])
        except (TypeError, ValueError) as exc:
            raise Qwen3OmniCheckpointError(
                f"{self.root / 'config.json'}: code2wav_config: {exc}"
            ) from exc

    def load_code2wav(
        self, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
    ) -> CodecDecoder:
        """The code2wav decoder with the checkpoint's ``code2wav.*`` weights, strictly.

        Raises:
            Qwen3OmniCheckpointError: no talker in the checkpoint, bad config values.
            ModelFilesError: tensors missing, unexpected or of the wrong shape (named).
        """
        config = self.code2wav_config()
        return load_codec_decoder(
            self.tensors("code2wav."),
            config,
            device,
            dtype,
            source=f"{self.root} (code2wav.*)",
            prefix="code2wav.",
        )

    def need_talker(self, what: str) -> None:
        """Raise Qwen3OmniCheckpointError (naming ``what``) when the checkpoint has no talker."""
        if not self.has_talker:
            raise Qwen3OmniCheckpointError(
                f"{self.root / 'config.json'} has enable_audio_output false: the checkpoint has "
                f"no {what} (the Thinking and Captioner checkpoints are thinker-only)"
            )


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object file; Qwen3OmniCheckpointError naming it when it is not one."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise Qwen3OmniCheckpointError(f"{path}: not a readable JSON file ({exc})") from exc
    if not isinstance(data, dict):
        raise Qwen3OmniCheckpointError(f"{path}: expected a JSON object")
    return data
