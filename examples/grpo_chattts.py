"""GRPO on ChatTTS with omnistep as the rollout engine: a trainer a reader can copy.

Each iteration: ``rollout`` (n samples of each prompt; the group shares its prompt's KV blocks)
-> a reward per sample -> group-relative advantages (GRPO: the reward less its group's mean,
over its group's standard deviation; Shao et al. 2024, arXiv 2402.03300) -> the policy-gradient
loss on the log-probs ``score`` recomputes with autograd on the trainer's own copy of the
weights (``omni.trainer()``; train = serve: they equal the recorded ones) -> an optimizer step
on that copy (serving is untouched, so this is safe while rollouts run) -> ``update_weights``
(the engine serves the trainer's weights, version ``iteration + 1``) -> the next rollout. No
clipping or KL term: every rollout is on-policy (the ratio is 1), which is what a single step
per rollout gives.

The reward is computable on a CPU with no model: the share of frames whose first-codebook code
lies in the lower half of the codebook (``REWARD_CODES``). Swap ``reward()`` for a real one
(duration, a recognizer's WER, a speaker-similarity score) and the loop stays the same.

Run::

    .venv/bin/python examples/grpo_chattts.py --model chattts=/path/to/ChatTTS --iterations 20
    .venv/bin/python examples/grpo_chattts.py        # a tiny random checkpoint in a temp folder

It prints the mean reward per iteration and plots the curve to ``--plot`` (PNG, matplotlib).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from omnistep.core import SamplingParams
from omnistep.offline import OmniEngine, RolloutGroup

PROMPTS = ("hello there, this is a test", "read this sentence out loud")
REWARD_CODES = 313
"""First-codebook codes below this count as rewarded (the lower half of ChatTTS's 626)."""
TRAINED = (
    "head_code.0.parametrizations.weight.original0",
    "head_code.0.parametrizations.weight.original1",
)
"""The weights trained: the first codebook's head (its weight-norm parts, checkpoint names)."""


@dataclass
class Iteration:
    """What one iteration did: its weight version, rewards, loss."""

    version: int
    mean_reward: float
    loss: float
    versions_seen: set[int]


def reward(tokens: np.ndarray) -> float:
    """The share of frames (``tokens`` int64 ``[T, 4]``) whose first code is < REWARD_CODES."""
    return float((tokens[:, 0] < REWARD_CODES).mean()) if len(tokens) else 0.0


def advantages(groups: list[RolloutGroup]) -> list[list[float]]:
    """GRPO advantages: per group, (r - mean) / (std + 1e-6)."""
    out = []
    for group in groups:
        r = np.array([reward(s.loops["decode"].tokens) for s in group.samples])
        out.append(list((r - r.mean()) / (r.std() + 1e-6)))
    return out


def train(
    omni: OmniEngine, iterations: int, n: int, lr: float, max_new_tokens: int, seed: int = 0
) -> list[Iteration]:
    """Run ``iterations`` of GRPO on ``omni``'s ChatTTS GPT; returns each iteration's record."""
    # the trainer's own copy of the weights: an optimizer step never touches what serves
    trainer = omni.trainer()
    weights = trainer.weights(TRAINED)
    optimizer = torch.optim.Adam(weights.values(), lr=lr)
    # temperature 1 and no truncation: the processed and the policy distributions coincide
    sampling = SamplingParams(
        temperature=1.0, top_p=1.0, top_k=0, repetition_penalty=1.0,
        max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
    )  # fmt: skip
    history = []
    for it in range(iterations):
        groups = omni.rollout(
            list(PROMPTS), n=n, seed=seed + 1000 * it, voice="alloy", sampling=sampling,
            logprobs="policy", progress=False,
        )  # fmt: skip
        adv = advantages(groups)
        samples = [s for g in groups for s in g.samples]
        scores = omni.score(samples, mode="policy", trainer=trainer)
        flat_adv = [a for group in adv for a in group]
        loss = -sum(a * s["decode"].sum() for a, s in zip(flat_adv, scores, strict=True))
        loss = loss / len(samples)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        omni.update_weights(trainer, version=it + 1)  # serving changes here, and only here
        rewards = [reward(s.loops["decode"].tokens) for s in samples]
        seen = {int(v) for s in samples for v in s.loops["decode"].weight_versions}
        history.append(Iteration(it, float(np.mean(rewards)), loss.item(), seen))
        print(f"iteration {it}: mean reward {np.mean(rewards):.3f}, loss {loss.item():+.4f}")
    return history


def plot(history: list[Iteration], path: Path) -> None:
    """The mean reward per iteration as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3))
    ax.plot([h.version for h in history], [h.mean_reward for h in history], marker="o")
    ax.set_xlabel("iteration")
    ax.set_ylabel("mean reward")
    ax.set_title("GRPO on ChatTTS (omnistep rollouts)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> list[Iteration]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--model", help="chattts=/path (default: a tiny random checkpoint)")
    ap.add_argument("--iterations", type=int, default=5)
    ap.add_argument("--n", type=int, default=8, help="samples per prompt")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--plot", type=Path, default=Path("grpo_reward.png"))
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        spec = args.model or f"chattts={_tiny_checkpoint(Path(tmp))}"
        with OmniEngine(spec, kv_cache_gb=0.05, batch_invariant=True) as omni:
            history = train(omni, args.iterations, args.n, args.lr, args.max_new_tokens)
    if args.plot:
        plot(history, args.plot)
        print(f"wrote {args.plot}")
    return history


def _tiny_checkpoint(folder: Path) -> Path:
    """A tiny random ChatTTS in the official layout (the test suite's writer)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from omnistep.models.chattts.tiny import write_servable_tiny_chattts

    return write_servable_tiny_chattts(folder / "chattts")


if __name__ == "__main__":
    main()
