"""Tests of omnistep.layers against transformers' Llama (CPU, float32, tiny configs).

Parity: RMSNorm and RoPE bit-exact; paged attention vs a dense float64 reference; LlamaModel over
the paged cache vs transformers' LlamaModel with its DynamicCache, one sequence at a time.
Batch invariance: with ``batch_invariant`` a sequence's outputs are bit-identical alone or batched.
"""

from __future__ import annotations

import inspect
import math
import random
import time

import pytest
import torch
from transformers import DynamicCache, LlamaConfig
from transformers import LlamaModel as HFLlamaModel
from transformers.models.llama.modeling_llama import (
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from omnistep.kv import BlockManager
from omnistep.layers import (
    AttentionMetadata,
    LlamaConfigLite,
    LlamaModel,
    PagedKVCache,
    RMSNorm,
    RotaryEmbedding,
    RowChunking,
    apply_rope,
    map_row_chunks,
    paged_attention,
    rope_cos_sin,
    write_kv,
)

PARITY_TOL = 1e-4
PREFILL_LENS = (5, 11, 17)
NUM_DECODE_STEPS = 8
BLOCK_SIZE = 4
NUM_BLOCKS = 64


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny ops on a shared 2-core box: OpenMP barriers cost ms when a core is busy elsewhere."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


# ---------------------------------------------------------------- RMSNorm and RoPE


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_matches_transformers(dtype):
    torch.manual_seed(0)
    ours, theirs = RMSNorm(48, eps=1e-6), LlamaRMSNorm(48, eps=1e-6)
    with torch.no_grad():
        ours.weight.copy_(1 + 0.3 * torch.randn(48))
        theirs.weight.copy_(ours.weight)
    x = (3 * torch.randn(7, 5, 48)).to(dtype)
    assert list(ours.state_dict()) == ["weight"]
    assert torch.equal(ours(x), theirs(x))


def test_rope_matches_transformers():
    config = LlamaConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0
    )
    positions = torch.tensor([0, 1, 2, 7, 100, 1999])
    x = torch.randn(1, positions.numel(), 64)
    cos_ref, sin_ref = LlamaRotaryEmbedding(config)(x, positions[None])
    cos, sin = rope_cos_sin(positions, 16, 10000.0, torch.float32, "cpu")
    assert torch.equal(cos, cos_ref[0]) and torch.equal(sin, sin_ref[0])

    table = RotaryEmbedding(16, 10000.0, max_positions=2048)
    assert table.state_dict() == {}
    assert all(
        torch.equal(a, b) for a, b in zip(table(positions, torch.float32), (cos, sin), strict=True)
    )

    q, k = torch.randn(6, 4, 16), torch.randn(6, 2, 16)
    q_ref, k_ref = apply_rotary_pos_emb(  # [batch, heads, seq, dim] layout there
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos_ref, sin_ref
    )
    q_rot, k_rot = apply_rope(q, k, cos, sin)
    assert torch.equal(q_rot, q_ref[0].transpose(0, 1))
    assert torch.equal(k_rot, k_ref[0].transpose(0, 1))


def test_llama3_rope_scaling_matches_transformers():
    """Llama 3.1's rescaled frequencies (Chatterbox's T3 config) against transformers' rope on a
    config whose low, medium and high frequency bands are all populated (head_dim 64)."""
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    config = LlamaConfig(
        hidden_size=256,
        num_attention_heads=4,
        num_hidden_layers=1,
        intermediate_size=64,
        rope_theta=500000.0,
        rope_scaling=scaling,
    )
    positions = torch.tensor([0, 1, 5, 300, 4095])
    x = torch.randn(1, positions.numel(), 256)
    cos_ref, sin_ref = LlamaRotaryEmbedding(config)(x, positions[None])
    lite = LlamaConfigLite.from_hf(config)
    assert lite.rope_scaling is not None and lite.rope_scaling.factor == 8.0
    cos, sin = rope_cos_sin(positions, 64, 500000.0, torch.float32, "cpu", lite.rope_scaling)
    torch.testing.assert_close(cos, cos_ref[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, sin_ref[0], rtol=0, atol=1e-6)
    plain, _ = rope_cos_sin(positions, 64, 500000.0, torch.float32, "cpu")
    assert (plain - cos).abs().max() > 1e-3  # the scaling changes the low frequencies


def test_map_row_chunks_pads_and_trims():
    weight = torch.randn(8, 6)
    x = torch.randn(21, 6)
    shapes = []

    def fn(chunk):
        shapes.append(tuple(chunk.shape))
        return chunk @ weight.T

    out = map_row_chunks(fn, x, chunk_rows=8)
    assert shapes == [(8, 6)] * 3 and out.shape == (21, 8)
    torch.testing.assert_close(out, x @ weight.T)


# ---------------------------------------------------------------- metadata and attention


def test_metadata_slot_mapping_and_validation():
    meta = AttentionMetadata.build(
        query_lens=[3, 1], context_lens=[3, 6], block_tables=[[7], [2, 5]], block_size=4
    )
    assert meta.query_start_loc.tolist() == [0, 3, 4]
    assert meta.slot_mapping.tolist() == [28, 29, 30, 5 * 4 + 1]  # seq 1 token 5: block 5, +1
    assert meta.block_tables.tolist() == [[7, 0], [2, 5]]
    assert (meta.num_seqs, meta.num_tokens, meta.max_context_len) == (2, 4, 6)
    assert not meta.is_decode_only
    with pytest.raises(ValueError, match="query_lens"):
        AttentionMetadata.build([2], [1], [[0]], block_size=4)
    with pytest.raises(ValueError, match="block_tables"):
        AttentionMetadata.build([1], [5], [[0]], block_size=4)
    with pytest.raises(ValueError, match="differ in length"):
        AttentionMetadata.build([1, 1], [1], [[0]], block_size=4)


def _dense_attention(q, k, v, scale):
    """Float64 reference: ``q`` [L, H, D] at the last L positions of ``k``/``v`` [S, Hkv, D]."""
    query_len, num_heads, _ = q.shape
    context_len, num_kv_heads, _ = k.shape
    k = k.double().repeat_interleave(num_heads // num_kv_heads, dim=1)
    v = v.double().repeat_interleave(num_heads // num_kv_heads, dim=1)
    scores = torch.einsum("lhd,shd->hls", q.double(), k) * scale
    query_pos = torch.arange(context_len - query_len, context_len)[:, None]
    scores = scores.masked_fill(torch.arange(context_len)[None, :] > query_pos, -math.inf)
    return torch.einsum("hls,shd->lhd", scores.softmax(-1), v).float()


def _attention_case(query_lens, context_lens, seed=0):
    """A cache filled for each sequence's prefix, shuffled tables, and the step's new q/k/v."""
    gen = torch.Generator().manual_seed(seed)
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 8, 4
    cache = PagedKVCache(1, 40, block_size, num_kv_heads, head_dim)
    block_ids = torch.randperm(40, generator=gen).tolist()
    tables = []
    for context_len in context_lens:
        num_blocks = -(-context_len // block_size)
        tables.append(block_ids[:num_blocks])
        block_ids = block_ids[num_blocks:]
    full_k = [torch.randn(c, num_kv_heads, head_dim, generator=gen) for c in context_lens]
    full_v = [torch.randn(c, num_kv_heads, head_dim, generator=gen) for c in context_lens]
    prefix = AttentionMetadata.build(list(context_lens), list(context_lens), tables, block_size)
    write_kv(cache, 0, torch.cat(full_k), torch.cat(full_v), prefix)
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen)
    return cache, tables, q, full_k, full_v


def _run_attention(cache, tables, q, query_lens, context_lens, batch_invariant, padded=True):
    meta = AttentionMetadata.build(
        list(query_lens), list(context_lens), tables, cache.block_size,
        batch_invariant=batch_invariant, padded_decode=padded,
    )  # fmt: skip
    return paged_attention(q, cache, 0, meta, scale=8**-0.5)


@pytest.mark.parametrize(
    ("batch_invariant", "padded"), [(False, True), (False, False), (True, True)]
)
def test_paged_attention_matches_dense_reference(batch_invariant, padded):
    # prefill from scratch, decode, prefill continuing a cached prefix, short decode
    query_lens, context_lens = (7, 1, 5, 1), (7, 13, 12, 3)
    cache, tables, q, full_k, full_v = _attention_case(query_lens, context_lens)
    out = _run_attention(cache, tables, q, query_lens, context_lens, batch_invariant, padded)
    for i, rows in enumerate(out.split(query_lens)):
        q_i = q.split(query_lens)[i]
        expected = _dense_attention(q_i, full_k[i], full_v[i], 8**-0.5)
        torch.testing.assert_close(rows, expected, atol=1e-5, rtol=1e-5)


def test_decode_paths_agree_and_invariant_path_is_bit_identical():
    context_lens = (3, 17, 9, 30, 1)
    query_lens = (1,) * len(context_lens)
    cache, tables, q, _, _ = _attention_case(query_lens, context_lens, seed=3)
    padded = _run_attention(cache, tables, q, query_lens, context_lens, batch_invariant=False)
    exact = _run_attention(cache, tables, q, query_lens, context_lens, batch_invariant=True)
    torch.testing.assert_close(padded, exact, atol=1e-6, rtol=1e-6)
    for i, context_len in enumerate(context_lens):
        alone = _run_attention(
            cache, [tables[i]], q[i : i + 1], (1,), (context_len,), batch_invariant=True
        )
        assert torch.equal(alone[0], exact[i])


@pytest.mark.parametrize("query_len", [1, 5])
def test_consecutive_block_tables_read_the_pool_as_a_view_with_identical_results(
    query_len, monkeypatch
):
    """A table of consecutive blocks is read as a slice of the pool (no gather); the result
    equals the gather path's bit for bit and the dense reference within float rounding."""
    gen = torch.Generator().manual_seed(7)
    num_heads, num_kv_heads, head_dim, block_size, context_len = 4, 2, 8, 4, 14
    k = torch.randn(context_len, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(context_len, num_kv_heads, head_dim, generator=gen)
    q = torch.randn(query_len, num_heads, head_dim, generator=gen)
    outs, calls = [], []
    original = torch.Tensor.index_select

    def counting_index_select(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "index_select", counting_index_select)
    for table in ([3, 4, 5, 6], [9, 2, 7, 0]):  # consecutive, scattered
        cache = PagedKVCache(1, 12, block_size, num_kv_heads, head_dim)
        write_kv(cache, 0, k, v, AttentionMetadata.build([context_len], [context_len], [table], 4))
        calls.clear()
        outs.append(_run_attention(cache, [table], q, (query_len,), (context_len,), True))
        assert bool(calls) == (table[1] != table[0] + 1), table
    assert torch.equal(outs[0], outs[1])
    torch.testing.assert_close(outs[0], _dense_attention(q, k, v, 8**-0.5), atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- Llama vs transformers


def _tiny_configs() -> tuple[LlamaConfig, LlamaConfigLite]:
    hf_config = LlamaConfig(
        vocab_size=32,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=256,
        attn_implementation="eager",
    )
    return hf_config, LlamaConfigLite.from_hf(hf_config)


@pytest.fixture(scope="module")
def models() -> tuple[HFLlamaModel, LlamaModel]:
    """transformers' model with unit-scale random weights, and ours loaded from its state dict."""
    torch.manual_seed(0)
    hf_config, config = _tiny_configs()
    hf_model = HFLlamaModel(hf_config).eval()
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if name.endswith("layernorm.weight") or name == "norm.weight":
                param.copy_(1 + 0.2 * torch.randn_like(param))
            else:
                param.copy_(torch.randn_like(param) / math.sqrt(param.shape[-1]))
    model = LlamaModel(config).eval()
    model.load_hf_state_dict(hf_model.state_dict())
    return hf_model, model


@pytest.fixture(scope="module")
def inputs() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per sequence: prefill embeddings [L, 64] and decode embeddings [steps, 64]."""
    gen = torch.Generator().manual_seed(1)
    prefill = [torch.randn(n, 64, generator=gen) for n in PREFILL_LENS]
    decode = [torch.randn(NUM_DECODE_STEPS, 64, generator=gen) for _ in PREFILL_LENS]
    return prefill, decode


@pytest.fixture(scope="module")
def reference(models, inputs) -> list[torch.Tensor]:
    """transformers, one sequence at a time with its DynamicCache: [L + steps, 64] each."""
    hf_model, _ = models
    cache_kwarg = "cache" if "cache" in inspect.signature(hf_model.forward).parameters else None
    outputs = []
    with torch.no_grad():
        for prefill, decode in zip(*inputs, strict=True):
            kv = DynamicCache(config=hf_model.config)
            kwargs = {cache_kwarg or "past_key_values": kv, "use_cache": True}
            rows = [hf_model(inputs_embeds=prefill[None], **kwargs).last_hidden_state[0]]
            for embed in decode:
                rows.append(
                    hf_model(inputs_embeds=embed[None, None], **kwargs).last_hidden_state[0]
                )
            outputs.append(torch.cat(rows))
    return outputs


class PagedRunner:
    """Drives LlamaModel over a paged cache the way a component would, with BlockManager tables.

    ``block_perm`` renames the manager's block ids (a shuffled, non-contiguous layout).
    """

    def __init__(self, model, batch_invariant=False, block_perm=None, padded_decode=None):
        self.model = model
        self.cache = model.make_cache(NUM_BLOCKS, BLOCK_SIZE)
        self.manager = BlockManager(NUM_BLOCKS, BLOCK_SIZE)
        self.block_perm = block_perm or list(range(NUM_BLOCKS))
        self.batch_invariant = batch_invariant
        self.padded_decode = padded_decode
        self.context_lens: dict[int, int] = {}

    def step(self, seq_ids: list[int], embeds: list[torch.Tensor]) -> list[torch.Tensor]:
        query_lens = [e.shape[0] for e in embeds]
        context_lens = [
            self.context_lens.get(s, 0) + n for s, n in zip(seq_ids, query_lens, strict=True)
        ]
        tables = [
            [self.block_perm[b] for b in self.manager.allocate(s, c)]
            for s, c in zip(seq_ids, context_lens, strict=True)
        ]
        device = self.cache.device
        meta = AttentionMetadata.build(
            query_lens, context_lens, tables, BLOCK_SIZE, device, self.batch_invariant,
            self.padded_decode,
        )  # fmt: skip
        positions = torch.cat(
            [torch.arange(c - n, c) for n, c in zip(query_lens, context_lens, strict=True)]
        )
        positions = positions.to(device)
        with torch.no_grad():
            out = self.model(torch.cat(embeds), positions, self.cache, meta)
        self.context_lens.update(zip(seq_ids, context_lens, strict=True))
        return list(out.split(query_lens))


def _run_batched(runner, inputs, seq_ids=(0, 1, 2)) -> list[torch.Tensor]:
    """Prefill ``seq_ids`` as one varlen batch, then decode them together step by step."""
    prefill, decode = inputs
    seq_ids = list(seq_ids)
    rows = {
        s: [out]
        for s, out in zip(seq_ids, runner.step(seq_ids, [prefill[s] for s in seq_ids]), strict=True)
    }
    for t in range(NUM_DECODE_STEPS):
        outs = runner.step(seq_ids, [decode[s][t : t + 1] for s in seq_ids])
        for s, out in zip(seq_ids, outs, strict=True):
            rows[s].append(out)
    return [torch.cat(rows[s]) for s in seq_ids]


def _max_diff(outputs, expected) -> float:
    return max((a - b).abs().max().item() for a, b in zip(outputs, expected, strict=True))


def test_llama_state_dict_matches_transformers(models):
    hf_model, model = models
    assert set(model.state_dict()) == set(hf_model.state_dict()) - {"embed_tokens.weight"}
    fresh = LlamaModel(model.config)
    fresh.load_hf_state_dict({f"model.{k}": v for k, v in hf_model.state_dict().items()}, "model.")
    assert all(
        torch.equal(a, b) for a, b in zip(fresh.parameters(), model.parameters(), strict=True)
    )
    with pytest.raises(RuntimeError, match="Missing"):
        fresh.load_hf_state_dict({"norm.weight": model.norm.weight})


# (batch_invariant, padded_decode): per-sequence attention, padded decode, batch-invariant
MODES = [(False, False), (False, True), (True, None)]


@pytest.mark.parametrize(("batch_invariant", "padded"), MODES)
def test_llama_matches_transformers_prefill_then_decode(
    models, inputs, reference, batch_invariant, padded
):
    _, model = models
    outputs = _run_batched(PagedRunner(model, batch_invariant, padded_decode=padded), inputs)
    max_diff = _max_diff(outputs, reference)
    print(f"\nmax |ours - transformers| {batch_invariant=} {padded=}: {max_diff:.2e}")
    assert max_diff <= PARITY_TOL


def test_llama_shuffled_block_tables_give_identical_results(models, inputs):
    _, model = models
    perm = list(range(NUM_BLOCKS))
    random.Random(7).shuffle(perm)
    for batch_invariant, padded in MODES:
        plain = _run_batched(PagedRunner(model, batch_invariant, None, padded), inputs)
        shuffled = _run_batched(PagedRunner(model, batch_invariant, perm, padded), inputs)
        assert all(torch.equal(a, b) for a, b in zip(plain, shuffled, strict=True))


def _staggered_schedule(inputs, seq_id) -> list[torch.Tensor | None]:
    """Per tick, the rows a sequence feeds (None: absent). Sequences 0 and 1 prefill at tick 0
    and then decode; sequence 2 arrives at tick 1 and prefills in two chunks (6, then 11 rows
    over a cached prefix) while the others decode, so ticks 1 and 2 are mixed batches."""
    prefill, decode = inputs
    if seq_id < 2:
        return [prefill[seq_id]] + [decode[seq_id][t : t + 1] for t in range(NUM_DECODE_STEPS)]
    chunks = [prefill[2][:6], prefill[2][6:]]
    return [None, *chunks] + [decode[2][t : t + 1] for t in range(NUM_DECODE_STEPS - 2)]


def _run_staggered(runner, inputs, seq_ids=(0, 1, 2)) -> list[torch.Tensor]:
    schedules = {s: _staggered_schedule(inputs, s) for s in seq_ids}
    rows = {s: [] for s in seq_ids}
    for tick in range(max(len(schedule) for schedule in schedules.values())):
        active = [s for s in seq_ids if tick < len(schedules[s]) and schedules[s][tick] is not None]
        if not active:
            continue
        outs = runner.step(active, [schedules[s][tick] for s in active])
        for s, out in zip(active, outs, strict=True):
            rows[s].append(out)
    return [torch.cat(rows[s]) for s in seq_ids]


@pytest.mark.parametrize(("batch_invariant", "padded"), MODES)
def test_llama_mixed_batches_and_chunked_prefill_match_transformers(
    models, inputs, reference, batch_invariant, padded
):
    _, model = models
    outputs = _run_staggered(PagedRunner(model, batch_invariant, None, padded), inputs)
    num_rows_2 = PREFILL_LENS[2] + NUM_DECODE_STEPS - 2
    expected = [reference[0], reference[1], reference[2][:num_rows_2]]
    assert _max_diff(outputs, expected) <= PARITY_TOL


def _alone_vs_batched(model, inputs, run_fn, batch_invariant, padded=None) -> list[bool]:
    def run(seq_ids):
        return run_fn(PagedRunner(model, batch_invariant, None, padded), inputs, seq_ids)

    batched = run([0, 1, 2])
    return [torch.equal(run([s])[0], batched[s]) for s in range(3)]


@pytest.fixture(scope="module")
def small_chunk_model(models) -> LlamaModel:
    """The same weights with tiny invariant chunks, so rows straddle chunk boundaries."""
    _, model = models
    small = LlamaModel(model.config, row_chunking=RowChunking(decode_rows=2, prefill_rows=8))
    small.load_state_dict(model.state_dict())
    return small.eval()


@pytest.mark.parametrize("padded", [None, True])
@pytest.mark.parametrize("run_fn", [_run_batched, _run_staggered])
def test_llama_batch_invariant_outputs_are_bit_identical_alone_and_batched(
    models, small_chunk_model, inputs, run_fn, padded
):
    for model in (models[1], small_chunk_model):
        assert _alone_vs_batched(model, inputs, run_fn, True, padded) == [True, True, True]


def test_llama_default_path_batch_dependence_is_reported(models, inputs):
    """Not guaranteed by the default path (dense kernels see the batch's M); printed."""
    for padded in (False, True):
        same = _alone_vs_batched(models[1], inputs, _run_batched, False, padded)
        print(f"\ndefault path ({padded=}) bit-identical alone vs batched: {same}")


def test_llama_config_validates():
    _, config = _tiny_configs()
    assert (config.head_dim, config.num_key_value_heads) == (16, 2)
    assert LlamaConfigLite(64, 4, 1, 128).num_key_value_heads == 4
    with pytest.raises(ValueError, match="num_key_value_heads"):
        LlamaConfigLite(64, 4, 1, 128, num_key_value_heads=3)
    with pytest.raises(ValueError, match="hidden_act"):
        LlamaConfigLite(64, 4, 1, 128, hidden_act="gelu")
    with pytest.raises(ValueError, match="num_hidden_layers"):
        LlamaConfigLite(64, 4, 0, 128)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model = LlamaModel(LlamaConfigLite(64, 4, 1, 128, max_position_embeddings=4))
        meta = AttentionMetadata.build([5], [5], [[0, 1]], block_size=4)
        model(torch.zeros(5, 64), torch.arange(5), model.make_cache(2, 4), meta)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_llama_cuda_matches_cpu_and_is_batch_invariant(models, inputs, reference):
    _, cpu_model = models
    model = LlamaModel(cpu_model.config, device="cuda")
    model.load_state_dict(cpu_model.state_dict())
    cuda_inputs = tuple([x.cuda() for x in group] for group in inputs)

    outputs = _run_batched(PagedRunner(model), cuda_inputs)
    assert _max_diff([o.cpu() for o in outputs], reference) <= 1e-3
    for run_fn in (_run_batched, _run_staggered):
        assert _alone_vs_batched(model, cuda_inputs, run_fn, True) == [True, True, True]


# ---------------------------------------------------------------- timing (not run by default)


def _time_decode_attention(batch, context_lens, padded, repeats=20) -> float:
    num_heads, head_dim, block_size = 12, 64, 16
    num_blocks = sum(-(-c // block_size) for c in context_lens) + 1
    cache = PagedKVCache(1, num_blocks, block_size, num_heads, head_dim)
    cache.key_cache.normal_(), cache.value_cache.normal_()
    ids = torch.randperm(num_blocks).tolist()
    tables = []
    for c in context_lens:
        tables.append(ids[: -(-c // block_size)])
        ids = ids[len(tables[-1]) :]
    meta = AttentionMetadata.build(
        [1] * batch, list(context_lens), tables, block_size, padded_decode=padded
    )
    q = torch.randn(batch, num_heads, head_dim)
    best = math.inf  # the minimum: the box is shared, interference only adds time
    for _ in range(repeats + 1):
        start = time.perf_counter()
        paged_attention(q, cache, 0, meta, head_dim**-0.5)
        best = min(best, time.perf_counter() - start)
    return best * 1e3


@pytest.mark.slow
def test_print_decode_attention_timing():
    """ChatTTS-sized decode attention (12 heads x 64) per layer: padded vs per-sequence."""
    rng = random.Random(0)
    print("\nbatch  contexts    padded_ms  per_seq_ms")
    for batch in (1, 4, 16):
        for label in ("50", "500", "50..500"):
            if label == "50..500":
                lens = [rng.randint(50, 500) for _ in range(batch)]
            else:
                lens = [int(label)] * batch
            padded = _time_decode_attention(batch, lens, padded=True)
            exact = _time_decode_attention(batch, lens, padded=False)
            print(f"{batch:5d}  {label:10s}  {padded:9.3f}  {exact:10.3f}")


@pytest.mark.parametrize("run_fn", [_run_batched, _run_staggered])
def test_llama_batch_invariant_with_chunked_gemms(models, inputs, run_fn, monkeypatch):
    """The fallback when a CPU's packed GEMMs are not batch-invariant: fixed-size row chunks."""
    model = models[1]
    print(f"\nGEMMs batch-invariant unchunked: {model.gemms_batch_invariant(torch.zeros(1, 1))}")
    monkeypatch.setattr(LlamaModel, "gemms_batch_invariant", lambda self, x: False)
    assert _alone_vs_batched(model, inputs, run_fn, True, None) == [True, True, True]


# ---------------------------------------------------------------- forward_dense (train = serve)


def _dense_inputs(inputs, s) -> torch.Tensor:
    prefill, decode = inputs
    return torch.cat([prefill[s], decode[s]])


@pytest.mark.parametrize("chunked_gemms", [False, True])
def test_forward_dense_reruns_serving_rows_bit_for_bit(
    models, small_chunk_model, inputs, chunked_gemms, monkeypatch
):
    """With ``prefill_len`` and ``batch_invariant``, each row of one whole-sequence forward
    equals the row serving computed in a batch (prefill, then decode steps), to the bit;
    with the plain causal path, within rounding."""
    if chunked_gemms:
        monkeypatch.setattr(LlamaModel, "gemms_batch_invariant", lambda self, x: False)
    for model in (models[1], small_chunk_model):
        served = _run_batched(PagedRunner(model, batch_invariant=True), inputs)
        for s, n in enumerate(PREFILL_LENS):
            x = _dense_inputs(inputs, s)
            with torch.no_grad():
                exact = model.forward_dense(x, prefill_len=n, batch_invariant=True)
                plain = model.forward_dense(x)
            assert torch.equal(exact, served[s]), (s, (exact - served[s]).abs().max())
            assert (plain - served[s]).abs().max().item() <= 1e-5


def test_forward_dense_matches_transformers_and_its_gradients(models, inputs):
    """The plain causal path equals transformers' forward, and its gradients (the packed
    linears' custom backward included) equal transformers' autograd."""
    hf_model, model = models
    x = _dense_inputs(inputs, 2)
    model.zero_grad()
    hf_model.zero_grad()
    ours = model.forward_dense(x)
    theirs = hf_model(inputs_embeds=x[None]).last_hidden_state[0]
    assert (ours - theirs).abs().max().item() <= PARITY_TOL
    weights = torch.randn_like(ours)
    (ours * weights).sum().backward()
    (theirs * weights).sum().backward()
    hf_params = dict(hf_model.named_parameters())
    for name, param in model.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name
        ref = hf_params[name].grad
        assert (param.grad - ref).abs().max().item() <= 1e-4 * (1 + ref.abs().max().item()), name
    model.zero_grad()
    hf_model.zero_grad()


def test_forward_dense_validates():
    model = LlamaModel(LlamaConfigLite(64, 4, 1, 128, max_position_embeddings=4))
    with pytest.raises(ValueError, match="prefill_len"):
        model.forward_dense(torch.zeros(3, 64), prefill_len=4)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model.forward_dense(torch.zeros(5, 64))


def test_segment_attention_equals_a_block_diagonal_mask():
    """``segment_attention`` over segments of mixed lengths (a zero-length one included)
    equals SDPA over the whole sequence with a block-diagonal mask (float64)."""
    from omnistep.layers.segment_attention import segment_attention

    torch.manual_seed(0)
    lengths = [5, 3, 0, 5, 1, 7]
    q, k, v = (torch.randn(2, sum(lengths), 4, dtype=torch.float64) for _ in range(3))
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    mask = ids[:, None] == ids[None, :]
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(segment_attention(q, k, v, lengths), want, atol=1e-12, rtol=0)
    with pytest.raises(ValueError, match="do not cover"):
        segment_attention(q, k, v, [5, 3])
