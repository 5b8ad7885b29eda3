"""Tiny VoxCPM2 folders in the layout ``voxcpm`` 2.0.3's ``VoxCPM2Model.from_local`` reads.

``write_tiny_voxcpm(root)`` writes the configuration and tokenizer files of a published
VoxCPM2 folder::

    root/
      config.json             VoxCPMConfig: lm_config (MiniCPM-4: LongRoPE rope_scaling,
                              use_mup, scale_emb, scale_depth, dim_model_base), patch_size,
                              feat_dim, residual_lm_num_layers, residual_lm_no_rope,
                              scalar_quantization_latent_dim / _scale, encoder_config,
                              dit_config (with cfm_config), audio_vae_config, max_length, dtype
      tokenizer.json          a Llama-style BPE (``tokenizers``; "▁" word marker, no byte
      tokenizer_config.json   fallback) loaded by ``LlamaTokenizerFast``

The weights (``model.safetensors``: everything but the AudioVAE; ``audiovae.pth``: the AudioVAE
state dict) are written by upstream's own classes in the tests
(``tests/voxcpm_ref/upstream.py: write_weights``), which read this config.

What is shrunk: every width and depth, the vocabulary (184 tokens: ``<unk> <s> </s>``, reserved
ids 3..100, upstream's audio control ids 101..104 -- ``audio_start``, ``audio_end``,
``ref_audio_start``, ``ref_audio_end``, hard-coded in ``VoxCPM2Model.__init__`` -- then
characters, four CJK characters and a few merges, one of them the two-character CJK token that
upstream's tokenizer wrapper splits), the AudioVAE's channels (encoder 4, decoder 64, latent
16). What is kept: the AudioVAE's rates (encoder [2, 5, 8, 8] at 16 kHz: 640 samples per
latent; decoder [8, 6, 5, 2, 2, 2] at 48 kHz: 1920 samples per latent), its sample-rate
conditioning buckets, patch_size 4, MiniCPM's muP scaling keys and a LongRoPE whose
``max_position_embeddings`` exceeds ``original_max_position_embeddings`` (so the long factors
and the attention scaling factor != 1 are exercised). Imports: the standard library and
``tokenizers``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

AUDIO_START, AUDIO_END, REF_AUDIO_START, REF_AUDIO_END = 101, 102, 103, 104
CHARS = (
    ["▁"]
    + [chr(c) for c in range(ord("a"), ord("z") + 1)]
    + [chr(c) for c in range(ord("A"), ord("Z") + 1)]
    + list("0123456789.,!?'-")
    + list("你好世界")
)
MERGES = [("▁", "t"), ("h", "e"), ("▁t", "he"), ("▁", "a"), ("i", "n"), ("你", "好")]


def tiny_config(head_dim: int = 16) -> dict[str, Any]:
    """The tiny ``config.json`` as a dict (keys: ``voxcpm.model.voxcpm2.VoxCPMConfig``)."""
    half = head_dim // 2
    lm = {
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_size": 64,
        "intermediate_size": 160,
        "max_position_embeddings": 4096,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": {
            "type": "longrope",
            "long_factor": [1.0 + 0.25 * i for i in range(half)],
            "short_factor": [1.0 + 0.05 * i for i in range(half)],
            "original_max_position_embeddings": 2048,
        },
        "vocab_size": 256,
        "use_mup": True,
        "scale_emb": 12.0,
        "dim_model_base": 256,
        "scale_depth": 1.4,
    }
    return {
        "architecture": "voxcpm2",
        "lm_config": lm,
        "patch_size": 4,
        "feat_dim": 16,
        "residual_lm_num_layers": 2,
        "residual_lm_no_rope": False,
        "scalar_quantization_latent_dim": 32,
        "scalar_quantization_scale": 9,
        "encoder_config": {"hidden_dim": 32, "ffn_dim": 64, "num_heads": 2, "num_layers": 1},
        "dit_config": {
            "hidden_dim": 32,
            "ffn_dim": 64,
            "num_heads": 2,
            "num_layers": 2,
            "dit_mean_mode": False,
            "cfm_config": {
                "sigma_min": 1e-6,
                "solver": "euler",
                "t_scheduler": "log-norm",
                "inference_cfg_rate": 2.0,
            },
        },
        "audio_vae_config": {
            "encoder_dim": 4,
            "encoder_rates": [2, 5, 8, 8],
            "latent_dim": 16,
            "decoder_dim": 64,
            "decoder_rates": [8, 6, 5, 2, 2, 2],
            "depthwise": True,
            "sample_rate": 16000,
            "out_sample_rate": 48000,
            "use_noise_block": False,
            "sr_bin_boundaries": [20000, 30000, 40000],
            "cond_type": "scale_bias",
            "cond_dim": 128,
            "cond_out_layer": False,
        },
        "max_length": 512,
        "device": "cpu",
        "dtype": "float32",
    }


def write_tokenizer(root: Path) -> int:
    """Write ``tokenizer.json`` / ``tokenizer_config.json``; returns the vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<reserved_{i}>": i for i in range(3, AUDIO_START)})
    for i, name in enumerate(
        ["<|audio_start|>", "<|audio_end|>", "<|ref_audio_start|>", "<|ref_audio_end|>"]
    ):
        vocab[name] = AUDIO_START + i
    for piece in CHARS + [a + b for a, b in MERGES]:
        vocab[piece] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, MERGES, unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.save(str(root / "tokenizer.json"))
    config = {
        "tokenizer_class": "LlamaTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "add_eos_token": False,
        "legacy": False,
    }
    (root / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return len(vocab)


def write_tiny_voxcpm(root: str | Path, **overrides: Any) -> Path:
    """Write ``config.json`` and the tokenizer files under ``root`` (created); top-level
    ``overrides`` replace config keys. Returns the folder."""
    out = Path(root)
    out.mkdir(parents=True, exist_ok=True)
    config = tiny_config()
    config.update(overrides)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer(out)
    return out


FOLDER_VARIANTS: tuple[str, ...] = ()
"""One kind of folder."""


def write_folder(folder: Path, variant: str | None = None, seed: int = 0) -> Path:
    """``omnistep weights voxcpm DIR``: the tiny folder (``write_tiny_voxcpm``) with random
    weights from ``seed``, written by omnistep's own modules under upstream's tensor names
    (``model.safetensors``; ``audiovae.safetensors`` with ``decoder.`` / ``encoder.`` tensors,
    the convs' weights already folded as plain ``weight``: ``load_voxcpm`` reads them, upstream's
    weight-normed AudioVAE would want ``weight_g`` / ``weight_v``). For serving smoke tests and
    ``omnistep weights``; the parity tests use upstream's own writer.

    Raises:
        ValueError: a ``variant`` (the family has one kind of folder).
    """
    if variant is not None:
        raise ValueError(f"voxcpm has one kind of folder, not '{variant}'")
    import torch
    from safetensors.torch import save_file

    from omnistep.models.voxcpm.audio_vae import AudioVAEDecoder, AudioVAEEncoder
    from omnistep.models.voxcpm.config import VoxCPMConfig
    from omnistep.models.voxcpm.lm import VoxCPMBackbone

    root = write_tiny_voxcpm(folder)
    config = VoxCPMConfig.from_file(root / "config.json")
    torch.manual_seed(seed)
    backbone = VoxCPMBackbone(config)
    state = {}
    for name, value in backbone.state_dict().items():
        if name == "embed_tokens.weight":
            name = "base_lm.embed_tokens.weight"
        elif name.startswith("estimator."):
            name = "feat_decoder." + name
        state[name] = value.contiguous()
    save_file(state, str(root / "model.safetensors"))
    vae: dict[str, torch.Tensor] = {}
    for part, module in (
        ("decoder", AudioVAEDecoder(config.audio_vae)),
        ("encoder", AudioVAEEncoder(config.audio_vae)),
    ):
        for name, value in module.state_dict().items():
            vae[f"{part}.{name}"] = value.contiguous()
    save_file(vae, str(root / "audiovae.safetensors"))
    return root
