"""Train = serve: ``score()`` recomputes recorded rollout log-probs with a teacher-forced forward
of the same component code (no paged cache, autograd on) for ChatTTS, the Qwen2.5-Omni thinker
and talker, and the toy card; under ``batch_invariant`` it equals the recorded log-probs (both
modes), gradients reach the component's weights, and scoring while the engine serves changes
neither. The default mode's figures are printed (``-s``) and checked against a looser bound."""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import replace

import numpy as np
import pytest
import torch

from omnistep.core import InvalidRequestError, SamplingParams
from omnistep.layers.training import ServingWeightsError
from omnistep.models.chattts.tiny import write_servable_tiny_chattts
from omnistep.offline import OmniEngine, RolloutGroup

EXACT = 1e-6
"""Batch-invariant parity bound (measured: 0.0, bit-identical, on this project's CPU)."""
DEFAULT_MODE = 1e-4
"""Bound for the default mode, where serving's kernels may see other requests' rows and
``score`` packs the samples (one causal attention call per sequence; measured on this
project's CPU: ChatTTS 1.1e-5, the thinker and talker 2.4e-6)."""
CHATTTS_SAMPLING = SamplingParams(max_new_tokens=64, min_new_tokens=32)
QWEN_SAMPLING = SamplingParams(
    max_new_tokens=16, temperature=0.8, top_p=0.9, top_k=50, repetition_penalty=1.1
)


def _deltas(scores: list[dict], groups: list[RolloutGroup], loop: str) -> np.ndarray:
    samples = [s for g in groups for s in g.samples]
    assert len(scores) == len(samples)
    out = []
    for scored, sample in zip(scores, samples, strict=True):
        got = scored[loop]
        got = got.detach().cpu().numpy() if isinstance(got, torch.Tensor) else got
        assert got.shape == sample.loops[loop].logprobs.shape and got.dtype == np.float32
        out.append(np.abs(got - sample.loops[loop].logprobs).ravel())
    return np.concatenate(out)


def _report(label: str, deltas: np.ndarray) -> float:
    print(f"\n{label}: max |d| {deltas.max():.3g}, mean {deltas.mean():.3g} over {deltas.size}")
    return float(deltas.max())


# ---------------------------------------------------------------- ChatTTS


@pytest.fixture(scope="module")
def chattts_root(tmp_path_factory):
    return write_servable_tiny_chattts(tmp_path_factory.mktemp("chattts") / "ckpt")


@pytest.fixture(scope="module")
def chattts(chattts_root):
    with OmniEngine(f"chattts={chattts_root}", kv_cache_gb=0.05, batch_invariant=True) as eng:
        yield eng


def _chattts_group(engine: OmniEngine, mode: str = "processed") -> RolloutGroup:
    [group] = engine.rollout(
        ["score me, every frame of me"],
        n=8,
        seed=11,
        voice="alloy",
        sampling=CHATTTS_SAMPLING,
        logprobs=mode,
        progress=False,
    )
    return group


@pytest.mark.parametrize("mode", ["processed", "policy"])
def test_chattts_score_equals_the_recorded_logprobs(chattts, mode):
    group = _chattts_group(chattts, mode)
    scores = chattts.score(group)
    first = scores[0]["decode"]
    assert isinstance(first, torch.Tensor) and first.dtype == torch.float32
    assert first.shape == (group.samples[0].loops["decode"].tokens.shape[0], 4)
    assert not first.requires_grad  # serving weights: no graph (a trainer's copy has one)
    assert _report(f"chattts batch-invariant {mode}", _deltas(scores, [group], "decode")) <= EXACT
    # the whole-sequence attention path: equal within rounding only
    plain = chattts.score(group, match_serving=False)
    assert _report(f"chattts one-call attention {mode}", _deltas(plain, [group], "decode")) <= 1e-4
    # a mode asked explicitly overrides the recorded one
    other = "policy" if mode == "processed" else "processed"
    assert _deltas(chattts.score(group, mode=other), [group], "decode").max() > 1e-3


def test_chattts_score_backpropagates_into_the_trainers_gpt_weights(chattts):
    group = _chattts_group(chattts)
    gpt = chattts.engine.models["chattts"].components["gpt"]
    with pytest.raises(ServingWeightsError, match="update_weights"):
        gpt.trainable_weights()  # serving weights are never handed to an optimizer
    trainer = chattts.trainer()
    weights = trainer.weights()
    [served] = chattts.score(group.samples[0])  # on the serving weights: no graph
    assert not served["decode"].requires_grad
    [scored] = chattts.score(group.samples[0], trainer=trainer)
    assert torch.equal(scored["decode"].detach(), served["decode"])  # the copy is equal
    scored["decode"].sum().backward()
    for name in (
        "layers.0.self_attn.q_proj.weight",
        "layers.1.mlp.down_proj.weight",
        "norm.weight",
        "emb_text.weight",
        "emb_code.3.weight",
        "head_code.0.parametrizations.weight.original0",
        "head_code.2.parametrizations.weight.original1",
    ):
        grad = weights[name].grad
        assert grad is not None and grad.abs().sum().item() > 0, name
    # the refine-text head is not in a code trajectory's graph
    assert weights["head_text.parametrizations.weight.original1"].grad is None
    assert all(t.grad is None for t in gpt._weight_tensors().values())  # none reached serving
    # serving is unchanged by a score and its graph
    again = _chattts_group(chattts)
    for a, b in zip(group.samples, again.samples, strict=True):
        assert np.array_equal(a.loops["decode"].tokens, b.loops["decode"].tokens)
        assert np.array_equal(a.loops["decode"].logprobs, b.loops["decode"].logprobs)


def test_scoring_while_serving_changes_neither(chattts):
    """A trainer thread scores while the engine serves a new rollout: the rollout equals the
    same rollout run alone, the scores equal the recorded log-probs, no KV is left held."""
    group = _chattts_group(chattts)
    gpt = chattts.engine.models["chattts"].components["gpt"]
    served: list[RolloutGroup] = []
    thread = threading.Thread(target=lambda: served.append(_chattts_group(chattts)))
    thread.start()
    scores = [chattts.score(group) for _ in range(3)]
    thread.join()
    for scored in scores:
        assert _deltas(scored, [group], "decode").max() <= EXACT
    for a, b in zip(group.samples, served[0].samples, strict=True):
        assert np.array_equal(a.loops["decode"].tokens, b.loops["decode"].tokens)
        assert np.array_equal(a.loops["decode"].logprobs, b.loops["decode"].logprobs)
    assert gpt.blocks.num_used_blocks == 0 and not gpt.lengths


def test_chattts_default_mode_figures(chattts_root):
    with OmniEngine(f"chattts={chattts_root}", kv_cache_gb=0.05) as engine:
        for mode in ("processed", "policy"):
            group = _chattts_group(engine, mode)
            deltas = _deltas(engine.score(group), [group], "decode")
            assert _report(f"chattts default mode {mode}", deltas) <= DEFAULT_MODE


def test_score_refuses_bad_arguments(chattts):
    group = _chattts_group(chattts)
    with pytest.raises(InvalidRequestError) as err:
        chattts.score(group, mode="raw")
    assert err.value.param == "mode"
    with pytest.raises(InvalidRequestError) as err:
        chattts.score(group, loops=["talk"])
    assert err.value.param == "loops"
    with pytest.raises(InvalidRequestError) as err:
        chattts.score(["not a sample"])
    assert err.value.param == "samples"
    gpt = chattts.engine.models["chattts"].components["gpt"]
    actions = group.samples[0].loops["decode"]
    with pytest.raises(ValueError, match="at least one frame"):
        gpt.score_logits(actions.prompt, [])
    with pytest.raises(ValueError, match="mode"):
        gpt.score_logprobs(actions.prompt, actions.tokens.tolist(), None, mode="raw")


def test_score_refuses_tampered_actions_with_typed_errors(chattts):
    # each was an IndexError, RuntimeError, TypeError, AttributeError or StopIteration (which
    # AsyncOmniEngine.score cannot even raise: the worker thread's future never finished)
    group = _chattts_group(chattts)
    sample = group.samples[0]
    actions = sample.loops["decode"]
    tokens = actions.tokens

    def edited(**fields):
        return replace(sample, loops={"decode": replace(actions, **fields)})

    outside = tokens.copy()
    outside[0, 1] = 626  # a code of the first frame (embedded) outside the 626 codes
    last = tokens.copy()
    last[-1, 0] = 626  # the last frame: only the head's distribution sees it
    bad = {
        "an id outside the vocab": edited(tokens=outside),
        "an id outside the vocab in the last frame": edited(tokens=last),
        "a negative id": edited(tokens=tokens - 1000),
        "3 codebooks of 4": edited(tokens=tokens[:, :3], mask=None),
        "5 codebooks of 4": edited(tokens=np.concatenate([tokens, tokens[:, :1]], 1), mask=None),
        "1-D tokens": edited(tokens=tokens[:, 0], mask=None),
        "float tokens": edited(tokens=tokens + 0.5),
        "a mask of another shape": edited(mask=np.ones((1, 4), bool)),
        "a prompt of another model": edited(prompt=(1, 2, 3)),
        "a loop the card does not run": replace(sample, loops={"bogus": actions}),
    }
    for what, tampered in bad.items():
        with pytest.raises(InvalidRequestError) as err:
            chattts.score(tampered)
        assert err.value.param == "samples", what
    # nothing changed: the recorded log-probs are still reproduced, to the bit
    [again] = chattts.score(sample)
    assert np.array_equal(again["decode"].numpy(), actions.logprobs)


# ---------------------------------------------------------------- Qwen2.5-Omni


@pytest.fixture(scope="module")
def qwen_root(tmp_path_factory):
    from omnistep.models.qwen2_5_omni.tiny import write_tiny_qwen_omni

    return write_tiny_qwen_omni(tmp_path_factory.mktemp("qwen") / "ckpt")


def _qwen_engine(root, batch_invariant: bool) -> OmniEngine:
    return OmniEngine(
        f"qwen2_5_omni={root}",
        kv_cache_gb=0.05,
        batch_invariant=batch_invariant,
        talker_max_new_tokens=24,
    )


def _qwen_group(engine: OmniEngine, mode: str = "processed") -> RolloutGroup:
    [group] = engine.rollout(
        ["tell me about the sea"],
        n=8,
        seed=5,
        voice="Chelsie",
        sampling=QWEN_SAMPLING,
        logprobs=mode,
        audio=True,
        progress=False,
    )
    return group


@pytest.fixture(scope="module")
def qwen(qwen_root):
    with _qwen_engine(qwen_root, True) as engine:
        yield engine


@pytest.mark.parametrize("mode", ["processed", "policy"])
def test_qwen_thinker_and_talker_scores_equal_the_recorded_logprobs(qwen, mode):
    from omnistep.models.qwen2_5_omni.talker import TalkerPrompt

    group = _qwen_group(qwen, mode)
    talk = group.samples[0].loops["talk"]
    assert isinstance(talk.prompt, TalkerPrompt)
    assert len(talk.prompt.replay) == talk.tokens.shape[0] - 1
    scores = qwen.score(group)
    for loop in ("think", "talk"):
        deltas = _deltas(scores, [group], loop)
        assert _report(f"qwen {loop} batch-invariant {mode}", deltas) <= EXACT


def test_qwen_score_backpropagates_into_thinker_and_talker_weights(qwen):
    group = _qwen_group(qwen)
    trainer = qwen.trainer()
    thinker = trainer.policy.components["thinker"]
    weights = trainer.weights()
    try:
        [scored] = qwen.score(group.samples[0], trainer=trainer)
        (scored["think"].sum() + scored["talk"].sum()).backward()
        head = "thinker.model.embed_tokens.weight"
        if not thinker.tied_head:
            head = "thinker.lm_head.weight"
        for name in (
            "thinker.model.layers.0.self_attn.q_proj.bias",
            "thinker.model.layers.0.mlp.gate_proj.weight",
            "thinker.model.embed_tokens.weight",
            head,
            "talker.model.layers.0.self_attn.k_proj.weight",
            "talker.model.embed_tokens.weight",
            "talker.thinker_to_talker_proj.weight",
            "talker.thinker_to_talker_proj.bias",
            "talker.codec_head.weight",
        ):
            grad = weights[name].grad
            assert grad is not None and grad.abs().sum().item() > 0, name
    finally:
        for tensor in weights.values():
            tensor.grad = None
            if not isinstance(tensor, torch.nn.Parameter):
                tensor.requires_grad_(False)


def test_qwen_default_mode_figures(qwen_root):
    with _qwen_engine(qwen_root, False) as engine:
        for mode in ("processed", "policy"):
            group = _qwen_group(engine, mode)
            scores = engine.score(group)
            for loop in ("think", "talk"):
                deltas = _deltas(scores, [group], loop)
                assert _report(f"qwen {loop} default mode {mode}", deltas) <= DEFAULT_MODE


QWEN_SDE = dataclasses.replace(QWEN_SAMPLING, flow_noise_level=0.7)


def _sde_rel_deltas(scores: list[dict], groups: list[RolloutGroup]) -> np.ndarray:
    samples = [s for g in groups for s in g.samples]
    out = []
    for scored, sample in zip(scores, samples, strict=True):
        recorded = sample.denoise["denoise"].logprobs
        got = scored["denoise"].detach().cpu().numpy()
        out.append(np.abs(got - recorded) / np.abs(recorded))
    return np.concatenate(out)


def test_qwen_dit_sde_steps_are_recorded_and_scored(qwen):
    """Flow-GRPO on the DiT through the rollout API: with ``flow_noise_level`` every solver
    step of every window is a recorded policy step; ``score`` recomputes each step's
    log-prob (batch-invariant: to the bit) and its gradient reaches the DiT's weights; the
    same seed samples the same SDE path; noise level 0 records nothing and equals the ODE."""
    [group] = qwen.rollout(
        ["tell me about the sea"], n=3, seed=5, voice="Chelsie", sampling=QWEN_SDE,
        audio=True, progress=False,
    )  # fmt: skip
    sample = group.samples[0]
    steps = sample.denoise["denoise"]
    windows = sorted({r.window for r in steps.steps})
    assert steps.noise_level == 0.7 and steps.seed == 5
    assert len(steps.steps) == 9 * len(windows) and len(windows) >= 1
    assert [r.step for r in steps.steps[:9]] == list(range(9))
    assert all(r.x.shape == r.x_next.shape == (r.window[3] - r.window[0], 80) for r in steps.steps)
    assert (steps.weight_versions == 0).all()
    scores = qwen.score(group)
    rel = _sde_rel_deltas(scores, [group])
    assert _report("qwen DiT SDE steps batch-invariant (relative)", rel) <= EXACT
    trainer = qwen.trainer()
    params = trainer.weights()
    [scored] = qwen.score(sample, loops="denoise", trainer=trainer)
    scored["denoise"].sum().backward()
    for name in ("proj_out.weight", "transformer_blocks.0.ff.ff.0.weight"):
        name = "token2wav.code2wav_dit_model." + name
        assert params[name].grad is not None and params[name].grad.abs().sum() > 0, name
    [again] = qwen.rollout(
        ["tell me about the sea"], n=1, seed=5, voice="Chelsie", sampling=QWEN_SDE,
        audio=True, progress=False,
    )  # fmt: skip
    assert np.array_equal(again.samples[0].audio, sample.audio)
    [ode] = qwen.rollout(
        ["tell me about the sea"], n=1, seed=5, voice="Chelsie", sampling=QWEN_SAMPLING,
        audio=True, progress=False,
    )  # fmt: skip
    assert ode.samples[0].denoise == {} and not np.array_equal(ode.samples[0].audio, sample.audio)


def test_qwen_dit_sde_default_mode_figures(qwen_root):
    """The default (batched) mode: the 8 samples' DiT windows step together; the recomputed
    log-probs are within 1e-5 relative of the recorded ones."""
    with _qwen_engine(qwen_root, False) as engine:
        [group] = engine.rollout(
            ["tell me about the sea"], n=8, seed=5, voice="Chelsie", sampling=QWEN_SDE,
            audio=True, progress=False,
        )  # fmt: skip
        rel = _sde_rel_deltas(engine.score(group), [group])
    assert _report("qwen DiT SDE steps default mode (relative)", rel) <= 1e-5


# ---------------------------------------------------------------- toy


def test_toy_score_recomputes_the_recorded_numpy_logprobs():
    sampling = SamplingParams(max_new_tokens=12, temperature=0.7, min_new_tokens=4)
    with OmniEngine("toy") as engine:
        for mode in ("processed", "policy"):
            groups = engine.rollout(
                ["roll me", "and me"], n=3, seed=9, sampling=sampling, logprobs=mode
            )
            scores = engine.score(groups)
            assert all(isinstance(s["decode"], np.ndarray) for s in scores)
            assert _deltas(scores, groups, "decode").max() == 0.0


async def test_async_form_scores_on_a_worker_thread():
    from omnistep.offline import AsyncOmniEngine

    omni = AsyncOmniEngine.from_specs("toy")
    try:
        sampling = SamplingParams(max_new_tokens=6)
        groups = await omni.rollout(["async"], n=2, seed=3, sampling=sampling)
        scores = await omni.score(groups, loops=["decode"])
        assert _deltas(scores, groups, "decode").max() == 0.0
    finally:
        await omni.close()
