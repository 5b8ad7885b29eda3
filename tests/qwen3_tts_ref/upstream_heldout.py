"""Functions that run INSIDE the qwen-tts reference subprocess (``tests.qwen3_tts_ref.env``):
a held-out tiny Qwen3-TTS folder written by the reference's own classes.

The fixtures of the other tests are written by ``tests.qwen3_tts_ref.assets`` (configs as JSON
text omnistep's tests compose, weights through ``upstream.write_weights``: bf16 safetensors of
the modules' state dicts). This writer uses none of that serialisation: ``Qwen3TTSConfig`` /
``Qwen3TTSTokenizerV2Config`` objects, ``save_pretrained`` of
``Qwen3TTSForConditionalGeneration`` (config.json + model.safetensors, float32),
``Qwen3TTSTokenizerV2Model``, ``Qwen3TTSProcessor`` (the slow Qwen2 tokenizer's files),
``EncodecFeatureExtractor`` and transformers' ``GenerationConfig``. Only ``configuration.json``
(ModelScope's) and the top ``preprocessor_config.json`` are plain JSON copies: no class writes
them (the processor's ``save_pretrained`` in transformers 4.57.3 writes no processor config
for a processor without attributes; upstream loads without it, omnistep's loader requires the
published file list). The processor saves a fast ``tokenizer.json`` beside the slow files, and
the config class adds a default ``speaker_encoder_config`` to every variant, with a
``model_type`` key its own ``__init__`` refuses (upstream cannot read back what it saved):
``_readable_config`` drops that one key. Call through
``call_reference("tests.qwen3_tts_ref.upstream_heldout:write_heldout", ...)``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_heldout(
    root: str | Path,
    config: dict[str, Any],
    codec_config: dict[str, Any],
    generation: dict[str, Any],
    tokenizer_dir: str | Path,
    speech_preprocessor: dict[str, Any],
    configuration: dict[str, Any],
    preprocessor: dict[str, Any],
    seed: int = 0,
) -> list[str]:
    """Write a Qwen3-TTS folder under ``root`` with upstream's classes.

    Args:
        config, codec_config: the values of ``config.json`` and ``speech_tokenizer/config.json``
            (turned into upstream config objects, then saved by them).
        generation: the sampling defaults, saved by ``GenerationConfig.save_pretrained``.
        tokenizer_dir: a folder with ``vocab.json``, ``merges.txt``, ``tokenizer_config.json``
            that ``Qwen3TTSProcessor.from_pretrained`` reads; the processor saves its own copy.
        speech_preprocessor: ``EncodecFeatureExtractor`` arguments.
        configuration: ``configuration.json``'s content.
        preprocessor: ``preprocessor_config.json``'s content.
        seed: ``torch.manual_seed`` before building the modules (upstream ``_init_weights``);
            the speech tokenizer's codebooks and decoder weights are then redrawn as
            ``upstream._build`` does (zero codebooks would make the audio code-independent).

    Returns:
        The written files, relative to ``root``, sorted.
    """
    import torch
    from qwen_tts.core.models import (
        Qwen3TTSConfig,
        Qwen3TTSForConditionalGeneration,
        Qwen3TTSProcessor,
    )
    from qwen_tts.core.tokenizer_12hz.configuration_qwen3_tts_tokenizer_v2 import (
        Qwen3TTSTokenizerV2Config,
    )
    from qwen_tts.core.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2 import (
        Qwen3TTSTokenizerV2Model,
    )
    from transformers import AutoConfig, AutoProcessor, EncodecFeatureExtractor, GenerationConfig

    from tests.qwen3_tts_ref.upstream import make_audible

    root = Path(root)
    (root / "speech_tokenizer").mkdir(parents=True, exist_ok=True)
    cfg = Qwen3TTSConfig.from_dict(config)
    codec_cfg = Qwen3TTSTokenizerV2Config.from_dict(codec_config)
    torch.manual_seed(seed)
    model = Qwen3TTSForConditionalGeneration(cfg).eval()
    codec = Qwen3TTSTokenizerV2Model(codec_cfg).eval()
    make_audible(codec, seed)
    model.save_pretrained(str(root), safe_serialization=True)
    _readable_config(root / "config.json")
    codec.save_pretrained(str(root / "speech_tokenizer"), safe_serialization=True)
    AutoConfig.register("qwen3_tts", Qwen3TTSConfig)
    AutoProcessor.register(Qwen3TTSConfig, Qwen3TTSProcessor)
    processor = Qwen3TTSProcessor.from_pretrained(str(tokenizer_dir))
    processor.save_pretrained(str(root))
    GenerationConfig(**generation).save_pretrained(str(root))
    EncodecFeatureExtractor(**speech_preprocessor).save_pretrained(str(root / "speech_tokenizer"))
    for folder in (root, root / "speech_tokenizer"):
        (folder / "configuration.json").write_text(json.dumps(configuration, indent=2))
    (root / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2))
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def _readable_config(path: Path) -> None:
    """Drop ``speaker_encoder_config.model_type`` from a saved ``config.json``:
    ``Qwen3TTSConfig.to_dict`` writes it and ``Qwen3TTSSpeakerEncoderConfig.__init__`` takes
    no such argument (qwen-tts 0.1.1), so ``from_pretrained`` would fail on it."""
    config = json.loads(path.read_text())
    config.get("speaker_encoder_config", {}).pop("model_type", None)
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
