"""Reads a Higgs Audio v2 folder in the layout transformers 5.x loads.

The folder (as ``HiggsAudioV2ForConditionalGeneration.from_pretrained`` and
``HiggsAudioV2Processor`` read it)::

    config.json                 model_type higgs_audio_v2 (``HiggsAudioV2Config``)
    model.safetensors           or model.safetensors.index.json + shards
    tokenizer.json, tokenizer_config.json   the Llama-3 text tokenizer with Higgs' special tokens
    audio_tokenizer/config.json model_type higgs_audio_v2_tokenizer
                                (``HiggsAudioV2TokenizerConfig``)
    audio_tokenizer/model.safetensors

The audio tokenizer is published as its own repository (bosonai/higgs-audio-v2-tokenizer); the
card takes it from ``audio_tokenizer/`` inside the folder, or from the folder its
``audio_tokenizer`` option names.

Config keys read (``HiggsAudioV2Config``): the Llama sizes, ``rope_parameters`` (llama3
scaling), ``num_codebooks``, ``codebook_size`` (codec ids + the stream BOS/EOS ids),
``audio_token_id``, ``audio_bos_token_id``, ``audio_delay_token_id``, ``audio_stream_bos_id``,
``audio_stream_eos_id``, ``eos_token_id``. Audio tokenizer (``HiggsAudioV2TokenizerConfig``):
``codebook_size``, ``codebook_dim``, ``target_bandwidths``, ``sample_rate``,
``acoustic_model_config`` (DAC: ``hidden_size``, ``decoder_hidden_size``,
``upsampling_ratios``), ``semantic_model_config.hidden_size``.

Imports: the standard library, torch, safetensors, ``omnistep.core``, ``omnistep.runners.locate``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from omnistep.core import ModelFilesError
from omnistep.runners.locate import checkpoint_folder

FAMILY = "Higgs Audio v2"
LAYOUT = "config.json, model.safetensors, tokenizer.json, audio_tokenizer/ (transformers 5.x)"
AUDIO_TOKENIZER_DIR = "audio_tokenizer"


class HiggsCheckpointError(ModelFilesError, ValueError):
    """A Higgs Audio v2 folder is missing a file, a config key or a tensor, or one does not
    match; the message names the file and the key or tensor."""


def _json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise HiggsCheckpointError(f"{path}: unreadable JSON ({exc})") from exc


def _key(cfg: dict[str, Any], name: str, path: Path, default: Any = ...) -> Any:
    if name in cfg:
        return cfg[name]
    if default is ...:
        raise HiggsCheckpointError(f"{path} has no '{name}'")
    return default


@dataclass(frozen=True)
class HiggsLMConfig:
    """The backbone's fields of ``config.json`` (``HiggsAudioV2Config``; defaults as there)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: dict[str, Any]
    num_codebooks: int
    codebook_size: int
    audio_token_id: int
    audio_bos_token_id: int
    audio_delay_token_id: int
    audio_stream_bos_id: int
    audio_stream_eos_id: int
    eos_token_id: int

    @property
    def rope_theta(self) -> float:
        return float(self.rope.get("rope_theta", 500000.0))

    @classmethod
    def read(cls, path: Path) -> HiggsLMConfig:
        """Parse ``path`` (``config.json``).

        Raises:
            HiggsCheckpointError: another model_type, a missing key, an unsupported rope or
                activation.
        """
        cfg = _json(path)
        if cfg.get("model_type") != "higgs_audio_v2":
            raise HiggsCheckpointError(
                f"{path}: model_type is {cfg.get('model_type')!r}, not 'higgs_audio_v2' "
                "(the original bosonai 'higgs_audio' folder must be converted to the "
                "transformers layout)"
            )
        hidden = _key(cfg, "hidden_size", path, 3072)
        heads = _key(cfg, "num_attention_heads", path, 24)
        rope = cfg.get("rope_parameters") or {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 32.0,
            "low_freq_factor": 0.125,
            "high_freq_factor": 0.5,
            "original_max_position_embeddings": 1024,
        }
        if rope.get("rope_type", "default") not in ("default", "llama3"):
            raise HiggsCheckpointError(f"{path}: rope_type {rope.get('rope_type')!r} unsupported")
        if (
            cfg.get("hidden_act", "silu") != "silu"
            or cfg.get("attention_bias")
            or cfg.get("mlp_bias")
        ):
            raise HiggsCheckpointError(f"{path}: only silu, bias-free layers are supported")
        eos = cfg.get("eos_token_id", 128009)
        return cls(
            vocab_size=_key(cfg, "vocab_size", path, 128256),
            hidden_size=hidden,
            intermediate_size=_key(cfg, "intermediate_size", path, 8192),
            num_hidden_layers=_key(cfg, "num_hidden_layers", path, 28),
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            max_position_embeddings=_key(cfg, "max_position_embeddings", path, 2048),
            rope=dict(rope),
            num_codebooks=_key(cfg, "num_codebooks", path, 8),
            codebook_size=_key(cfg, "codebook_size", path, 1024),
            audio_token_id=_key(cfg, "audio_token_id", path, 128016),
            audio_bos_token_id=_key(cfg, "audio_bos_token_id", path, 128013),
            audio_delay_token_id=_key(cfg, "audio_delay_token_id", path, 128014),
            audio_stream_bos_id=_key(cfg, "audio_stream_bos_id", path, 1024),
            audio_stream_eos_id=_key(cfg, "audio_stream_eos_id", path, 1025),
            eos_token_id=eos[0] if isinstance(eos, list) else eos,
        )


@dataclass(frozen=True)
class HiggsCodecConfig:
    """The audio tokenizer's decoder fields (``HiggsAudioV2TokenizerConfig``)."""

    codebook_size: int
    codebook_dim: int
    num_quantizers: int
    sample_rate: int
    acoustic_hidden_size: int
    semantic_hidden_size: int
    decoder_hidden_size: int
    upsampling_ratios: tuple[int, ...]

    @property
    def hop_length(self) -> int:
        """Samples per frame: the product of the DAC upsampling ratios (960: 25 frames/s)."""
        return math.prod(self.upsampling_ratios)

    @classmethod
    def read(cls, path: Path) -> HiggsCodecConfig:
        """Parse the audio tokenizer's ``config.json``; ``num_quantizers`` as transformers
        derives it: ``1000 * max bandwidth // (frame_rate * ceil(log2(codebook_size)))``.

        Raises:
            HiggsCheckpointError: another model_type or a missing key.
        """
        cfg = _json(path)
        if cfg.get("model_type") != "higgs_audio_v2_tokenizer":
            raise HiggsCheckpointError(
                f"{path}: model_type is {cfg.get('model_type')!r}, not 'higgs_audio_v2_tokenizer'"
            )
        acoustic = _key(cfg, "acoustic_model_config", path)
        semantic = _key(cfg, "semantic_model_config", path)
        ratios = tuple(_key(acoustic, "upsampling_ratios", path))
        sample_rate = int(cfg.get("sample_rate", 24000))
        codebook_size = int(cfg.get("codebook_size", 1024))
        frame_rate = math.ceil(sample_rate / math.prod(ratios))
        bandwidth = list(cfg.get("target_bandwidths", (0.5, 1, 1.5, 2, 4)))[-1]
        bits = math.ceil(math.log2(codebook_size))
        return cls(
            codebook_size=codebook_size,
            codebook_dim=int(cfg.get("codebook_dim", 64)),
            num_quantizers=int(1000 * bandwidth // (frame_rate * bits)),
            sample_rate=sample_rate,
            acoustic_hidden_size=int(_key(acoustic, "hidden_size", path)),
            semantic_hidden_size=int(_key(semantic, "hidden_size", path)),
            decoder_hidden_size=int(_key(acoustic, "decoder_hidden_size", path)),
            upsampling_ratios=ratios,
        )


def read_safetensors(folder: Path, what: str) -> dict[str, torch.Tensor]:
    """Every tensor of ``model.safetensors`` or of the shards ``model.safetensors.index.json``
    lists, on the CPU.

    Raises:
        HiggsCheckpointError: neither file, or a shard missing.
    """
    from safetensors.torch import load_file

    single = folder / "model.safetensors"
    if single.is_file():
        return load_file(str(single))
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        raise HiggsCheckpointError(f"{what} {folder} has no model.safetensors ({LAYOUT})")
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(set(_key(_json(index), "weight_map", index).values())):
        if not (folder / shard).is_file():
            raise HiggsCheckpointError(f"{what} {folder} is missing shard {shard}")
        tensors.update(load_file(str(folder / shard)))
    return tensors


def take(tensors: dict[str, torch.Tensor], name: str, shape: tuple[int, ...], where: Path):
    """``tensors[name]`` checked against ``shape``.

    Raises:
        HiggsCheckpointError: the tensor is missing or of another shape (both named).
    """
    if name not in tensors:
        raise HiggsCheckpointError(f"{where} has no tensor {name}")
    tensor = tensors[name]
    if tuple(tensor.shape) != tuple(shape):
        raise HiggsCheckpointError(
            f"{where}: tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(shape)}"
        )
    return tensor


@dataclass(frozen=True)
class HiggsCheckpoint:
    """An opened folder: parsed configs and paths; tensors are read by the components."""

    root: Path
    lm: HiggsLMConfig
    codec: HiggsCodecConfig
    codec_root: Path

    @classmethod
    def open(cls, path: str | Path, audio_tokenizer: str | Path | None = None) -> HiggsCheckpoint:
        """Check the folder's files and parse its configs.

        Args:
            path: the model folder.
            audio_tokenizer: the audio tokenizer folder (default ``path/audio_tokenizer``).

        Raises:
            HiggsCheckpointError: a missing file or key (named), or a mismatch between the
                two configs (codebooks, stream ids).
        """
        root = checkpoint_folder(
            path,
            FAMILY,
            LAYOUT,
            ("config.json", "tokenizer.json", "tokenizer_config.json"),
            ("model.safetensors", "model.safetensors.index.json"),
            error=HiggsCheckpointError,
        )
        codec_root = Path(audio_tokenizer) if audio_tokenizer else root / AUDIO_TOKENIZER_DIR
        checkpoint_folder(
            codec_root,
            f"{FAMILY} audio tokenizer",
            "config.json, model.safetensors (bosonai/higgs-audio-v2-tokenizer)",
            ("config.json", "model.safetensors"),
            error=HiggsCheckpointError,
        )
        lm = HiggsLMConfig.read(root / "config.json")
        codec = HiggsCodecConfig.read(codec_root / "config.json")
        if codec.num_quantizers < lm.num_codebooks:
            raise HiggsCheckpointError(
                f"{codec_root}: {codec.num_quantizers} quantizers for {lm.num_codebooks} codebooks"
            )
        if lm.audio_stream_bos_id != codec.codebook_size or lm.codebook_size <= max(
            lm.audio_stream_bos_id, lm.audio_stream_eos_id
        ):
            raise HiggsCheckpointError(
                f"{root / 'config.json'}: codebook_size {lm.codebook_size} and stream ids "
                f"{lm.audio_stream_bos_id}/{lm.audio_stream_eos_id} do not fit the audio "
                f"tokenizer's {codec.codebook_size} codes"
            )
        return cls(root, lm, codec, codec_root)

    def tokenizer(self) -> Any:
        """The text tokenizer (``tokenizers.Tokenizer`` of ``tokenizer.json``)."""
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(self.root / "tokenizer.json"))
