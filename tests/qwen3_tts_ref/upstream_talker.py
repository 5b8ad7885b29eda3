"""Reference-side functions for the Qwen3-TTS talker parity tests (run in the reference
subprocess through ``tests.qwen3_tts_ref.env.call_reference``; they import ``qwen_tts``).

``generate`` runs upstream ``Qwen3TTSForConditionalGeneration.generate`` (qwen_tts 0.1.1,
core/models/modeling_qwen3_tts.py) on a checkpoint folder's talker weights and returns its codes
together with the raw logits it sampled from: the talker's ``codec_head`` output of every forward
(prefill + each decode step) and the code predictor's ``lm_head[j]`` output of every sub-step,
captured by forward hooks.

``write_tiny_talker`` writes a tiny random checkpoint (``config.json``, ``generation_config.json``,
``model.safetensors`` with the talker's tensors under their official names), initialised by
upstream's own ``post_init``: a development stand-in for ``tests/qwen3_tts_ref/assets.py``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TINY_TALKER: dict[str, Any] = {
    "vocab_size": 3072,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000,
    "rope_scaling": {"interleaved": True, "mrope_section": [2, 3, 3], "rope_type": "default"},
    "attention_bias": False,
    "num_code_groups": 16,
    "text_hidden_size": 48,
    "text_vocab_size": 151936,
    "codec_eos_token_id": 2150,
    "codec_think_id": 2154,
    "codec_nothink_id": 2155,
    "codec_think_bos_id": 2156,
    "codec_think_eos_id": 2157,
    "codec_pad_id": 2148,
    "codec_bos_id": 2149,
    "codec_language_id": {
        "chinese": 2055,
        "english": 2050,
        "german": 2053,
        "beijing_dialect": 2074,
        "sichuan_dialect": 2062,
    },
    "spk_id": {"vivian": 3065, "ryan": 3061, "eric": 2875},
    "spk_is_dialect": {"vivian": False, "ryan": False, "eric": "sichuan_dialect"},
    "code_predictor_config": {
        "vocab_size": 2048,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "hidden_act": "silu",
        "max_position_embeddings": 64,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000,
        "num_code_groups": 16,
    },
}

TINY_GENERATION_CONFIG = {
    "do_sample": True,
    "repetition_penalty": 1.05,
    "temperature": 0.9,
    "top_k": 50,
    "top_p": 1.0,
    "subtalker_dosample": True,
    "subtalker_temperature": 0.9,
    "subtalker_top_k": 50,
    "subtalker_top_p": 1.0,
    "max_new_tokens": 8192,
}


def _model_class():
    from qwen_tts.core.models.configuration_qwen3_tts import Qwen3TTSConfig
    from qwen_tts.core.models.modeling_qwen3_tts import Qwen3TTSForConditionalGeneration

    return Qwen3TTSConfig, Qwen3TTSForConditionalGeneration


def write_tiny_talker(root: str, variant: str = "custom_voice", seed: int = 0) -> str:
    """Write a tiny random checkpoint of ``variant`` (custom_voice | voice_design) to ``root``."""
    import torch
    from safetensors.torch import save_file

    config_cls, model_cls = _model_class()
    raw = {
        "model_type": "qwen3_tts",
        "tts_model_type": variant,
        "tts_model_size": "0b6",
        "tokenizer_type": "qwen3_tts_tokenizer_12hz",
        "talker_config": TINY_TALKER,
        "speaker_encoder_config": {"enc_dim": 64},
    }
    torch.manual_seed(seed)
    model = model_cls(config_cls(**raw)).float().eval()
    root_path = Path(root)
    root_path.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k.startswith("talker.")}
    save_file(state, str(root_path / "model.safetensors"))
    (root_path / "config.json").write_text(json.dumps(raw, indent=2))
    (root_path / "generation_config.json").write_text(json.dumps(TINY_GENERATION_CONFIG, indent=2))
    return str(root_path)


def _load(root: str):
    import torch
    from safetensors.torch import load_file

    config_cls, model_cls = _model_class()
    raw = json.loads((Path(root) / "config.json").read_text())
    config = config_cls(**raw)
    config._attn_implementation = "eager"
    config.talker_config._attn_implementation = "eager"
    config.talker_config.code_predictor_config._attn_implementation = "eager"
    model = model_cls(config).float().eval()
    state = {k: v.float() for k, v in load_file(str(Path(root) / "model.safetensors")).items()}
    talker = {k: v for k, v in state.items() if k.startswith("talker.")}
    missing, unexpected = model.load_state_dict(talker, strict=False)
    missing = [k for k in missing if k.startswith("talker.")]
    if missing or unexpected:
        raise RuntimeError(f"missing {missing[:5]}, unexpected {unexpected[:5]}")
    torch.set_grad_enabled(False)
    return model


def generate(
    root: str,
    input_ids: list[int],
    language: str = "auto",
    speaker: str | None = None,
    instruct_ids: list[int] | None = None,
    non_streaming_mode: bool = False,
    max_new_tokens: int = 33,
    greedy: bool = True,
    seed: int = 0,
) -> dict[str, Any]:
    """Upstream ``generate`` for one request, with the logits it sampled from.

    Args:
        input_ids: the tokenised ``<|im_start|>assistant\\n{text}<|im_end|>\\n<|im_start|>
            assistant\\n`` (3 role ids, the text, a 5-id tail).
        instruct_ids: the tokenised ``<|im_start|>user\\n{instruct}<|im_end|>\\n`` or None.

    Returns:
        ``codes`` ``[T, 16]`` int64 (upstream's output: frames before its EOS),
        ``talker_logits`` ``[F, V]`` float32 (one row per talker forward: the prefill's last
        row, then each decode step's), ``predictor_logits`` ``[P, 15, V_pred]`` float32 (one
        ``[15, V_pred]`` block per predictor run, i.e. per frame whose codebooks 1..15 were
        predicted), all numpy.
    """
    import torch

    model = _load(root)
    talker_rows: list[torch.Tensor] = []
    predictor_rows: list[tuple[int, torch.Tensor]] = []

    def talker_hook(_module, _inputs, output):
        talker_rows.append(output[0, -1].detach().clone())

    model.talker.codec_head.register_forward_hook(talker_hook)
    for j, head in enumerate(model.talker.code_predictor.lm_head):

        def hook(_module, _inputs, output, j=j):
            predictor_rows.append((j, output[0, -1].detach().clone()))

        head.register_forward_hook(hook)
    torch.manual_seed(seed)
    ids = torch.tensor([input_ids], dtype=torch.long)
    instruct = None if instruct_ids is None else [torch.tensor([instruct_ids], dtype=torch.long)]
    codes, _hidden = model.generate(
        input_ids=[ids],
        instruct_ids=instruct,
        languages=[language],
        speakers=[speaker],
        non_streaming_mode=non_streaming_mode,
        max_new_tokens=max_new_tokens,
        do_sample=not greedy,
        subtalker_dosample=not greedy,
    )
    blocks = []
    for start in range(0, len(predictor_rows), 15):
        block = predictor_rows[start : start + 15]
        if [j for j, _ in block] != list(range(15)):
            raise RuntimeError("predictor heads did not run in order 0..14")
        blocks.append(torch.stack([row for _, row in block]))
    return {
        "codes": codes[0].cpu().numpy(),
        "talker_logits": torch.stack(talker_rows).float().numpy(),
        "predictor_logits": torch.stack(blocks).float().numpy(),
    }


def mrope_vs_rope(head_dim: int, mrope_section: list[int], theta: float, positions: list[int]):
    """Upstream's interleaved mRoPE (``Qwen3TTSTalkerRotaryEmbedding`` +
    ``apply_multimodal_rotary_pos_emb(..., mrope_interleaved=True)``) applied to random q/k with
    the three position components equal, and upstream's plain ``apply_rotary_pos_emb`` with the
    1-D cos/sin of the same positions: returns both results (numpy), for a bitwise comparison."""
    import torch
    from qwen_tts.core.models.configuration_qwen3_tts import Qwen3TTSTalkerConfig
    from qwen_tts.core.models.modeling_qwen3_tts import (
        Qwen3TTSTalkerRotaryEmbedding,
        apply_multimodal_rotary_pos_emb,
    )

    config = Qwen3TTSTalkerConfig(
        hidden_size=head_dim * 2,
        num_attention_heads=2,
        head_dim=head_dim,
        rope_theta=theta,
        rope_scaling={"interleaved": True, "mrope_section": mrope_section, "rope_type": "default"},
    )
    rotary = Qwen3TTSTalkerRotaryEmbedding(config)
    pos = torch.tensor([positions], dtype=torch.long)
    q = torch.randn(1, 2, len(positions), head_dim, generator=torch.Generator().manual_seed(0))
    k = torch.randn(1, 2, len(positions), head_dim, generator=torch.Generator().manual_seed(1))
    cos3, sin3 = rotary(q, pos[None].expand(3, -1, -1))
    q_m, k_m = apply_multimodal_rotary_pos_emb(q, k, cos3, sin3, mrope_section, True)
    return {
        "q": q.numpy(),
        "k": k.numpy(),
        "q_mrope": q_m.numpy(),
        "k_mrope": k_m.numpy(),
        "cos_1d": cos3[0].numpy(),
        "sin_1d": sin3[0].numpy(),
    }


def run_many(calls: list[tuple[str, dict[str, Any]]]) -> list[Any]:
    """Run several functions of this module in one reference subprocess (one import of
    ``qwen_tts``): ``[(function name, kwargs), ...]`` -> their results, in order."""
    return [globals()[name](**kwargs) for name, kwargs in calls]
