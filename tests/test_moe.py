"""omnistep.layers.moe: parity with transformers' Qwen3-Omni MoE blocks (thinker: no shared
expert, normalised top-k; talker: shared expert with a sigmoid gate), the published per-expert
tensor names, batch invariance, routing replay, autograd and ties."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import (
    Qwen3OmniMoeTalkerTextConfig,
    Qwen3OmniMoeTextConfig,
)
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeTalkerTextSparseMoeBlock,
    Qwen3OmniMoeThinkerTextSparseMoeBlock,
)

from omnistep.layers.moe import MoEConfig, MoEFeedForward, fuse_expert_tensors

SIZES = dict(hidden_size=64, moe_intermediate_size=24, num_experts=8, num_experts_per_tok=3)


def _randomize(module: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.2)


def _thinker(seed: int = 0) -> Qwen3OmniMoeThinkerTextSparseMoeBlock:
    block = Qwen3OmniMoeThinkerTextSparseMoeBlock(Qwen3OmniMoeTextConfig(**SIZES))
    _randomize(block, seed)
    return block.eval()


def _talker(seed: int = 1, norm_topk_prob: bool = False) -> Qwen3OmniMoeTalkerTextSparseMoeBlock:
    config = Qwen3OmniMoeTalkerTextConfig(
        **SIZES, shared_expert_intermediate_size=40, norm_topk_prob=norm_topk_prob
    )
    block = Qwen3OmniMoeTalkerTextSparseMoeBlock(config)
    _randomize(block, seed)
    return block.eval()


def _ours(reference: torch.nn.Module, published: bool = False) -> MoEFeedForward:
    """Our layer with the reference block's weights, by transformers 5's fused names or (with
    ``published``) by the released checkpoints' per-expert names under a layer prefix."""
    moe = MoEFeedForward(MoEConfig.of(reference.experts.config))
    state = reference.state_dict()
    if published:
        state = _per_expert(state)
        state = {f"thinker.model.layers.3.mlp.{k}": v for k, v in state.items()}
        state["thinker.model.layers.3.self_attn.q_proj.weight"] = torch.zeros(1)  # ignored
        moe.load_hf_state_dict(state, "thinker.model.layers.3.mlp.")
    else:
        moe.load_hf_state_dict(state)
    return moe


def _per_expert(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The fused expert tensors split into the published ``experts.{e}.*_proj.weight``."""
    out = {k: v for k, v in state.items() if not k.startswith("experts.")}
    gate_up, down = state["experts.gate_up_proj"], state["experts.down_proj"]
    inner = gate_up.shape[1] // 2
    for e in range(gate_up.shape[0]):
        out[f"experts.{e}.gate_proj.weight"] = gate_up[e, :inner].clone()
        out[f"experts.{e}.up_proj.weight"] = gate_up[e, inner:].clone()
        out[f"experts.{e}.down_proj.weight"] = down[e].clone()
    return out


def _rows(n: int, seed: int = 7) -> torch.Tensor:
    return torch.randn(n, SIZES["hidden_size"], generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------ reference parity
@pytest.mark.parametrize("make", [_thinker, _talker, lambda: _talker(2, norm_topk_prob=True)])
def test_matches_transformers_qwen3_omni_moe_blocks(make):
    reference = make()
    moe = _ours(reference)
    x = _rows(2 * 9).view(2, 9, -1)
    with torch.no_grad():
        expected = reference(x).reshape(18, -1)
        _, _, chosen = reference.gate(x.reshape(18, -1))
        got = moe(x.reshape(18, -1))
    assert got.hidden.shape == expected.shape
    assert torch.allclose(got.hidden, expected, atol=1e-5, rtol=0)
    assert float(expected.abs().mean()) > 0.1  # a real signal, not zeros
    assert got.expert_ids.dtype == torch.long and got.expert_ids.shape == (18, 3)
    assert torch.equal(got.expert_ids, chosen)  # most probable first, as topk orders them


def test_published_per_expert_names_load_like_the_fused_ones():
    reference = _thinker(3)
    fused, published = _ours(reference), _ours(reference, published=True)
    for name, tensor in fused.state_dict().items():
        assert torch.equal(tensor, published.state_dict()[name]), name
    x = _rows(6)
    with torch.no_grad():
        assert torch.equal(fused(x).hidden, published(x).hidden)
    names = ["experts.down_proj", "experts.gate_up_proj", "gate.weight"]
    assert sorted(fused.state_dict()) == names


def test_a_missing_expert_tensor_is_named():
    state = _per_expert(_thinker().state_dict())
    del state["experts.5.up_proj.weight"]
    moe = MoEFeedForward(MoEConfig(**SIZES))
    with pytest.raises(KeyError, match=r"experts\.5\.up_proj\.weight"):
        moe.load_hf_state_dict(state)
    with pytest.raises(KeyError, match="gate.weight"):
        moe.load_hf_state_dict({"experts.gate_up_proj": torch.zeros(8, 48, 64)})
    assert set(fuse_expert_tensors({"gate.weight": torch.zeros(1)}, 8)) == {"gate.weight"}


# ------------------------------------------------------------------ batch invariance
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("make", [_thinker, _talker])
def test_batch_invariant_row_alone_equals_row_in_sixteen(make, dtype):
    # float64 runs F.linear, whose result for a row depends on the call's row count here (MKL);
    # float32 runs the oneDNN packed kernels (layers/linear.py)
    moe = _ours(make()).to(dtype)
    x = _rows(16, seed=11).to(dtype)
    with torch.no_grad():
        full = moe(x, batch_invariant=True)
        for i in (0, 5, 15):
            alone = moe(x[i : i + 1], batch_invariant=True)
            assert torch.equal(alone.hidden[0], full.hidden[i]), i
            assert torch.equal(alone.expert_ids[0], full.expert_ids[i])
        # the same rows in another order and with other neighbours
        perm = torch.randperm(16, generator=torch.Generator().manual_seed(0))
        mixed = moe(torch.cat([x[perm], _rows(7, seed=12).to(dtype)]), batch_invariant=True)
        assert torch.equal(mixed.hidden[:16], full.hidden[perm])
        # and the fast mode computes the same function
        assert torch.allclose(moe(x).hidden, full.hidden, atol=1e-5, rtol=0)


# ------------------------------------------------------------------ routing replay
@pytest.mark.parametrize("batch_invariant", [False, True])
def test_replaying_the_recorded_routing_reproduces_the_output(batch_invariant):
    moe = _ours(_talker())
    x = _rows(10)
    with torch.no_grad():
        served = moe(x, batch_invariant=batch_invariant)
        replayed = moe(x, served.expert_ids.to(torch.int32), batch_invariant)
        assert torch.equal(replayed.hidden, served.hidden)
        assert torch.equal(replayed.expert_ids, served.expert_ids)
        # another routing gives another output: the replayed ids are really used
        other = moe(x, (served.expert_ids + 1) % SIZES["num_experts"], batch_invariant)
        assert not torch.allclose(other.hidden, served.hidden, atol=1e-3)
        # after the router changes, replay keeps the recorded experts
        moe.gate.weight.mul_(-1.0)
        moved = moe(x, batch_invariant=batch_invariant).expert_ids
        assert not torch.equal(moved, served.expert_ids)
        kept = moe(x, served.expert_ids, batch_invariant)
        assert torch.equal(kept.expert_ids, served.expert_ids)


def test_replayed_weights_are_the_router_probabilities_of_those_experts():
    moe = _ours(_thinker())  # norm_topk_prob: the k probabilities renormalised
    x = _rows(4)
    forced = torch.tensor([[0, 1, 2], [7, 6, 5], [3, 3, 4], [1, 0, 2]])
    with torch.no_grad():
        probs = moe.router_probs(x)
        ids, weights = moe.select(probs, forced)
        expected = probs.gather(1, forced)
        expected = expected / expected.sum(-1, keepdim=True)
        assert torch.equal(ids, forced)
        assert torch.allclose(weights, expected, atol=1e-7, rtol=0)
        assert torch.allclose(weights.sum(-1), torch.ones(4))


def test_bad_routing_and_inputs_raise():
    moe = MoEFeedForward(MoEConfig(**SIZES))
    x = _rows(2)
    with pytest.raises(ValueError, match=r"\[2, 3\]"):
        moe(x, torch.zeros(2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="integers"):
        moe(x, torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"\[0, 8\)"):
        moe(x, torch.tensor([[0, 1, 8], [0, 1, 2]]))
    with pytest.raises(ValueError, match=r"x must be \[N, 64\]"):
        moe(x[None])
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        MoEConfig(64, 24, num_experts=2, num_experts_per_tok=3)
    with pytest.raises(ValueError, match="hidden_act"):
        MoEConfig(64, 24, 8, 2, hidden_act="gelu")
    with pytest.raises(ValueError, match="chunk_rows"):
        MoEFeedForward(MoEConfig(**SIZES), chunk_rows=0)
    for batch_invariant in (False, True):
        empty = moe(x[:0], batch_invariant=batch_invariant)
        assert empty.hidden.shape == (0, 64) and empty.expert_ids.shape == (0, 3)


# ------------------------------------------------------------------ autograd
@pytest.mark.parametrize("batch_invariant", [False, True])
def test_gradients_match_transformers(batch_invariant):
    reference = _talker(4, norm_topk_prob=True)
    moe = _ours(reference)
    x = _rows(12)
    x_ref, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    target = torch.randn(12, SIZES["hidden_size"], generator=torch.Generator().manual_seed(5))
    (reference(x_ref[None])[0] * target).sum().backward()
    out = moe(x_ours, batch_invariant=batch_invariant)
    (out.hidden * target).sum().backward()
    assert torch.allclose(x_ours.grad, x_ref.grad, atol=1e-5, rtol=0)
    theirs = dict(reference.named_parameters())
    for name, p in moe.named_parameters():
        assert p.grad is not None, name
        assert torch.allclose(p.grad, theirs[name].grad, atol=1e-5, rtol=0), name
    assert float(moe.gate.weight.grad.abs().sum()) > 0  # the router learns through the weights
    # score replays the recorded routing: the same gradients, the router's included
    served = {name: p.grad.clone() for name, p in moe.named_parameters()}
    moe.zero_grad()
    replayed = moe(x.clone().requires_grad_(), out.expert_ids, batch_invariant)
    (replayed.hidden * target).sum().backward()
    for name, p in moe.named_parameters():
        assert torch.equal(p.grad, served[name]), name


# ------------------------------------------------------------------ ties
def test_ties_go_to_the_lower_expert_id_whatever_the_batch():
    moe = MoEFeedForward(MoEConfig(**SIZES))
    x = _rows(16)
    with torch.no_grad():
        moe.gate.weight.zero_()  # every expert equally probable
        ids = moe(x).expert_ids
        assert ids.tolist() == [[0, 1, 2]] * 16
        # experts 6 and 2 share the best router row, 4 is second: 2 before 6, then 4
        generator = torch.Generator().manual_seed(0)
        best = torch.randn(64, generator=generator)
        moe.gate.weight[6] = moe.gate.weight[2] = best * 10
        moe.gate.weight[4] = best * 9.99
        probe = best[None].repeat(5, 1)
        for rows in (probe, probe[:1]):
            for batch_invariant in (False, True):
                ids = moe(rows, batch_invariant=batch_invariant).expert_ids
                assert ids[0].tolist() == [2, 6, 4]
