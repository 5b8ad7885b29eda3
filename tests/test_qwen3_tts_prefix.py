"""Cross-request prefix sharing of a cloned voice's rows in the Qwen3-TTS talker
(``Qwen3TTSTalker._prompt_prefix`` on ``PagedARModel``'s kept prefixes), on the tiny Base
folder with a synthetic voice (random x-vector and reference codes): a second request of the
voice computes only its own rows and shares the prefix's full blocks; a request's codes and
logits are bit-identical (``batch_invariant``) on a fresh talker, after other requests of the
voice and batched with them; split and whole prefills agree to float rounding; aborted requests
hold no blocks; a full pool evicts kept prefixes (or takes them over) instead of failing."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch

from omnistep.core import WorkUnitKind
from omnistep.kv import KVCacheConfig
from omnistep.loops.ar_decode import ARPrefillInput, ARStepInput
from omnistep.models.qwen3_tts.loader import Qwen3TTSCheckpoint
from omnistep.models.qwen3_tts.prompt import (
    REF_TAIL_IDS,
    ROLE_IDS,
    assistant_text,
    build_prompt,
    ref_text,
)
from omnistep.models.qwen3_tts.talker import CloneRows, Qwen3TTSSampling, Qwen3TTSTalker
from tests.test_qwen3_tts_talker import Job, _rows_of, _spy, drive

TEXTS = ("Good morning.", "The blue door, twice.", "Ring the bell.", "See you at noon!")
TRANSCRIPT = "Hi there, this is me speaking now."  # 13 ids: 21 voice rows
FRAMES = 12
BLOCK = 16


@pytest.fixture(scope="module")
def ckpt(qwen3_tts_folders) -> Qwen3TTSCheckpoint:
    return Qwen3TTSCheckpoint.open(qwen3_tts_folders["base"].root)


@pytest.fixture(scope="module")
def tok(ckpt) -> Any:
    return ckpt.tokenizer()


def _voice(ckpt: Qwen3TTSCheckpoint, seed: int, frames: int = 20) -> CloneRows:
    rng = np.random.default_rng(seed)
    hidden = ckpt.config.talker.hidden_size
    emb = rng.standard_normal(hidden).astype(np.float32)
    codes = rng.integers(0, 2048, size=(frames, ckpt.config.talker.num_code_groups))
    return CloneRows(emb, codes.astype(np.int64))


def _talker(ckpt, num_blocks: int = 128, batch_invariant: bool = True) -> Qwen3TTSTalker:
    kv = KVCacheConfig(num_blocks=num_blocks, block_size=BLOCK)
    return Qwen3TTSTalker.from_checkpoint(ckpt, kv, batch_invariant=batch_invariant)


def _parts(talker: Qwen3TTSTalker, tok: Any, clone: CloneRows, text: str, **kw):
    ids = tok(assistant_text(text))["input_ids"]
    ref = tok(ref_text(TRANSCRIPT))["input_ids"][ROLE_IDS:-REF_TAIL_IDS]
    return build_prompt(talker.config, ids, clone=clone, ref_ids=ref, **kw)


def _unit(talker, prompt, seq_id: str, seed: int = 0) -> ARPrefillInput:
    sampling = Qwen3TTSSampling.from_defaults(talker.config)
    return ARPrefillInput(seq_id, prompt, (), (), sampling, torch.Generator().manual_seed(seed))


class _RowCounter:
    """Rows the talker computes per forward: prefix prefills and (suffix) prefills."""

    def __init__(self, talker: Qwen3TTSTalker):
        self.prefixes: list[list[int]] = []
        self.prefills: list[list[int]] = []
        inner_prefixes, inner_prefills = talker.prefixes.compute, talker._compute_prefills

        def prefixes(jobs):
            self.prefixes.append([rows.shape[0] for rows, _ in jobs.values()])
            return inner_prefixes(jobs)

        def prefills(units, inputs):
            self.prefills.append([x.shape[0] for x in inputs])
            return inner_prefills(units, inputs)

        talker.prefixes.compute, talker._compute_prefills = prefixes, prefills


def test_the_voice_rows_are_the_text_independent_prefix(ckpt, tok):
    talker = _talker(ckpt, num_blocks=4)
    voice = _voice(ckpt, 1)
    a = _parts(talker, tok, voice, TEXTS[0]).prompt
    b = _parts(talker, tok, voice, TEXTS[1]).prompt
    n = a.voice_rows
    ref = len(tok(ref_text(TRANSCRIPT))["input_ids"]) - ROLE_IDS - REF_TAIL_IDS
    assert n == 8 + ref  # role (3), nothink/think_bos/think_eos, x-vector, tts_bos; transcript
    assert a.voice_key() == b.voice_key() and a.text_ids[:n] == b.text_ids[:n]
    assert a.text_ids[n] != b.text_ids[n]  # the text starts right after the voice's rows
    # language, layout and voice are in the key
    other_lang = _parts(talker, tok, voice, TEXTS[0], language="english").prompt
    non_streaming = _parts(talker, tok, voice, TEXTS[0], non_streaming=True).prompt
    other_voice = _parts(talker, tok, _voice(ckpt, 2), TEXTS[0]).prompt
    keys = {p.voice_key() for p in (a, other_lang, non_streaming, other_voice)}
    assert len(keys) == 4
    # without a clone (a speaker, an instruction, or neither) the rows before the text
    plain = [
        build_prompt(talker.config, tok(assistant_text(t))["input_ids"]).prompt for t in TEXTS[:2]
    ]
    assert [p.voice_rows for p in plain] == [7, 7]  # role (3), 3 think rows, tts_bos
    assert len(plain[0].text_ids) == 8  # streaming: one text row
    assert plain[0].voice_key() == plain[1].voice_key() != a.voice_key()
    assert talker._prompt_prefix(plain[0]) == (plain[0].voice_key(), 7)


def test_a_second_request_of_the_voice_computes_only_its_text_rows(ckpt, tok):
    """Rows computed per forward, block refcounts of the shared prefix, a group on top."""
    talker = _talker(ckpt)
    voice = _voice(ckpt, 1)
    prompts = [_parts(talker, tok, voice, t).prompt for t in TEXTS[:2]]
    n = prompts[0].voice_rows
    assert n % BLOCK  # a partly filled last block
    sizes = [len(p.text_ids) for p in prompts]
    counter = _RowCounter(talker)
    [out] = talker.execute(WorkUnitKind.PREFILL, [_unit(talker, prompts[0], "a")])
    assert not out.preempted
    assert counter.prefixes == [[n]] and counter.prefills == [[sizes[0] - n]]
    [out] = talker.execute(WorkUnitKind.PREFILL, [_unit(talker, prompts[1], "b")])
    assert not out.preempted
    assert counter.prefixes == [[n]], "the kept prefix is not computed again"
    assert counter.prefills[-1] == [sizes[1] - n]
    prefix_table = talker.blocks.block_table(next(iter(talker.prefixes.kept.values())).seq_id)
    full = n // BLOCK
    assert full >= 1
    for seq in ("a", "b"):  # full blocks shared by reference, the partial one copied
        table = talker.blocks.block_table(seq)
        assert table[:full] == prefix_table[:full]
        assert table[full] != prefix_table[full]
    assert all(talker.blocks.ref_count(b) == 3 for b in prefix_table[:full])
    assert talker.blocks.ref_count(prefix_table[full]) == 1
    # a replay after a preemption (a generated frame) splits the same way
    replay = dataclasses.replace(prompts[1], replay_text=(talker.config.ids.tts_pad,))
    unit = dataclasses.replace(_unit(talker, replay, "b"), generated=(out.tokens,))
    [again] = talker.execute(WorkUnitKind.PREFILL, [unit])
    assert not again.preempted and talker.lengths["b"] == sizes[1] + 1
    assert counter.prefixes == [[n]] and counter.prefills[-1] == [sizes[1] + 1 - n]
    # two samples of one group with a third text: one suffix prefill, the second forks it
    group = [_unit(talker, _parts(talker, tok, voice, TEXTS[2]).prompt, s) for s in "cd"]
    group = [dataclasses.replace(u, share_group="g") for u in group]
    outs = talker.execute(WorkUnitKind.PREFILL, group)
    assert not any(o.preempted for o in outs)
    assert counter.prefixes == [[n]] and len(counter.prefills[-1]) == 1
    assert talker.blocks.block_table("c")[:full] == prefix_table[:full]
    for seq in "abcd":
        talker.free_sequence(seq)
    assert talker.kv_blocks()[0] == 0
    assert talker.num_kept_prefixes == 1
    assert talker.kept_prefix_blocks == talker.blocks.num_used_blocks == -(-n // BLOCK)
    assert talker.drop_voice("no such voice") == 0
    assert talker.drop_voice(voice.key) == 1
    assert talker.blocks.num_used_blocks == 0 and not talker.lengths


def test_a_speakers_requests_share_the_rows_before_their_text(qwen3_tts_folders, tok):
    """CustomVoice: the rows before the first text id (role, think rows with the language,
    the speaker's codec id, tts_bos) are kept once per speaker and language; a streaming-layout
    request then computes its one text row, in a batch too; another speaker or language is
    another prefix."""
    custom = Qwen3TTSCheckpoint.open(qwen3_tts_folders["custom_voice"].root)
    talker = Qwen3TTSTalker.from_checkpoint(
        custom, KVCacheConfig(num_blocks=64, block_size=BLOCK), batch_invariant=False
    )
    speakers = sorted(talker.config.spk_id)

    def prompt(text: str, speaker: str = speakers[0], language: str = "english"):
        ids = tok(assistant_text(text))["input_ids"]
        return build_prompt(talker.config, ids, speaker=speaker, language=language).prompt

    prompts = [prompt(t) for t in TEXTS]
    n = prompts[0].voice_rows
    assert n == 9 and all(len(p.text_ids) == n + 1 for p in prompts)
    counter = _RowCounter(talker)
    outs = talker.execute(WorkUnitKind.PREFILL, [_unit(talker, prompts[0], "a")])
    assert counter.prefixes == [[n]] and counter.prefills == [[1]]
    units = [_unit(talker, p, f"b{i}") for i, p in enumerate(prompts[1:])]
    outs += talker.execute(WorkUnitKind.PREFILL, units)
    assert not any(o.preempted for o in outs)
    assert counter.prefixes == [[n]] and counter.prefills[-1] == [1, 1, 1]
    others = [prompt(TEXTS[0], speaker=speakers[1]), prompt(TEXTS[0], language="auto")]
    talker.execute(WorkUnitKind.PREFILL, [_unit(talker, p, f"o{i}") for i, p in enumerate(others)])
    assert counter.prefixes[-1] == [n, n - 1] and talker.num_kept_prefixes == 3


def test_non_streaming_requests_share_the_speakers_rows_with_either_layout(qwen3_tts_folders, tok):
    """CustomVoice in the non-streaming layout (a whole text's default): the rows before the
    text are the same as the streaming layout's (one kept prefix serves both); a request then
    computes its text rows, ``tts_eos`` and the ``tts_pad | codec_bos`` row; its first frame
    (greedy, batch-invariant) equals a fresh talker's."""
    custom = Qwen3TTSCheckpoint.open(qwen3_tts_folders["custom_voice"].root)

    def talker_() -> Qwen3TTSTalker:
        kv = KVCacheConfig(num_blocks=64, block_size=BLOCK)
        return Qwen3TTSTalker.from_checkpoint(custom, kv, batch_invariant=True)

    talker = talker_()
    speaker = sorted(talker.config.spk_id)[0]

    def prompt(text: str, non_streaming: bool = True):
        ids = tok(assistant_text(text))["input_ids"]
        return build_prompt(
            talker.config, ids, speaker=speaker, language="english", non_streaming=non_streaming
        ).prompt

    whole = [prompt(t) for t in TEXTS]
    n = whole[0].voice_rows
    assert n == 9 and whole[0].voice_key() == prompt(TEXTS[1], False).voice_key()
    text_rows = [len(tok(assistant_text(t))["input_ids"]) - ROLE_IDS - 5 for t in TEXTS]
    assert [len(p.text_ids) - n for p in whole] == [k + 2 for k in text_rows]
    counter = _RowCounter(talker)
    first = talker.execute(WorkUnitKind.PREFILL, [_unit(talker, whole[0], "a")])
    assert counter.prefixes == [[n]] and counter.prefills == [[text_rows[0] + 2]]
    units = [_unit(talker, p, f"b{i}") for i, p in enumerate(whole[1:])]
    units.append(_unit(talker, prompt(TEXTS[0], False), "s"))  # the other layout
    talker.execute(WorkUnitKind.PREFILL, units)
    assert counter.prefixes == [[n]]  # nothing new: the kept rows serve both layouts
    assert counter.prefills[-1] == [k + 2 for k in text_rows[1:]] + [1]
    fresh = talker_().execute(WorkUnitKind.PREFILL, [_unit(talker, whole[0], "a")])
    assert first[0].tokens == fresh[0].tokens and first[0].logprobs == fresh[0].logprobs


def test_a_request_is_bit_identical_fresh_after_its_voice_and_batched(ckpt, tok):
    """C1/C3 with ``batch_invariant``: a request's codes and its talker and predictor logits
    are equal on a fresh talker (its prefix computed for it), after two other requests of the
    voice (prefix kept) and batched with two more (one of another voice)."""
    voice, other = _voice(ckpt, 1), _voice(ckpt, 3)
    fresh = _talker(ckpt)
    target = Job(_parts(fresh, tok, voice, TEXTS[0]), seed=7, max_new_tokens=FRAMES)
    log = _spy(fresh)
    [alone] = drive(fresh, [target])
    want = _rows_of(log, "r0/talker")
    assert len(alone["frames"]) == FRAMES

    warm = _talker(ckpt)
    log = _spy(warm)
    before = [Job(_parts(warm, tok, voice, t), seed=1, max_new_tokens=4) for t in TEXTS[1:3]]
    drive(warm, before)
    assert warm.num_kept_prefixes == 1
    log.clear()
    [after] = drive(warm, [target])
    got = _rows_of(log, "r0/talker")
    assert after["frames"] == alone["frames"]
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    log.clear()
    mates = [
        Job(_parts(warm, tok, voice, TEXTS[3]), seed=2, max_new_tokens=FRAMES + 3),
        Job(_parts(warm, tok, other, TEXTS[1]), seed=3, max_new_tokens=5),
    ]
    batched = drive(warm, [mates[0], target, mates[1]])
    got = _rows_of(log, "r1/talker")
    assert batched[1]["frames"] == alone["frames"]
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert max(len(ids) for ids, _, _ in log) == 3
    assert warm.kv_blocks()[0] == 0 and warm.num_kept_prefixes == 2


def test_split_prefill_equals_whole_prefill_to_float_rounding(ckpt, tok, monkeypatch):
    """The same greedy request with its voice's rows split off and prefilled whole: equal
    codes, logits within 1e-5 (float32 rounding of another attention shape)."""
    split, whole = _talker(ckpt, batch_invariant=False), _talker(ckpt, batch_invariant=False)
    monkeypatch.setattr(whole, "_prompt_prefix", lambda prompt: None)
    job = Job(_parts(split, tok, _voice(ckpt, 1), TEXTS[1]), greedy=True, max_new_tokens=FRAMES)
    logs = [_spy(split), _spy(whole)]
    runs = [drive(split, [job])[0], drive(whole, [job])[0]]
    assert split.num_kept_prefixes == 1 and whole.num_kept_prefixes == 0
    assert runs[0]["frames"] == runs[1]["frames"]
    (h0, p0), (h1, p1) = (_rows_of(log, "r0/talker") for log in logs)
    delta = max((h0 - h1).abs().max().item(), (p0 - p1).abs().max().item())
    print(f"\nsplit vs whole prefill: max |d logits| {delta:.3g}")
    assert 0 < delta <= 1e-5 or torch.equal(h0, h1)


def test_aborted_requests_hold_no_blocks_and_kept_prefixes_can_be_dropped(ckpt, tok):
    talker = _talker(ckpt, batch_invariant=False)
    voice = _voice(ckpt, 1)
    sampling = Qwen3TTSSampling.from_defaults(talker.config)
    gens = [torch.Generator().manual_seed(i) for i in range(50)]
    prompts = [_parts(talker, tok, voice, f"Number {i} of fifty.").prompt for i in range(50)]
    units = [
        ARPrefillInput(f"s{i}", p, (), (), sampling, g)
        for i, (p, g) in enumerate(zip(prompts, gens, strict=True))
    ]
    outs = talker.execute(WorkUnitKind.PREFILL, units)
    assert all(not o.preempted for o in outs)
    live = {f"s{i}": o.tokens for i, o in enumerate(outs)}
    pad = talker.config.ids.tts_pad
    for step in range(1, 3):
        steps = [
            ARStepInput(s, last, step, (last,), sampling, gens[int(s[1:])], extra=pad)
            for s, last in live.items()
        ]
        for unit, out in zip(steps, talker.execute(WorkUnitKind.AR_TOKEN, steps), strict=True):
            live[unit.seq_id] = out.tokens
        for s in list(live)[:20]:
            talker.free_sequence(s)
            del live[s]
    assert talker.kv_blocks()[0] > 0
    for s in live:
        talker.free_sequence(s)
    # requests hold nothing; the one kept prefix holds its own blocks, reported as free
    n = prompts[0].voice_rows
    assert talker.kv_blocks() == (0, talker.blocks.num_blocks)
    assert talker.num_kept_prefixes == 1 and talker.kept_prefix_blocks == -(-n // BLOCK)
    assert talker.drop_prefixes() == 1
    assert talker.blocks.num_used_blocks == 0 and not talker.lengths


def test_a_full_pool_evicts_kept_prefixes_instead_of_failing(ckpt, tok):
    """Pool of 3 blocks: voice A's request leaves its prefix kept; voice B's request (2 blocks,
    plus 1 for its own kept prefix) evicts it. Pool of 2: a request that fits whole takes its
    prefix's blocks over (nothing kept) and computes what a roomy talker computes."""
    voices = [_voice(ckpt, 1), _voice(ckpt, 2)]
    talker = _talker(ckpt, num_blocks=3)
    prompts = [_parts(talker, tok, v, TEXTS[0]).prompt for v in voices]
    assert all(16 < p.voice_rows < len(p.text_ids) <= 32 for p in prompts)
    [a] = talker.execute(WorkUnitKind.PREFILL, [_unit(talker, prompts[0], "a")])
    assert not a.preempted and talker.num_kept_prefixes == 1
    talker.free_sequence("a")
    [b] = talker.execute(WorkUnitKind.PREFILL, [_unit(talker, prompts[1], "b")])
    assert not b.preempted
    assert [kept.label[0] for kept in talker.prefixes.kept.values()] == [voices[1].key]  # B kept
    assert talker.blocks.num_free_blocks == 0
    # decode growth evicts B's prefix (partial block copied, so it is only the prefix's)
    step = ARStepInput(
        "b",
        b.tokens,
        1,
        (b.tokens,),
        _unit(talker, prompts[1], "b").sampling,
        torch.Generator().manual_seed(0),
        extra=talker.config.ids.tts_pad,
    )
    for _ in range(32 - len(prompts[1].text_ids) + 1):
        [out] = talker.execute(WorkUnitKind.AR_TOKEN, [step])
        assert not out.preempted
    assert talker.num_kept_prefixes == 0 and talker.lengths["b"] == 33
    talker.free_sequence("b")

    tight, roomy = _talker(ckpt, num_blocks=2), _talker(ckpt)
    got = tight.execute(WorkUnitKind.PREFILL, [_unit(tight, prompts[0], "x", seed=5)])
    want = roomy.execute(WorkUnitKind.PREFILL, [_unit(roomy, prompts[0], "x", seed=5)])
    assert not got[0].preempted and got[0].tokens == want[0].tokens
    assert got[0].logprobs == want[0].logprobs
    assert tight.num_kept_prefixes == 0 and roomy.num_kept_prefixes == 1
    assert tight.blocks.num_used_blocks == 2


def test_score_replays_the_split_prefill(ckpt, tok):
    """Train = serve: ``score_logprobs`` (``match_serving``) runs the prompt in the same two
    pieces (voice rows, then the rest) and reproduces a cloned-voice rollout's recorded
    log-probs of all 16 codebooks bit for bit under ``batch_invariant``."""
    talker = _talker(ckpt)
    voice = _voice(ckpt, 1)
    jobs = [
        Job(_parts(talker, tok, voice, t), seed=9, max_new_tokens=6, rollout=True)
        for t in TEXTS[:2]
    ]
    for run in drive(talker, jobs):
        result = run["result"]
        frames = [r.tokens for r in result.trajectory]
        recorded = torch.tensor([r.logprobs for r in result.trajectory], dtype=torch.float32)
        sampling = Qwen3TTSSampling.from_defaults(talker.config)
        with torch.no_grad():
            scored = talker.score_logprobs(result.info["prompt"], frames, sampling)
        assert scored.shape == (6, 16)
        assert torch.equal(scored.float(), recorded)
