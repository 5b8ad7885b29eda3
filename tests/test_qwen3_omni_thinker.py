"""Qwen3-Omni's thinker text model on the paged-KV AR component (models/qwen3_omni/thinker.py)
against transformers' ``Qwen3OmniMoeThinkerForConditionalGeneration`` on the tiny checkpoint:
logits, greedy text, and the routing kept per token and MoE layer."""

from __future__ import annotations

import pytest
import torch

from omnistep.core import WorkUnitKind
from omnistep.kv import KVCacheConfig
from omnistep.loops.ar_decode import ARPrefillInput, ARStepInput
from omnistep.models.qwen3_omni.loader import Qwen3OmniCheckpoint
from omnistep.models.qwen3_omni.thinker import ThinkerTextConfig, load_thinker
from omnistep.models.qwen3_omni.tiny import TINY_SIZES
from omnistep.sampling import SamplingRow

PREFILL, AR_TOKEN = WorkUnitKind.PREFILL, WorkUnitKind.AR_TOKEN
GREEDY = SamplingRow(temperature=0.0)
KV = KVCacheConfig(num_blocks=64, block_size=4)
STEPS = 6


@pytest.fixture(scope="module")
def models(qwen3_omni_folder):
    """(ours, transformers' thinker, tokenizer) on the same weights."""
    from transformers import AutoTokenizer, Qwen3OmniMoeForConditionalGeneration

    ckpt = Qwen3OmniCheckpoint.open(qwen3_omni_folder)
    ref = Qwen3OmniMoeForConditionalGeneration.from_pretrained(qwen3_omni_folder).thinker
    tok = AutoTokenizer.from_pretrained(qwen3_omni_folder)
    return load_thinker(ckpt, KV), ref.eval(), tok


def _prompts(tok) -> list[list[int]]:
    texts = ["hello world, how is it today?", "tell me something about yourself please"]
    chats = [[{"role": "user", "content": t}] for t in texts]
    return [
        tok(tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False)).input_ids
        for c in chats
    ]


def _ref_logits(ref, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(input_ids=torch.tensor([ids])).logits[0].float()  # [T, vocab]


def test_config_reads_the_published_keys(qwen3_omni_folder):
    config = ThinkerTextConfig.from_dict(Qwen3OmniCheckpoint.open(qwen3_omni_folder).config)
    assert (config.num_experts, config.num_experts_per_tok) == (TINY_SIZES.experts, 2)
    assert config.rope_theta == 1e6 and sum(config.mrope_section) == TINY_SIZES.head_dim // 2
    assert config.llama().is_sparse(0) and config.llama().qk_norm
    with pytest.raises(ValueError, match="mrope_section"):
        ThinkerTextConfig(head_dim=8, mrope_section=(2, 1, 2))


def test_logits_match_transformers(models):
    ours, ref, tok = models
    prompt = _prompts(tok)[0]
    generated = [5, 77, 300, 12]
    want = _ref_logits(ref, prompt + generated)[len(prompt) - 1 :]
    for incremental in (False, True):
        got = ours.teacher_forced_logits(prompt, generated, incremental=incremental)[:, 0]
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert want.std() > 0.1  # a real spread of logits, not a flat distribution


def test_greedy_text_matches_transformers_and_routing_is_kept(models):
    ours, ref, tok = models
    prompts = _prompts(tok)
    ids = ["a", "b"]
    units = [
        ARPrefillInput(s, tuple(p), (), (), GREEDY, None) for s, p in zip(ids, prompts, strict=True)
    ]
    frames = [[o.tokens] for o in ours.execute(PREFILL, units)]  # both prompts in one batch
    for step in range(1, STEPS):
        units = [
            ARStepInput(s, frames[i][-1], step, tuple(frames[i]), GREEDY, None)
            for i, s in enumerate(ids)
        ]
        for i, out in enumerate(ours.execute(AR_TOKEN, units)):
            frames[i].append(out.tokens)
    for i, prompt in enumerate(prompts):
        got = [f[0] for f in frames[i]]
        want = list(prompt)
        for _ in range(STEPS):  # greedy by transformers' own forward
            want.append(int(_ref_logits(ref, want)[-1].argmax()))
        assert got == want[len(prompt) :], tok.decode(got)
        # routing: one row per computed token (prompt, then STEPS - 1 fed tokens), per layer
        routing = ours.routing(ids[i])
        fed = len(prompt) + STEPS - 1
        assert routing.shape == (fed, TINY_SIZES.layers, 2)
        assert routing.min() >= 0 and routing.max() < TINY_SIZES.experts
        assert _ref_routing(ref, want[:fed]).equal(routing)
        ours.free_sequence(ids[i])
        with pytest.raises(KeyError):
            ours.routing(ids[i])


def _ref_routing(ref, ids: list[int]) -> torch.Tensor:
    """transformers' top-k experts per token and layer ``[T, layers, k]``, from its router
    logits (most probable first)."""
    with torch.no_grad():
        out = ref(input_ids=torch.tensor([ids]), output_router_logits=True)
    k = ref.config.text_config.num_experts_per_tok
    per_layer = [
        torch.sort(logits.float().softmax(-1), dim=-1, descending=True, stable=True)[1][:, :k]
        for logits in out.router_logits
    ]
    return torch.stack(per_layer, dim=1)


def test_batch_invariant_logits_do_not_depend_on_the_batch(qwen3_omni_folder, models):
    """C3 with MoE layers: in batch_invariant mode a prompt's logits and routing are the same
    bits alone and prefilled beside another prompt."""
    _, _, tok = models
    ours = load_thinker(Qwen3OmniCheckpoint.open(qwen3_omni_folder), KV, batch_invariant=True)
    first, second = _prompts(tok)

    def prefill(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        units = [
            ARPrefillInput(f"s{i}", tuple(p), (), (), GREEDY, None) for i, p in enumerate(prompts)
        ]
        outs = ours.execute(PREFILL, units)
        routing = ours.routing("s0")
        for i in range(len(prompts)):
            ours.free_sequence(f"s{i}")
        return outs[0].hidden, routing

    alone, routing_alone = prefill([first])
    beside, routing_beside = prefill([first, second])
    assert torch.equal(alone, beside) and torch.equal(routing_alone, routing_beside)
