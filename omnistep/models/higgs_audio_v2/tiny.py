"""Tiny random Higgs Audio v2 folders in the published transformers layout, for tests and
``omnistep weights higgs_audio_v2 DIR``.

Layout as ``loader`` reads it (and transformers 5.x ``from_pretrained`` loads it): config.json
(model_type higgs_audio_v2) and model.safetensors with every tensor name of
``HiggsAudioV2ForConditionalGeneration``; tokenizer.json / tokenizer_config.json (a byte-level
BPE of ``omnistep.text.tiny_bpe`` plus the Llama-3 chat and Higgs audio special tokens); and
audio_tokenizer/ (model_type higgs_audio_v2_tokenizer, the DAC decoder, RVQ and fc2 tensors at
the published names, and the encoder side: HuBERT, the semantic and DAC encoders, the
quantizers' ``project_in``, initialised by transformers' own modules). Sizes are
tiny; what is kept: 8 codebooks, codec ids 0..1023 with stream BOS/EOS 1024/1025
(``codebook_size`` 1026), 24 kHz at 25 frames/s (upsampling ratios 8, 5, 4, 2, 3), llama3 rope.
Weights: ``N(0, 0.02)`` matrices and embeddings, unit norms, small biases, Snake alphas 1.

Imports: the standard library, torch, safetensors, tokenizers, ``omnistep.text.tiny_bpe``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from omnistep.text.tiny_bpe import bpe_vocab_and_merges

SPECIAL_TOKENS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|audio_out_bos|>",
    "<|AUDIO_OUT|>",
    "<|audio_eos|>",
    "<|reserved_special_token_6|>",
    "<|scene_desc_start|>",
    "<|scene_desc_end|>",
)

FOLDER_VARIANTS: tuple[str, ...] = ("base",)
"""``omnistep weights higgs_audio_v2 DIR``: the one layout (generation-3B-base)."""

LM_SIZES = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 1024,
}

CODEC_CONFIG = {
    "model_type": "higgs_audio_v2_tokenizer",
    "target_bandwidths": [0.5, 1, 1.5, 2],
    "sample_rate": 24000,
    "codebook_size": 1024,
    "codebook_dim": 8,
    "semantic_sample_rate": 16000,
    "downsample_factor": 320,
    "acoustic_model_config": {
        "model_type": "dac",
        "encoder_hidden_size": 2,
        "downsampling_ratios": [8, 5, 4, 2, 3],
        "decoder_hidden_size": 64,
        "upsampling_ratios": [8, 5, 4, 2, 3],
        "hidden_size": 8,
    },
    "semantic_model_config": {
        "model_type": "hubert",
        "hidden_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "intermediate_size": 16,
        "conv_dim": [8, 8, 8, 8],
        "conv_stride": [5, 4, 4, 4],
        "conv_kernel": [10, 8, 8, 8],
        "num_conv_pos_embedding_groups": 2,
        "num_conv_pos_embeddings": 4,
        "mask_time_prob": 0.0,
    },
}


def tokenizer_json() -> tuple[dict, dict[str, int]]:
    """``tokenizer.json`` (a ``tokenizers`` byte-level BPE) and the special tokens' ids."""
    vocab, merges = bpe_vocab_and_merges()
    base = len(vocab)
    ids = {tok: base + i for i, tok in enumerate(SPECIAL_TOKENS)}
    added = [
        {
            "id": i,
            "content": tok,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for tok, i in ids.items()
    ]
    data = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {
            "type": "ByteLevel",
            "add_prefix_space": False,
            "trim_offsets": True,
            "use_regex": True,
        },
        "post_processor": None,
        "decoder": {
            "type": "ByteLevel",
            "add_prefix_space": True,
            "trim_offsets": True,
            "use_regex": True,
        },
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [f"{a} {b}" for a, b in merges],
        },
    }
    return data, ids


def lm_config(ids: dict[str, int], vocab_size: int, sizes: dict | None = None) -> dict:
    """``config.json`` of the backbone (``HiggsAudioV2Config`` keys): ``LM_SIZES`` with
    ``sizes`` over them (any ``config.json`` key, e.g. the published widths and
    ``rope_parameters``)."""
    cfg = {
        "model_type": "higgs_audio_v2",
        "architectures": ["HiggsAudioV2ForConditionalGeneration"],
        "vocab_size": vocab_size,
        **LM_SIZES,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 32.0,
            "low_freq_factor": 0.125,
            "high_freq_factor": 0.5,
            "original_max_position_embeddings": 64,
        },
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "num_codebooks": 8,
        "codebook_size": 1026,
        "audio_token_id": ids["<|AUDIO_OUT|>"],
        "audio_bos_token_id": ids["<|audio_out_bos|>"],
        "audio_delay_token_id": ids["<|reserved_special_token_6|>"],
        "audio_stream_bos_id": 1024,
        "audio_stream_eos_id": 1025,
        "pad_token_id": ids["<|end_of_text|>"],
        "bos_token_id": ids["<|begin_of_text|>"],
        "eos_token_id": ids["<|eot_id|>"],
    }
    cfg.update(sizes or {})
    return cfg


def _lm_tensors(cfg: dict, g: torch.Generator) -> dict[str, torch.Tensor]:
    h, inner = cfg["hidden_size"], cfg["intermediate_size"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    audio = cfg["num_codebooks"] * cfg["codebook_size"]

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.02

    def norm() -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(h, generator=g)

    t = {"model.embed_tokens.weight": w(cfg["vocab_size"], h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for name, shape in (("q", (q, h)), ("k", (kv, h)), ("v", (kv, h)), ("o", (h, q))):
            t[f"{p}self_attn.{name}_proj.weight"] = w(*shape)
        for mlp in ("mlp", "audio_mlp"):
            t[f"{p}{mlp}.gate_proj.weight"] = w(inner, h)
            t[f"{p}{mlp}.up_proj.weight"] = w(inner, h)
            t[f"{p}{mlp}.down_proj.weight"] = w(h, inner)
        for n in ("input", "post_attention", "audio_input", "audio_post_attention"):
            t[f"{p}{n}_layernorm.weight"] = norm()
    t["model.norm.weight"] = norm()
    t["model.embed_audio_tokens.embed_audio_tokens.weight"] = w(audio, h)
    t["audio_lm_head.weight"] = torch.randn(audio, h, generator=g) * 0.2
    return t


def _codec_tensors(cfg: dict, g: torch.Generator) -> dict[str, torch.Tensor]:
    """The decoder side at the published names (encoder side: see ``_codec_encoder``)."""
    ac, sem = cfg["acoustic_model_config"], cfg["semantic_model_config"]
    hidden = ac["hidden_size"] + sem["hidden_size"]
    t: dict[str, torch.Tensor] = {}

    def w(*shape: int, scale: float = 0.3) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    def conv(name: str, out_ch: int, in_ch: int, k: int, transposed: bool = False) -> None:
        shape = (in_ch, out_ch, k) if transposed else (out_ch, in_ch, k)
        t[f"{name}.weight"] = w(*shape, scale=0.5 * (1.0 / (in_ch * k)) ** 0.5)
        t[f"{name}.bias"] = w(out_ch, scale=0.01)

    def snake(name: str, ch: int) -> None:
        t[f"{name}.alpha"] = 1.0 + 0.1 * torch.rand(1, ch, 1, generator=g)

    d = "acoustic_decoder"
    ch = ac["decoder_hidden_size"]
    conv(f"{d}.conv1", ch, ac["hidden_size"], 7)
    for i, stride in enumerate(ac["upsampling_ratios"]):
        cin, cout = ch // 2**i, ch // 2 ** (i + 1)
        b = f"{d}.block.{i}"
        snake(f"{b}.snake1", cin)
        conv(f"{b}.conv_t1", cout, cin, 2 * stride, transposed=True)
        for r in (1, 2, 3):
            snake(f"{b}.res_unit{r}.snake1", cout)
            conv(f"{b}.res_unit{r}.conv1", cout, cout, 7)
            snake(f"{b}.res_unit{r}.snake2", cout)
            conv(f"{b}.res_unit{r}.conv2", cout, cout, 1)
    last = ch // 2 ** len(ac["upsampling_ratios"])
    snake(f"{d}.snake1", last)
    conv(f"{d}.conv2", 1, last, 7)
    for name, (o, i) in (
        ("fc", (hidden, hidden)),
        ("fc1", (sem["hidden_size"], hidden)),
        ("fc2", (ac["hidden_size"], hidden)),
    ):
        t[f"{name}.weight"] = w(o, i, scale=i**-0.5)
        t[f"{name}.bias"] = w(o, scale=0.01)
    size, dim = cfg["codebook_size"], cfg["codebook_dim"]
    for q in range(8):
        p = f"quantizer.quantizers.{q}"
        embed = torch.randn(size, dim, generator=g)
        t[f"{p}.codebook.inited"] = torch.ones(1)
        t[f"{p}.codebook.cluster_size"] = torch.ones(size)
        t[f"{p}.codebook.embed"] = embed
        t[f"{p}.codebook.embed_avg"] = embed.clone()
        t[f"{p}.project_in.weight"] = w(dim, hidden, scale=hidden**-0.5)
        t[f"{p}.project_in.bias"] = w(dim, scale=0.01)
        t[f"{p}.project_out.weight"] = w(hidden, dim, scale=dim**-0.5)
        t[f"{p}.project_out.bias"] = w(hidden, scale=0.01)
    return t


def _codec_encoder_tensors(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    """The encoder side (HuBERT, semantic encoder, DAC encoder), initialised by
    ``encoder.HiggsCodecEncoder``'s modules (transformers' own init), seeded."""
    from omnistep.models.higgs_audio_v2.encoder import HiggsCodecEncoder

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        enc = HiggsCodecEncoder(cfg, 8)
    t = {}
    for prefix in ("semantic_model", "encoder_semantic", "acoustic_encoder"):
        for name, value in getattr(enc, prefix).state_dict().items():
            t[f"{prefix}.{name}"] = value.detach().clone().contiguous()
    return t


def write_folder(
    folder: str | Path,
    variant: str | None = None,
    seed: int = 0,
    lm_sizes: dict | None = None,
    codec_config: dict | None = None,
) -> Path:
    """``omnistep weights higgs_audio_v2 DIR``: write a tiny random folder (``variant``: only
    ``base``). Returns the folder.

    ``lm_sizes`` (``config.json`` keys over ``LM_SIZES``) and ``codec_config`` (the whole
    audio tokenizer ``config.json`` instead of ``CODEC_CONFIG``) give other sizes in the same
    layout, e.g. ``bench/families.py``'s published widths at reduced depth. The text vocabulary
    stays the tiny tokenizer's.

    Raises:
        ValueError: another variant.
    """
    from safetensors.torch import save_file

    if variant not in (None, *FOLDER_VARIANTS):
        raise ValueError(f"variant must be one of {FOLDER_VARIANTS}, got {variant!r}")
    root = Path(folder)
    (root / "audio_tokenizer").mkdir(parents=True, exist_ok=True)
    tok, ids = tokenizer_json()
    vocab_size = max(ids.values()) + 1
    cfg = lm_config(ids, vocab_size, lm_sizes)
    codec_cfg = codec_config or CODEC_CONFIG
    g = torch.Generator().manual_seed(seed)
    (root / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
        "pad_token": "<|end_of_text|>",
        "model_max_length": 131072,
    }
    (root / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    (root / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    gen = {
        "do_sample": True,
        "temperature": 1.0,
        "top_k": 50,
        "top_p": 0.95,
        "eos_token_id": cfg["eos_token_id"],
        "max_new_tokens": 2048,
    }
    (root / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    save_file(_lm_tensors(cfg, g), str(root / "model.safetensors"))
    (root / "audio_tokenizer" / "config.json").write_text(json.dumps(codec_cfg, indent=2))
    codec = _codec_tensors(codec_cfg, g)
    codec.update(_codec_encoder_tensors(codec_cfg, seed))
    save_file(codec, str(root / "audio_tokenizer" / "model.safetensors"))
    return root
