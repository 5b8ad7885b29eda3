"""Seeded random Qwen3-TTS checkpoints in the published layout of Qwen/Qwen3-TTS-12Hz-*.

``write_tiny_qwen3_tts(root, variant)`` writes exactly the files of the published folders::

    root/
      config.json                 model_type qwen3_tts: talker_config (with
                                  code_predictor_config, spk_id, spk_is_dialect,
                                  codec_language_id), speaker_encoder_config (Base only),
                                  tts_model_type, tts_model_size, token ids
      generation_config.json      the sampling defaults upstream ``generate`` starts from
      model.safetensors           one unsharded file, bf16 (as published)
      vocab.json, merges.txt      byte-level BPE (merges.txt without a ``#version`` line)
      tokenizer_config.json       slow ``Qwen2Tokenizer`` with the 33 added tokens; there is no
                                  tokenizer.json
      preprocessor_config.json    the ``Qwen3TTSProcessor`` (left padding)
      configuration.json          ModelScope's framework/task file
      speech_tokenizer/
        config.json               model_type qwen3_tts_tokenizer_12hz: encoder_config (Mimi),
                                  decoder_config, sample rates, 1920 samples per code frame
        model.safetensors         f32 (as published): ``encoder.*`` (Mimi), ``decoder.*``
        preprocessor_config.json  ``EncodecFeatureExtractor`` at 24 kHz
        configuration.json

Variants (published checkpoints in parentheses): ``custom_voice`` (0.6B/1.7B-CustomVoice: nine
speakers in ``spk_id``, twelve ``codec_language_id`` entries with the two dialects, no
``speaker_encoder_config`` and no ``speaker_encoder.*`` tensors), ``voice_design``
(1.7B-VoiceDesign: empty ``spk_id`` / ``spk_is_dialect``, ten languages, no speaker encoder),
``base`` (0.6B/1.7B-Base: empty speaker tables, ten languages, ``speaker_encoder_config`` and
the ``speaker_encoder.*`` ECAPA-TDNN tensors). ``model_size`` is ``tts_model_size``: "0b6"
(talker and code predictor share one hidden size, so there is no ``small_to_mtp_projection``;
upstream ignores ``instruct`` for CustomVoice) or "1b7" (the code predictor is narrower than the
talker: ``talker.code_predictor.small_to_mtp_projection`` exists). VoiceDesign is published at
1.7B only, so it defaults to "1b7"; the others default to "0b6".

What is shrunk: hidden sizes, layers, heads, the text vocabulary (a tiny byte-level BPE of
``E`` tokens, then the 33 added tokens in their official order, so tiny text ids are official
ids minus ``151643 - E``; ``text_vocab_size`` keeps its official offset ``E + 293``), the
speech tokenizer's channels. What is kept: every published key and its non-size value, the
codec id layout (talker vocab 3072: codes 0..2047, languages 2050..2074, control ids
2148..2157, speakers 2861..3066 -- all official values), ``num_code_groups`` 16, the code
predictor and speech-tokenizer codebook sizes (2048), the sample rates and the upsampling
factors (1920 samples per code at 24 kHz). Departure: Base's ``speaker_encoder_config`` gains
``enc_channels`` / ``enc_attention_channels`` / ``enc_se_channels`` (published: only ``enc_dim``
and ``sample_rate``, the rest upstream class defaults, 512..1536 channels).

Weights (``write_weights``): drawn here from the shapes the loader checks
(``loader.model_tensor_shapes``, ``loader.speech_decoder_tensor_shapes``) and, for the speech
tokenizer's Mimi encoder, from transformers' ``MimiModel`` built from ``encoder_config``, under
the official names. Values follow upstream's ``_init_weights`` for ``model.safetensors``
(matrices and embeddings ``N(0, 0.02)``, zero biases, unit norms); the speech tokenizer's decoder
is drawn ``N(0, 1/fan_in)`` with its residual units' last convs x0.3 and its output conv x0.15,
layer scales 0.01, SnakeBeta log-scales 0, and every codebook ``cluster_usage ~ U(0.5, 2)``,
``embedding_sum = usage * N(0, 1)``, so that the decoded audio depends on the codes and has
real amplitude (the tests' reference writer, ``tests/qwen3_tts_ref/upstream.py``, draws the
decoder and codebooks the same way, but from upstream's modules). Each tensor has its own
generator seeded by ``crc32(f"{seed}/{file}/{name}")``: same seed, same torch -> identical files.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omnistep.text.tiny_bpe import bpe_vocab_and_merges

VARIANTS = ("custom_voice", "voice_design", "base")
MODEL_SIZES = ("0b6", "1b7")

# The 33 tokens after the BPE vocabulary (official ids 151643..151675), (content, special).
QWEN3_TTS_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
    ("<|audio_start|>", True),
    ("<|audio_end|>", True),
    ("<tts_pad>", True),
    ("<tts_text_bos>", True),
    ("<tts_text_eod>", True),
    ("<tts_text_bos_single>", True),
    ("<|audio_pad|>", True),
)
OFFICIAL_ENDOFTEXT_ID = 151643
TEXT_VOCAB_OFFSET = 293  # official text_vocab_size 151936 = 151643 + 293

# Codec ids (talker vocabulary 3072), all official values.
CODEC_VOCAB = 3072
CODEC_PAD_ID = 2148
CODEC_BOS_ID = 2149
CODEC_EOS_ID = 2150
CODEC_THINK_ID = 2154
CODEC_NOTHINK_ID = 2155
CODEC_THINK_BOS_ID = 2156
CODEC_THINK_EOS_ID = 2157
LANGUAGES: dict[str, int] = {
    "chinese": 2055,
    "english": 2050,
    "german": 2053,
    "italian": 2070,
    "portuguese": 2071,
    "spanish": 2054,
    "japanese": 2058,
    "korean": 2064,
    "french": 2061,
    "russian": 2069,
}
DIALECTS: dict[str, int] = {"beijing_dialect": 2074, "sichuan_dialect": 2062}
SPEAKERS: dict[str, int] = {
    "serena": 3066,
    "vivian": 3065,
    "uncle_fu": 3010,
    "ryan": 3061,
    "aiden": 2861,
    "ono_anna": 2873,
    "sohee": 2864,
    "eric": 2875,
    "dylan": 2878,
}
SPEAKER_DIALECTS: dict[str, str | bool] = {
    "serena": False,
    "vivian": False,
    "uncle_fu": False,
    "ryan": False,
    "aiden": False,
    "ono_anna": False,
    "sohee": False,
    "eric": "sichuan_dialect",
    "dylan": "beijing_dialect",
}

GENERATION_CONFIG: dict[str, Any] = {
    "do_sample": True,
    "temperature": 0.9,
    "top_p": 1.0,
    "top_k": 50,
    "repetition_penalty": 1.05,
    "subtalker_dosample": True,
    "subtalker_temperature": 0.9,
    "subtalker_top_p": 1.0,
    "subtalker_top_k": 50,
    "max_new_tokens": 8192,
}
PREPROCESSOR_CONFIG: dict[str, Any] = {
    "padding_side": "left",
    "padding_value": 0.0,
    "processor_class": "Qwen3TTSProcessor",
    "return_attention_mask": True,
}
SPEECH_PREPROCESSOR_CONFIG: dict[str, Any] = {
    "chunk_length_s": None,
    "feature_extractor_type": "EncodecFeatureExtractor",
    "feature_size": 1,
    "overlap": None,
    "padding_side": "right",
    "padding_value": 0.0,
    "return_attention_mask": True,
    "sampling_rate": 24000,
}
CONFIGURATION: dict[str, Any] = {
    "framework": "pytorch",
    "task": "text-to-speech",
    "allow_remote": True,
}

"""Every file of a published folder (relative paths)."""


@dataclass(frozen=True)
class Qwen3TTSSizes:
    """Every size the tiny checkpoint shrinks (official 0.6B / 1.7B values in comments)."""

    # talker (Qwen3 decoder with interleaved mRoPE)
    hidden: int = 32  # 1024 / 2048
    intermediate: int = 64  # 3072 / 6144
    layers: int = 2  # 28
    heads: int = 4  # 16
    kv_heads: int = 2  # 8
    head_dim: int = 16  # 128 (heads * head_dim != hidden, as published)
    mrope_section: tuple[int, int, int] = (4, 2, 2)  # (24, 20, 20); sum = head_dim / 2
    text_hidden: int = 48  # 2048
    # code predictor (its hidden equals the talker's for 0b6; ``cp_hidden_1b7`` for 1b7)
    cp_hidden_1b7: int = 24  # 1024 (talker 2048)
    cp_intermediate: int = 64  # 3072
    cp_layers: int = 2  # 5
    cp_heads: int = 4  # 16
    cp_kv_heads: int = 2  # 8
    cp_head_dim: int = 16  # 128
    # speaker encoder (Base; ECAPA-TDNN), enc_dim = talker hidden as published
    spk_channels: tuple[int, ...] = (16, 16, 16, 16, 48)  # (512, 512, 512, 512, 1536)
    spk_attention_channels: int = 8  # 128
    spk_se_channels: int = 8  # 128
    # speech tokenizer decoder
    dec_codebook_dim: int = 16  # 512
    dec_latent_dim: int = 32  # 1024
    dec_hidden: int = 16  # 512
    dec_intermediate: int = 32  # 1024
    dec_layers: int = 2  # 8
    dec_heads: int = 2  # 16
    dec_kv_heads: int = 2  # 16
    dec_head_dim: int = 16  # 64
    dec_decoder_dim: int = 64  # 1536
    # speech tokenizer encoder (Mimi)
    enc_hidden: int = 16  # 512
    enc_filters: int = 4  # 64
    enc_layers: int = 1  # 8
    enc_heads: int = 2  # 8
    enc_kv_heads: int = 2  # 8
    enc_head_dim: int = 8  # 64
    enc_intermediate: int = 32  # 2048
    enc_codebook_dim: int = 8  # 256

    def cp_hidden(self, model_size: str) -> int:
        return self.hidden if model_size == "0b6" else self.cp_hidden_1b7


TINY_SIZES = Qwen3TTSSizes()

PUBLISHED_0B6_SIZES = dataclasses.replace(
    TINY_SIZES,
    hidden=1024,
    intermediate=3072,
    layers=28,
    heads=16,
    kv_heads=8,
    head_dim=128,
    mrope_section=(24, 20, 20),
    text_hidden=2048,
    cp_hidden_1b7=1024,
    cp_intermediate=3072,
    cp_layers=5,
    cp_heads=16,
    cp_kv_heads=8,
    cp_head_dim=128,
    dec_codebook_dim=512,
    dec_latent_dim=1024,
    dec_hidden=512,
    dec_intermediate=1024,
    dec_layers=8,
    dec_heads=16,
    dec_kv_heads=16,
    dec_head_dim=64,
    dec_decoder_dim=1536,
)
"""The published Qwen3-TTS-12Hz-0.6B widths and depths of the talker, its code predictor and
the speech tokenizer's decoder (the values in ``Qwen3TTSSizes``' comments; the decoder's are
``omnistep.layers.codec_decoder.PUBLISHED_DECODER``). The speaker encoder and the speech
tokenizer's Mimi encoder keep the tiny sizes (neither runs when speaking a CustomVoice voice);
the text vocabulary stays the tiny BPE. ``bench/qwen3_tts.py`` writes it with fewer layers
(``dataclasses.replace(PUBLISHED_0B6_SIZES, layers=..., cp_layers=..., dec_layers=...)``)."""


@dataclass(frozen=True)
class Qwen3TTSTokenIds:
    """Text ids of the tiny tokenizer (official values in comments) and the codec ids."""

    endoftext: int  # 151643
    im_start: int  # 151644
    im_end: int  # 151645
    tts_pad: int  # 151671
    tts_bos: int  # 151672
    tts_eos: int  # 151673
    assistant: int  # 77091 (the BPE token "assistant")
    user: int
    newline: int  # 198
    text_vocab: int  # 151936
    codec_pad: int = CODEC_PAD_ID
    codec_bos: int = CODEC_BOS_ID
    codec_eos: int = CODEC_EOS_ID
    codec_think: int = CODEC_THINK_ID
    codec_nothink: int = CODEC_NOTHINK_ID
    codec_think_bos: int = CODEC_THINK_BOS_ID
    codec_think_eos: int = CODEC_THINK_EOS_ID
    codec_vocab: int = CODEC_VOCAB


@dataclass(frozen=True)
class Qwen3TTSInfo:
    """What a test needs to know about a written folder."""

    root: Path
    variant: str  # tts_model_type
    model_size: str  # tts_model_size
    sizes: Qwen3TTSSizes
    ids: Qwen3TTSTokenIds
    speakers: dict[str, int] = field(default_factory=dict)  # spk_id
    spk_is_dialect: dict[str, str | bool] = field(default_factory=dict)
    languages: dict[str, int] = field(default_factory=dict)  # codec_language_id
    tensor_shapes: dict[str, list[int]] = field(default_factory=dict)  # both safetensors files

    @property
    def num_code_groups(self) -> int:
        return 16

    @property
    def sample_rate(self) -> int:
        return 24000

    @property
    def samples_per_code(self) -> int:
        return 1920


# ----------------------------------------------------------------------------- tokenizer


def tokenizer_files() -> tuple[dict[str, str], Qwen3TTSTokenIds]:
    """``vocab.json``, ``merges.txt``, ``tokenizer_config.json`` texts and the text ids."""
    vocab, merges = bpe_vocab_and_merges()
    e = len(vocab)
    added = {tok: e + i for i, (tok, _) in enumerate(QWEN3_TTS_ADDED_TOKENS)}
    ids = Qwen3TTSTokenIds(
        endoftext=added["<|endoftext|>"],
        im_start=added["<|im_start|>"],
        im_end=added["<|im_end|>"],
        tts_pad=added["<tts_pad>"],
        tts_bos=added["<tts_text_bos>"],
        tts_eos=added["<tts_text_eod>"],
        assistant=vocab["assistant"],
        user=vocab["user"],
        newline=vocab["\u010a"],  # byte-level "\n"
        text_vocab=e + TEXT_VOCAB_OFFSET,
    )
    added_decoder = {
        str(e + i): {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
        for i, (content, special) in enumerate(QWEN3_TTS_ADDED_TOKENS)
    }
    tokenizer_config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added_decoder,
        "additional_special_tokens": [c for c, s in QWEN3_TTS_ADDED_TOKENS[1:] if s],
        "audio_bos_token": "<|audio_start|>",
        "audio_eos_token": "<|audio_end|>",
        "audio_token": "<|audio_pad|>",
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "image_token": "<|image_pad|>",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
        "video_token": "<|video_pad|>",
        "vision_bos_token": "<|vision_start|>",
        "vision_eos_token": "<|vision_end|>",
    }
    files = {
        "vocab.json": json.dumps(vocab, ensure_ascii=False),
        "merges.txt": "".join(f"{a} {b}\n" for a, b in merges),
        "tokenizer_config.json": json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n",
    }
    return files, ids


# ----------------------------------------------------------------------------- configs


def _code_predictor_config(s: Qwen3TTSSizes, model_size: str) -> dict[str, Any]:
    """As published: a full ``PretrainedConfig.to_dict()`` of the code predictor config."""
    return {
        "_name_or_path": "",
        "add_cross_attention": False,
        "architectures": None,
        "attention_bias": False,
        "attention_dropout": 0,
        "bad_words_ids": None,
        "begin_suppress_tokens": None,
        "bos_token_id": None,
        "chunk_size_feed_forward": 0,
        "cross_attention_hidden_size": None,
        "decoder_start_token_id": None,
        "diversity_penalty": 0.0,
        "do_sample": False,
        "early_stopping": False,
        "encoder_no_repeat_ngram_size": 0,
        "eos_token_id": None,
        "exponential_decay_length_penalty": None,
        "finetuning_task": None,
        "forced_bos_token_id": None,
        "forced_eos_token_id": None,
        "head_dim": s.cp_head_dim,
        "hidden_act": "silu",
        "hidden_size": s.cp_hidden(model_size),
        "id2label": {"0": "LABEL_0", "1": "LABEL_1"},
        "initializer_range": 0.02,
        "intermediate_size": s.cp_intermediate,
        "is_decoder": False,
        "is_encoder_decoder": False,
        "label2id": {"LABEL_0": 0, "LABEL_1": 1},
        "layer_types": ["full_attention"] * s.cp_layers,
        "length_penalty": 1.0,
        "max_length": 20,
        "max_position_embeddings": 65536,
        "max_window_layers": 28,
        "min_length": 0,
        "model_type": "qwen3_tts_talker_code_predictor",
        "no_repeat_ngram_size": 0,
        "num_attention_heads": s.cp_heads,
        "num_beam_groups": 1,
        "num_beams": 1,
        "num_code_groups": 16,
        "num_hidden_layers": s.cp_layers,
        "num_key_value_heads": s.cp_kv_heads,
        "num_return_sequences": 1,
        "output_attentions": False,
        "output_hidden_states": False,
        "output_scores": False,
        "pad_token_id": None,
        "prefix": None,
        "problem_type": None,
        "pruned_heads": {},
        "remove_invalid_values": False,
        "repetition_penalty": 1.0,
        "return_dict": True,
        "return_dict_in_generate": False,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sep_token_id": None,
        "sliding_window": None,
        "suppress_tokens": None,
        "task_specific_params": None,
        "temperature": 1.0,
        "tf_legacy_loss": False,
        "tie_encoder_decoder": False,
        "tie_word_embeddings": False,
        "tokenizer_class": None,
        "top_k": 50,
        "top_p": 1.0,
        "dtype": None,
        "torchscript": False,
        "typical_p": 1.0,
        "use_bfloat16": False,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 2048,
    }


def _variant_tables(variant: str) -> tuple[dict[str, int], dict[str, Any], dict[str, int]]:
    """(spk_id, spk_is_dialect, codec_language_id) as published for ``variant``."""
    if variant == "custom_voice":
        return dict(SPEAKERS), dict(SPEAKER_DIALECTS), {**LANGUAGES, **DIALECTS}
    return {}, {}, dict(LANGUAGES)


def config_dict(
    s: Qwen3TTSSizes, ids: Qwen3TTSTokenIds, variant: str, model_size: str
) -> dict[str, Any]:
    """``config.json``, keys in the published order (Qwen3-TTS-12Hz-1.7B-CustomVoice)."""
    spk_id, spk_is_dialect, languages = _variant_tables(variant)
    talker = {
        "attention_bias": False,
        "attention_dropout": 0,
        "code_predictor_config": _code_predictor_config(s, model_size),
        "codec_bos_id": ids.codec_bos,
        "codec_eos_token_id": ids.codec_eos,
        "codec_think_id": ids.codec_think,
        "codec_language_id": languages,
        "codec_nothink_id": ids.codec_nothink,
        "codec_pad_id": ids.codec_pad,
        "codec_think_bos_id": ids.codec_think_bos,
        "codec_think_eos_id": ids.codec_think_eos,
        "spk_id": spk_id,
        "spk_is_dialect": spk_is_dialect,
        "head_dim": s.head_dim,
        "hidden_act": "silu",
        "hidden_size": s.hidden,
        "initializer_range": 0.02,
        "intermediate_size": s.intermediate,
        "max_position_embeddings": 32768,
        "model_type": "qwen3_tts_talker",
        "num_attention_heads": s.heads,
        "num_code_groups": 16,
        "num_hidden_layers": s.layers,
        "num_key_value_heads": s.kv_heads,
        "position_id_per_seconds": 13,
        "rms_norm_eps": 1e-06,
        "rope_scaling": {
            "interleaved": True,
            "mrope_section": list(s.mrope_section),
            "rope_type": "default",
            "type": "default",
        },
        "rope_theta": 1000000,
        "sliding_window": None,
        "text_hidden_size": s.text_hidden,
        "text_vocab_size": ids.text_vocab,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": ids.codec_vocab,
    }
    config: dict[str, Any] = {
        "architectures": ["Qwen3TTSForConditionalGeneration"],
        "assistant_token_id": ids.assistant,
        "im_end_token_id": ids.im_end,
        "im_start_token_id": ids.im_start,
        "tts_bos_token_id": ids.tts_bos,
        "tts_eos_token_id": ids.tts_eos,
        "tts_pad_token_id": ids.tts_pad,
        "model_type": "qwen3_tts",
        "tokenizer_type": "qwen3_tts_tokenizer_12hz",
        "tts_model_size": model_size,
        "tts_model_type": variant,
    }
    if variant == "base":
        config["speaker_encoder_config"] = {
            "enc_dim": s.hidden,
            "sample_rate": 24000,
            "enc_channels": list(s.spk_channels),
            "enc_attention_channels": s.spk_attention_channels,
            "enc_se_channels": s.spk_se_channels,
        }
    config["talker_config"] = talker
    config["transformers_version"] = "4.57.3"
    config["auto_map"] = {
        "AutoConfig": "configuration_qwen3_tts.Qwen3TTSConfig",
        "AutoModel": "modeling_qwen3_tts.Qwen3TTSForConditionalGeneration",
    }
    return config


def speech_tokenizer_config_dict(s: Qwen3TTSSizes) -> dict[str, Any]:
    """``speech_tokenizer/config.json``: top-level keys and ``decoder_config`` in the published
    order, ``encoder_config`` (a Mimi config) sorted."""
    decoder = {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "latent_dim": s.dec_latent_dim,
        "codebook_dim": s.dec_codebook_dim,
        "codebook_size": 2048,
        "decoder_dim": s.dec_decoder_dim,
        "hidden_act": "silu",
        "hidden_size": s.dec_hidden,
        "intermediate_size": s.dec_intermediate,
        "layer_scale_initial_scale": 0.01,
        "max_position_embeddings": 8000,
        "head_dim": s.dec_head_dim,
        "num_attention_heads": s.dec_heads,
        "num_hidden_layers": s.dec_layers,
        "num_key_value_heads": s.dec_kv_heads,
        "num_quantizers": 16,
        "num_semantic_quantizers": 1,
        "rms_norm_eps": 1e-05,
        "rope_theta": 10000,
        "semantic_codebook_size": 4096,
        "sliding_window": 72,
        "upsample_rates": [8, 5, 4, 3],
        "upsampling_ratios": [2, 2],
        "vector_quantization_hidden_dimension": s.dec_codebook_dim,
    }
    encoder = {
        "_frame_rate": 12.5,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "audio_channels": 1,
        "codebook_dim": s.enc_codebook_dim,
        "codebook_size": 2048,
        "compress": 2,
        "dilation_growth_rate": 2,
        "head_dim": s.enc_head_dim,
        "hidden_act": "gelu",
        "hidden_size": s.enc_hidden,
        "initializer_range": 0.02,
        "intermediate_size": s.enc_intermediate,
        "kernel_size": 7,
        "last_kernel_size": 3,
        "layer_scale_initial_scale": 0.01,
        "max_position_embeddings": 8000,
        "model_type": "mimi",
        "norm_eps": 1e-05,
        "num_attention_heads": s.enc_heads,
        "num_filters": s.enc_filters,
        "num_hidden_layers": s.enc_layers,
        "num_key_value_heads": s.enc_kv_heads,
        "num_quantizers": 32,
        "num_residual_layers": 1,
        "num_semantic_quantizers": 1,
        "pad_mode": "constant",
        "residual_kernel_size": 3,
        "rope_theta": 10000.0,
        "sampling_rate": 24000,
        "sliding_window": 250,
        "trim_right_ratio": 1.0,
        "upsample_groups": s.enc_hidden,
        "upsampling_ratios": [8, 6, 5, 4],
        "use_cache": False,
        "use_causal_conv": True,
        "use_conv_shortcut": False,
        "use_streaming": False,
        "vector_quantization_hidden_dimension": s.enc_codebook_dim,
    }
    return {
        "architectures": ["Qwen3TTSTokenizerV2Model"],
        "model_type": "qwen3_tts_tokenizer_12hz",
        "encoder_valid_num_quantizers": 16,
        "input_sample_rate": 24000,
        "output_sample_rate": 24000,
        "decode_upsample_rate": 1920,
        "encode_downsample_rate": 1920,
        "decoder_config": decoder,
        "encoder_config": encoder,
        "transformers_version": "4.57.3",
    }


def _dumps(obj: Any) -> str:
    return json.dumps(obj, indent=2, ensure_ascii=False) + "\n"


# ----------------------------------------------------------------------------- writer


def default_model_size(variant: str) -> str:
    """ "1b7" for VoiceDesign (published at 1.7B only), else "0b6"."""
    return "1b7" if variant == "voice_design" else "0b6"


def write_tiny_qwen3_tts(
    root: str | Path,
    variant: str = "custom_voice",
    seed: int = 0,
    model_size: str | None = None,
    sizes: Qwen3TTSSizes = TINY_SIZES,
) -> Qwen3TTSInfo:
    """Write a seeded tiny Qwen3-TTS folder of ``variant`` (one of ``VARIANTS``) under ``root``
    (created), every file of ``loader.LAYOUT``; needs torch, safetensors and transformers (the
    ``qwen3_tts`` extra), nothing else; about a second at the tiny sizes.

    Raises:
        ValueError: unknown ``variant`` / ``model_size``.
    """
    info = write_configs(Path(root), variant, model_size, sizes)
    return dataclasses.replace(info, tensor_shapes=write_weights(info.root, seed))


FOLDER_VARIANTS: tuple[str, ...] = VARIANTS
"""``omnistep weights qwen3_tts DIR --variant V``: one of these (default custom_voice)."""


def write_folder(folder: Path, variant: str | None = None, seed: int = 0) -> Path:
    """``omnistep weights qwen3_tts DIR``: :func:`write_tiny_qwen3_tts` of ``variant`` (None:
    custom_voice). Returns ``folder``."""
    return write_tiny_qwen3_tts(folder, variant or VARIANTS[0], seed).root


def write_weights(root: str | Path, seed: int = 0) -> dict[str, list[int]]:
    """Write ``root/model.safetensors`` (bf16, as published) and
    ``root/speech_tokenizer/model.safetensors`` (f32) for the configs already in ``root``
    (``write_configs``), drawn as the module docstring says.

    Returns:
        name -> shape of every tensor written (the speech tokenizer's under
        ``speech_tokenizer/``).

    Raises:
        Qwen3TTSCheckpointError: the configs in ``root`` are missing or invalid.
    """
    import torch
    from safetensors.torch import save_file

    from omnistep.models.qwen3_tts.loader import (
        model_tensor_shapes,
        parse_config,
        speech_decoder_tensor_shapes,
    )

    root = Path(root)
    config = parse_config(root)
    main = {
        name: _draw_main(seed, name, shape).to(torch.bfloat16).contiguous()
        for name, shape in model_tensor_shapes(config).items()
    }
    codec = {
        name: _draw_decoder(seed, name, shape)
        for name, shape in speech_decoder_tensor_shapes(config.speech_tokenizer.decoder).items()
    }
    mimi = json.loads((root / "speech_tokenizer" / "config.json").read_text(encoding="utf-8"))
    codec.update(_mimi_encoder_tensors(mimi["encoder_config"], seed))
    _redraw_codebooks(codec, seed)
    out = f"decoder.decoder.{len(config.speech_tokenizer.decoder.upsample_rates) + 2}.conv.weight"
    codec[out] = codec[out] * OUTPUT_GAIN
    save_file(main, str(root / "model.safetensors"), metadata={"format": "pt"})
    codec = {k: v.float().contiguous() for k, v in codec.items()}
    save_file(
        codec, str(root / "speech_tokenizer" / "model.safetensors"), metadata={"format": "pt"}
    )
    shapes = {k: list(v.shape) for k, v in main.items()}
    shapes.update({f"speech_tokenizer/{k}": list(v.shape) for k, v in codec.items()})
    return shapes


CODEBOOK_USAGE_RANGE = (0.5, 2.0)
"""``cluster_usage`` of the random codebooks is drawn uniformly from this range."""
RESIDUAL_GAIN = 0.3
"""Factor on the last conv of each decoder residual unit (after the ``N(0, 1/fan_in)`` draw)."""
OUTPUT_GAIN = 0.15
"""Factor on the decoder's output conv (after the ``N(0, 1/fan_in)`` draw)."""
INIT_STD = 0.02
"""upstream ``initializer_range``: the std of ``model.safetensors``' matrices."""


def _generator(seed: int, file: str, name: str):  # noqa: ANN202
    import torch

    return torch.Generator().manual_seed(zlib.crc32(f"{seed}/{file}/{name}".encode()))


def _draw_main(seed: int, name: str, shape: tuple[int, ...]):  # noqa: ANN202
    """A ``model.safetensors`` tensor as upstream ``_init_weights`` draws it."""
    import torch

    if len(shape) == 1:
        return torch.ones(shape) if name.endswith("norm.weight") else torch.zeros(shape)
    g = _generator(seed, "model", name)
    return INIT_STD * torch.randn(shape, generator=g)


_TRANSPOSED = re.compile(r"^decoder\.(upsample\.\d+\.0|decoder\.\d+\.block\.1)\.conv\.weight$")
"""The speech decoder's ``ConvTranspose1d`` weights (``[c_in, c_out, k]``, stride ``k`` for the
upsample blocks, ``k / 2`` for the decoder blocks)."""


def _draw_decoder(seed: int, name: str, shape: tuple[int, ...]):  # noqa: ANN202
    """A ``decoder.*`` tensor of the speech tokenizer (see the module docstring)."""
    import torch

    leaf = name.rsplit(".", 1)[-1]
    if len(shape) == 1:
        if leaf == "scale":
            return torch.full(shape, 0.01)
        if leaf == "gamma":
            return torch.full(shape, 0.01)
        if name.endswith("norm.weight"):
            return torch.ones(shape)
        return torch.zeros(shape)  # biases, SnakeBeta log-scales, cluster_usage (redrawn)
    if name.endswith("embedding_sum"):
        return torch.zeros(shape)  # redrawn with its usage by _redraw_codebooks
    g = _generator(seed, "speech_tokenizer", name)
    fan_in = math.prod(shape[1:])
    if _TRANSPOSED.match(name):
        stride = shape[2] if ".upsample." in name else shape[2] // 2
        fan_in = shape[0] * shape[2] // stride
    w = torch.randn(shape, generator=g) / math.sqrt(fan_in)
    if name.endswith(".conv2.conv.weight") and name.startswith("decoder.decoder."):
        w *= RESIDUAL_GAIN
    return w


def _mimi_encoder_tensors(encoder_config: dict[str, Any], seed: int) -> dict[str, Any]:
    """The ``encoder.*`` tensors (official names) of transformers' ``MimiModel`` built from
    ``encoder_config`` without its decoder half, initialised under ``torch.manual_seed(seed)``."""
    import torch
    from transformers import MimiConfig, MimiModel

    from omnistep.models.qwen3_tts.encoder import _official_name

    config = MimiConfig(**encoder_config)
    config.decoder_config = None
    state = torch.random.fork_rng()
    with state:
        torch.manual_seed(seed)
        model = MimiModel(config)
    return {_official_name(k): v.detach().clone() for k, v in model.state_dict().items()}


def _redraw_codebooks(tensors: dict[str, Any], seed: int) -> None:
    """Every codebook (``embedding_sum`` / ``embed_sum`` with its ``cluster_usage``):
    ``usage ~ U(CODEBOOK_USAGE_RANGE)``, ``sum = usage * N(0, 1)``."""
    import torch

    lo, hi = CODEBOOK_USAGE_RANGE
    for name in sorted(tensors):
        if name.endswith(("_codebook.embedding_sum", "codebook.embed_sum")):
            g = _generator(seed, "codebook", name)
            shape = tensors[name].shape
            usage = lo + (hi - lo) * torch.rand(shape[0], generator=g)
            tensors[name.rsplit(".", 1)[0] + ".cluster_usage"] = usage
            tensors[name] = usage[:, None] * torch.randn(shape, generator=g)


def write_configs(
    root: Path, variant: str, model_size: str | None, sizes: Qwen3TTSSizes
) -> Qwen3TTSInfo:
    """Every file of ``loader.LAYOUT`` but the two safetensors (``write_weights`` writes those); the
    info without ``tensor_shapes``.

    Raises:
        ValueError: unknown ``variant`` / ``model_size``.
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    model_size = model_size or default_model_size(variant)
    if model_size not in MODEL_SIZES:
        raise ValueError(f"model_size must be one of {MODEL_SIZES}, got {model_size!r}")
    (root / "speech_tokenizer").mkdir(parents=True, exist_ok=True)
    tok_files, ids = tokenizer_files()
    for name, text in tok_files.items():
        (root / name).write_text(text, encoding="utf-8")
    (root / "config.json").write_text(_dumps(config_dict(sizes, ids, variant, model_size)))
    # Published: indent 2, no final newline (245 bytes).
    (root / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2))
    (root / "preprocessor_config.json").write_text(_dumps(PREPROCESSOR_CONFIG))
    (root / "configuration.json").write_text(_dumps(CONFIGURATION))
    st = root / "speech_tokenizer"
    (st / "config.json").write_text(_dumps(speech_tokenizer_config_dict(sizes)))
    (st / "preprocessor_config.json").write_text(_dumps(SPEECH_PREPROCESSOR_CONFIG))
    (st / "configuration.json").write_text(_dumps(CONFIGURATION))
    spk_id, spk_is_dialect, languages = _variant_tables(variant)
    return Qwen3TTSInfo(
        root=root,
        variant=variant,
        model_size=model_size,
        sizes=sizes,
        ids=ids,
        speakers=spk_id,
        spk_is_dialect=spk_is_dialect,
        languages=languages,
    )
