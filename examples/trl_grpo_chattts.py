"""GRPO on ChatTTS through TRL's own ``GRPOTrainer``, with omnistep as the rollout engine.

``omnistep.integrations.trl.grpo_trainer`` returns TRL's ``GRPOTrainer`` whose
``rollout_func`` is ``OmniEngine.rollout`` (a group of ``num_generations`` samples per prompt
sharing one prefill), whose policy forward is ``OmniEngine.score`` on the trainer's own copy of
the weights (train = serve), and whose optimizer steps reach serving through
``update_weights`` before the next rollout. TRL does the rest: group-relative advantages, its
clipped loss, the optimizer, the scheduler and the logs.

The reward is the one of ``examples/grpo_chattts.py``, computable on a CPU with no model: the
share of frames whose first-codebook code lies in the lower half of the codebook. TRL hands
reward functions the frames (``frames``, int64 ``[T, 4]``) beside its usual arguments.

Run::

    .venv/bin/python examples/trl_grpo_chattts.py --model chattts=/path/to/ChatTTS --steps 20
    .venv/bin/python examples/trl_grpo_chattts.py        # a tiny random checkpoint in a temp folder

It prints TRL's log line per step (``reward`` is the mean reward of that step's rollout).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
from datasets import Dataset
from trl import GRPOConfig

from omnistep.core import SamplingParams
from omnistep.integrations.trl import grpo_trainer
from omnistep.offline import OmniEngine

PROMPTS = ("hello there, this is a test", "read this sentence out loud")
REWARD_CODES = 313
"""First-codebook codes below this count as rewarded (the lower half of ChatTTS's 626)."""
TRAINED = (
    "head_code.0.parametrizations.weight.original0",
    "head_code.0.parametrizations.weight.original1",
)
"""The weights trained: the first codebook's head (its weight-norm parts, checkpoint names)."""


def low_codes(frames: list[np.ndarray], **_: object) -> list[float]:
    """TRL reward function: per completion, the share of frames (int64 ``[T, 4]``) whose
    first code is below ``REWARD_CODES``."""
    return [float((f[:, 0] < REWARD_CODES).mean()) if len(f) else 0.0 for f in frames]


def train(
    omni: OmniEngine, steps: int, n: int, lr: float, frames: int, output_dir: str
) -> tuple[list[dict], list[set[int]]]:
    """``steps`` GRPO steps of TRL's trainer on ``omni``'s ChatTTS: TRL's log entry of each
    step (``reward``: the mean reward of its rollout) and the weight versions each step's
    rollout ran under."""
    args = GRPOConfig(
        output_dir=output_dir,
        max_steps=steps,
        learning_rate=lr,
        lr_scheduler_type="constant",
        per_device_train_batch_size=n * len(PROMPTS),  # one rollout of every prompt per step
        num_generations=n,
        max_completion_length=frames * 4,  # TRL counts tokens: 4 per ChatTTS frame
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        disable_tqdm=True,
        seed=0,
    )
    dataset = Dataset.from_dict({"prompt": list(PROMPTS) * steps})
    # temperature 1, no truncation, fixed length: the sampled and the policy distributions
    # coincide, and every completion has the same number of frames
    sampling = SamplingParams(
        temperature=1.0, top_p=1.0, top_k=0, repetition_penalty=1.0,
        max_new_tokens=frames, min_new_tokens=frames,
    )  # fmt: skip
    versions: list[set[int]] = []

    @functools.wraps(low_codes)
    def reward(frames: list[np.ndarray], weight_version: list[int], **kwargs: object):
        versions.append(set(weight_version))
        return low_codes(frames)

    trainer = grpo_trainer(
        omni, reward, dataset, args, trainable=TRAINED, voice="alloy", sampling=sampling
    )
    trainer.train()
    return [h for h in trainer.state.log_history if "reward" in h], versions


def main(argv: list[str] | None = None) -> tuple[list[dict], list[set[int]]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--model", help="chattts=/path (default: a tiny random checkpoint)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--n", type=int, default=8, help="samples per prompt (num_generations)")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--frames", type=int, default=16, help="frames per completion")
    args = ap.parse_args(argv)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is experimental
    with tempfile.TemporaryDirectory() as tmp:
        spec = args.model or f"chattts={_tiny_checkpoint(Path(tmp))}"
        with OmniEngine(spec, kv_cache_gb=0.05, batch_invariant=True) as omni:
            history, versions = train(
                omni, args.steps, args.n, args.lr, args.frames, str(Path(tmp) / "out")
            )
    for step, entry in enumerate(history):
        print(f"step {step}: mean reward {entry['reward']:.3f}, weights v{sorted(versions[step])}")
    return history, versions


def _tiny_checkpoint(folder: Path) -> Path:
    """A tiny random ChatTTS in the official layout (the test suite's writer)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from omnistep.models.chattts.tiny import write_servable_tiny_chattts

    return write_servable_tiny_chattts(folder / "chattts")


if __name__ == "__main__":
    main()
