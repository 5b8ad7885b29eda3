"""The sampler: one vectorised draw for a batch of rows, each with its own generator.

Random draws use the inverse CDF: each row draws ``num_vq`` uniforms from its own generator
(``torch.rand(num_vq, generator=g)``, a tiny per-row loop), then every row and codebook picks at
once the first token whose cumulative probability exceeds ``u * total`` (``searchsorted``). A
row's random stream therefore advances by exactly ``num_vq`` numbers per step whatever its vocab
or settings (greedy rows with a generator draw too, and ignore the draw), and its token depends
only on its own logits, settings, history and generator, never on its batch neighbours.

Imports: torch and ``omnistep.core`` only (through ``omnistep.sampling``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from omnistep.sampling.params import SamplingRow
from omnistep.sampling.processors import processed_logprobs


@dataclass(frozen=True, slots=True)
class SampleOutput:
    """What one sampling step returns.

    Attributes:
        tokens: ``[B, num_vq]`` long: the chosen token of each row and codebook.
        logprobs: ``[B, num_vq]`` float32: their log-probabilities under the processed
            distribution (after temperature, penalty, top-p/top-k and the EOS mask): the
            distribution actually sampled (``processed`` mode).
        policy_logprobs: ``[B, num_vq]`` float32: their log-probabilities under the policy at
            the sampling temperature, ``log_softmax(logits / temperature)`` with no penalty,
            truncation or mask (``policy`` mode, what a PPO/GRPO ratio uses; see
            ``policy_logprobs``); None unless ``sample`` was asked ``with_policy``.
    """

    tokens: torch.Tensor
    logprobs: torch.Tensor
    policy_logprobs: torch.Tensor | None = None


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A fresh generator on ``device`` seeded with ``seed``: one per request, never shared."""
    return torch.Generator(device=device).manual_seed(seed)


def _uniforms(
    rows: Sequence[SamplingRow],
    generators: Sequence[torch.Generator | None],
    num_vq: int,
    device: torch.device,
) -> torch.Tensor:
    """``[B, num_vq, 1]`` uniforms in [0, 1), each row from its own generator (0 without one)."""
    draws = []
    for index, (row, gen) in enumerate(zip(rows, generators, strict=True)):
        if gen is None:
            if not row.is_greedy():
                raise ValueError(f"'generators'[{index}] is None for a row that samples")
            draws.append(torch.zeros(num_vq, device=device))
        else:
            draws.append(torch.rand(num_vq, generator=gen, device=device))
    return torch.stack(draws).unsqueeze(-1)


def _inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Draw ``[B, num_vq, 1]`` tokens from ``probs [B, num_vq, V]`` given uniforms in [0, 1).

    The index is capped at the last token of positive probability: rounding can make
    ``u * total`` reach the total, and the cap keeps zero-probability tokens (a masked EOS at
    the end of the vocab) unreachable.
    """
    cdf = probs.cumsum(dim=-1)  # [B, num_vq, V]
    target = uniforms * cdf[..., -1:]
    index = torch.searchsorted(cdf, target, right=True)
    position = torch.arange(probs.shape[-1], device=probs.device)
    last = torch.where(probs > 0, position, 0).amax(dim=-1, keepdim=True)
    return torch.minimum(index, last)


def sample(
    logits: torch.Tensor,
    rows: Sequence[SamplingRow],
    history: Sequence[torch.Tensor],
    num_generated: Sequence[int],
    generators: Sequence[torch.Generator | None],
    with_policy: bool = False,
) -> SampleOutput:
    """Sample one token per row and codebook.

    Args:
        logits: ``[B, num_vq, V]`` float32 (``num_vq = 1`` for an ordinary LM).
        rows: each row's settings.
        history: each row's generated tokens so far, ``[num_vq, T_i]`` long, any length.
        num_generated: tokens each row has generated so far (drives the EOS mask).
        generators: each row's generator, on the logits' device; None only for greedy rows.
        with_policy: also return the tokens' policy log-probs (rollouts record them; serving
            does not pay the extra log-softmax).
    """
    logprobs, processed, greedy = processed_logprobs(logits, rows, history, num_generated)
    if len(generators) != logits.shape[0]:
        raise ValueError(f"'generators' has {len(generators)} entries for {logits.shape[0]} rows")
    uniforms = _uniforms(rows, generators, logits.shape[1], logits.device)
    drawn = _inverse_cdf(logprobs.exp(), uniforms)  # [B, num_vq, 1]
    tokens = torch.where(greedy, processed.argmax(dim=-1, keepdim=True), drawn).squeeze(-1)
    return SampleOutput(
        tokens=tokens,
        logprobs=logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1),
        policy_logprobs=policy_logprobs(logits, rows, tokens) if with_policy else None,
    )


def policy_logprobs(
    logits: torch.Tensor, rows: Sequence[SamplingRow], tokens: torch.Tensor
) -> torch.Tensor:
    """Log-probabilities ``[B, num_vq]`` float32 of ``tokens [B, num_vq]`` under the policy
    at each row's sampling temperature: ``log_softmax(logits / temperature)`` over the whole
    vocab, with no repetition penalty, top-p/top-k or EOS mask (a greedy codebook's
    temperature 0 counts as 1). Differentiable in ``logits`` (a trainer's ratio uses it).

    Raises:
        ValueError: ``rows`` and ``logits`` disagree on the batch size.
    """
    logp = policy_distribution(logits, rows)
    return logp.gather(-1, tokens.to(logits.device).long().unsqueeze(-1)).squeeze(-1)


def policy_distribution(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """The policy's whole distribution, ``log_softmax(logits / temperature)`` ``[B, num_vq,
    V]`` float32 (``policy_logprobs`` gathers from it; a greedy codebook's temperature 0
    counts as 1).

    Raises:
        ValueError: ``rows`` and ``logits`` disagree on the batch size.
    """
    batch, num_vq, _ = logits.shape
    if len(rows) != batch:
        raise ValueError(f"'rows' has {len(rows)} entries for a batch of {batch}")
    temps = [[t if t > 0 else 1.0 for t in row.temperatures(num_vq)] for row in rows]
    divisor = torch.tensor(temps, dtype=torch.float32, device=logits.device).unsqueeze(-1)
    return torch.log_softmax(logits.float() / divisor, dim=-1)


def entropy(logprobs: torch.Tensor) -> torch.Tensor:
    """Shannon entropy in nats, ``-sum_v p_v log p_v`` over the last dim, of log-probabilities
    ``[..., V]`` (ids at ``-inf``, masked or truncated away, count 0): ``[...]`` float32.
    Differentiable (a masked id gives no gradient and no NaN)."""
    logprobs = logprobs.float()
    finite = torch.isfinite(logprobs)
    safe = torch.where(finite, logprobs, torch.zeros_like(logprobs))
    return -(safe.exp() * safe).masked_fill(~finite, 0.0).sum(-1)


def recompute_logprobs(
    logits: torch.Tensor,
    rows: Sequence[SamplingRow],
    history: Sequence[torch.Tensor],
    num_generated: Sequence[int],
    tokens: torch.Tensor,
) -> torch.Tensor:
    """Log-probabilities ``[B, num_vq]`` of given ``tokens [B, num_vq]`` under the same processing.

    Used by the rollout parity gate: recomputed log-probs must equal the recorded ones.
    """
    logprobs, _, _ = processed_logprobs(logits, rows, history, num_generated)
    return logprobs.gather(-1, tokens.to(logits.device).long().unsqueeze(-1)).squeeze(-1)
