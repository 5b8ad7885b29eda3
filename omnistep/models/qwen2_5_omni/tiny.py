"""Seeded random Qwen2.5-Omni checkpoints in the official HF layout of Qwen/Qwen2.5-Omni-7B.

``write_tiny_qwen_omni(root)`` writes::

    root/
      config.json                        model_type qwen2_5_omni: thinker_config (text_config,
                                         audio_config, vision_config), talker_config,
                                         token2wav_config (dit_config, bigvgan_config)
      generation_config.json             bos/eos/pad of the thinker text model
      model-0000{i}-of-0000{n}.safetensors   the tensors, shards in sorted-name order
      model.safetensors.index.json       {"metadata": {"total_size"}, "weight_map": {name: file}}
      spk_dict.pt                        {"Chelsie"|"Ethan": {"cond", "ref_mel", "bos_token"}}
      tokenizer.json, vocab.json, merges.txt, tokenizer_config.json (with ``chat_template``),
      special_tokens_map.json, added_tokens.json, chat_template.json

Tensor names are the OFFICIAL checkpoint names, which are what transformers 5.x
``save_pretrained`` writes and what ``from_pretrained`` reads; they are NOT the names of
``Qwen2_5OmniForConditionalGeneration.state_dict()`` in transformers 5.x for the thinker (its
modules moved; ``from_pretrained`` renames on load, see ``transformers/conversion_mapping.py``)::

    checkpoint (official)             transformers 5.x state_dict()
    thinker.model.*                   thinker.model.language_model.*   (embed_tokens, layers, norm)
    thinker.audio_tower.*             thinker.model.audio_tower.*
    thinker.visual.*                  thinker.model.visual.*
    thinker.lm_head.weight            thinker.lm_head.weight
    talker.*, token2wav.*             identical

Tensor names and shapes (``H`` thinker hidden, ``Ht`` talker hidden, ``Vt`` text vocab, ``Vc``
codec vocab; ``{l}`` layer index; official values in parentheses)::

  thinker.model.embed_tokens.weight [Vt(152064), H(3584)]; thinker.lm_head.weight [Vt, H]
  thinker.model.layers.{l}.self_attn.{q,k,v}_proj.{weight,bias} ([H|kv, H], bias), o_proj.weight
  thinker.model.layers.{l}.mlp.{gate,up,down}_proj.weight; {input,post_attention}_layernorm.weight
  thinker.model.norm.weight
  thinker.audio_tower.conv1 [d(1280), mel(128), 3], conv2 [d, d, 3] (+bias); layers.{l}.self_attn.
    {q,v,out}_proj.{weight,bias}, k_proj.weight (no bias); self_attn_layer_norm, fc1, fc2,
    final_layer_norm; ln_post; proj [H, d] (+bias); audio_bos_eos_token.weight [2, H]
  thinker.visual.patch_embed.proj.weight [hv(1280), 3, 2, 14, 14] (no bias); blocks.{l}.norm1,
    norm2 (RMSNorm weights), attn.{q,k,v,proj}.{weight,bias}, mlp.{gate,up,down}_proj.{weight,bias};
    merger.ln_q.weight [hv]; merger.mlp.0 [4hv, 4hv], merger.mlp.2 [H, 4hv] (+bias)
  talker.thinker_to_talker_proj.{weight [Ht(896), H], bias}; talker.model.embed_tokens.weight
    [Vc(8448), H] (embedding_size = thinker hidden); talker.model.layers.{l}.* like the thinker
    with head_dim explicit (q_proj [heads*head_dim(12*128), Ht]); talker.model.norm.weight;
    talker.codec_head.weight [Vc, Ht]
  token2wav.code2wav_dit_model.time_embed.time_mlp.{0 [D, 256], 2 [D, D]}; text_embed.codec_embed
    .weight [num_embeds + 1, emb_dim]; input_embed.proj [D, mel + enc_dim + enc_emb_dim + emb_dim];
    input_embed.spk_encoder.* (ECAPA-TDNN: blocks.0.conv, blocks.{1..}.{tdnn1,tdnn2}.conv,
    res2net_block.blocks.{j}.conv, se_block.conv{1,2}; mfa.conv; asp.tdnn.conv, asp.conv; fc);
    transformer_blocks.{l}.attn_norm.linear [6D, D], attn.to_{q,k,v} [heads*head_dim, D],
    attn.to_out.0, ff.ff.0 [ff_mult*D, D], ff.ff.3 [D, ff_mult*D]; norm_out.linear [2D, D];
    proj_out [mel(80), D]
  token2wav.code2wav_bigvgan_model.conv_pre [C(1536), mel, 7]; ups.{i}.0 (ConvTranspose1d
    [C/2^i, C/2^(i+1), k_i]); resblocks.{3i+j}.convs{1,2}.{0,1,2}, activations.{0..5}.act.
    {alpha,beta}; activation_post.act.{alpha,beta}; conv_post.weight [1, C/64, 7] (no bias)

Non-persistent buffers (rotary ``inv_freq``, the audio tower's sinusoid table, the Kaiser-sinc
filters of BigVGAN's anti-aliased activations) are not in the files; transformers computes them.

Token ids.  The tiny tokenizer is a byte-level BPE (Qwen2 pre-tokenizer regex, NFC) of ``E``
tokens, followed by the 22 Qwen2.5-Omni added tokens in their official order (official
``<|endoftext|>`` = 151643, so tiny ids are official ids minus ``151643 - E``).  The text-only
ids beyond the tokenizer keep their official offsets from ``E``: ``tts_text_pad`` E+216 (151859),
``tts_text_start`` E+217, ``tts_text_end`` E+218, text vocab E+421 (152064).  The speakers' text
BOS ids (``spk_dict[name]["bos_token"]``, rows of the thinker embedding) are E+227+i -- a tiny
choice, not official values.  Codec: ``C`` real codes (official 8192), then ``pad`` C+100 (8292),
``bos`` C+101 (8293), ``eos`` C+102 (8294), ``mask`` C+104 (8296), vocab C+256 (8448).

Weights are drawn per tensor from ``torch.Generator().manual_seed(crc32(f"{seed}/{name}"))``, so
equal seeds give byte-identical safetensors and tokenizer/config files (``spk_dict.pt`` too:
torch's random ``.data/serialization_id`` record is overwritten with a fixed one).  Scales are
"trained-like" so every stage is non-degenerate: matrices ``N(0, 1/fan_in)`` (residual outputs
further ``1/sqrt(2L)``; LM heads ``2/sqrt(H)`` so logits have std ~2), norm weights ``1 + 0.1N``,
biases ``0.02N``, embeddings ``0.5N`` (DiT codec embedding ``N``), snake ``alpha``/``beta``
(log-scale) ``0.1N``, BigVGAN transposed convs ``N(0, stride/(c_in*k))``, the DiT ``proj_out``
bias ``-5 + 0.5N`` (so the mel sits in the log-amplitude range BigVGAN expects, not clamped),
speaker ``cond ~ N(0, 1)`` and ``ref_mel ~ -5 + 1.5N``.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import struct
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omnistep.text.tiny_bpe import bpe_vocab_and_merges

# The 22 tokens Qwen2.5-Omni adds after the BPE vocabulary (official ids 151643..151664).
QWEN_OMNI_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|AUDIO|>", True),
    ("<|audio_bos|>", True),
    ("<|audio_eos|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_bos|>", True),
    ("<|vision_eos|>", True),
    ("<|vision_pad|>", True),
    ("<|IMAGE|>", True),
    ("<|VIDEO|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
)
OFFICIAL_ENDOFTEXT_ID = 151643
# Offsets from <|endoftext|> of the ids beyond the tokenizer (official values in comments).
TTS_TEXT_PAD_OFFSET = 216  # 151859
TTS_TEXT_START_OFFSET = 217  # 151860
TTS_TEXT_END_OFFSET = 218  # 151861
SPEAKER_BOS_OFFSET = 227  # tiny choice, first speaker; the next speakers follow
TEXT_VOCAB_OFFSET = 421  # 152064
# Offsets from the number of real codes (official 8192) of the codec specials and vocab.
CODEC_PAD_OFFSET = 100  # 8292
CODEC_BOS_OFFSET = 101  # 8293
CODEC_EOS_OFFSET = 102  # 8294
CODEC_MASK_OFFSET = 104  # 8296
CODEC_VOCAB_OFFSET = 256  # 8448

DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."
# The system prompt the official model card requires for speech output.
QWEN_SPEECH_SYSTEM_PROMPT = (
    "You are Qwen, a virtual human developed by the Qwen Team, Alibaba Group, capable of "
    "perceiving auditory and visual inputs, as well as generating text and speech."
)

# The Qwen2.5-Omni chat template (same output as the official ``chat_template.json``): a
# default system turn when the first message is not one; string or list-of-parts contents;
# media parts become <|vision_bos|><|IMAGE|><|vision_eos|>, <|audio_bos|><|AUDIO|><|audio_eos|>,
# <|vision_bos|><|VIDEO|><|vision_eos|> (the processor expands the placeholders).
CHAT_TEMPLATE = (
    "{% set audio_count = namespace(value=0) %}{% set image_count = namespace(value=0) %}"
    "{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\n" + DEFAULT_SYSTEM_PROMPT + "<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_bos|><|IMAGE|><|vision_eos|>"
    "{% elif content['type'] == 'audio' or 'audio' in content or 'audio_url' in content %}"
    "{% set audio_count.value = audio_count.value + 1 %}"
    "{% if add_audio_id %}Audio {{ audio_count.value }}: {% endif %}"
    "<|audio_bos|><|AUDIO|><|audio_eos|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_bos|><|VIDEO|><|vision_eos|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Qwen2's pre-tokenizer split (as in the official tokenizer.json).
QWEN2_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class QwenOmniSizes:
    """Every size the checkpoint depends on. Defaults are the tiny test sizes."""

    # thinker language model
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 128
    mrope_section: tuple[int, ...] = (2, 3, 3)  # sum = head_dim / 2 (official 16, 24, 24)
    rope_theta: float = 1000000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    # audio encoder (Whisper-like)
    audio_d_model: int = 32
    audio_layers: int = 1
    audio_heads: int = 2
    audio_ffn: int = 64
    audio_mel_bins: int = 128
    audio_n_window: int = 100
    audio_max_source_positions: int = 1500
    # vision encoder (Qwen2.5-VL-like, separate q/k/v)
    vision_depth: int = 2
    vision_hidden: int = 32
    vision_heads: int = 2
    vision_intermediate: int = 64
    vision_patch: int = 14
    vision_temporal_patch: int = 2
    vision_merge: int = 2
    vision_window: int = 112
    vision_fullatt: tuple[int, ...] = (1,)
    # talker (codec LM)
    talker_hidden: int = 48
    talker_layers: int = 2
    talker_heads: int = 4
    talker_kv_heads: int = 2
    talker_head_dim: int = 16  # explicit: heads * head_dim != hidden, like the official 12*128/896
    talker_intermediate: int = 96
    talker_mrope_section: tuple[int, ...] = (2, 3, 3)
    codec_codes: int = 128  # real codes 0..codec_codes-1 (official 8192)
    # token2wav DiT
    dit_hidden: int = 64
    dit_layers: int = 4
    dit_heads: int = 4
    dit_head_dim: int = 16
    dit_ff_mult: int = 2
    dit_emb_dim: int = 32
    dit_block_size: int = 8  # mel frames per attention block (official 24)
    dit_look_ahead_layers: tuple[int, ...] = (2,)  # official (10,) of 22
    dit_look_backward_layers: tuple[int, ...] = (0, 3)  # official (0, 20)
    dit_repeats: int = 2
    dit_num_embeds: int | None = None  # None: the codec vocab (must be >= it for random talkers)
    dit_rope_theta: float = 10000.0
    mel_dim: int = 80
    enc_emb_dim: int = 16  # speaker ``cond`` size (official 192)
    enc_dim: int = 16  # ECAPA output (official 128)
    enc_channels: tuple[int, ...] = (32, 32, 32, 32, 96)  # official (256, 256, 256, 256, 768)
    enc_kernel_sizes: tuple[int, ...] = (5, 3, 3, 3, 1)
    enc_dilations: tuple[int, ...] = (1, 2, 3, 4, 1)
    enc_attention_channels: int = 16  # official 64
    enc_res2net_scale: int = 2
    enc_se_channels: int = 16  # official 64
    # token2wav BigVGAN (kernel sizes, dilations and rates official: same receptive field)
    bigvgan_channels: int = 128  # official 1536
    resblock_kernel_sizes: tuple[int, ...] = (3, 7, 11)
    resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    upsample_rates: tuple[int, ...] = (5, 3, 2, 2, 2, 2)
    upsample_kernel_sizes: tuple[int, ...] = (11, 7, 4, 4, 4, 4)
    # speakers and files
    speakers: tuple[str, ...] = ("Chelsie", "Ethan")
    ref_mel_frames: int = 48
    num_shards: int = 3  # official 5
    dtype: str = "float32"  # official bfloat16

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def codec_vocab(self) -> int:
        return self.codec_codes + CODEC_VOCAB_OFFSET

    @property
    def num_embeds(self) -> int:
        return self.codec_vocab if self.dit_num_embeds is None else self.dit_num_embeds

    def validate(self) -> None:
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError("hidden % heads and heads % kv_heads must be 0")
        if 2 * sum(self.mrope_section) != self.head_dim:
            raise ValueError("sum(mrope_section) must be head_dim / 2 (thinker)")
        if 2 * sum(self.talker_mrope_section) != self.talker_head_dim:
            raise ValueError("sum(talker_mrope_section) must be talker_head_dim / 2")
        if self.talker_heads % self.talker_kv_heads:
            raise ValueError("talker_heads % talker_kv_heads must be 0")
        if self.num_embeds < self.codec_vocab:
            raise ValueError("DiT num_embeds must be >= codec vocab (random talkers emit any id)")
        if self.enc_channels[-1] != sum(self.enc_channels[1:-1]):
            raise ValueError("enc_channels[-1] must be the sum of the SE-Res2Net block channels")
        if any(c % self.enc_res2net_scale for c in self.enc_channels[1:-1]):
            raise ValueError("SE-Res2Net channels must be divisible by enc_res2net_scale")
        if self.bigvgan_channels % 2 ** len(self.upsample_rates):
            raise ValueError("bigvgan_channels must be divisible by 2**len(upsample_rates)")
        if len(self.resblock_kernel_sizes) != len(self.resblock_dilation_sizes):
            raise ValueError("one dilation triple per resblock kernel size")
        if any(len(d) != 3 for d in self.resblock_dilation_sizes):
            raise ValueError("AMP blocks have exactly three dilated convolutions")
        rates_kernels = zip(self.upsample_rates, self.upsample_kernel_sizes, strict=True)
        if any((k - r) % 2 for r, k in rates_kernels):
            raise ValueError("(kernel - rate) must be even: then each upsampler is exactly x rate")
        if self.vision_hidden % self.vision_heads:
            raise ValueError("vision_hidden % vision_heads must be 0")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"unsupported dtype {self.dtype}")


TINY_SIZES = QwenOmniSizes()


# ----------------------------------------------------------------------------- token ids


@dataclass(frozen=True)
class QwenOmniTokenIds:
    """Every id the config and the speaker dictionary reference (tiny values)."""

    endoftext: int
    im_start: int
    im_end: int
    audio: int
    audio_bos: int
    audio_eos: int
    vision_bos: int
    vision_eos: int
    vision_pad: int
    image: int
    video: int
    user: int  # the BPE token "user" (official 872)
    tts_text_pad: int
    tts_text_start: int
    tts_text_end: int
    text_vocab: int
    speaker_bos: dict[str, int]
    codec_pad: int
    codec_bos: int
    codec_eos: int
    codec_mask: int
    codec_vocab: int

    @property
    def talker_eos_token_ids(self) -> list[int]:
        """What ``generate(talker_eos_token_id=...)`` needs (official default [8292, 8294])."""
        return [self.codec_pad, self.codec_eos]


def token_ids(sizes: QwenOmniSizes, num_bpe_tokens: int, user_id: int) -> QwenOmniTokenIds:
    e = num_bpe_tokens
    added = {tok: e + i for i, (tok, _) in enumerate(QWEN_OMNI_ADDED_TOKENS)}
    c = sizes.codec_codes
    return QwenOmniTokenIds(
        endoftext=added["<|endoftext|>"],
        im_start=added["<|im_start|>"],
        im_end=added["<|im_end|>"],
        audio=added["<|AUDIO|>"],
        audio_bos=added["<|audio_bos|>"],
        audio_eos=added["<|audio_eos|>"],
        vision_bos=added["<|vision_bos|>"],
        vision_eos=added["<|vision_eos|>"],
        vision_pad=added["<|vision_pad|>"],
        image=added["<|IMAGE|>"],
        video=added["<|VIDEO|>"],
        user=user_id,
        tts_text_pad=e + TTS_TEXT_PAD_OFFSET,
        tts_text_start=e + TTS_TEXT_START_OFFSET,
        tts_text_end=e + TTS_TEXT_END_OFFSET,
        text_vocab=e + TEXT_VOCAB_OFFSET,
        speaker_bos={name: e + SPEAKER_BOS_OFFSET + i for i, name in enumerate(sizes.speakers)},
        codec_pad=c + CODEC_PAD_OFFSET,
        codec_bos=c + CODEC_BOS_OFFSET,
        codec_eos=c + CODEC_EOS_OFFSET,
        codec_mask=c + CODEC_MASK_OFFSET,
        codec_vocab=c + CODEC_VOCAB_OFFSET,
    )


# ----------------------------------------------------------------------------- tokenizer


def _tokenizer_files(sizes: QwenOmniSizes) -> tuple[dict[str, str], QwenOmniTokenIds]:
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
    )

    vocab, merges = bpe_vocab_and_merges()
    ids = token_ids(sizes, len(vocab), vocab["user"])
    tok = Tokenizer(models.BPE(vocab=dict(vocab), merges=list(merges), fuse_unk=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    for content, special in QWEN_OMNI_ADDED_TOKENS:
        at = AddedToken(content, single_word=False, lstrip=False, rstrip=False, normalized=False)
        if special:
            tok.add_special_tokens([at])
        else:
            tok.add_tokens([at])
    tokenizer_json = json.loads(tok.to_str())
    tokenizer_json["post_processor"] = {
        "type": "ByteLevel",
        "add_prefix_space": False,
        "trim_offsets": False,
        "use_regex": False,
    }
    got = {t["content"]: t["id"] for t in tokenizer_json["added_tokens"]}
    for i, (content, _) in enumerate(QWEN_OMNI_ADDED_TOKENS):
        if got[content] != ids.endoftext + i:
            raise AssertionError(f"{content} got id {got[content]}")

    added_decoder = {
        str(ids.endoftext + i): {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
        for i, (content, special) in enumerate(QWEN_OMNI_ADDED_TOKENS)
    }
    additional = [c for c, special in QWEN_OMNI_ADDED_TOKENS[1:] if special]
    media_tokens = {
        "audio_bos_token": "<|audio_bos|>",
        "audio_eos_token": "<|audio_eos|>",
        "audio_token": "<|AUDIO|>",
        "image_token": "<|IMAGE|>",
        "video_token": "<|VIDEO|>",
        "vision_bos_token": "<|vision_bos|>",
        "vision_eos_token": "<|vision_eos|>",
    }
    tokenizer_config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added_decoder,
        "additional_special_tokens": additional,
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "extra_special_tokens": media_tokens,
        "model_max_length": sizes.max_position_embeddings,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    special_tokens_map = {
        "additional_special_tokens": additional,
        "eos_token": {
            "content": "<|im_end|>",
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
        },
        "pad_token": {
            "content": "<|endoftext|>",
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
        },
    }
    added_tokens = {c: ids.endoftext + i for i, (c, _) in enumerate(QWEN_OMNI_ADDED_TOKENS)}
    merges_txt = "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges)
    files = {
        "tokenizer.json": json.dumps(tokenizer_json, ensure_ascii=False, indent=2) + "\n",
        "vocab.json": json.dumps(vocab, ensure_ascii=False) + "\n",
        "merges.txt": merges_txt,
        "tokenizer_config.json": _dumps(tokenizer_config),
        "special_tokens_map.json": _dumps(special_tokens_map),
        "added_tokens.json": _dumps(added_tokens),
        "chat_template.json": _dumps({"chat_template": CHAT_TEMPLATE}),
    }
    return files, ids


# ----------------------------------------------------------------------------- config


def _rope_scaling(section: tuple[int, ...]) -> dict[str, Any]:
    return {"mrope_section": list(section), "rope_type": "default", "type": "default"}


def config_dict(s: QwenOmniSizes, ids: QwenOmniTokenIds) -> dict[str, Any]:
    """``config.json`` in the official nesting and key style (``rope_theta`` + ``rope_scaling``)."""
    text_config = {
        "model_type": "qwen2_5_omni_text",
        "vocab_size": ids.text_vocab,
        "hidden_size": s.hidden,
        "intermediate_size": s.intermediate,
        "num_hidden_layers": s.layers,
        "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads,
        "hidden_act": "silu",
        "max_position_embeddings": s.max_position_embeddings,
        "rms_norm_eps": s.rms_norm_eps,
        "rope_theta": s.rope_theta,
        "rope_scaling": _rope_scaling(s.mrope_section),
        "use_sliding_window": False,
        "sliding_window": s.max_position_embeddings,
        "max_window_layers": s.layers,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "tie_word_embeddings": False,
        "bos_token_id": ids.endoftext,
        "eos_token_id": ids.im_end,
        "pad_token_id": ids.endoftext,
    }
    audio_config = {
        "model_type": "qwen2_5_omni_audio_encoder",
        "num_mel_bins": s.audio_mel_bins,
        "encoder_layers": s.audio_layers,
        "encoder_attention_heads": s.audio_heads,
        "encoder_ffn_dim": s.audio_ffn,
        "d_model": s.audio_d_model,
        "dropout": 0.0,
        "attention_dropout": 0.0,
        "activation_function": "gelu",
        "activation_dropout": 0.0,
        "scale_embedding": False,
        "initializer_range": 0.02,
        "max_source_positions": s.audio_max_source_positions,
        "n_window": s.audio_n_window,
        "output_dim": s.hidden,
    }
    vision_config = {
        "model_type": "qwen2_5_omni_vision_encoder",
        "depth": s.vision_depth,
        "hidden_size": s.vision_hidden,
        "hidden_act": "silu",
        "intermediate_size": s.vision_intermediate,
        "num_heads": s.vision_heads,
        "in_channels": 3,
        "patch_size": s.vision_patch,
        "spatial_merge_size": s.vision_merge,
        "temporal_patch_size": s.vision_temporal_patch,
        "window_size": s.vision_window,
        "out_hidden_size": s.hidden,
        "fullatt_block_indexes": list(s.vision_fullatt),
        "initializer_range": 0.02,
    }
    thinker_config = {
        "model_type": "qwen2_5_omni_thinker",
        "architectures": ["Qwen2_5OmniThinkerForConditionalGeneration"],
        "audio_config": audio_config,
        "vision_config": vision_config,
        "text_config": text_config,
        "audio_token_index": ids.audio,
        "image_token_index": ids.image,
        "video_token_index": ids.video,
        "audio_start_token_id": ids.audio_bos,
        "audio_end_token_id": ids.audio_eos,
        "vision_start_token_id": ids.vision_bos,
        "vision_end_token_id": ids.vision_eos,
        "vision_token_id": ids.vision_pad,
        "user_token_id": ids.user,
        "bos_token_id": ids.im_start,
        "eos_token_id": ids.im_end,
        "pad_token_id": ids.endoftext,
        "position_id_per_seconds": 25,
        "seconds_per_chunk": 2,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
    }
    talker_config = {
        "model_type": "qwen2_5_omni_talker",
        "architectures": ["Qwen2_5OmniTalkerForConditionalGeneration"],
        "vocab_size": ids.codec_vocab,
        "embedding_size": s.hidden,
        "hidden_size": s.talker_hidden,
        "intermediate_size": s.talker_intermediate,
        "num_hidden_layers": s.talker_layers,
        "num_attention_heads": s.talker_heads,
        "num_key_value_heads": s.talker_kv_heads,
        "head_dim": s.talker_head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": s.max_position_embeddings,
        "rms_norm_eps": s.rms_norm_eps,
        "rope_theta": s.rope_theta,
        "rope_scaling": _rope_scaling(s.talker_mrope_section),
        "use_sliding_window": False,
        "sliding_window": s.max_position_embeddings,
        "max_window_layers": s.talker_layers,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "tie_word_embeddings": False,
        "tts_codec_start_token_id": ids.codec_bos,
        "tts_codec_end_token_id": ids.codec_eos,
        "tts_codec_pad_token_id": ids.codec_pad,
        "tts_codec_mask_token_id": ids.codec_mask,
        "tts_text_start_token_id": ids.tts_text_start,
        "tts_text_end_token_id": ids.tts_text_end,
        "tts_text_pad_token_id": ids.tts_text_pad,
        "audio_token_index": ids.audio,
        "image_token_index": ids.image,
        "video_token_index": ids.video,
        "audio_start_token_id": ids.audio_bos,
        "audio_end_token_id": ids.audio_eos,
        "vision_start_token_id": ids.vision_bos,
        "vision_end_token_id": ids.vision_eos,
        "position_id_per_seconds": 25,
        "seconds_per_chunk": 2,
        "spatial_merge_size": s.vision_merge,
    }
    dit_config = {
        "model_type": "qwen2_5_omni_dit",
        "hidden_size": s.dit_hidden,
        "num_hidden_layers": s.dit_layers,
        "num_attention_heads": s.dit_heads,
        "head_dim": s.dit_head_dim,
        "ff_mult": s.dit_ff_mult,
        "emb_dim": s.dit_emb_dim,
        "rope_theta": s.dit_rope_theta,
        "max_position_embeddings": s.max_position_embeddings,
        "block_size": s.dit_block_size,
        "look_ahead_layers": list(s.dit_look_ahead_layers),
        "look_backward_layers": list(s.dit_look_backward_layers),
        "repeats": s.dit_repeats,
        "num_embeds": s.num_embeds,
        "mel_dim": s.mel_dim,
        "dropout": 0.1,
        "enc_emb_dim": s.enc_emb_dim,
        "enc_dim": s.enc_dim,
        "enc_channels": list(s.enc_channels),
        "enc_kernel_sizes": list(s.enc_kernel_sizes),
        "enc_dilations": list(s.enc_dilations),
        "enc_attention_channels": s.enc_attention_channels,
        "enc_res2net_scale": s.enc_res2net_scale,
        "enc_se_channels": s.enc_se_channels,
    }
    bigvgan_config = {
        "model_type": "qwen2_5_omni_bigvgan",
        "mel_dim": s.mel_dim,
        "upsample_initial_channel": s.bigvgan_channels,
        "resblock_kernel_sizes": list(s.resblock_kernel_sizes),
        "resblock_dilation_sizes": [list(d) for d in s.resblock_dilation_sizes],
        "upsample_rates": list(s.upsample_rates),
        "upsample_kernel_sizes": list(s.upsample_kernel_sizes),
    }
    return {
        "architectures": ["Qwen2_5OmniForConditionalGeneration"],
        "model_type": "qwen2_5_omni",
        "enable_audio_output": True,
        "enable_talker": True,
        "torch_dtype": s.dtype,
        "thinker_config": thinker_config,
        "talker_config": talker_config,
        "token2wav_config": {
            "model_type": "qwen2_5_omni_token2wav",
            "dit_config": dit_config,
            "bigvgan_config": bigvgan_config,
        },
    }


def generation_config_dict(ids: QwenOmniTokenIds) -> dict[str, Any]:
    return {
        "bos_token_id": ids.endoftext,
        "eos_token_id": ids.im_end,
        "pad_token_id": ids.endoftext,
    }


# ----------------------------------------------------------------------------- tensors


def _qwen2_layers(prefix: str, n: int, h: int, q: int, kv: int, inter: int) -> dict[str, tuple]:
    spec: dict[str, tuple] = {}
    for i in range(n):
        p = f"{prefix}layers.{i}."
        spec[p + "self_attn.q_proj.weight"] = (q, h)
        spec[p + "self_attn.q_proj.bias"] = (q,)
        spec[p + "self_attn.k_proj.weight"] = (kv, h)
        spec[p + "self_attn.k_proj.bias"] = (kv,)
        spec[p + "self_attn.v_proj.weight"] = (kv, h)
        spec[p + "self_attn.v_proj.bias"] = (kv,)
        spec[p + "self_attn.o_proj.weight"] = (h, q)
        spec[p + "mlp.gate_proj.weight"] = (inter, h)
        spec[p + "mlp.up_proj.weight"] = (inter, h)
        spec[p + "mlp.down_proj.weight"] = (h, inter)
        spec[p + "input_layernorm.weight"] = (h,)
        spec[p + "post_attention_layernorm.weight"] = (h,)
    spec[prefix + "norm.weight"] = (h,)
    return spec


def _spec_thinker(s: QwenOmniSizes, ids: QwenOmniTokenIds) -> dict[str, tuple]:
    h, kv = s.hidden, s.head_dim * s.kv_heads
    spec: dict[str, tuple] = {"thinker.model.embed_tokens.weight": (ids.text_vocab, h)}
    spec.update(_qwen2_layers("thinker.model.", s.layers, h, h, kv, s.intermediate))
    spec["thinker.lm_head.weight"] = (ids.text_vocab, h)
    # audio tower
    a, p = s.audio_d_model, "thinker.audio_tower."
    spec[p + "conv1.weight"] = (a, s.audio_mel_bins, 3)
    spec[p + "conv1.bias"] = (a,)
    spec[p + "conv2.weight"] = (a, a, 3)
    spec[p + "conv2.bias"] = (a,)
    for i in range(s.audio_layers):
        lp = f"{p}layers.{i}."
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            spec[f"{lp}self_attn.{proj}.weight"] = (a, a)
            if proj != "k_proj":
                spec[f"{lp}self_attn.{proj}.bias"] = (a,)
        spec[lp + "self_attn_layer_norm.weight"] = (a,)
        spec[lp + "self_attn_layer_norm.bias"] = (a,)
        spec[lp + "fc1.weight"] = (s.audio_ffn, a)
        spec[lp + "fc1.bias"] = (s.audio_ffn,)
        spec[lp + "fc2.weight"] = (a, s.audio_ffn)
        spec[lp + "fc2.bias"] = (a,)
        spec[lp + "final_layer_norm.weight"] = (a,)
        spec[lp + "final_layer_norm.bias"] = (a,)
    spec[p + "ln_post.weight"] = (a,)
    spec[p + "ln_post.bias"] = (a,)
    spec[p + "proj.weight"] = (h, a)
    spec[p + "proj.bias"] = (h,)
    spec[p + "audio_bos_eos_token.weight"] = (2, h)
    # vision tower
    v, p = s.vision_hidden, "thinker.visual."
    spec[p + "patch_embed.proj.weight"] = (
        v,
        3,
        s.vision_temporal_patch,
        s.vision_patch,
        s.vision_patch,
    )
    for i in range(s.vision_depth):
        bp = f"{p}blocks.{i}."
        spec[bp + "norm1.weight"] = (v,)
        spec[bp + "norm2.weight"] = (v,)
        for proj in ("q", "k", "v", "proj"):
            spec[f"{bp}attn.{proj}.weight"] = (v, v)
            spec[f"{bp}attn.{proj}.bias"] = (v,)
        spec[bp + "mlp.gate_proj.weight"] = (s.vision_intermediate, v)
        spec[bp + "mlp.gate_proj.bias"] = (s.vision_intermediate,)
        spec[bp + "mlp.up_proj.weight"] = (s.vision_intermediate, v)
        spec[bp + "mlp.up_proj.bias"] = (s.vision_intermediate,)
        spec[bp + "mlp.down_proj.weight"] = (v, s.vision_intermediate)
        spec[bp + "mlp.down_proj.bias"] = (v,)
    m = v * s.vision_merge**2
    spec[p + "merger.ln_q.weight"] = (v,)
    spec[p + "merger.mlp.0.weight"] = (m, m)
    spec[p + "merger.mlp.0.bias"] = (m,)
    spec[p + "merger.mlp.2.weight"] = (h, m)
    spec[p + "merger.mlp.2.bias"] = (h,)
    return spec


def _spec_talker(s: QwenOmniSizes, ids: QwenOmniTokenIds) -> dict[str, tuple]:
    ht = s.talker_hidden
    spec: dict[str, tuple] = {
        "talker.thinker_to_talker_proj.weight": (ht, s.hidden),
        "talker.thinker_to_talker_proj.bias": (ht,),
        "talker.model.embed_tokens.weight": (ids.codec_vocab, s.hidden),
    }
    spec.update(
        _qwen2_layers(
            "talker.model.",
            s.talker_layers,
            ht,
            s.talker_heads * s.talker_head_dim,
            s.talker_kv_heads * s.talker_head_dim,
            s.talker_intermediate,
        )
    )
    spec["talker.codec_head.weight"] = (ids.codec_vocab, ht)
    return spec


def _tdnn(spec: dict[str, tuple], p: str, c_out: int, c_in: int, k: int) -> None:
    spec[p + "conv.weight"] = (c_out, c_in, k)
    spec[p + "conv.bias"] = (c_out,)


def _spec_dit(s: QwenOmniSizes) -> dict[str, tuple]:
    d, p = s.dit_hidden, "token2wav.code2wav_dit_model."
    inner = s.dit_heads * s.dit_head_dim
    spec: dict[str, tuple] = {
        p + "time_embed.time_mlp.0.weight": (d, 256),
        p + "time_embed.time_mlp.0.bias": (d,),
        p + "time_embed.time_mlp.2.weight": (d, d),
        p + "time_embed.time_mlp.2.bias": (d,),
        p + "text_embed.codec_embed.weight": (s.num_embeds + 1, s.dit_emb_dim),
        p + "input_embed.proj.weight": (d, s.mel_dim + s.enc_dim + s.enc_emb_dim + s.dit_emb_dim),
        p + "input_embed.proj.bias": (d,),
    }
    e, ch = p + "input_embed.spk_encoder.", s.enc_channels
    _tdnn(spec, e + "blocks.0.", ch[0], s.mel_dim, s.enc_kernel_sizes[0])
    for i in range(1, len(ch) - 1):
        b, c = f"{e}blocks.{i}.", ch[i]
        _tdnn(spec, b + "tdnn1.", c, ch[i - 1], 1)
        sub = c // s.enc_res2net_scale
        for j in range(s.enc_res2net_scale - 1):
            _tdnn(spec, f"{b}res2net_block.blocks.{j}.", sub, sub, s.enc_kernel_sizes[i])
        _tdnn(spec, b + "tdnn2.", c, c, 1)
        spec[b + "se_block.conv1.weight"] = (s.enc_se_channels, c, 1)
        spec[b + "se_block.conv1.bias"] = (s.enc_se_channels,)
        spec[b + "se_block.conv2.weight"] = (c, s.enc_se_channels, 1)
        spec[b + "se_block.conv2.bias"] = (c,)
    _tdnn(spec, e + "mfa.", ch[-1], ch[-1], s.enc_kernel_sizes[-1])
    _tdnn(spec, e + "asp.tdnn.", s.enc_attention_channels, 3 * ch[-1], 1)
    spec[e + "asp.conv.weight"] = (ch[-1], s.enc_attention_channels, 1)
    spec[e + "asp.conv.bias"] = (ch[-1],)
    spec[e + "fc.weight"] = (s.enc_dim, 2 * ch[-1], 1)
    spec[e + "fc.bias"] = (s.enc_dim,)
    for i in range(s.dit_layers):
        b = f"{p}transformer_blocks.{i}."
        spec[b + "attn_norm.linear.weight"] = (6 * d, d)
        spec[b + "attn_norm.linear.bias"] = (6 * d,)
        for proj in ("to_q", "to_k", "to_v"):
            spec[f"{b}attn.{proj}.weight"] = (inner, d)
            spec[f"{b}attn.{proj}.bias"] = (inner,)
        spec[b + "attn.to_out.0.weight"] = (d, inner)
        spec[b + "attn.to_out.0.bias"] = (d,)
        spec[b + "ff.ff.0.weight"] = (s.dit_ff_mult * d, d)
        spec[b + "ff.ff.0.bias"] = (s.dit_ff_mult * d,)
        spec[b + "ff.ff.3.weight"] = (d, s.dit_ff_mult * d)
        spec[b + "ff.ff.3.bias"] = (d,)
    spec[p + "norm_out.linear.weight"] = (2 * d, d)
    spec[p + "norm_out.linear.bias"] = (2 * d,)
    spec[p + "proj_out.weight"] = (s.mel_dim, d)
    spec[p + "proj_out.bias"] = (s.mel_dim,)
    return spec


def _spec_bigvgan(s: QwenOmniSizes) -> dict[str, tuple]:
    p, c0 = "token2wav.code2wav_bigvgan_model.", s.bigvgan_channels
    spec: dict[str, tuple] = {
        p + "conv_pre.weight": (c0, s.mel_dim, 7),
        p + "conv_pre.bias": (c0,),
    }
    n_res = len(s.resblock_kernel_sizes)
    for i, k in enumerate(s.upsample_kernel_sizes):
        c_in, c_out = c0 // 2**i, c0 // 2 ** (i + 1)
        spec[f"{p}ups.{i}.0.weight"] = (c_in, c_out, k)
        spec[f"{p}ups.{i}.0.bias"] = (c_out,)
        for j, rk in enumerate(s.resblock_kernel_sizes):
            r = f"{p}resblocks.{i * n_res + j}."
            for conv in ("convs1", "convs2"):
                for m in range(3):
                    spec[f"{r}{conv}.{m}.weight"] = (c_out, c_out, rk)
                    spec[f"{r}{conv}.{m}.bias"] = (c_out,)
            for m in range(6):
                spec[f"{r}activations.{m}.act.alpha"] = (c_out,)
                spec[f"{r}activations.{m}.act.beta"] = (c_out,)
    c_last = c0 // 2 ** len(s.upsample_rates)
    spec[p + "activation_post.act.alpha"] = (c_last,)
    spec[p + "activation_post.act.beta"] = (c_last,)
    spec[p + "conv_post.weight"] = (1, c_last, 7)
    return spec


def tensor_specs(sizes: QwenOmniSizes, ids: QwenOmniTokenIds) -> dict[str, tuple[int, ...]]:
    """Official checkpoint tensor name -> shape, for every tensor in the safetensors shards."""
    spec: dict[str, tuple[int, ...]] = {}
    spec.update(_spec_thinker(sizes, ids))
    spec.update(_spec_talker(sizes, ids))
    spec.update(_spec_dit(sizes))
    spec.update(_spec_bigvgan(sizes))
    return spec


_RESIDUAL_OUT = (
    "self_attn.o_proj.weight",
    "mlp.down_proj.weight",
    "self_attn.out_proj.weight",
    ".fc2.weight",
    "attn.proj.weight",
    "attn.to_out.0.weight",
    "ff.ff.3.weight",
)


BIGVGAN_RESIDUAL_GAIN = 0.4


def _num_layers(name: str, s: QwenOmniSizes) -> int:
    if name.startswith("thinker.model."):
        return s.layers
    if name.startswith("thinker.audio_tower."):
        return s.audio_layers
    if name.startswith("thinker.visual."):
        return s.vision_depth
    if name.startswith("talker."):
        return s.talker_layers
    return s.dit_layers


def _draw(seed: int, name: str, shape: tuple[int, ...], s: QwenOmniSizes):  # noqa: ANN202
    import torch

    g = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{name}".encode()))

    def randn() -> torch.Tensor:
        return torch.randn(shape, generator=g, dtype=torch.float32)

    leaf = name.rsplit(".", 1)[-1]
    if name.endswith((".act.alpha", ".act.beta")):
        return 0.1 * randn()
    if len(shape) == 1:
        if leaf == "weight":  # RMSNorm / LayerNorm scales
            return 1.0 + 0.1 * randn()
        if name.endswith("code2wav_dit_model.proj_out.bias"):
            return -5.0 + 0.5 * randn()
        return 0.02 * randn()
    if name.endswith("codec_embed.weight"):
        return randn()
    if name.endswith(("embed_tokens.weight", "audio_bos_eos_token.weight")):
        return 0.5 * randn()
    if name.endswith(("lm_head.weight", "codec_head.weight")):
        return randn() * (2.0 / math.sqrt(shape[1]))
    if ".code2wav_bigvgan_model.ups." in name:  # ConvTranspose1d [c_in, c_out, k]
        i = int(name.split(".ups.")[1].split(".")[0])
        stride = s.upsample_rates[i]
        return randn() * math.sqrt(stride / (shape[0] * shape[2]))
    std = 1.0 / math.sqrt(math.prod(shape[1:]))
    if name.endswith(_RESIDUAL_OUT):
        std /= math.sqrt(2 * _num_layers(name, s))
    if ".code2wav_bigvgan_model.resblocks." in name and ".convs2." in name:
        std *= BIGVGAN_RESIDUAL_GAIN  # AMP residual branches: keep the level flat over stages
    return randn() * std


def _dumps(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def _torch_dtype(name: str):  # noqa: ANN202
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def _shard(names: list[str], nbytes: dict[str, int], n: int) -> list[list[str]]:
    """Contiguous groups of ``names`` (sorted) of about equal bytes; no group is empty."""
    n = max(1, min(n, len(names)))
    total = sum(nbytes.values())
    groups: list[list[str]] = [[]]
    acc = 0
    for i, name in enumerate(names):
        left_names = len(names) - i
        left_groups = n - len(groups)
        need_new = groups[-1] and (acc >= total * len(groups) / n or left_names <= left_groups)
        if need_new and len(groups) < n:
            groups.append([])
        groups[-1].append(name)
        acc += nbytes[name]
    return groups


def _deterministic_torch_save(obj: Any) -> bytes:
    """``torch.save`` bytes with the random ``.data/serialization_id`` record fixed (CRC fixed)."""
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    raw = bytearray(buf.getvalue())
    zf = zipfile.ZipFile(io.BytesIO(bytes(raw)))
    for info in zf.infolist():
        if not info.filename.endswith(".data/serialization_id"):
            continue
        old = zf.read(info)
        new = b"0" * len(old)
        crc = zlib.crc32(new)
        h = info.header_offset
        name_len, extra_len = struct.unpack_from("<HH", raw, h + 26)
        data_at = h + 30 + name_len + extra_len
        raw[data_at : data_at + len(old)] = new
        struct.pack_into("<I", raw, h + 14, crc)
        pos = zf.start_dir
        while raw[pos : pos + 4] == b"PK\x01\x02":
            n, e, c = struct.unpack_from("<HHH", raw, pos + 28)
            if raw[pos + 46 : pos + 46 + n].decode() == info.filename:
                struct.pack_into("<I", raw, pos + 16, crc)
            pos += 46 + n + e + c
    out = bytes(raw)
    if zipfile.ZipFile(io.BytesIO(out)).testzip() is not None:
        raise AssertionError("spk_dict.pt zip is corrupt after fixing serialization_id")
    return out


def speaker_dict(sizes: QwenOmniSizes, ids: QwenOmniTokenIds, seed: int) -> dict[str, dict]:
    """``spk_dict.pt`` contents: per speaker ``cond`` [1, enc_emb_dim] (the DiT's speaker
    embedding), ``ref_mel`` [1, ref_frames, mel_dim] (log-mel fed to the DiT's ECAPA encoder) and
    ``bos_token`` (int: the thinker-vocab id whose embedding opens the talker's text track)."""
    import torch

    out: dict[str, dict] = {}
    for name in sizes.speakers:
        g = torch.Generator().manual_seed(zlib.crc32(f"{seed}/spk/{name}".encode()))
        cond = torch.randn(1, sizes.enc_emb_dim, generator=g)
        ref_mel = -5.0 + 1.5 * torch.randn(1, sizes.ref_mel_frames, sizes.mel_dim, generator=g)
        out[name] = {"cond": cond, "ref_mel": ref_mel, "bos_token": ids.speaker_bos[name]}
    return out


# ----------------------------------------------------------------------------- writer


def write_qwen_omni(root: Path, sizes: QwenOmniSizes, seed: int = 0) -> Path:
    """Write the whole folder (see module docstring); returns ``root``."""
    from safetensors.torch import save_file

    sizes.validate()
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    tok_files, ids = _tokenizer_files(sizes)
    for rel, text in tok_files.items():
        (root / rel).write_text(text, encoding="utf-8")
    (root / "config.json").write_text(_dumps(config_dict(sizes, ids)), encoding="utf-8")
    (root / "generation_config.json").write_text(
        _dumps(generation_config_dict(ids)), encoding="utf-8"
    )

    dtype = _torch_dtype(sizes.dtype)
    specs = tensor_specs(sizes, ids)
    names = sorted(specs)
    itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}[sizes.dtype]
    nbytes = {k: math.prod(specs[k]) * itemsize for k in names}
    groups = _shard(names, nbytes, sizes.num_shards)
    for old in root.glob("model-*-of-*.safetensors"):
        old.unlink()
    weight_map: dict[str, str] = {}
    for i, group in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {k: _draw(seed, k, specs[k], sizes).to(dtype).contiguous() for k in group}
        save_file(tensors, str(root / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in group})
    index = {"metadata": {"total_size": sum(nbytes.values())}, "weight_map": weight_map}
    (root / "model.safetensors.index.json").write_text(_dumps(index), encoding="utf-8")
    (root / "spk_dict.pt").write_bytes(_deterministic_torch_save(speaker_dict(sizes, ids, seed)))
    return root


def write_tiny_qwen_omni(root: Path, seed: int = 0, **overrides: Any) -> Path:
    """Write a tiny checkpoint folder (``TINY_SIZES`` with ``overrides`` of its fields)."""
    fields = {f.name for f in dataclasses.fields(QwenOmniSizes)}
    unknown = set(overrides) - fields
    if unknown:
        raise TypeError(f"unknown QwenOmniSizes fields: {sorted(unknown)}")
    return write_qwen_omni(root, dataclasses.replace(TINY_SIZES, **overrides), seed=seed)


FOLDER_VARIANTS: tuple[str, ...] = ()
"""``omnistep weights qwen2_5_omni`` writes one kind of folder (``write_folder``)."""


def write_folder(folder: Path, variant: str | None = None, seed: int = 0) -> Path:
    """``omnistep weights qwen2_5_omni DIR``: :func:`write_tiny_qwen_omni` (``variant`` is
    unused: one kind). Returns ``folder``."""
    return write_tiny_qwen_omni(Path(folder), seed=seed)


# ----------------------------------------------------------------------------- reading back


@dataclass(frozen=True)
class QwenOmniInfo:
    """What tests need to know about a written folder, read back from its official files."""

    root: Path
    config: dict[str, Any]
    ids: QwenOmniTokenIds
    weight_map: dict[str, str]
    speakers: tuple[str, ...]

    @property
    def talker_eos_token_ids(self) -> list[int]:
        return self.ids.talker_eos_token_ids

    @property
    def mel_frames_per_code(self) -> int:
        return int(self.config["token2wav_config"]["dit_config"]["repeats"])

    @property
    def samples_per_mel_frame(self) -> int:
        return math.prod(self.config["token2wav_config"]["bigvgan_config"]["upsample_rates"])

    @property
    def samples_per_code(self) -> int:
        """Waveform samples per codec token: repeats (2) x prod(upsample_rates) (240) = 480."""
        return self.mel_frames_per_code * self.samples_per_mel_frame


def read_info(root: Path) -> QwenOmniInfo:
    root = Path(root)
    cfg = json.loads((root / "config.json").read_text(encoding="utf-8"))
    th, tk = cfg["thinker_config"], cfg["talker_config"]
    added = json.loads((root / "added_tokens.json").read_text(encoding="utf-8"))
    vocab = json.loads((root / "vocab.json").read_text(encoding="utf-8"))
    import torch

    spk = torch.load(root / "spk_dict.pt", weights_only=True)
    ids = QwenOmniTokenIds(
        endoftext=added["<|endoftext|>"],
        im_start=added["<|im_start|>"],
        im_end=added["<|im_end|>"],
        audio=th["audio_token_index"],
        audio_bos=th["audio_start_token_id"],
        audio_eos=th["audio_end_token_id"],
        vision_bos=th["vision_start_token_id"],
        vision_eos=th["vision_end_token_id"],
        vision_pad=added["<|vision_pad|>"],
        image=th["image_token_index"],
        video=th["video_token_index"],
        user=vocab["user"],
        tts_text_pad=tk["tts_text_pad_token_id"],
        tts_text_start=tk["tts_text_start_token_id"],
        tts_text_end=tk["tts_text_end_token_id"],
        text_vocab=th["text_config"]["vocab_size"],
        speaker_bos={k: int(v["bos_token"]) for k, v in spk.items()},
        codec_pad=tk["tts_codec_pad_token_id"],
        codec_bos=tk["tts_codec_start_token_id"],
        codec_eos=tk["tts_codec_end_token_id"],
        codec_mask=tk["tts_codec_mask_token_id"],
        codec_vocab=tk["vocab_size"],
    )
    index = json.loads((root / "model.safetensors.index.json").read_text(encoding="utf-8"))
    return QwenOmniInfo(
        root=root,
        config=cfg,
        ids=ids,
        weight_map=index["weight_map"],
        speakers=tuple(spk),
    )
