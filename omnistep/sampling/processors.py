"""Logits processors: small pure functions over batched logits ``[batch, num_vq, vocab]``.

Per-row settings arrive as ``[batch, 1, 1]`` (or ``[batch, num_vq, 1]``) tensors, so one call
processes every row and codebook at once, and every operation works along the vocab axis only:
a row's result never depends on the other rows. ``processed_logprobs`` chains them in upstream
ChatTTS's order (``GPT.generate`` in ChatTTS/model/gpt.py, processors from ``gen_logits`` in
ChatTTS/model/processors.py):

    delay pattern (forced ids, when a row has one: ``omnistep.sampling.delay``)
    -> logits / temperature -> repetition penalty -> top-p -> top-k (min keep) -> EOS mask
    -> log-softmax

Imports: torch and ``omnistep.core`` only (through ``omnistep.sampling.params``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence

from omnistep.sampling.delay import constrain
from omnistep.sampling.params import SamplingRow

NEG_INF = float("-inf")


@dataclass(frozen=True, slots=True)
class BatchParams:
    """The rows' settings as device tensors, shaped to broadcast against ``[B, num_vq, V]``.

    Attributes:
        temperature: ``[B, num_vq, 1]`` divisor; 1 where the codebook is greedy.
        greedy: ``[B, num_vq, 1]`` bool, True where the temperature is 0.
        top_p_cut: ``[B, 1, 1]``: ``1 - top_p``; ascending cumulative mass at or below it is cut.
        penalty: ``[B, 1, 1]`` repetition penalty.
        top_k: ``[B, 1, 1]`` long: tokens kept by top-k, already ``max(k, min_keep)`` and <= V.
        min_keep: ``[B, 1, 1]`` long: tokens top-p always keeps, <= V.
        eos_masked: ``[B, 1, V]`` bool, True at the EOS id of rows still under min_new_tokens.
        sort_free_k: host-side: when no row truncates by top-p (``top_p == 1``) and every row
            that truncates by top-k keeps at most ``SORT_FREE_MAX_K`` tokens, the largest such
            k (0: no row truncates by top-k); None otherwise (``apply_top_p_top_k`` sorts).
    """

    temperature: torch.Tensor
    greedy: torch.Tensor
    top_p_cut: torch.Tensor
    penalty: torch.Tensor
    top_k: torch.Tensor
    min_keep: torch.Tensor
    eos_masked: torch.Tensor
    sort_free_k: int | None = None


SORT_FREE_MAX_K = 256
"""Largest top-k that ``apply_top_p_top_k`` finds with ``torch.topk`` instead of a full sort."""


def build_params(
    rows: Sequence[SamplingRow],
    num_generated: Sequence[int],
    num_vq: int,
    vocab: int,
    device: torch.device,
) -> BatchParams:
    """Pack the rows' settings into two host->device copies (one float, one long tensor)."""
    floats = [[*row.temperatures(num_vq), 1.0 - row.top_p, row.repetition_penalty] for row in rows]
    longs = [
        [
            min(max(row.top_k or vocab, row.min_keep), vocab),
            min(row.min_keep, vocab),
            -1 if row.eos_token_id is None else row.eos_token_id,
            int(row.eos_token_id is not None and n < row.min_new_tokens),
        ]
        for row, n in zip(rows, num_generated, strict=True)
    ]
    f = torch.tensor(floats, dtype=torch.float32, device=device).unsqueeze(-1)  # [B, nvq+2, 1]
    i = torch.tensor(longs, dtype=torch.long, device=device).unsqueeze(-1)  # [B, 4, 1]
    temperature = f[:, :num_vq]
    greedy = temperature == 0
    ids = torch.arange(vocab, device=device)
    ks = [k for k, *_ in longs if k < vocab]
    sort_free = all(row.top_p >= 1.0 for row in rows) and max(ks, default=0) <= SORT_FREE_MAX_K
    return BatchParams(
        temperature=torch.where(greedy, torch.ones_like(temperature), temperature),
        greedy=greedy,
        top_p_cut=f[:, num_vq : num_vq + 1],
        penalty=f[:, num_vq + 1 : num_vq + 2],
        top_k=i[:, 0:1],
        min_keep=i[:, 1:2],
        eos_masked=(ids == i[:, 2:3]) & (i[:, 3:4] == 1),
        sort_free_k=max(ks, default=0) if sort_free else None,
    )


def penalty_counts(
    history: Sequence[torch.Tensor],
    windows: Sequence[int],
    num_vq: int,
    vocab: int,
    device: torch.device,
) -> torch.Tensor:
    """How often each token occurs in each row's last ``window`` tokens, per codebook.

    Args:
        history: per row, ``[num_vq, T_i]`` long: the tokens generated so far.
        windows: per row, how many of the latest tokens count.

    Returns:
        ``[B, num_vq, V]`` float32 counts.
    """
    recent = [
        h[:, h.shape[1] - min(w, h.shape[1]) :] for h, w in zip(history, windows, strict=True)
    ]
    counts = torch.zeros(len(recent), num_vq, vocab, device=device)
    lengths = [r.shape[1] for r in recent]
    if max(lengths, default=0) == 0:
        return counts
    # [B, W, num_vq] -> [B, num_vq, W], zero-padded on the right; padding adds 0 below.
    ids = pad_sequence([r.to(device).T for r in recent], batch_first=True).transpose(1, 2)
    width = ids.shape[-1]
    valid = torch.arange(width, device=device) < torch.tensor(lengths, device=device)[:, None]
    weights = valid[:, None, :].expand(-1, num_vq, -1).to(counts.dtype)
    return counts.scatter_add_(-1, ids.long(), weights)


def apply_repetition_penalty(
    logits: torch.Tensor, counts: torch.Tensor, penalty: torch.Tensor
) -> torch.Tensor:
    """Upstream's ``CustomRepetitionPenaltyLogitsProcessorRepeat``: compounding, sign-aware.

    A token seen ``n`` times in the window gets ``alpha = penalty ** n``; a negative logit is
    multiplied by alpha, a non-negative one divided by it, so ``penalty > 1`` always lowers it.
    """
    alpha = torch.pow(penalty, counts)  # [B, num_vq, V]
    return torch.where(logits < 0, logits * alpha, logits / alpha)


def apply_top_p_top_k(logits: torch.Tensor, params: BatchParams) -> torch.Tensor:
    """Top-p then top-k, as transformers' ``TopPLogitsWarper`` and ``TopKLogitsWarper``.

    Top-p sorts ascending and cuts tokens whose cumulative probability is ``<= 1 - top_p``,
    keeping the ``min_keep`` largest; top-k then cuts tokens below the k-th largest surviving
    logit (ties at the k-th value survive). One stable sort serves both.

    Without top-p (every row's ``top_p == 1``, upstream Qwen3-TTS's default) the sort is not
    needed (``_top_k_without_sort``): a sort of a 2048-id row costs ~0.1 ms on a CPU, once
    per row and codebook, while ``torch.topk`` of 50 costs a few microseconds.
    """
    if params.sort_free_k is not None:
        out = _top_k_without_sort(logits, params, params.sort_free_k)
        if out is not None:
            return out
    vocab = logits.shape[-1]
    sorted_logits, order = torch.sort(logits, dim=-1, stable=True)  # ascending
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    position = torch.arange(vocab, device=logits.device)
    cut = (cumulative <= params.top_p_cut) & (position < vocab - params.min_keep)
    kept_sorted = sorted_logits.masked_fill(cut, NEG_INF)
    kth = kept_sorted.gather(-1, (vocab - params.top_k).expand(-1, logits.shape[1], -1))
    cut_top_p = cut.scatter(-1, order, cut)
    return logits.masked_fill(cut_top_p | (logits < kth), NEG_INF)


def _top_k_without_sort(logits: torch.Tensor, params: BatchParams, k: int) -> torch.Tensor | None:
    """``apply_top_p_top_k`` for rows with ``top_p == 1`` and top-k at most ``k`` (0: none).

    With ``1 - top_p = 0`` the sorted path cuts a token when its ascending cumulative
    probability is 0, i.e. when its own probability is 0 (probabilities grow with the logit,
    so every token before it in ascending order has probability 0 too), unless it is among
    the ``min_keep`` largest. While a row has at least ``min_keep`` tokens of positive
    probability those are never zero-probability ones, so the cut is exactly ``p == 0``; the
    k-th largest surviving logit is the k-th largest logit (``torch.topk``) when at least k
    tokens survive, and -inf (no cut) otherwise, as there. Same tokens cut as the sorted path
    (the softmax's sum is taken in another order, which can move a probability within
    rounding of float32's smallest subnormal across 0: rows with a logit whose probability is
    subnormal or rounds to 0 from a nonzero ``exp`` go to the sort). Returns None for those
    and when some row has fewer than ``min_keep`` tokens of positive probability (the sorted
    path then decides which zero-probability tokens stay).
    """
    vocab = logits.shape[-1]
    probs = logits.softmax(dim=-1)
    positive = probs > 0
    count = positive.sum(dim=-1, keepdim=True)  # [B, num_vq, 1]
    # exp(logit - max) > 0 but the probability below the smallest normal: its rounding to 0
    # or not depends on the order the softmax's sum ran in (the sorted path sums sorted)
    info = torch.finfo(probs.dtype)
    near_zero = (probs < info.tiny) & (
        logits - logits.amax(dim=-1, keepdim=True) > math.log(info.tiny * info.eps) - 2.0
    )
    if bool(((count < params.min_keep) | near_zero.any(dim=-1, keepdim=True)).any()):
        return None
    cut = ~positive
    if k:
        top = torch.topk(logits, k, dim=-1).values  # [B, num_vq, k], descending
        rank = (params.top_k.clamp(max=k) - 1).expand(-1, logits.shape[1], -1)
        kth = top.gather(-1, rank)
        kth = kth.masked_fill((params.top_k >= vocab) | (params.top_k > count), NEG_INF)
        cut = cut | (logits < kth)
    return logits.masked_fill(cut, NEG_INF)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Cut tokens less likely than ``min_p`` times the most likely one (transformers'
    ``MinPLogitsWarper``, min_tokens_to_keep 1: the most likely always stays).

    Args:
        logits: ``[B, num_vq, V]`` float32 (after penalty and temperature).
        min_p: ``[B, 1, 1]`` float32; a row with 0 is unchanged.
    """
    probs = torch.softmax(logits, dim=-1)
    cut = probs < min_p * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(cut, NEG_INF)


def processed_logprobs(
    logits: torch.Tensor,
    rows: Sequence[SamplingRow],
    history: Sequence[torch.Tensor],
    num_generated: Sequence[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run the whole pipeline; the one place that defines the distribution sampled from.

    Returns:
        ``(logprobs [B, num_vq, V], processed logits [B, num_vq, V], greedy [B, num_vq, 1])``.
    """
    batch, num_vq, vocab = logits.shape
    for name, seq in (("rows", rows), ("history", history), ("num_generated", num_generated)):
        if len(seq) != batch:
            raise ValueError(f"'{name}' has {len(seq)} entries for a batch of {batch}")
    params = build_params(rows, num_generated, num_vq, vocab, logits.device)
    if any(row.delay is not None for row in rows):  # forced ids first, as upstream Higgs
        logits = constrain(logits, [row.delay for row in rows], history, num_generated)
    x = logits.float() / params.temperature
    if any(row.repetition_penalty != 1.0 for row in rows):
        windows = [row.penalty_window for row in rows]
        counts = penalty_counts(history, windows, num_vq, vocab, logits.device)
        if not all(row.penalty_compounds for row in rows):
            once = torch.tensor([not row.penalty_compounds for row in rows], device=x.device)
            counts = torch.where(once[:, None, None], counts.clamp(max=1.0), counts)
        x = apply_repetition_penalty(x, counts, params.penalty)
    eos_only = x.masked_fill(params.eos_masked, NEG_INF)
    if any(row.min_p > 0 for row in rows):
        min_p = torch.tensor([row.min_p for row in rows], device=x.device).view(-1, 1, 1)
        x = apply_min_p(x, min_p)
    x = apply_top_p_top_k(x, params).masked_fill(params.eos_masked, NEG_INF)
    # If top-p/top-k kept nothing but EOS and EOS is masked, upstream would sample from NaNs;
    # fall back to the penalised logits without EOS (never reached with min_keep >= 2).
    empty = torch.isneginf(x).all(dim=-1, keepdim=True)
    x = torch.where(empty, eos_only, x)
    return torch.log_softmax(x, dim=-1), x, params.greedy
