"""The ``toy`` card's ``lm`` component: a bigram "language model" over byte ids, numpy only.

Logits are rows of a fixed random table; sampling is Gumbel-max with noise drawn from
``default_rng([seed, step])``, so each unit's token is a pure function of (previous token, seed,
step) whatever else is in its batch. Fault injection (``fail_step``, ``slow``) is set per unit by
the token loop (``omnistep.models.toy.loop``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from omnistep.core import WorkUnitKind

VOCAB = 64
EOS = 0
FAIL_STEP = 3
LATE_FAIL_STEP = 20
SLOW_STEP_SECONDS = 0.02


def byte_ids(text: str) -> list[int]:
    """The toy tokenizer: the text's UTF-8 bytes as ids in ``[1, VOCAB)`` (``1 + b % 63``;
    0 is EOS)."""
    return [1 + b % (VOCAB - 1) for b in text.encode()]


@dataclass(frozen=True, slots=True)
class TokenUnit:
    """One AR_TOKEN unit: the previous token, the step's seed material and sampling settings;
    ``fail_step``: the step at which the lm raises (fault injection), or None."""

    prev_token: int
    seed: int
    step: int
    temperature: float
    min_new_tokens: int
    fail_step: int | None = None
    slow: bool = False


class ToyLM:
    """A bigram "language model": logits are a fixed random table row ``[VOCAB]`` float64."""

    def __init__(self, device: str = "cpu"):
        self.table = np.random.default_rng(1234).normal(size=(VOCAB, VOCAB)) * 2.0
        self.table[:, EOS] -= 3.0  # EOS is rare, so outputs run to a length tests can predict
        self.weight_version = 0

    def weight_specs(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """The one weight: ``table`` ``[VOCAB, VOCAB]`` float64 (row = previous token)."""
        return {"table": (self.table.shape, str(self.table.dtype))}

    def update_weights(self, tensors: dict[str, np.ndarray]) -> None:
        """Copy a new ``table`` in place (checked by ``ModelInstance.check_weights``)."""
        self.table[...] = np.asarray(tensors["table"])

    def execute(
        self, kind: WorkUnitKind, payloads: Sequence[TokenUnit]
    ) -> list[tuple[int, float, int]]:
        """Sample one token per unit; returns (token id, log-prob, weight version) per unit."""
        if kind is not WorkUnitKind.AR_TOKEN:
            raise ValueError(f"toy lm cannot run {kind}")
        if any(p.step == p.fail_step for p in payloads):
            raise RuntimeError("injected fault in toy lm")
        if any(p.slow for p in payloads):
            time.sleep(SLOW_STEP_SECONDS)
        logits = self.table[[p.prev_token for p in payloads]]  # [batch, VOCAB]
        out = []
        for row, unit in zip(logits, payloads, strict=True):
            row = _masked(row, unit.step, unit.min_new_tokens)
            out.append((*_sample(row, unit), self.weight_version))
        return out

    def score_logprobs(
        self,
        prev_tokens: Sequence[int],
        tokens: Sequence[int],
        temperature: float,
        min_new_tokens: int,
    ) -> np.ndarray:
        """Log-probs of recorded tokens, recomputed: ``[T, 1]`` float32 (numpy, no autograd),
        equal to what ``execute`` recorded for step ``i`` fed ``prev_tokens[i]`` (the same
        float64 arithmetic per row, then the float32 of ``LoopActions``).

        Raises:
            ValueError: the two sequences differ in length, or an id outside the vocab.
        """
        if len(prev_tokens) != len(tokens):
            raise ValueError(f"{len(prev_tokens)} previous tokens for {len(tokens)} tokens")
        if any(not 0 <= int(t) < VOCAB for t in [*prev_tokens, *tokens]):
            raise ValueError(f"token ids must be in [0, {VOCAB})")
        out = np.empty((len(tokens), 1), dtype=np.float32)
        for step, (prev, token) in enumerate(zip(prev_tokens, tokens, strict=True)):
            row = _masked(self.table[int(prev)], step, min_new_tokens)
            out[step, 0] = _logprobs(row, temperature)[int(token)]
        return out


def _masked(row: np.ndarray, step: int, min_new_tokens: int) -> np.ndarray:
    """A copy of a logits row with EOS at -inf while ``step < min_new_tokens``."""
    row = row.copy()
    if step < min_new_tokens:
        row[EOS] = -np.inf
    return row


def _logprobs(logits: np.ndarray, temperature: float) -> np.ndarray:
    """``log_softmax(logits / temperature)`` float64; temperature 0 counts as 1."""
    scaled = logits / (temperature or 1.0)
    return scaled - np.logaddexp.reduce(scaled)


def _sample(logits: np.ndarray, unit: TokenUnit) -> tuple[int, float]:
    """Gumbel-max sampling, noise from ``default_rng([seed, step])``; greedy at temperature 0.
    Returns the token and its log-prob under ``log_softmax(logits / temperature)`` (the
    distribution sampled; with no truncation it is the policy's too; temperature 0 counts as 1).
    """
    logp = _logprobs(logits, unit.temperature)
    if unit.temperature == 0:
        token = int(np.argmax(logp))
    else:
        gumbel = np.random.default_rng([unit.seed, unit.step]).gumbel(size=logits.shape)
        token = int(np.argmax(logp + gumbel))
    return token, float(logp[token])
