"""Seeded random Qwen3-Omni checkpoints in the published layout of
Qwen/Qwen3-Omni-30B-A3B-{Instruct,Thinking,Captioner}, written by transformers' own classes.

``write_tiny_qwen3_omni(root)`` builds ``Qwen3OmniMoeForConditionalGeneration`` (transformers
``models/qwen3_omni_moe``) from a tiny ``Qwen3OmniMoeConfig``, redraws every tensor from a
seeded generator (``_redraw``: transformers' init leaves SnakeBeta at 0 and norms at 1, which
would hide mistakes) and writes it with ``save_pretrained``, which writes the official
tensor names (per-expert ``mlp.experts.{e}.{gate,up,down}_proj.weight``, the thinker under
``thinker.model.*`` / ``thinker.audio_tower.*`` / ``thinker.visual.*``)::

    root/
      config.json                      model_type qwen3_omni_moe: thinker_config (text_config,
                                       audio_config, vision_config), talker_config
                                       (text_config, code_predictor_config), code2wav_config
      generation_config.json           as save_pretrained writes it
      model-0000{i}-of-0000{n}.safetensors, model.safetensors.index.json   (sharded as published)
      vocab.json, merges.txt, tokenizer_config.json, chat_template.json

Token ids.  The tokenizer is ``omnistep.text.tiny_bpe`` (E tokens) followed by Qwen3-Omni's
added tokens in their published order (``ADDED_TOKENS``: ``<|endoftext|>`` is 151643 in the
published vocabulary, here E); every id in the config (``im_start_token_id``,
``tts_pad_token_id``, ``audio_token_id``, ``user_token_id``, ...) is the tiny vocabulary's id
of the same token. The talker's codec vocabulary is ``codebook_size`` codes followed by its
control ids (``CODEC_CONTROL``, published order pad, bos, eos, ..., nothink, think_bos,
think_eos) and the speaker ids.

Not written: ``preprocessor_config.json`` (the encoders then read
``encoders.PREPROCESSOR_DEFAULTS``, the published values).

Imports: the standard library, ``omnistep.text``; torch and transformers inside functions
(writing a checkpoint needs them; reading one does not).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omnistep.text.tiny_bpe import bpe_vocab_and_merges

ADDED_TOKENS: tuple[str, ...] = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>",
    "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>",
    "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
    "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
    "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
    "<think>", "</think>", "<|audio_start|>", "<|audio_end|>", "<tts_pad>", "<tts_text_bos>",
    "<tts_text_eod>", "<tts_text_bos_single>", "<|audio_pad|>",
)  # fmt: skip
"""Qwen3-Omni's added tokens, published ids 151643.. in this order (``tts_pad`` 151671,
``tts_text_bos`` 151672, ``tts_text_eod`` 151673 as ``Qwen3OmniMoeConfig``'s defaults)."""
NOT_SPECIAL = frozenset(
    {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"}
)
"""Added tokens that are not ``special`` (they may appear in decoded text)."""

CODEC_CONTROL: tuple[str, ...] = (
    "pad", "bos", "eos", "reserved_0", "reserved_1", "reserved_2", "reserved_3", "nothink",
    "think_bos", "think_eos",
)  # fmt: skip
"""The talker's control ids after the codes, in published order (pad 2148, bos 2149, eos 2150,
nothink 2155, think_bos 2156, think_eos 2157 with 2048 codes + 100 spare)."""
SPEAKERS: tuple[str, ...] = ("chelsie", "ethan", "aiden")
"""Voices of the published talker config's ``speaker_id`` table."""

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] == 'audio' %}{{ '<|audio_start|><|audio_pad|><|audio_end|>' }}"
    "{% elif part['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'video' %}{{ '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""A ChatML template placing text, audio, image and video parts as the published one does
(one ``<|audio_start|><|audio_pad|><|audio_end|>`` per audio part,
``<|vision_start|><|image_pad|><|vision_end|>`` per image, ``<|video_pad|>`` per video); the
published one also handles system defaults, tools and thinking."""

THINKING_CHAT_TEMPLATE = CHAT_TEMPLATE.replace(
    "'<|im_start|>assistant\\n'", "'<|im_start|>assistant\\n<think>\\n'"
)
"""The Thinking checkpoint's generation prompt opens the reasoning (``<think>\\n``), as the
Qwen3 thinking models' templates do."""


@dataclass(frozen=True)
class Qwen3OmniSizes:
    """Widths of a tiny checkpoint (published values in the field docs)."""

    hidden: int = 32
    """Thinker text width (2048)."""
    layers: int = 2
    """Thinker text layers (48)."""
    heads: int = 4
    """Thinker query heads (32); KV heads are ``heads // 2`` (4 published)."""
    head_dim: int = 8
    """(128); MRoPE sections split ``head_dim // 2`` as (24, 20, 20) does 64."""
    experts: int = 8
    """Routed experts per MoE layer (128)."""
    top_k: int = 2
    """Experts per token (8)."""
    moe_intermediate: int = 16
    """Expert width (768)."""
    talker_hidden: int = 32
    """(1024)."""
    talker_layers: int = 2
    """(20)."""
    shared_expert_intermediate: int = 24
    """The talker's gated shared expert width."""
    codebook_size: int = 64
    """Codes per codebook (2048)."""
    num_code_groups: int = 16
    """Codebooks per frame (16)."""
    code2wav_hidden: int = 32
    """(1024)."""
    code2wav_layers: int = 2
    """(8)."""
    sliding_window: int = 8
    """code2wav attention window in frames (72)."""
    decoder_dim: int = 32
    """code2wav conv decoder width (1536); must divide by 16 (4 upsample rates)."""


TINY_SIZES = Qwen3OmniSizes()


@dataclass(frozen=True)
class Qwen3OmniTokenIds:
    """Ids of the tiny vocabulary the config refers to."""

    endoftext: int
    im_start: int
    im_end: int
    tts_pad: int
    tts_bos: int
    tts_eos: int
    audio_start: int
    audio_pad: int
    image_pad: int
    video_pad: int
    vision_start: int
    system: int
    user: int
    assistant: int
    vocab_size: int
    """Rows of the thinker's embedding / lm_head (the published 152064 is past the last
    added token too)."""


def tokenizer_files(template: str = CHAT_TEMPLATE) -> tuple[dict[str, str], Qwen3OmniTokenIds]:
    """``vocab.json``, ``merges.txt``, ``tokenizer_config.json``, ``chat_template.json``
    texts (with chat ``template``) and the ids they give."""
    vocab, merges = bpe_vocab_and_merges()
    e = len(vocab)
    added = {tok: e + i for i, tok in enumerate(ADDED_TOKENS)}
    ids = Qwen3OmniTokenIds(
        endoftext=added["<|endoftext|>"],
        im_start=added["<|im_start|>"],
        im_end=added["<|im_end|>"],
        tts_pad=added["<tts_pad>"],
        tts_bos=added["<tts_text_bos>"],
        tts_eos=added["<tts_text_eod>"],
        audio_start=added["<|audio_start|>"],
        audio_pad=added["<|audio_pad|>"],
        image_pad=added["<|image_pad|>"],
        video_pad=added["<|video_pad|>"],
        vision_start=added["<|vision_start|>"],
        system=vocab["system"],
        user=vocab["user"],
        assistant=vocab["assistant"],
        vocab_size=e + len(ADDED_TOKENS) + 7,
    )
    decoder = {
        str(i): {
            "content": tok,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": tok not in NOT_SPECIAL,
        }
        for tok, i in added.items()
    }
    tokenizer_config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": decoder,
        "additional_special_tokens": [t for t in ADDED_TOKENS[1:] if t not in NOT_SPECIAL],
        "bos_token": None,
        "chat_template": template,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 65536,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    files = {
        "vocab.json": json.dumps(vocab, ensure_ascii=False),
        "merges.txt": "".join(f"{a} {b}\n" for a, b in merges),
        "tokenizer_config.json": _dumps(tokenizer_config),
        "chat_template.json": _dumps({"chat_template": template}),
    }
    return files, ids


def _rope(sizes: Qwen3OmniSizes) -> dict[str, Any]:
    """Interleaved MRoPE over ``head_dim // 2`` frequencies, split (t, h, w) as the
    published (24, 20, 20) of 64: here (half - 2 s, s, s)."""
    half = sizes.head_dim // 2
    side = half * 20 // 64 or 1
    return {
        "rope_type": "default",
        "rope_theta": 1000000.0,
        "mrope_section": [half - 2 * side, side, side],
        "interleaved": True,
        "mrope_interleaved": True,
    }


def codec_ids(sizes: Qwen3OmniSizes) -> dict[str, int]:
    """The talker's control and speaker ids: ``CODEC_CONTROL`` then ``SPEAKERS`` after the
    ``codebook_size`` codes (published: 100 spare ids after 2048 codes; here 4)."""
    first = sizes.codebook_size + 4
    ids = {name: first + i for i, name in enumerate(CODEC_CONTROL)}
    ids.update({name: first + len(CODEC_CONTROL) + i for i, name in enumerate(SPEAKERS)})
    return ids


def config_dict(sizes: Qwen3OmniSizes, ids: Qwen3OmniTokenIds) -> dict[str, Any]:
    """The ``Qwen3OmniMoeConfig`` keyword arguments (nested as the published config.json)."""
    s = sizes
    text = {
        "vocab_size": ids.vocab_size,
        "hidden_size": s.hidden,
        "intermediate_size": 2 * s.hidden,
        "num_hidden_layers": s.layers,
        "num_attention_heads": s.heads,
        "num_key_value_heads": s.heads // 2,
        "head_dim": s.head_dim,
        "moe_intermediate_size": s.moe_intermediate,
        "num_experts": s.experts,
        "num_experts_per_tok": s.top_k,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 65536,
        "rope_parameters": _rope(s),
    }
    codec = codec_ids(s)
    talker_text = dict(
        text,
        # transformers' generate suppresses the top 1024 talker ids but EOS (the control
        # block): the vocabulary must reach past it, as the published 3072 does
        vocab_size=max(max(codec.values()) + 1, s.codebook_size + SUPPRESSED_TOP_IDS),
        hidden_size=s.talker_hidden,
        intermediate_size=2 * s.talker_hidden,
        num_hidden_layers=s.talker_layers,
        norm_topk_prob=False,
        shared_expert_intermediate_size=s.shared_expert_intermediate,
    )
    return {
        "thinker_config": {
            "text_config": text,
            "audio_config": {
                "d_model": 16, "encoder_layers": 1, "encoder_attention_heads": 2,
                "encoder_ffn_dim": 32, "output_dim": s.hidden, "downsample_hidden_size": 8,
            },
            "vision_config": {
                "depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2,
                "out_hidden_size": s.hidden, "deepstack_visual_indexes": [0],
                "num_position_embeddings": 64,
            },
            "audio_token_id": ids.audio_pad,
            "image_token_id": ids.image_pad,
            "video_token_id": ids.video_pad,
            "audio_start_token_id": ids.audio_start,
            "vision_start_token_id": ids.vision_start,
            "user_token_id": ids.user,
        },
        "talker_config": {
            "text_config": talker_text,
            "code_predictor_config": {
                "vocab_size": s.codebook_size, "hidden_size": s.talker_hidden,
                "intermediate_size": 2 * s.talker_hidden, "num_hidden_layers": 1,
                "num_attention_heads": s.heads, "num_key_value_heads": s.heads // 2,
                "head_dim": s.head_dim, "num_code_groups": s.num_code_groups,
            },
            "num_code_groups": s.num_code_groups,
            "thinker_hidden_size": s.hidden,
            "accept_hidden_layer": s.layers - 1,
            "codec_pad_id": codec["pad"],
            "codec_bos_id": codec["bos"],
            "codec_eos_token_id": codec["eos"],
            "codec_nothink_id": codec["nothink"],
            "codec_think_bos_id": codec["think_bos"],
            "codec_think_eos_id": codec["think_eos"],
            "speaker_id": {name: codec[name] for name in SPEAKERS},
            "spatial_merge_size": 2,
            "audio_token_id": ids.audio_pad,
            "image_token_id": ids.image_pad,
            "video_token_id": ids.video_pad,
            "vision_start_token_id": ids.vision_start,
            "audio_start_token_id": ids.audio_start,
        },
        "code2wav_config": {
            "codebook_size": s.codebook_size, "hidden_size": s.code2wav_hidden,
            "num_attention_heads": 4, "num_key_value_heads": 4,
            "intermediate_size": 2 * s.code2wav_hidden, "num_hidden_layers": s.code2wav_layers,
            "sliding_window": s.sliding_window, "num_quantizers": s.num_code_groups,
            "decoder_dim": s.decoder_dim, "upsample_rates": [8, 5, 4, 3],
            "upsampling_ratios": [2, 2],
        },
        "im_start_token_id": ids.im_start,
        "im_end_token_id": ids.im_end,
        "tts_pad_token_id": ids.tts_pad,
        "tts_bos_token_id": ids.tts_bos,
        "tts_eos_token_id": ids.tts_eos,
        "system_token_id": ids.system,
        "user_token_id": ids.user,
        "assistant_token_id": ids.assistant,
    }  # fmt: skip


SUPPRESSED_TOP_IDS = 1024
"""``Qwen3OmniMoeForConditionalGeneration.generate`` suppresses talker ids ``[vocab - 1024,
vocab)`` except the codec EOS."""

RESIDUAL_GAIN = 0.3
"""Factor on the 1x1 conv closing each code2wav residual unit (after the draw)."""
OUTPUT_GAIN = 0.15
"""Factor on code2wav's output conv (after the draw)."""


def _redraw(model: Any, seed: int) -> None:
    """Every parameter redrawn from ``torch.Generator().manual_seed(seed)`` in name order:
    matrices and embeddings ``N(0, 1 / fan_in)``, norm weights ``1 + N(0, 0.1^2)``, other
    vectors (biases, LayerScale, SnakeBeta's log alpha/beta) ``N(0, 0.1^2)``; code2wav's
    residual and output convs then scaled (``_gain``)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if p.dim() >= 2:
                p.copy_(noise / p[0].numel() ** 0.5)
            elif "norm" in name or "ln_" in name:
                p.copy_(1.0 + 0.1 * noise)
            else:
                p.copy_(0.1 * noise)
            p.mul_(_gain(name, model.config.code2wav_config))


def _gain(name: str, code2wav: Any) -> float:
    """A factor on code2wav's residual branches and output conv, so that a random decoder's
    wave stays mostly inside the [-1, 1] clamp (as a trained one does) and float32 rounding
    is not amplified past the parity tolerances."""
    last = f"code2wav.decoder.{len(code2wav.upsample_rates) + 2}.conv."
    if name.startswith(last):
        return OUTPUT_GAIN
    if name.startswith("code2wav.decoder.") and ".conv2." in name:
        return RESIDUAL_GAIN
    return 1.0


def write_tiny_qwen3_omni(
    root: str | Path,
    seed: int = 0,
    sizes: Qwen3OmniSizes = TINY_SIZES,
    thinking: bool = False,
    variant: str | None = None,
) -> Path:
    """Write a seeded tiny Qwen3-Omni folder (module docstring) under ``root`` (created) in
    float32, sharded in pieces of about 200 kB as the published checkpoint is sharded; about
    two seconds. ``variant`` (``FOLDER_VARIANTS``; ``thinking=True`` is ``"thinking"``):
    ``instruct`` (thinker, talker, code2wav), ``thinking`` (``enable_audio_output`` false, so
    no talker or code2wav tensors; the chat template opens ``<think>``) or ``captioner``
    (``enable_audio_output`` false, the plain template). Returns ``root``.

    Raises:
        ValueError: an unknown variant.
    """
    variant = variant or ("thinking" if thinking else "instruct")
    if variant not in FOLDER_VARIANTS:
        raise ValueError(f"variant must be one of {', '.join(FOLDER_VARIANTS)}, got {variant!r}")
    thinking = variant == "thinking"
    import torch
    from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    files, ids = tokenizer_files(THINKING_CHAT_TEMPLATE if thinking else CHAT_TEMPLATE)
    audio_out = variant == "instruct"
    config = Qwen3OmniMoeConfig(**config_dict(sizes, ids), enable_audio_output=audio_out)
    with torch.device("cpu"):
        model = Qwen3OmniMoeForConditionalGeneration(config)
    _redraw(model, seed)
    model.save_pretrained(root, max_shard_size="200KB")
    for name, text in files.items():
        (root / name).write_text(text, encoding="utf-8")
    return root


FOLDER_VARIANTS: tuple[str, ...] = ("instruct", "thinking", "captioner")
"""``omnistep weights qwen3_omni DIR [--variant]``: the Instruct layout (thinker, talker,
code2wav), the Thinking one (thinker only, reasoning template) or the Captioner one (thinker
only, plain template: audio in, text out)."""


def write_folder(folder: Path, variant: str | None = None, seed: int = 0) -> Path:
    """``omnistep weights qwen3_omni DIR``: :func:`write_tiny_qwen3_omni` of ``variant``
    (``FOLDER_VARIANTS``; None: instruct). Returns ``folder``.

    Raises:
        ValueError: an unknown variant.
    """
    if variant not in (None, *FOLDER_VARIANTS):
        raise ValueError(f"variant must be one of {', '.join(FOLDER_VARIANTS)}, got {variant!r}")
    return write_tiny_qwen3_omni(folder, seed, variant=variant)


def _dumps(obj: Any) -> str:
    return json.dumps(obj, indent=2, ensure_ascii=False) + "\n"
