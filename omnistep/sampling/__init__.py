"""Sampling: logits processors and a multi-codebook sampler as pure functions over batched tensors.

``sample`` takes logits ``[batch, num_vq, vocab]`` (``num_vq = 1`` for an ordinary LM), one
``SamplingRow`` of settings per request, each request's token history and its own
``torch.Generator``, and returns the tokens and their log-probabilities in one vectorised pass.
No global RNG is touched, so a request's tokens do not depend on its batch neighbours.
``recompute_logprobs`` scores given tokens with the same processing (the rollout parity gate);
``policy_logprobs`` scores them under ``log_softmax(logits / temperature)`` (no truncation).
The processing order follows upstream ChatTTS: temperature, repetition penalty, top-p, top-k,
EOS mask, softmax.

Imports: torch and ``omnistep.core`` only.
"""

from omnistep.sampling.delay import DelayPattern
from omnistep.sampling.params import SamplingRow
from omnistep.sampling.processors import (
    BatchParams,
    apply_repetition_penalty,
    apply_top_p_top_k,
    build_params,
    penalty_counts,
    processed_logprobs,
)
from omnistep.sampling.sampler import (
    SampleOutput,
    entropy,
    make_generator,
    policy_distribution,
    policy_logprobs,
    recompute_logprobs,
    sample,
)

__all__ = [
    "BatchParams",
    "DelayPattern",
    "SampleOutput",
    "SamplingRow",
    "apply_repetition_penalty",
    "apply_top_p_top_k",
    "build_params",
    "entropy",
    "make_generator",
    "policy_distribution",
    "penalty_counts",
    "policy_logprobs",
    "processed_logprobs",
    "recompute_logprobs",
    "sample",
]
