"""Reference-side functions for the Qwen3-TTS talker parity tests (run in the reference
subprocess through ``tests.qwen3_tts_ref.env.call_reference``; they import ``qwen_tts``).

``generate`` runs upstream ``Qwen3TTSForConditionalGeneration.generate`` (qwen_tts 0.1.1,
core/models/modeling_qwen3_tts.py) on a checkpoint folder's talker weights and returns its codes
together with the raw logits it sampled from: the talker's ``codec_head`` output of every forward
(prefill + each decode step) and the code predictor's ``lm_head[j]`` output of every sub-step,
captured by forward hooks.

The checkpoints are ``omnistep/models/qwen3_tts/tiny.py``'s tiny published folders; only the
talker's tensors (``talker.*``) are loaded, in float32.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _load(root: str):
    import torch
    from qwen_tts.core.models import Qwen3TTSConfig, Qwen3TTSForConditionalGeneration
    from safetensors.torch import load_file

    config = Qwen3TTSConfig.from_pretrained(str(root))
    config._attn_implementation = "eager"
    config.talker_config._attn_implementation = "eager"
    config.talker_config.code_predictor_config._attn_implementation = "eager"
    model = Qwen3TTSForConditionalGeneration(config).float().eval()
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
