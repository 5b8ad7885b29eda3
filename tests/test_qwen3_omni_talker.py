"""Qwen3-Omni's talker stack (models/qwen3_omni/talker.py: the MoE decoder with the gated
shared expert and the codebook-0 head) against transformers' ``Qwen3OmniMoeTalkerModel`` +
``codec_head`` on the tiny checkpoint."""

from __future__ import annotations

import pytest
import torch

from omnistep.models.qwen3_omni.loader import Qwen3OmniCheckpoint
from omnistep.models.qwen3_omni.talker import load_talker_stack
from omnistep.models.qwen3_omni.tiny import TINY_SIZES


@pytest.fixture(scope="module")
def stacks(qwen3_omni_folder):
    from transformers import Qwen3OmniMoeForConditionalGeneration

    ours = load_talker_stack(Qwen3OmniCheckpoint.open(qwen3_omni_folder))
    ref = Qwen3OmniMoeForConditionalGeneration.from_pretrained(qwen3_omni_folder).talker
    return ours, ref.eval()


def test_talker_stack_has_the_shared_expert_and_no_renormalisation(stacks):
    ours, _ = stacks
    moe = ours.llama.config.moe
    assert moe.shared_expert_intermediate_size == TINY_SIZES.shared_expert_intermediate
    assert not moe.norm_topk_prob
    assert all(layer.sparse for layer in ours.llama.layers)


def test_codec_logits_match_transformers(stacks):
    ours, ref = stacks
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, ours.codec_embedding.shape[0], (9,), generator=g)
    embeds = ours.codec_embedding[codes] + 0.5 * torch.randn(
        9, TINY_SIZES.talker_hidden, generator=g
    )
    with torch.no_grad():
        hidden = ref.model(inputs_embeds=embeds[None]).last_hidden_state[0]
        want = ref.codec_head(hidden)
    logits, got_hidden = ours.codec_logits(embeds)
    torch.testing.assert_close(got_hidden, hidden, atol=1e-4, rtol=0)
    torch.testing.assert_close(logits, want, atol=1e-4, rtol=0)
    assert want.std() > 0.1
    torch.testing.assert_close(
        ours.codec_embedding, ref.model.codec_embedding.weight.detach(), atol=0, rtol=0
    )
