"""omnistep.integrations.trl: TRL's GRPOTrainer with omnistep as the rollout engine.

The mapping (frame tokens, prompt runs, refused settings) without a model; then, on the tiny
ChatTTS, TRL's own calls (rollout_func, the fused-head forward) answered with the recorded
samples' log-probs and a weight sync per optimizer step; then examples/trl_grpo_chattts.py
end to end: the mean reward rises over 8 steps of TRL's trainer."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from datasets import Dataset
from trl import GRPOConfig
from trl.trainer.utils import pad

from omnistep.core import SamplingParams
from omnistep.integrations.trl import (
    _check_args,
    _group_texts,
    frame_tokenizer,
    frame_tokens,
    grpo_trainer,
    token_frames,
)
from omnistep.models.chattts.tiny import write_servable_tiny_chattts
from omnistep.offline import OmniEngine

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "trl_grpo_chattts.py"
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


def _config(tmp_path, **overrides) -> GRPOConfig:
    settings = {
        "output_dir": str(tmp_path / "out"), "max_steps": 1, "per_device_train_batch_size": 4,
        "num_generations": 2, "max_completion_length": 16, "report_to": "none",
        "save_strategy": "no", "use_cpu": True, "bf16": False, "gradient_checkpointing": False,
        "disable_tqdm": True,
    }  # fmt: skip
    return GRPOConfig(**{**settings, **overrides})


def test_frames_map_to_tokens_codebook_by_codebook_and_back():
    frames = np.array([[0, 5, 9], [3, 0, 1]])
    ids = frame_tokens(frames, codebook_size=10)
    assert ids == [0, 15, 29, 3, 10, 21]
    assert np.array_equal(token_frames(ids, 3, 10), frames)
    with pytest.raises(ValueError, match="outside"):
        frame_tokens(np.array([[10, 0, 0]]), 10)
    with pytest.raises(ValueError, match="whole frames"):
        token_frames(ids[:-1], 3, 10)
    with pytest.raises(ValueError, match="its position's codebook"):
        token_frames([15, 15, 29], 3, 10)  # 15 is codebook 1's, at codebook 0's place


def test_the_frame_tokenizer_decodes_codes_and_keeps_pad_and_eos_outside_them():
    tok = frame_tokenizer(num_codebooks=2, codebook_size=3)
    assert tok.pad_token_id == 6 and tok.eos_token_id == 7
    assert tok.decode([0, 4, 2, 5]) == "<c0_0> <c1_1> <c0_2> <c1_2>"
    assert tok.convert_tokens_to_ids("<c1_0>") == 3


def test_prompt_runs_become_one_group_per_text_and_bad_runs_are_refused():
    assert _group_texts(["a", "a", "b", "b"], 2) == ["a", "b"]
    with pytest.raises(ValueError, match="runs of num_generations=2"):
        _group_texts(["a", "b", "b", "b"], 2)
    with pytest.raises(TypeError, match="text prompts"):
        _group_texts([[{"role": "user", "content": "a"}]] * 2, 2)


@pytest.mark.parametrize(
    "field, value",
    [("beta", 0.1), ("bf16", True), ("gradient_checkpointing", True), ("entropy_coef", 0.01),
     ("mask_truncated_completions", True)],
)  # fmt: skip
def test_settings_the_adapter_cannot_map_are_refused_by_name(tmp_path, field, value):
    with pytest.raises(ValueError, match=f"GRPOConfig.{field}"):
        _check_args(_config(tmp_path, **{field: value}))


@pytest.fixture(scope="module")
def omni(tmp_path_factory):
    root = write_servable_tiny_chattts(tmp_path_factory.mktemp("chattts") / "chattts")
    with OmniEngine(f"chattts={root}", kv_cache_gb=0.05, batch_invariant=True) as engine:
        yield engine


def test_trl_calls_get_the_recorded_samples_log_probs_and_a_sync_per_step(omni, tmp_path):
    texts = ["hello there", "read this sentence out loud"]
    sampling = SamplingParams(temperature=0.8, max_new_tokens=3, min_new_tokens=3)
    grpo = grpo_trainer(
        omni, lambda frames, **_: [0.0] * len(frames), Dataset.from_dict({"prompt": texts}),
        _config(tmp_path), trainable=["head_code.0.parametrizations.weight.original1"],
        voice="alloy", sampling=sampling,
    )  # fmt: skip
    policy = grpo.model
    assert policy.config.num_codebooks == 4 and grpo.processing_class.pad_token_id == 4 * (
        policy.config.codebook_size
    )
    assert [n for n, _ in policy.named_parameters()] == [
        "head_code.0.parametrizations.weight.original1"
    ]
    version = omni.engine.weight_versions[policy.trainer.card_id]

    out = grpo.rollout_func([texts[0], texts[0], texts[1], texts[1]], grpo)
    assert [len(c) for c in out["completion_ids"]] == [12] * 4  # 3 frames of 4 codes
    assert out["weight_version"] == [version] * 4
    for ids, frames in zip(out["completion_ids"], out["frames"], strict=True):
        assert np.array_equal(token_frames(ids, 4, policy.config.codebook_size), frames)
    assert len(set(map(tuple, out["prompt_ids"]))) == 2  # one prompt per text

    # TRL's own batching: left-padded prompts, right-padded completions, labels on completions
    pad_id = grpo.processing_class.pad_token_id
    prompt_ids = pad([torch.tensor(p) for p in out["prompt_ids"]], pad_id, padding_side="left")
    prompt_mask = pad([torch.ones(len(p)) for p in out["prompt_ids"]], 0, padding_side="left")
    completion = torch.tensor(out["completion_ids"])
    input_ids = torch.cat([prompt_ids, completion], dim=1)
    mask = torch.cat([prompt_mask.long(), torch.ones_like(completion)], dim=1)
    labels = input_ids.masked_fill(mask == 0, -100)
    labels[:, : -completion.shape[1]] = -100
    result = policy(input_ids=input_ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    scored = result.log_probs[:, -completion.shape[1] :]
    recorded = torch.tensor(out["logprobs"])
    assert torch.allclose(scored, recorded, atol=1e-5), (scored - recorded).abs().max()
    assert (result.log_probs[:, : prompt_ids.shape[1] - 1] == 0).all()
    entropy = result.entropy[:, -completion.shape[1] :]  # of real distributions: (0, log V]
    assert entropy.min() > 0 and entropy.max() <= np.log(policy.config.codebook_size) + 1e-4
    scored.sum().backward()  # the graph reaches the trained tensor
    (weight,) = (t for _, t in policy.named_parameters())
    assert weight.grad is not None and weight.grad.abs().sum() > 0

    with pytest.raises(NotImplementedError, match="fused-head"):
        policy(input_ids=input_ids, attention_mask=mask)
    stranger = labels.clone()
    size = policy.config.codebook_size  # another code of the last frame's codebook 3
    stranger[0, -1] = input_ids[0, -1] = (int(input_ids[0, -1]) + 1) % size + 3 * size
    with pytest.raises(KeyError, match="no sample"):
        policy(input_ids=input_ids, attention_mask=mask, labels=stranger, fused_lm_head=True)

    # an optimizer step later, the next rollout first sends the trainer's weights to serving
    with torch.no_grad():
        weight.add_(0.5)
    grpo.state.global_step = 1
    out = grpo.rollout_func([texts[0]] * 2, grpo)
    assert omni.engine.weight_versions[policy.trainer.card_id] == version + 1
    assert out["weight_version"] == [version + 1] * 2
    grpo.rollout_func([texts[0]] * 2, grpo)  # same step: no second sync
    assert omni.engine.weight_versions[policy.trainer.card_id] == version + 1


def _example():
    spec = importlib.util.spec_from_file_location("trl_grpo_chattts", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_trl_grpo_trainer_raises_the_mean_reward_with_omnistep_rollouts():
    example = _example()
    history, versions = example.main(["--steps", "8"])
    rewards = [entry["reward"] for entry in history]
    assert len(rewards) == 8
    # step k's rollout ran on the weights of TRL's k-th optimizer step (version k)
    assert versions == [{k} for k in range(8)]
    assert rewards[-1] > rewards[0] + 0.1, rewards
    assert np.mean(rewards[-3:]) > np.mean(rewards[:3]) + 0.05, rewards


def test_the_reward_function_scores_first_codebook_codes():
    example = _example()
    frames = [np.array([[0, 1, 2, 3], [400, 0, 0, 0]]), np.zeros((0, 4), dtype=np.int64)]
    assert example.low_codes(frames) == [0.5, 0.0]
    assert example.low_codes.__name__ == "low_codes"
