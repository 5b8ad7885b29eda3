"""Chatterbox T3 on the shared paged AR component, against the reference (chatterbox-tts 0.1.7
in the ``.ref/chatterbox`` overlay) on a tiny checkpoint its own ``T3`` wrote: prompt rows,
classifier-free-guided logits within 1e-4 and greedy tokens identical; the loader's file checks;
the guidance mechanism's bookkeeping (the two rows of a request admitted, grown and freed
together; log-probs of the guided distribution; batch-mates unaffected)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from omnistep.core import WorkUnitKind
from omnistep.kv import KVCacheConfig
from omnistep.loops.ar_decode import ARPrefillInput, ARStepInput
from omnistep.models.chatterbox.loader import (
    ChatterboxCheckpointError,
    check_folder,
    load_default_voice,
    load_t3,
)
from omnistep.models.chatterbox.t3 import T3Prompt
from omnistep.runners.paged_ar import uncond_id
from omnistep.sampling import SamplingRow, processed_logprobs
from tests.chatterbox_ref.env import call_reference

TEXT = [10, 11, 9, 12, 30, 8]
STEPS = 8
EOS = 6562


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("chatterbox")
    call_reference("tests.chatterbox_ref.upstream_t3:write_checkpoint", root=str(root))
    return root


@pytest.fixture(scope="module")
def reference(checkpoint) -> dict:
    return call_reference(
        "tests.chatterbox_ref.upstream_t3:greedy",
        root=str(checkpoint),
        text_ids=TEXT,
        cfg_weight=0.5,
        exaggeration=0.7,
        max_new_tokens=STEPS,
    )


@pytest.fixture(scope="module")
def t3(checkpoint):
    return load_t3(checkpoint, KVCacheConfig(num_blocks=64, block_size=16))


def _prompt(checkpoint: Path, cfg_weight: float | None = 0.5, text=TEXT) -> T3Prompt:
    voice = load_default_voice(checkpoint)
    assert voice is not None
    return T3Prompt(tuple(text), voice.speaker, voice.prompt_tokens, 0.7, cfg_weight)


GREEDY = SamplingRow(temperature=0.0, eos_token_id=EOS)


def _generate(t3, prompts: dict[str, T3Prompt], steps: int = STEPS):
    """Greedy decode of several requests batched together; per request its tokens, log-probs
    and the logits the sampler saw (``_sampling_logits``' input)."""
    seen: list[torch.Tensor] = []
    t3._sampling_logits = lambda logits: seen.append(logits.clone()) or logits
    try:
        ids = list(prompts)
        units = [ARPrefillInput(s, prompts[s], (), (), GREEDY, None) for s in ids]
        outs = t3.execute(WorkUnitKind.PREFILL, units)
        tokens = {s: [o.tokens[0]] for s, o in zip(ids, outs, strict=True)}
        logprobs = {s: [o.logprobs[0]] for s, o in zip(ids, outs, strict=True)}
        logits = {s: [seen[-1][j, 0]] for j, s in enumerate(ids)}
        for _ in range(steps - 1):
            live = [s for s in ids if tokens[s][-1] != EOS]
            if not live:
                break
            steps_in = [
                ARStepInput(s, (tokens[s][-1],), len(tokens[s]), (), GREEDY, None) for s in live
            ]
            outs = t3.execute(WorkUnitKind.AR_TOKEN, steps_in)
            for j, (s, o) in enumerate(zip(live, outs, strict=True)):
                assert not o.preempted
                tokens[s].append(o.tokens[0])
                logprobs[s].append(o.logprobs[0])
                logits[s].append(seen[-1][j, 0])
    finally:
        del t3._sampling_logits
        for s in prompts:
            t3.free_sequence(s)
    return tokens, logprobs, {s: torch.stack(v) for s, v in logits.items()}


def test_prompt_rows_match_reference(t3, checkpoint, reference):
    unit = ARPrefillInput("rows", _prompt(checkpoint), (), (), GREEDY, None)
    rows = t3._prefill_inputs(unit).float()
    ref = torch.from_numpy(reference["prefix"])  # upstream's prompt embeddings: one BOS row
    assert rows.shape[0] == ref.shape[0] + 1  # upstream feeds the start of speech again
    torch.testing.assert_close(rows[:-1], ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(rows[-1], ref[-1], rtol=0, atol=1e-6)
    uncond = t3._unconditional_inputs(unit).float()
    text = slice(34, 34 + len(TEXT) + 2)
    torch.testing.assert_close(uncond[:34], rows[:34], rtol=0, atol=0)
    assert (uncond[text] - rows[text]).abs().max() > 1e-3  # text embeddings zeroed
    torch.testing.assert_close(uncond[text], t3.text_pos_emb.weight[: len(TEXT) + 2])


def test_guided_greedy_matches_reference(t3, checkpoint, reference):
    tokens, logprobs, logits = _generate(t3, {"r0": _prompt(checkpoint)})
    ref_tokens = reference["tokens"]
    assert tokens["r0"] == ref_tokens
    ref_logits = torch.from_numpy(reference["logits"])
    assert logits["r0"].shape == ref_logits.shape
    torch.testing.assert_close(logits["r0"], ref_logits, rtol=0, atol=1e-4)
    # the log-probs reported are of the guided distribution the token was drawn from
    expected = torch.log_softmax(ref_logits, -1)[torch.arange(len(ref_tokens)), ref_tokens]
    np.testing.assert_allclose(logprobs["r0"], expected.numpy(), atol=1e-4)
    assert t3.blocks.num_used_blocks == 0  # both rows freed


def test_sampling_chain_matches_reference(checkpoint):
    """Upstream's processors at its defaults (repetition penalty 1.2 over every generated id and
    the start of speech, temperature 0.8, min_p 0.05, top_p 0.95 here to cut too) against
    ``processed_logprobs`` on upstream's own guided logits, step by step: equal distributions
    (the penalty once per id, as transformers', before temperature or after: they commute)."""
    settings = dict(repetition_penalty=1.2, temperature=0.8, min_p=0.05, top_p=0.95)
    ref = call_reference(
        "tests.chatterbox_ref.upstream_t3:greedy",
        root=str(checkpoint),
        text_ids=TEXT,
        cfg_weight=0.5,
        exaggeration=0.7,
        max_new_tokens=6,
        **settings,
    )
    row = SamplingRow(
        temperature=0.8,
        top_p=0.95,
        min_p=0.05,
        repetition_penalty=1.2,
        penalty_compounds=False,
        penalty_window=4096,  # every generated id counts, as upstream's
        min_keep=1,
    )
    logits = torch.from_numpy(ref["logits"])[:, None]  # [T, 1, V]
    history = [torch.tensor([[6561, *ref["tokens"][:i]]]) for i in range(len(ref["tokens"]))]
    n = len(history)
    logp, _, _ = processed_logprobs(logits, [row] * n, history, list(range(n)))
    probs = torch.from_numpy(ref["probs"])
    kept, ours = probs > 0, logp[:, 0].exp()
    assert bool((kept.sum(-1) < probs.shape[-1] * 0.7).all())  # min_p / top_p did cut
    assert torch.equal(torch.isfinite(logp[:, 0]), kept)  # the same tokens cut
    torch.testing.assert_close(ours, probs, rtol=0, atol=1e-6)  # measured: 6e-10


def test_guidance_changes_the_distribution(t3, checkpoint, reference):
    _, _, plain = _generate(t3, {"p": _prompt(checkpoint, cfg_weight=None)}, steps=1)
    ref_first = torch.from_numpy(reference["logits"][0])
    assert (plain["p"][0] - ref_first).abs().max() > 1e-2


def test_guided_and_plain_requests_batch_as_alone(t3, checkpoint):
    guided = _prompt(checkpoint)
    plain = _prompt(checkpoint, cfg_weight=None, text=TEXT[:3])
    heavy = _prompt(checkpoint, cfg_weight=1.5, text=TEXT[::-1])
    alone = {k: _generate(t3, {k: p}) for k, p in {"g": guided, "p": plain, "h": heavy}.items()}
    together = _generate(t3, {"g": guided, "p": plain, "h": heavy})
    for k in ("g", "p", "h"):
        assert together[0][k] == alone[k][0][k]
        torch.testing.assert_close(together[2][k], alone[k][2][k], rtol=0, atol=1e-4)
    assert t3.blocks.num_used_blocks == 0


def test_guided_rows_are_admitted_and_freed_together(t3, checkpoint):
    unit = ARPrefillInput("pair", _prompt(checkpoint), (), (), GREEDY, None)
    [out] = t3.execute(WorkUnitKind.PREFILL, [unit])
    n = t3._prefill_inputs(unit).shape[0]
    assert t3.lengths["pair"] == t3.lengths[uncond_id("pair")] == n
    step = ARStepInput("pair", out.tokens, 1, (), GREEDY, None)
    t3.execute(WorkUnitKind.AR_TOKEN, [step])
    assert t3.lengths["pair"] == t3.lengths[uncond_id("pair")] == n + 1
    assert t3.preemption_frees(step) == t3.blocks.num_used_blocks
    assert t3.preempt(step) > 0
    assert "pair" not in t3.lengths and uncond_id("pair") not in t3.lengths
    assert t3.blocks.num_used_blocks == 0
    assert t3.table.preempted == {"pair"}  # its step answers preempted; no stray row marked
    [answer] = t3.execute(WorkUnitKind.AR_TOKEN, [step])
    assert answer.preempted
    t3.free_sequence("pair")
    assert not t3.table.preempted


def test_guided_replay_after_preemption_continues_the_same(t3, checkpoint, reference):
    """A preempted guided request recomputes both rows by a prefill of its prompt and frames
    (the unconditional one too); the next step's guided logits are those of the first run."""
    tokens = reference["tokens"]
    seen: list[torch.Tensor] = []
    t3._sampling_logits = lambda logits: seen.append(logits.clone()) or logits
    try:
        replay = tuple((t,) for t in tokens[:3])
        unit = ARPrefillInput("replay", _prompt(checkpoint), replay, replay, GREEDY, None)
        [out] = t3.execute(WorkUnitKind.PREFILL, [unit])
    finally:
        del t3._sampling_logits
        t3.free_sequence("replay")
    assert out.tokens == (tokens[3],)
    ref = torch.from_numpy(reference["logits"][3])
    torch.testing.assert_close(seen[-1][0, 0], ref, rtol=0, atol=1e-4)


def test_guided_prefill_waits_when_only_one_row_fits(checkpoint):
    t3 = load_t3(checkpoint, KVCacheConfig(num_blocks=5, block_size=16))  # 3 blocks a row
    unit = ARPrefillInput("big", _prompt(checkpoint), (), (), GREEDY, None)
    assert t3.blocks.blocks_needed(t3._prefill_inputs(unit).shape[0]) == 3
    [out] = t3.execute(WorkUnitKind.PREFILL, [unit])
    assert out.preempted and t3.num_refused_prefills == 1
    assert t3.blocks.num_used_blocks == 0  # neither row holds blocks


def test_scoring_a_guided_trajectory_gives_the_served_logits(t3, checkpoint, reference):
    """Train = serve under guidance: teacher-forced guided logits and log-probs of the greedy
    trajectory equal what serving sampled from."""
    tokens, logprobs, logits = _generate(t3, {"s": _prompt(checkpoint)})
    frames = [(t,) for t in tokens["s"]]
    scored = t3.score_logits(_prompt(checkpoint), frames)[:, 0]
    torch.testing.assert_close(scored, logits["s"], rtol=0, atol=1e-5)
    lp = t3.score_logprobs(_prompt(checkpoint), frames, GREEDY)[:, 0]
    np.testing.assert_allclose(lp.numpy(), logprobs["s"], atol=1e-5)
    plain = t3.score_logits(_prompt(checkpoint, cfg_weight=None), frames)[:, 0]
    assert (plain - scored).abs().max() > 1e-2  # guidance is applied, not skipped


def test_loader_names_a_missing_file(checkpoint, tmp_path):
    assert check_folder(checkpoint) == checkpoint
    for name in ("ve.safetensors", "t3_cfg.safetensors", "s3gen.safetensors", "tokenizer.json"):
        partial = tmp_path / name.replace(".", "_")
        partial.mkdir()
        for other in checkpoint.iterdir():
            if other.name != name:
                (partial / other.name).symlink_to(other)
        with pytest.raises(ChatterboxCheckpointError, match=name):
            load_t3(partial, KVCacheConfig(num_blocks=4))
    with pytest.raises(ChatterboxCheckpointError, match="does not exist"):
        check_folder(tmp_path / "nowhere")
    assert load_default_voice(tmp_path) is None


def test_default_voice_is_read(checkpoint):
    voice = load_default_voice(checkpoint)
    conds = torch.load(checkpoint / "conds.pt", weights_only=True)["t3"]
    assert torch.equal(voice.speaker, conds["speaker_emb"].reshape(-1))
    assert voice.prompt_tokens == tuple(conds["cond_prompt_speech_tokens"].reshape(-1).tolist())
    assert voice.exaggeration == pytest.approx(0.5)
