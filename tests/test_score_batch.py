"""Batched scoring, masks and entropies: ``score`` packs a loop's samples into one
teacher-forced forward (``LlamaModel.forward_packed``) and equals per-sample scoring to the bit
under ``batch_invariant`` (within float rounding otherwise); ``LoopActions.mask`` marks exactly
the ids a loop did not sample (the EOS frame's other codebooks, ChatTTS and Qwen3-TTS);
``score(..., entropy=True)`` equals a direct entropy computation and carries a graph."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omnistep.core import SamplingParams
from omnistep.layers.llama import LlamaConfigLite, LlamaModel
from omnistep.models.chattts.tiny import write_servable_tiny_chattts
from omnistep.offline import LoopScore, OmniEngine

PACKED_DEFAULT_MODE = 1e-5
"""Bound on |packed - per-sample| in the default mode (float32 GEMMs over more rows; measured
on this project's CPU: see the report)."""


def _llama() -> LlamaModel:
    torch.manual_seed(0)
    config = LlamaConfigLite(
        hidden_size=64,
        num_attention_heads=4,
        num_hidden_layers=2,
        intermediate_size=128,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    model = LlamaModel(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model


@pytest.mark.parametrize("pieces", [None, [7], [3, 4]], ids=["causal", "prefill", "split"])
def test_packed_forward_equals_each_sequence_alone(pieces):
    """Three sequences packed: bit-equal to each one's ``forward_dense`` with row chunks,
    within float rounding without; and gradients flow to the weights."""
    model = _llama()
    lens = [9, 20, 13]
    x = torch.randn(sum(lens), 64)
    alone_bi = [model.forward_dense(p, None, pieces, True) for p in x.split(lens)]
    packed_bi = model.forward_packed(x, lens, [pieces] * 3, batch_invariant=True)
    for got, want in zip(packed_bi.split(lens), alone_bi, strict=True):
        assert torch.equal(got, want)
    alone = torch.cat([model.forward_dense(p, None, pieces) for p in x.split(lens)])
    packed = model.forward_packed(x, lens, [pieces] * 3)
    delta = (packed - alone).abs().max().item()
    print(f"\npacked vs alone, default mode, pieces={pieces}: max |d| {delta:.3g}")
    assert delta <= PACKED_DEFAULT_MODE
    packed.square().sum().backward()
    assert model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="seq_lens"):
        model.forward_packed(x, [9, 20], None)


def test_packed_sequences_sharing_a_prompt_equal_each_alone_within_rounding():
    """Sequences 1 and 2 reuse sequence 0's first 8 rows (a group's prompt, computed once):
    each equals its own whole ``forward_dense`` within float rounding."""
    model = _llama()
    prompt = torch.randn(8, 64)
    tails = [torch.randn(n, 64) for n in (12, 5, 9)]
    packed = model.forward_packed(
        torch.cat([prompt, *tails]), [20, 5, 9], None, shared=[None, (0, 8), (0, 8)]
    ).split([20, 5, 9])
    for i, tail in enumerate(tails):
        alone = model.forward_dense(torch.cat([prompt, tail]))
        got = packed[0] if i == 0 else torch.cat([packed[0][:8], packed[i]])
        assert (got - alone).abs().max().item() <= PACKED_DEFAULT_MODE
    with pytest.raises(ValueError, match="shared"):
        model.forward_packed(torch.cat([prompt, *tails]), [20, 5, 9], shared=[(1, 8), None, None])


# ---------------------------------------------------------------- ChatTTS


@pytest.fixture(scope="module")
def chattts(tmp_path_factory):
    root = write_servable_tiny_chattts(tmp_path_factory.mktemp("chattts") / "ckpt")
    with OmniEngine(f"chattts={root}", kv_cache_gb=0.05, batch_invariant=True) as eng:
        yield eng


def _roll(engine, n=6, seed=11, mode="processed", **sampling):
    sp = SamplingParams(**{"max_new_tokens": 24, "min_new_tokens": 16, **sampling})
    [group] = engine.rollout(
        ["pack us"], n=n, seed=seed, voice="alloy", sampling=sp, logprobs=mode, progress=False
    )
    return group


@pytest.mark.parametrize("match_serving", [True, False])
def test_chattts_packed_scores_equal_per_sample_scores_to_the_bit(chattts, match_serving):
    group = _roll(chattts)
    trainer = chattts.trainer()
    packed = chattts.score(group, trainer=trainer, match_serving=match_serving, batch_size=16)
    alone = chattts.score(group, trainer=trainer, match_serving=match_serving, batch_size=1)
    for p, a, sample in zip(packed, alone, group.samples, strict=True):
        assert torch.equal(p["decode"], a["decode"])
        if match_serving:  # and the recorded ones (batch-invariant serving)
            recorded = torch.from_numpy(sample.loops["decode"].logprobs)
            assert torch.equal(p["decode"].detach(), recorded)
    # a loss over the packed batch reaches the trainer's weights
    weights = trainer.weights(["layers.0.self_attn.q_proj.weight"])
    torch.stack([p["decode"].sum() for p in packed]).sum().backward()
    assert weights["layers.0.self_attn.q_proj.weight"].grad.abs().sum() > 0
    with pytest.raises(Exception, match="batch_size"):
        chattts.score(group, batch_size=0)


def test_chattts_default_mode_packed_scores_equal_per_sample_within_rounding(chattts):
    """The default mode (a trainer copy switched off batch-invariant kernels): packed, the
    group's prompt computed once and one causal call per sequence, against one sample per
    forward (serving's per-row calls)."""
    group = _roll(chattts)
    trainer = chattts.trainer()
    trainer.policy.components["gpt"].batch_invariant = False
    packed = chattts.score(group, trainer=trainer, batch_size=16)
    alone = chattts.score(group, trainer=trainer, batch_size=1)
    delta = max(
        (p["decode"] - a["decode"]).abs().max().item() for p, a in zip(packed, alone, strict=True)
    )
    print(f"\nChatTTS default mode, packed vs per-sample: max |d| {delta:.3g}")
    assert delta <= 1e-4


def _direct_entropy(logp: torch.Tensor) -> np.ndarray:
    """float64 ``-sum p log p`` over ids with p > 0."""
    lp = logp.detach().double()
    p = lp.exp()
    return -torch.where(p > 0, p * lp, torch.zeros_like(lp)).sum(-1).numpy()


@pytest.mark.parametrize("mode", ["policy", "processed"])
def test_chattts_entropy_equals_a_direct_computation(chattts, mode):
    group = _roll(chattts, n=2, mode=mode, temperature=0.7, top_k=20, top_p=0.8)
    trainer = chattts.trainer()
    scores = chattts.score(group, trainer=trainer, entropy=True)
    gpt = trainer.policy.components["gpt"]
    loop = trainer.policy.loops[
        next(n.loop_id for n in trainer.policy.card.program.nodes if n.name == "decode")
    ]
    for scored, sample in zip(scores, group.samples, strict=True):
        got = scored["decode"]
        assert isinstance(got, LoopScore) and got.entropy.shape == got.logprobs.shape
        actions = sample.loops["decode"]
        logits = gpt._sampling_logits(gpt.score_logits(actions.prompt, actions.tokens)).detach()
        row = loop.config.make_sampling(_request(sample))
        temps = torch.tensor(row.temperatures(logits.shape[1]))[None, :, None]
        if mode == "policy":
            want = _direct_entropy(torch.log_softmax(logits / temps, -1))
        else:  # the processed distribution: the top-k/top-p survivors at temperature
            from omnistep.sampling import processed_logprobs

            tokens = torch.from_numpy(actions.tokens)
            history = [tokens[max(0, i - 16) : i].T for i in range(len(tokens))]
            _, x, _ = processed_logprobs(logits, [row] * len(tokens), history, range(len(tokens)))
            want = torch.distributions.Categorical(logits=x.double()).entropy().numpy()
            kept = torch.isfinite(x).sum(-1)
            assert (kept <= 20).all() and (kept < logits.shape[-1]).all()
        np.testing.assert_allclose(got.entropy.detach().numpy(), want, rtol=1e-5, atol=1e-5)
        assert (got.entropy >= 0).all()
    weights = trainer.weights(["norm.weight"])
    sum(s["decode"].entropy.sum() for s in scores).backward()
    assert weights["norm.weight"].grad.abs().sum() > 0


def _request(sample):
    from omnistep.core import ExecutionProfile, Request

    return Request(
        sample.model, seed=sample.seed, sampling=sample.sampling, profile=ExecutionProfile.ROLLOUT
    )


def _force_eos(engine, names, eos_id, hidden, scale=60.0):
    """Weights under which codebook 0's EOS wins whenever the final hidden state's first
    coordinate is positive (the others' ids are untouched): final norm = e_0; head rows
    -e_0, the EOS row +e_0."""
    norm_name, head_name, g_name = names
    card_id = next(iter(engine.engine.models))
    specs = engine.engine.models[card_id].components
    tensors = next(c for c in specs.values() if norm_name in c.weight_specs())._weight_tensors()
    norm = torch.zeros_like(tensors[norm_name])
    norm[0] = 1.0
    head = torch.zeros_like(tensors[head_name])
    head[:, 0] = -scale
    head[eos_id, 0] = scale
    update = {norm_name: norm, head_name: head}
    if g_name is not None:  # weight norm: g * v / |v| (rows of norm 1 here), g = scale
        update[head_name] = head / scale
        update[g_name] = torch.full_like(tensors[g_name], scale)
    engine.update_weights(update, model=card_id)


def test_chattts_mask_is_false_exactly_where_an_end_frame_did_not_end(tmp_path):
    root = write_servable_tiny_chattts(tmp_path / "ckpt")
    with OmniEngine(f"chattts={root}", kv_cache_gb=0.05, batch_invariant=True) as eng:
        model = next(iter(eng.engine.models.values()))
        eos = model.loops["decode"].config.eos_token_ids[0]
        _force_eos(
            eng,
            (
                "norm.weight",
                "head_code.0.parametrizations.weight.original1",
                "head_code.0.parametrizations.weight.original0",
            ),
            eos,
            768,
        )
        group = _roll(eng, n=6, min_new_tokens=2, max_new_tokens=24)
        ended = [s.loops["decode"] for s in group.samples if s.loops["decode"].stop_reason == "eos"]
        assert ended, "no sample ended on EOS"
        for sample in group.samples:
            actions = sample.loops["decode"]
            mask = actions.mask
            assert mask.shape == actions.tokens.shape and mask.dtype == bool
            # every frame before the last was sampled in full
            assert mask[:-1].all()
            assert (
                (mask[-1] == (actions.tokens[-1] == eos)).all()
                if actions.stop_reason == "eos"
                else mask[-1].all()
            )
        for actions in ended:
            assert actions.tokens[-1, 0] == eos and not actions.mask[-1].all()
        # masked scoring: 0 exactly where the mask is False, the rest unchanged
        plain, masked = eng.score(group), eng.score(group, masked=True)
        for p, m, sample in zip(plain, masked, group.samples, strict=True):
            mask = torch.from_numpy(sample.loops["decode"].mask)
            assert torch.equal(m["decode"][mask], p["decode"][mask])
            assert (m["decode"][~mask] == 0).all()


def test_qwen3_tts_mask_is_false_exactly_on_an_eos_frames_unsampled_codebooks(tmp_path):
    from omnistep.models.qwen3_tts.tiny import write_tiny_qwen3_tts

    root = write_tiny_qwen3_tts(tmp_path / "qwen3", "custom_voice").root
    with OmniEngine(f"qwen3_tts={root}", kv_cache_gb=0.01, batch_invariant=True) as eng:
        model = next(iter(eng.engine.models.values()))
        eos = model.loops["decode"].config.eos_token_ids[0]
        names = ("talker.model.norm.weight", "talker.codec_head.weight", None)
        _force_eos(eng, names, eos, 0)
        [group] = eng.rollout(
            ["Please leave it by the door."],
            n=4,
            seed=2,
            voice="ryan",
            sampling=SamplingParams(max_new_tokens=12),
            progress=False,
        )
        ended = 0
        for sample in group.samples:
            actions = sample.loops["decode"]
            want = np.ones_like(actions.mask)
            if actions.stop_reason == "eos":
                ended += 1
                want[-1, 1:] = False  # codebooks 1..15 of the EOS frame were never sampled
                assert (actions.tokens[-1, 1:] == 0).all() and (actions.logprobs[-1, 1:] == 0).all()
            assert np.array_equal(actions.mask, want)
        assert ended, "no sample ended on EOS"
        # packed scoring equals per-sample scoring, and the recorded log-probs, to the bit
        packed, alone = eng.score(group, entropy=True), eng.score(group, batch_size=1)
        for p, a, sample in zip(packed, alone, group.samples, strict=True):
            assert torch.equal(p["decode"].logprobs, a["decode"])
            assert np.array_equal(a["decode"].numpy(), sample.loops["decode"].logprobs)
            not_sampled = torch.from_numpy(~sample.loops["decode"].mask)
            assert (p["decode"].entropy[not_sampled] == 0).all()
