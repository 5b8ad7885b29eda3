"""omnistep.layers.code_predictor configured as Qwen3-Omni's talker code predictor: teacher-forced
logits against transformers' ``Qwen3OmniMoeTalkerCodePredictorModelForConditionalGeneration`` on
the same random weights (Qwen3-TTS's configuration is checked against qwen-tts in
tests/test_qwen3_tts_talker.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import (
    Qwen3OmniMoeTalkerCodePredictorConfig,
)
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeTalkerCodePredictorModelForConditionalGeneration,
)

from omnistep.layers.code_predictor import CodePredictor, CodePredictorConfig

GROUPS, VOCAB, HIDDEN = 6, 40, 64


def _reference() -> Qwen3OmniMoeTalkerCodePredictorModelForConditionalGeneration:
    config = Qwen3OmniMoeTalkerCodePredictorConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_code_groups=GROUPS,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    model = Qwen3OmniMoeTalkerCodePredictorModelForConditionalGeneration(config).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(1.0)
    return model


def _sections(model) -> SimpleNamespace:
    """What a Qwen3-Omni loader would parse from ``code_predictor_config``."""
    c = model.config
    fields = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    more = ("num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings")
    rest = ("hidden_act", "attention_bias", "vocab_size", "num_code_groups")
    values = {name: getattr(c, name) for name in fields + more + rest}
    return SimpleNamespace(**values, rope_theta=c.rope_parameters["rope_theta"])


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_matches_transformers_qwen3_omni_code_predictor(batch_invariant):
    reference = _reference()
    config = CodePredictorConfig.of(_sections(reference))
    ours = CodePredictor(config, HIDDEN, torch.device("cpu"), torch.float32, batch_invariant)
    state = {f"talker.code_predictor.{k}": v for k, v in reference.state_dict().items()}
    targets = ours.weight_tensors()
    assert ours.proj_weight is None  # equal widths: no small_to_mtp_projection
    assert sorted(targets) == sorted(k for k in state if "rotary_emb" not in k)
    with torch.no_grad():
        for name, target in targets.items():
            target.copy_(state[name])

    generator = torch.Generator().manual_seed(1)
    batch = 3
    talker_hidden = torch.randn(batch, HIDDEN, generator=generator)
    first_embed = torch.randn(batch, HIDDEN, generator=generator)  # the talker's code-0 row
    codes = torch.randint(0, VOCAB, (batch, GROUPS - 1), generator=generator)
    with torch.no_grad():
        got = ours.run(talker_hidden, first_embed, lambda j, _logits: codes[:, j])
        tables = reference.model.codec_embedding
        rows = [talker_hidden, first_embed] + [tables[j](codes[:, j]) for j in range(GROUPS - 2)]
        hidden = reference.model(inputs_embeds=torch.stack(rows, dim=1)).last_hidden_state
        expected = torch.stack(
            [reference.lm_head[j](hidden[:, j + 1]) for j in range(GROUPS - 1)], dim=1
        )
    assert got.shape == (batch, GROUPS - 1, VOCAB)
    assert float(expected.abs().mean()) > 0.1
    assert torch.allclose(got, expected, atol=1e-5, rtol=0)


def test_config_checks():
    reference = _reference()
    sections = _sections(reference)
    sections.attention_bias = True
    with pytest.raises(ValueError, match="attention_bias"):
        CodePredictorConfig.of(sections)
    good = CodePredictorConfig.of(_sections(reference))
    with pytest.raises(ValueError, match="num_code_groups >= 2"):
        CodePredictorConfig(good.stack, VOCAB, 1)
