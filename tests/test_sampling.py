"""Sampling: processing order and semantics of upstream ChatTTS, per-request generators,
batch invariance and log-prob recomputation."""

from __future__ import annotations

import math

import pytest
import torch

from omnistep.sampling import (
    SamplingRow,
    make_generator,
    policy_logprobs,
    processed_logprobs,
    recompute_logprobs,
    sample,
)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
NUM_VQ = 4
VOCAB = 626  # ChatTTS audio vocab; 625 is EOS
EOS = 625
CHATTTS_CODE = SamplingRow(
    temperature=0.3, top_p=0.7, top_k=20, repetition_penalty=1.05, eos_token_id=EOS
)


def _logits(batch: int, device: str, seed: int = 0, num_vq: int = NUM_VQ) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, num_vq, VOCAB, generator=g) * 3).to(device)


def _history(batch: int, length: int, device: str, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # few distinct ids so tokens repeat inside the window
    return [torch.randint(0, 12, (NUM_VQ, length), generator=g).to(device) for _ in range(batch)]


def _empty(batch: int, device: str, num_vq: int = NUM_VQ) -> list[torch.Tensor]:
    return [torch.zeros(num_vq, 0, dtype=torch.long, device=device) for _ in range(batch)]


def _gens(seeds: list[int], device: str) -> list[torch.Generator]:
    return [make_generator(s, device) for s in seeds]


# --- a direct reference implementation, one row and codebook at a time, from upstream's math ---


def _ref_penalty(x: list[float], recent: list[int], penalty: float) -> list[float]:
    """penalty ** count; negative logits multiplied, non-negative divided."""
    out = []
    for token, value in enumerate(x):
        alpha = penalty ** recent.count(token)
        out.append(value * alpha if value < 0 else value / alpha)
    return out


def _ref_top_p_top_k(x: list[float], top_p: float, top_k: int, min_keep: int) -> list[float]:
    order = sorted(range(len(x)), key=lambda t: -x[t])
    top = max(x)
    total = sum(math.exp(v - top) for v in x)
    kept, before = set(), 0.0
    for rank, token in enumerate(order):  # the minimal prefix reaching top_p, >= min_keep
        if before < top_p or rank < min_keep:
            kept.add(token)
        before += math.exp(x[token] - top) / total
    x = [v if t in kept else -math.inf for t, v in enumerate(x)]
    k = min(max(top_k or len(x), min_keep), len(x))
    kth = sorted(x, reverse=True)[k - 1]
    return [v if v >= kth else -math.inf for v in x]


def _ref_logprobs(logits, row: SamplingRow, history, num_generated: int) -> torch.Tensor:
    out = torch.empty(logits.shape, dtype=torch.float64)
    for q in range(logits.shape[0]):
        temp = row.temperatures(logits.shape[0])[q] or 1.0
        x = [float(v) / temp for v in logits[q].double()]
        recent = history[q].tolist()[-row.penalty_window :] if row.penalty_window else []
        x = _ref_penalty(x, recent, row.repetition_penalty)
        x = _ref_top_p_top_k(x, row.top_p, row.top_k, row.min_keep)
        if row.eos_token_id is not None and num_generated < row.min_new_tokens:
            x[row.eos_token_id] = -math.inf
        out[q] = torch.log_softmax(torch.tensor(x, dtype=torch.float64), dim=-1)
    return out


# --- tests ---


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_is_argmax(device):
    logits = _logits(3, device)
    rows = [SamplingRow(temperature=0.0)] * 3
    out = sample(logits, rows, _empty(3, device), [0] * 3, [None] * 3)
    assert torch.equal(out.tokens, logits.argmax(-1))
    expected = torch.log_softmax(logits, -1).gather(-1, out.tokens[..., None])[..., 0]
    torch.testing.assert_close(out.logprobs, expected)


@pytest.mark.parametrize("device", DEVICES)
def test_top_k_one_is_greedy_and_min_keep_widens_it(device):
    logits = _logits(4, device)
    rows = [SamplingRow(temperature=1.3, top_k=1, min_keep=1)] * 4
    out = sample(logits, rows, _empty(4, device), [0] * 4, _gens([1, 2, 3, 4], device))
    assert torch.equal(out.tokens, logits.argmax(-1))
    assert torch.all(out.logprobs == 0)
    # upstream keeps at least 3 (min_tokens_to_keep=3): top_k=1 then keeps 3 tokens
    logprobs, _, _ = processed_logprobs(
        logits, [SamplingRow(top_k=1)] * 4, _empty(4, device), [0] * 4
    )
    assert torch.all(torch.isfinite(logprobs).sum(-1) == 3)


@pytest.mark.parametrize("device", DEVICES)
def test_top_p_keeps_minimal_set_reaching_p(device):
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])
    logits = probs.log().view(1, 1, 4).to(device)
    empty = _empty(1, device, num_vq=1)

    def kept(top_p: float, min_keep: int) -> list[int]:
        row = SamplingRow(top_p=top_p, min_keep=min_keep)
        logprobs, _, _ = processed_logprobs(logits, [row], empty, [0])
        return torch.isfinite(logprobs[0, 0]).nonzero()[:, 0].tolist()

    assert kept(0.45, 1) == [1]
    assert kept(0.7, 1) == [1, 3]  # 0.5 < 0.7, 0.5 + 0.3 reaches it
    assert kept(0.85, 1) == [1, 2, 3]
    assert kept(0.99, 1) == [0, 1, 2, 3]
    assert kept(0.45, 3) == [1, 2, 3]  # min_keep wins over top_p
    row = SamplingRow(top_p=0.7, min_keep=1)
    logprobs, _, _ = processed_logprobs(logits, [row], empty, [0])
    torch.testing.assert_close(logprobs[0, 0, [1, 3]].exp().cpu(), torch.tensor([0.625, 0.375]))


@pytest.mark.parametrize("device", DEVICES)
def test_per_codebook_temperatures(device):
    logits = _logits(1, device)
    temps = (0.5, 1.0, 2.0, 0.0)
    row = SamplingRow(temperature=temps)
    logprobs, _, greedy = processed_logprobs(logits, [row], _empty(1, device), [0])
    for q, t in enumerate(temps):
        expected = torch.log_softmax(logits[0, q] / (t or 1.0), -1)
        torch.testing.assert_close(logprobs[0, q], expected)
    assert greedy[0, :, 0].tolist() == [False, False, False, True]
    out = sample(logits, [row], _empty(1, device), [0], _gens([5], device))
    assert out.tokens[0, 3] == logits[0, 3].argmax()
    with pytest.raises(ValueError, match="temperature"):
        sample(logits, [SamplingRow(temperature=(1.0, 1.0))], _empty(1, device), [0], [None])


@pytest.mark.parametrize("device", DEVICES)
def test_repetition_penalty_matches_reference(device):
    logits = _logits(4, device).double().float()
    rows = [
        SamplingRow(repetition_penalty=1.3, top_p=1.0),
        SamplingRow(repetition_penalty=1.3, penalty_window=4),
        SamplingRow(repetition_penalty=0.8, penalty_window=40),
        SamplingRow(repetition_penalty=2.0, penalty_window=0),
    ]
    history = _history(4, 30, device)
    history[1] = history[1][:, :3]  # shorter than its window
    logprobs, _, _ = processed_logprobs(logits, rows, history, [30, 3, 30, 30])
    for b, row in enumerate(rows):
        ref = _ref_logprobs(logits[b].cpu(), row, [h.cpu() for h in history[b]], 0)
        torch.testing.assert_close(logprobs[b].double().cpu(), ref, atol=1e-5, rtol=0)
    # penalty > 1 lowers a repeated token whatever its sign, and repeats compound
    x = torch.tensor([[[2.0, -2.0, 2.0, -2.0, 0.5]]], device=device)
    hist = [torch.tensor([[0, 1, 2, 2, 3, 3]], device=device)]
    row = SamplingRow(temperature=1.0, repetition_penalty=2.0, min_keep=5)
    _, processed, _ = processed_logprobs(x, [row], hist, [6])
    assert processed[0, 0].tolist() == [1.0, -4.0, 0.5, -8.0, 0.5]


@pytest.mark.parametrize("device", DEVICES)
def test_chattts_defaults_follow_upstream_order(device):
    logits = _logits(3, device, seed=7)
    history = _history(3, 25, device)
    rows = [
        CHATTTS_CODE,
        SamplingRow(temperature=(0.3, 0.5, 0.7, 0.9), top_p=0.9, top_k=5, repetition_penalty=1.2),
        SamplingRow(temperature=0.7, top_p=0.7, top_k=20, eos_token_id=EOS, min_new_tokens=9),
    ]
    logprobs, _, _ = processed_logprobs(logits, rows, history, [25, 25, 8])
    for b, row in enumerate(rows):
        ref = _ref_logprobs(logits[b].cpu(), row, history[b].cpu(), [25, 25, 8][b])
        assert torch.equal(torch.isfinite(logprobs[b]).cpu(), torch.isfinite(ref))
        torch.testing.assert_close(logprobs[b].double().cpu(), ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_order_top_p_then_top_k_then_eos(device):
    def kept(probs: list[float], **settings) -> list[int]:
        logits = torch.tensor(probs, device=device).log().view(1, 1, -1)
        row = SamplingRow(min_keep=1, **settings)
        logprobs, _, _ = processed_logprobs(logits, [row], _empty(1, device, num_vq=1), [0])
        return torch.isfinite(logprobs[0, 0]).nonzero()[:, 0].tolist()

    # top-p on the full distribution keeps {0, 1}; top-k first would renormalise to {0}
    assert kept([0.4, 0.35, 0.25], top_p=0.5, top_k=2) == [0, 1]
    # top-p keeps {EOS, 1}, then EOS is masked; masking EOS first would keep {0, 1}
    eos = dict(top_p=0.8, eos_token_id=3, min_new_tokens=1)
    assert kept([0.1, 0.25, 0.05, 0.6], **eos) == [1]


@pytest.mark.parametrize("device", DEVICES)
def test_eos_masked_before_min_new_tokens(device):
    logits = torch.zeros(64, NUM_VQ, VOCAB, device=device)
    logits[..., EOS] = 20.0  # EOS overwhelmingly likely
    row = SamplingRow(temperature=1.0, eos_token_id=EOS, min_new_tokens=5)
    seeds = list(range(64))
    early = sample(logits, [row] * 64, _empty(64, device), [4] * 64, _gens(seeds, device))
    assert not torch.any(early.tokens == EOS)
    late = sample(logits, [row] * 64, _empty(64, device), [5] * 64, _gens(seeds, device))
    assert torch.all(late.tokens == EOS)
    # top-p keeps only EOS, which is masked: fall back to the other tokens, never NaN
    lone = SamplingRow(temperature=1.0, top_p=0.5, min_keep=1, eos_token_id=EOS, min_new_tokens=5)
    out = sample(logits[:1], [lone], _empty(1, device), [0], _gens([0], device))
    assert not torch.any(out.tokens == EOS) and torch.all(torch.isfinite(out.logprobs))


@pytest.mark.parametrize("device", DEVICES)
def test_same_seed_same_tokens(device):
    logits = _logits(2, device)
    rows = [CHATTTS_CODE] * 2
    history = _history(2, 20, device)
    a = sample(logits, rows, history, [20, 20], _gens([11, 12], device))
    b = sample(logits, rows, history, [20, 20], _gens([11, 12], device))
    c = sample(logits, rows, history, [20, 20], _gens([13, 14], device))
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.logprobs, b.logprobs)
    rows = [SamplingRow(temperature=5.0)] * 2  # flat: other seeds almost surely differ
    d = sample(logits, rows, history, [20, 20], _gens([11, 12], device))
    e = sample(logits, rows, history, [20, 20], _gens([13, 14], device))
    assert not torch.equal(d.tokens, e.tokens)
    assert c.tokens.shape == (2, NUM_VQ)


def _decode(logits_seq, rows, seeds, device):
    """A toy decode loop: fixed per-step logits, history grows with each row's own tokens."""
    gens = _gens(seeds, device)
    history = _empty(len(rows), device)
    tokens, logprobs = [], []
    for step, logits in enumerate(logits_seq):
        out = sample(logits, rows, history, [step] * len(rows), gens)
        history = [torch.cat([h, t[:, None]], 1) for h, t in zip(history, out.tokens, strict=True)]
        tokens.append(out.tokens)
        logprobs.append(out.logprobs)
    return torch.stack(tokens, 1), torch.stack(logprobs, 1), history


@pytest.mark.parametrize("device", DEVICES)
def test_row_alone_equals_row_in_batch(device):
    rows = [
        CHATTTS_CODE,
        SamplingRow(temperature=1.0),
        SamplingRow(temperature=0.0, repetition_penalty=1.5),
        SamplingRow(temperature=(0.2, 0.9, 0.0, 1.5), top_p=0.5, top_k=3, min_keep=1),
        SamplingRow(temperature=0.8, top_k=50, repetition_penalty=1.2, penalty_window=4),
    ]
    seeds = [101, 102, 103, 104, 105]
    steps = [_logits(5, device, seed=s) for s in range(12)]
    tokens, logprobs, _ = _decode(steps, rows, seeds, device)
    for b in range(5):
        alone_t, alone_l, _ = _decode([x[b : b + 1] for x in steps], [rows[b]], [seeds[b]], device)
        assert torch.equal(alone_t[0], tokens[b])
        assert torch.equal(alone_l[0], logprobs[b])


@pytest.mark.parametrize("device", DEVICES)
def test_recompute_logprobs_matches_sampled(device):
    rows = [CHATTTS_CODE, SamplingRow(temperature=(0.2, 0.9, 0.0, 1.5), repetition_penalty=1.1)]
    steps = [_logits(2, device, seed=s) for s in range(10)]
    tokens, logprobs, history = _decode(steps, rows, [1, 2], device)
    for step, logits in enumerate(steps):
        past = [h[:, :step] for h in history]
        again = recompute_logprobs(logits, rows, past, [step, step], tokens[:, step])
        assert torch.max(torch.abs(again - logprobs[:, step])) <= 1e-6
        # a batch of one recomputes the same values
        alone = recompute_logprobs(logits[1:], rows[1:], past[1:], [step], tokens[1:, step])
        assert torch.max(torch.abs(alone - logprobs[1:, step])) <= 1e-6


@pytest.mark.parametrize("device", DEVICES)
def test_empirical_frequencies_match_processed_probs(device):
    base = torch.tensor([1.0, 0.2, -0.5], device=device)
    batch = 1000  # x 4 codebooks = 4000 draws, each row with its own generator
    logits = base.expand(batch, NUM_VQ, 3).contiguous()
    row = SamplingRow(temperature=0.7, min_keep=1)
    rows, empty = [row] * batch, _empty(batch, device)
    out = sample(logits, rows, empty, [0] * batch, _gens(list(range(batch)), device))
    probs = torch.softmax(base / 0.7, -1)
    freq = torch.bincount(out.tokens.flatten(), minlength=3).double() / out.tokens.numel()
    assert torch.max(torch.abs(freq.cpu() - probs.double().cpu())) < 0.03
    torch.testing.assert_close(out.logprobs, probs.log()[out.tokens])


def test_validation_names_the_field():
    for field, value in [
        ("temperature", -0.1),
        ("temperature", (1.0, math.nan)),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -1),
        ("repetition_penalty", 0.0),
        ("penalty_window", -1),
        ("min_new_tokens", -2),
        ("eos_token_id", -1),
        ("min_keep", 0),
    ]:
        with pytest.raises(ValueError, match=field):
            SamplingRow(**{field: value})
    assert SamplingRow().min_keep == 3
    logits = _logits(1, "cpu")
    with pytest.raises(ValueError, match="generators"):
        sample(logits, [SamplingRow(temperature=1.0)], _empty(1, "cpu"), [0], [None])
    with pytest.raises(ValueError, match="history"):
        sample(logits, [SamplingRow()], [], [0], [None])


def test_policy_logprobs_ignore_truncation_penalty_and_mask():
    """``policy_logprobs`` is log_softmax(logits / temperature) over the whole vocab, whatever
    the row's top-p/top-k, repetition penalty or EOS mask; greedy codebooks count as T = 1."""
    torch.manual_seed(0)
    logits = torch.randn(3, 2, 50)
    rows = [
        SamplingRow(temperature=0.7, top_p=0.5, top_k=5, repetition_penalty=1.3),
        SamplingRow(temperature=(0.0, 2.0), min_new_tokens=4, eos_token_id=7),
        SamplingRow(),
    ]
    tokens = torch.tensor([[1, 2], [7, 49], [0, 10]])
    got = policy_logprobs(logits, rows, tokens)
    temps = torch.tensor([[0.7, 0.7], [1.0, 2.0], [1.0, 1.0]]).unsqueeze(-1)
    want = torch.log_softmax(logits / temps, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    assert torch.equal(got, want)
    generators = [torch.Generator().manual_seed(k) for k in range(3)]
    history = [torch.zeros(2, 0, dtype=torch.long)] * 3
    out = sample(logits, rows, history, [0, 0, 0], generators, with_policy=True)
    assert torch.equal(out.policy_logprobs, policy_logprobs(logits, rows, out.tokens))
    with pytest.raises(ValueError, match="rows"):
        policy_logprobs(logits, rows[:2], tokens)


@pytest.mark.parametrize("device", DEVICES)
def test_top_k_without_top_p_skips_the_sort_and_cuts_the_same_tokens(device):
    """Rows with ``top_p == 1`` take ``torch.topk`` instead of a full sort: the same logits
    bit for bit as the sorted path, on ordinary, peaked (probabilities that underflow to 0),
    suppressed (-inf) and tied rows, per-row k (none, below ``min_keep``, more than the
    positive-probability tokens); a row with fewer positive-probability tokens than
    ``min_keep`` goes back to the sort."""
    from dataclasses import replace

    from omnistep.sampling import apply_top_p_top_k, build_params

    g = torch.Generator().manual_seed(3)
    batch, vocab = 6, 3072
    x = torch.randn(batch, 2, vocab, generator=g) * 4
    x[1, :, :1500] -= 300.0  # 1500 ids of probability 0 (float32 underflow), not -inf
    x[2, :, :1024] = -math.inf  # suppressed ids (Qwen3-TTS's codebook-0 head)
    x[3] = torch.randint(0, 4, (2, vocab), generator=g).float()  # heavy ties at the k-th
    x[4, :, 7:] -= 200.0  # 7 ids of positive probability, top-k 50 keeps all of them
    x = x.to(device)
    rows = [
        SamplingRow(top_k=50),
        SamplingRow(top_k=50),
        SamplingRow(top_k=2),  # below min_keep 3: keeps 3
        SamplingRow(top_k=50),
        SamplingRow(top_k=50),
        SamplingRow(top_k=0),  # no top-k: only zero-probability ids are cut
    ]
    params = build_params(rows, [0] * batch, 2, vocab, x.device)
    assert params.sort_free_k == 50
    fast = apply_top_p_top_k(x, params)
    sorted_path = apply_top_p_top_k(x, replace(params, sort_free_k=None))
    assert torch.equal(fast, sorted_path)
    assert torch.isneginf(fast[1, :, :1500]).all() and torch.isfinite(fast[4, :, :7]).all()
    assert (torch.isfinite(fast[0]).sum(-1) == 50).all()
    assert (torch.isfinite(fast[2]).sum(-1) == 3).all()

    # one row with 2 ids of positive probability (< min_keep 3): the sort decides
    x[0, :, 2:] -= 300.0
    fast = apply_top_p_top_k(x, params)
    assert torch.equal(fast, apply_top_p_top_k(x, replace(params, sort_free_k=None)))
    assert (torch.isfinite(fast[0]).sum(-1) == 3).all()

    # any row with top-p < 1, or a large top-k, keeps the sorted path
    assert (
        build_params([*rows[:5], SamplingRow(top_p=0.9)], [0] * batch, 2, vocab, "cpu").sort_free_k
        is None
    )
    assert build_params([SamplingRow(top_k=300)], [0], 2, vocab, "cpu").sort_free_k is None


def test_top_k_without_sort_agrees_where_a_probability_rounds_near_zero():
    """A probability within float32's subnormals of 0 (a logit ~103 below the row's maximum)
    is 0 or not depending on the order the softmax's sum ran in: the sorted path sums in sorted
    order, so ``_top_k_without_sort`` must leave such rows to it. Rows of two near-equal maxima
    (a sum near 2), a few tiny terms that round the sum differently by order, and one logit at
    float32's smallest subnormal probability; every row must get the sorted path's logits."""
    from dataclasses import replace

    from omnistep.sampling import apply_top_p_top_k, build_params
    from omnistep.sampling.processors import _top_k_without_sort

    g = torch.Generator().manual_seed(1)
    batch, vocab = 512, 2048
    x = torch.full((batch, 1, vocab), -200.0)
    x[:, 0, 0] = 0.0
    x[:, 0, 1] = torch.log1p(-torch.rand(batch, generator=g, dtype=torch.float64) * 1e-6).float()
    small = math.log(2**-25) + torch.randn(batch, 40, generator=g) * 0.5
    used = torch.arange(40) < torch.randint(3, 40, (batch, 1), generator=g)
    x[:, 0, 2:42] = torch.where(used, small, torch.tensor(-200.0))
    x[:, 0, 100] = math.log(2**-149) + torch.rand(batch, generator=g) * 0.7
    x = x[..., torch.randperm(vocab, generator=g)]
    params = build_params([SamplingRow(top_k=50)] * batch, [0] * batch, 1, vocab, x.device)
    assert params.sort_free_k == 50
    fast = apply_top_p_top_k(x, params)
    assert torch.equal(fast, apply_top_p_top_k(x, replace(params, sort_free_k=None)))
    # ordinary rows (and ids of probability far below float32's) still skip the sort
    ordinary = torch.randn(batch, 1, vocab, generator=g) * 4
    ordinary[:, :, :100] -= 300.0
    assert _top_k_without_sort(ordinary, params, 50) is not None
