"""The Qwen3-TTS talker + code predictor (omnistep/models/qwen3_tts/talker.py, prompt.py) against
upstream ``qwen-tts`` 0.1.1 on the same tiny random weights, and its serving properties.

Reference runs go through ``tests/qwen3_tts_ref`` (a subprocess on the ``.ref/qwen-tts`` overlay);
they are skipped when the overlay is not installed. Parity: the talker's codebook-0 logits and the
code predictor's logits of every sub-step over the prefill + 32 frames (ours teacher-forced on
upstream's frames, ``score_logits``) within 1e-4, and the greedy codes of all 16 codebooks, served
through the loop, equal to upstream's, for a CustomVoice prompt (streaming text), a VoiceDesign
prompt (instruct, "auto") and a dialect speaker in non-streaming mode.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch

from omnistep.core import (
    Channel,
    Done,
    ExecutionProfile,
    InvalidRequestError,
    ModelInstance,
    Pending,
    ProgramContext,
    Request,
    SamplingParams,
    StepResult,
    WorkUnitKind,
)
from omnistep.kv import KVCacheConfig
from omnistep.layers.rope import RotaryEmbedding, apply_rope
from omnistep.loops.ar_decode import ARDecodeConfig, ARPrefillInput, ARStepInput
from omnistep.models.qwen3_tts.loader import Qwen3TTSCheckpoint
from omnistep.models.qwen3_tts.prompt import (
    TalkerPromptParts,
    assistant_text,
    build_prompt,
    instruct_text,
)
from omnistep.models.qwen3_tts.talker import (
    Qwen3TTSSampling,
    Qwen3TTSTalker,
    Qwen3TTSTalkerLoop,
    suppressed_ids,
    text_for_step,
)
from tests.qwen3_tts_ref.env import call_reference

FRAMES = 32
LOGIT_BOUND = 1e-4
CV_TEXT = "Hello, how are you today? I am fine, thank you."
VD_TEXT = "I want to hear the weather today."
DIALECT_TEXT = "Good morning to you, friend."
INSTRUCT = "A warm, slow, low voice."

CASES: dict[str, dict[str, Any]] = {
    "custom_voice": {
        "variant": "custom_voice",
        "text": CV_TEXT,
        "speaker": "ryan",
        "language": "english",
        "instruct": None,
        "non_streaming_mode": False,
    },
    "voice_design": {  # tts_model_size 1b7: the predictor is narrower (small_to_mtp_projection)
        "variant": "voice_design",
        "text": VD_TEXT,
        "speaker": None,
        "language": "auto",
        "instruct": INSTRUCT,
        "non_streaming_mode": False,
    },
    "dialect_non_streaming": {  # eric's dialect replaces "auto"; the whole text in the prompt
        "variant": "custom_voice",
        "text": DIALECT_TEXT,
        "speaker": "Eric",
        "language": "auto",
        "instruct": None,
        "non_streaming_mode": True,
    },
}


# ---------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def folders(qwen3_tts_folders) -> dict[str, Qwen3TTSCheckpoint]:
    """The tiny published folders of both variants (seed 0), opened by the loader."""
    variants = ("custom_voice", "voice_design")
    return {v: Qwen3TTSCheckpoint.open(qwen3_tts_folders[v].root) for v in variants}


@pytest.fixture(scope="module")
def tokenizers(folders) -> dict[str, Any]:
    return {v: ckpt.tokenizer() for v, ckpt in folders.items()}


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text)["input_ids"])


def _case_ids(tokenizers, case: dict[str, Any]) -> dict[str, Any]:
    tok = tokenizers[case["variant"]]
    return {
        "input_ids": _ids(tok, assistant_text(case["text"])),
        "instruct_ids": None
        if case["instruct"] is None
        else _ids(tok, instruct_text(case["instruct"])),
        "speaker": case["speaker"],
        "language": case["language"],
        "non_streaming_mode": case["non_streaming_mode"],
    }


@pytest.fixture(scope="module")
def reference(folders, tokenizers) -> dict[str, Any]:
    """Upstream's greedy runs of ``CASES`` and its mRoPE (one reference subprocess)."""
    calls: list[tuple[str, dict]] = [
        (
            "generate",
            {
                "root": str(folders[case["variant"]].root),
                "max_new_tokens": FRAMES + 1,
                **_case_ids(tokenizers, case),
            },
        )
        for case in CASES.values()
    ]
    calls.append(
        (
            "mrope_vs_rope",
            {"head_dim": 16, "mrope_section": [2, 3, 3], "theta": 1e6, "positions": [*range(50)]},
        )
    )
    results = call_reference("tests.qwen3_tts_ref.upstream_talker:run_many", calls=calls)
    return {"runs": dict(zip(CASES, results[:-1], strict=True)), "mrope": results[-1]}


def _talker(
    ckpt: Qwen3TTSCheckpoint, batch_invariant: bool = False, num_blocks: int = 256
) -> Qwen3TTSTalker:
    kv = KVCacheConfig(num_blocks=num_blocks, block_size=16)
    return Qwen3TTSTalker.from_checkpoint(ckpt, kv, batch_invariant=batch_invariant)


# ---------------------------------------------------------------- a small engine stand-in
@dataclasses.dataclass
class Job:
    """One request for ``drive``: its prompt parts, sampling and text track."""

    parts: TalkerPromptParts
    seed: int = 0
    greedy: bool = False
    max_new_tokens: int = FRAMES
    rollout: bool = False
    track: Channel | None = None  # None: the whole trailing text, closed


def drive(talker: Qwen3TTSTalker, jobs: Sequence[Job], feed: Any = None) -> list[dict[str, Any]]:
    """Run ``jobs`` through ``Qwen3TTSTalkerLoop`` as the engine would: each round, one batched
    ``execute`` of every ready PREFILL unit and one of every ready AR_TOKEN unit. ``feed(round)``
    is called before each round (e.g. to stream text in). Returns per job its frames, recorded
    trajectory and loop result."""
    config = talker.config
    cfg = ARDecodeConfig(
        loop_id="talker",
        component="talker",
        prompt_slot="prompt",
        make_sampling=lambda req: Qwen3TTSSampling.from_defaults(
            config, greedy=req.sampling.temperature == 0
        ),
        max_new_tokens=4096,
        eos_token_ids=(config.ids.codec_eos,),
        eos_codebooks=(0,),
        penalty_window=0,
    )
    loop = Qwen3TTSTalkerLoop(cfg, track_slot="track", pad_id=config.ids.tts_pad)
    model = ModelInstance(card=None, components={"talker": talker}, loops={}, device="cpu")
    states = []
    for i, job in enumerate(jobs):
        profile = ExecutionProfile.ROLLOUT if job.rollout else ExecutionProfile.SERVE
        sampling = SamplingParams(
            temperature=0.0 if job.greedy else None, max_new_tokens=job.max_new_tokens
        )
        req = Request(
            model="qwen3_tts",
            text="x",
            seed=job.seed,
            sampling=sampling,
            profile=profile,
            request_id=f"r{i}",
        )
        track = job.track
        if track is None:
            track = Channel()
            for text_id in job.parts.trailing:
                track.put(text_id)
            track.close()
        ctx = ProgramContext(
            request=req,
            model=model,
            profile=profile,
            slots={"prompt": job.parts.prompt, "track": track},
        )
        states.append(loop.init(req, model, ctx))
    results: list[dict[str, Any] | None] = [None] * len(jobs)
    for round_ in range(100_000):
        if feed is not None:
            feed(round_)
        plans: dict[WorkUnitKind, list] = {WorkUnitKind.PREFILL: [], WorkUnitKind.AR_TOKEN: []}
        for i, state in enumerate(states):
            if results[i] is not None:
                continue
            plan = loop.next(state)
            if isinstance(plan, Done):
                result = loop.finalize(state)
                loop.release(state)
                results[i] = {"frames": list(state.frames), "result": result}
            elif not isinstance(plan, Pending):
                plans[plan.kind].append((i, plan))
        if all(r is not None for r in results):
            break
        for kind, batch in plans.items():
            if not batch:
                continue
            outs = talker.execute(kind, [p.payload for _, p in batch])
            for (i, _), out in zip(batch, outs, strict=True):
                loop.advance(states[i], StepResult(out, len(batch)))
    return results  # type: ignore[return-value]


# ---------------------------------------------------------------- rope
def test_mrope_with_equal_positions_is_plain_rope_bitwise(reference):
    """Upstream's interleaved mRoPE with the three position components equal (all TTS
    positions) equals 1-D rope, bit for bit: our ``RotaryEmbedding`` + ``apply_rope``."""
    ref = reference["mrope"]
    q = torch.from_numpy(ref["q"])[0].transpose(0, 1)  # [L, H, D]
    k = torch.from_numpy(ref["k"])[0].transpose(0, 1)
    rotary = RotaryEmbedding(16, 1e6, 64)
    cos, sin = rotary(torch.arange(q.shape[0]), torch.float32)
    assert torch.equal(cos, torch.from_numpy(ref["cos_1d"])[0])
    q_ours, k_ours = apply_rope(q, k, cos, sin)
    assert torch.equal(q_ours, torch.from_numpy(ref["q_mrope"])[0].transpose(0, 1))
    assert torch.equal(k_ours, torch.from_numpy(ref["k_mrope"])[0].transpose(0, 1))


# ---------------------------------------------------------------- parity
@pytest.mark.parametrize("case", list(CASES))
def test_greedy_codes_and_logits_match_upstream(folders, tokenizers, reference, case):
    spec = CASES[case]
    ref = reference["runs"][case]
    assert ref["codes"].shape == (FRAMES, 16)  # upstream ran 32 whole frames, no EOS
    assert ref["talker_logits"].shape[0] == FRAMES + 1  # prefill + one per decode step
    talker = _talker(folders[spec["variant"]])
    ids = _case_ids(tokenizers, spec)
    parts = build_prompt(
        talker.config,
        ids["input_ids"],
        speaker=ids["speaker"],
        language=ids["language"],
        instruct_ids=ids["instruct_ids"],
        non_streaming=ids["non_streaming_mode"],
    )
    [run] = drive(talker, [Job(parts, greedy=True, max_new_tokens=FRAMES)])
    codes = np.array(run["frames"])
    assert codes.shape == (FRAMES, 16)
    np.testing.assert_array_equal(codes, ref["codes"])
    # logits of every frame's draws, teacher-forced on upstream's frames
    replay = tuple(text_for_step(k, parts.trailing, True, parts.pad_id) for k in range(FRAMES - 1))
    prompt = dataclasses.replace(parts.prompt, replay_text=replay)
    with torch.no_grad():
        logits = talker.score_logits(prompt, [tuple(f) for f in ref["codes"]])
    talker_delta = np.abs(logits[:, 0].numpy() - ref["talker_logits"][:FRAMES]).max()
    vocab = ref["predictor_logits"].shape[-1]
    predictor_delta = np.abs(logits[:, 1:, :vocab].numpy() - ref["predictor_logits"]).max()
    print(f"\n{case}: talker logits max |d| {talker_delta:.3g}, predictor {predictor_delta:.3g}")
    assert talker_delta <= LOGIT_BOUND
    assert predictor_delta <= LOGIT_BOUND
    assert torch.isneginf(logits[:, 1:, vocab:]).all()


# ---------------------------------------------------------------- serving properties
@pytest.fixture(scope="module")
def tok(tokenizers) -> Any:
    return tokenizers["custom_voice"]


@pytest.fixture(scope="module")
def tiny(folders) -> Qwen3TTSTalker:
    return _talker(folders["custom_voice"])


@pytest.fixture(scope="module")
def tiny_bi(folders) -> Qwen3TTSTalker:
    return _talker(folders["custom_voice"], batch_invariant=True)


def _cv(talker: Qwen3TTSTalker, tok: Any, text: str = CV_TEXT, **kw) -> TalkerPromptParts:
    return build_prompt(talker.config, _ids(tok, assistant_text(text)), speaker="vivian", **kw)


def _vd(talker: Qwen3TTSTalker, tok: Any, text: str = VD_TEXT) -> TalkerPromptParts:
    instruct = _ids(tok, instruct_text(INSTRUCT))
    return build_prompt(talker.config, _ids(tok, assistant_text(text)), instruct_ids=instruct)


def _assert_holds_only_kept_prefixes(talker: Qwen3TTSTalker) -> None:
    """No request holds a block: what is used belongs to kept voice prefixes (reported free),
    and dropping them empties the pool."""
    assert talker.kv_blocks()[0] == 0
    assert talker.blocks.num_used_blocks == talker.kept_prefix_blocks
    talker.drop_prefixes()
    assert talker.blocks.num_used_blocks == 0


def test_same_seed_same_codes_other_seed_other_codes(tiny, tok):
    parts = _cv(tiny, tok)
    a, b, c = drive(tiny, [Job(parts, seed=5), Job(parts, seed=5), Job(parts, seed=6)])
    assert len(a["frames"]) == FRAMES and a["frames"] == b["frames"]
    assert a["frames"] != c["frames"]
    # every codebook is sampled (not only codebook 0)
    codes = np.array(a["frames"])
    assert all(len(set(codes[:, j])) > 4 for j in range(16))
    _assert_holds_only_kept_prefixes(tiny)


def _spy(talker: Qwen3TTSTalker) -> list[tuple[list[str], torch.Tensor, torch.Tensor]]:
    """Record every served step's raw logits: (seq ids, talker [B, 1, V], predictor
    [B, 15, V_pred])."""
    log: list = []
    head, run, sample_ = talker._head, talker.predictor.run, talker._sample
    current: dict[str, Any] = {}

    def spy_sample(hidden, units, streams):
        current["ids"] = [u.seq_id for u in units]
        return sample_(hidden, units, streams)

    def spy_head(hidden, seq_id):
        current["head"] = head(hidden, seq_id).float().clone()
        return current["head"]

    def spy_run(*args):
        out = run(*args)
        log.append((current["ids"], current["head"], out.clone()))
        return out

    talker._sample, talker._head, talker.predictor.run = spy_sample, spy_head, spy_run
    return log


def _rows_of(log, seq_id: str) -> tuple[torch.Tensor, torch.Tensor]:
    heads, preds = [], []
    for ids, head, pred in log:
        if seq_id in ids:
            heads.append(head[ids.index(seq_id)])
            preds.append(pred[ids.index(seq_id)])
    return torch.stack(heads), torch.stack(preds)


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_codes_alone_equal_codes_batched_with_three_others(folders, tok, batch_invariant):
    """C3: a request's 16-codebook frames (sampled, its own generator) are the same alone and
    batched with 3 requests of other lengths, prompt kinds and caps; with ``batch_invariant``
    its talker and predictor logits are bit-identical too."""
    talker = _talker(folders["custom_voice"], batch_invariant=batch_invariant)
    target = Job(_cv(talker, tok), seed=3, max_new_tokens=24)
    others = [
        Job(_vd(talker, tok), seed=4, max_new_tokens=30),
        Job(_cv(talker, tok, CV_TEXT[:8]), seed=5, max_new_tokens=9),
        Job(_cv(talker, tok, CV_TEXT * 3, non_streaming=True), seed=6, max_new_tokens=40),
    ]
    log = _spy(talker)
    [alone] = drive(talker, [target])
    alone_logits = _rows_of(log, "r0/talker")
    log.clear()
    batched = drive(talker, [others[0], target, *others[1:]])
    assert batched[1]["frames"] == alone["frames"]
    assert len(alone["frames"]) == 24
    _assert_holds_only_kept_prefixes(talker)
    if batch_invariant:
        batched_logits = _rows_of(log, "r1/talker")
        assert torch.equal(batched_logits[0], alone_logits[0])
        assert torch.equal(batched_logits[1], alone_logits[1])
        assert max(len(ids) for ids, _, _ in log) == 4  # it did run in a batch of 4


def test_aborted_sequences_leave_no_kv_blocks(tiny, tok):
    config = tiny.config
    sampling = Qwen3TTSSampling.from_defaults(config)
    gens = [torch.Generator().manual_seed(i) for i in range(50)]
    prompts = [_cv(tiny, tok, CV_TEXT[: 2 + i]).prompt for i in range(50)]
    units = [
        ARPrefillInput(f"s{i}", p, (), (), sampling, g)
        for i, (p, g) in enumerate(zip(prompts, gens, strict=True))
    ]
    outs = tiny.execute(WorkUnitKind.PREFILL, units)
    assert all(not o.preempted and len(o.tokens) == 16 for o in outs)
    live = {f"s{i}": o.tokens for i, o in enumerate(outs)}
    for step in range(1, 4):  # a few decode steps, aborting some sequences after each
        steps = [
            ARStepInput(
                s, last, step, (last,), sampling, gens[int(s[1:])], extra=config.ids.tts_pad
            )
            for s, last in live.items()
        ]
        for unit, out in zip(steps, tiny.execute(WorkUnitKind.AR_TOKEN, steps), strict=True):
            live[unit.seq_id] = out.tokens
        for s in list(live)[:15]:
            tiny.free_sequence(s)
            del live[s]
    assert tiny.blocks.num_used_blocks > 0
    for s in list(live):
        tiny.free_sequence(s)
    for i in range(50):
        tiny.free_sequence(f"s{i}")  # idempotent
    _assert_holds_only_kept_prefixes(tiny)
    assert not tiny.lengths


def test_preempted_requests_resume_with_their_text_track(folders, tok):
    """A pool too small for four requests preempts some; their re-prefills replay frames with
    the text ids of those steps, and every request ends with the codes it has unpreempted."""
    roomy = _talker(folders["custom_voice"], num_blocks=256)
    tight = _talker(folders["custom_voice"], num_blocks=7)
    jobs = [Job(_cv(roomy, tok, CV_TEXT[: 10 * (1 + i)]), seed=10 + i) for i in range(4)]
    expected = drive(roomy, jobs)
    got = drive(tight, jobs)
    assert tight.num_preemptions > 0
    for a, b in zip(expected, got, strict=True):
        assert a["frames"] == b["frames"]
    _assert_holds_only_kept_prefixes(tight)


def test_text_streamed_word_by_word_equals_text_sent_whole(tiny, tok):
    """The loop waits (Pending) for a step whose text id has not arrived; text fed one id per
    two rounds gives the codes of the whole text."""
    parts = _cv(tiny, tok, CV_TEXT * 2)
    [whole] = drive(tiny, [Job(parts, seed=9, max_new_tokens=40)])
    track = Channel()
    ids = list(parts.trailing)
    waits = []

    def feed(round_: int) -> None:
        if round_ % 2 == 0 and ids:
            track.put(ids.pop(0))
            if not ids:
                track.close()
        waits.append(len(track))

    [streamed] = drive(tiny, [Job(parts, seed=9, max_new_tokens=40, track=track)], feed=feed)
    assert streamed["frames"] == whole["frames"]
    assert len(waits) > len(whole["frames"]) + 5  # rounds spent waiting for text


def test_unknown_speaker_language_and_empty_text_are_typed_errors(tiny, tok):
    config = tiny.config
    ids = _ids(tok, assistant_text(CV_TEXT))
    with pytest.raises(InvalidRequestError) as err:
        build_prompt(config, ids, speaker="nobody")
    assert err.value.code == "unknown_voice" and "vivian" in str(err.value)
    with pytest.raises(InvalidRequestError) as err:
        build_prompt(config, ids, speaker="ryan", language="klingon")
    assert err.value.code == "unsupported_language"
    with pytest.raises(InvalidRequestError) as err:  # dialects are not languages to ask for
        build_prompt(config, ids, speaker="ryan", language="sichuan_dialect")
    assert err.value.code == "unsupported_language"
    with pytest.raises(InvalidRequestError) as err:
        build_prompt(config, _ids(tok, assistant_text("")), speaker="ryan")
    assert err.value.code == "empty_input"


def test_prompt_layout_follows_upstream(tiny, tok):
    config, i = tiny.config, tiny.config.ids
    ids = _ids(tok, assistant_text(CV_TEXT))
    role, text = ids[:3], ids[3:-5]
    assert role == [i.im_start, i.assistant, ids[2]] and ids[-5] == i.im_end
    parts = build_prompt(config, ids, speaker="Eric", language="auto")
    pad, bos, eos = i.tts_pad, i.tts_bos, i.tts_eos
    dialect = config.codec_language_id["sichuan_dialect"]  # eric's dialect replaces "auto"
    assert config.spk_is_dialect["eric"] == "sichuan_dialect"
    assert parts.prompt.text_ids == (*role, pad, pad, pad, pad, pad, bos, text[0])
    assert parts.prompt.codec_ids == (
        -1, -1, -1,
        i.codec_think, i.codec_think_bos, dialect, i.codec_think_eos,
        config.spk_id["eric"], i.codec_pad, i.codec_bos,
    )  # fmt: skip
    assert parts.trailing == (*text[1:], eos)
    instruct = _ids(tok, instruct_text(INSTRUCT))
    whole = build_prompt(config, ids, instruct_ids=instruct, non_streaming=True)
    assert whole.prompt.text_ids == (*instruct, *role, pad, pad, pad, bos, *text, eos, pad)
    assert whole.prompt.codec_ids[len(instruct) + 3 :] == (
        i.codec_nothink, i.codec_think_bos, i.codec_think_eos,
        *[i.codec_pad] * (len(text) + 2), i.codec_bos,
    )  # fmt: skip
    assert whole.trailing == ()
    assert [text_for_step(k, (), True, pad) for k in range(3)] == [pad] * 3
    assert text_for_step(2, (7, 8), False, pad) is None


def test_sampling_defaults_follow_generation_config(tiny):
    """``generation_config.json`` values win over upstream's hard defaults (its
    ``_merge_generate_kwargs``, the loader's ``GenerationDefaults``); greedy zeroes both
    stages' temperatures."""
    config = tiny.config
    assert config.generation.max_new_tokens == 8192  # the published file's, not 2048 / 4096
    defaults = dataclasses.replace(config.generation, top_k=30, subtalker_temperature=0.7)
    rows = Qwen3TTSSampling.from_defaults(config, defaults)
    assert rows.talker.top_k == 30 and rows.predictor.temperature == 0.7
    assert rows.talker.temperature == 0.9 and rows.talker.repetition_penalty == 1.05
    assert rows.talker.min_new_tokens == 2 and rows.talker.eos_token_id == config.ids.codec_eos
    assert not rows.talker.penalty_compounds and rows.predictor.repetition_penalty == 1.0
    assert rows.talker.penalty_window == 8192
    greedy = Qwen3TTSSampling.from_defaults(config, greedy=True)
    assert greedy.talker.is_greedy() and greedy.predictor.is_greedy()
    suppressed = set(suppressed_ids(config))
    assert len(suppressed) == 1023 and config.ids.codec_eos not in suppressed
    assert min(suppressed) == config.talker.vocab_size - 1024


# ---------------------------------------------------------------- rollouts
@pytest.mark.parametrize("mode", ["processed", "policy"])
def test_score_reproduces_the_recorded_logprobs_of_all_16_codebooks(tiny_bi, tok, mode):
    config = tiny_bi.config
    jobs = [
        Job(_cv(tiny_bi, tok), seed=21, max_new_tokens=20, rollout=True),
        Job(_vd(tiny_bi, tok), seed=22, max_new_tokens=12, rollout=True),
    ]
    for run, job in zip(drive(tiny_bi, jobs), jobs, strict=True):
        result = run["result"]
        records = result.trajectory
        assert len(records) == job.max_new_tokens and len(records[0].tokens) == 16
        prompt = result.info["prompt"]
        assert len(prompt.replay_text) == len(records) - 1
        frames = [r.tokens for r in records]
        sampling = Qwen3TTSSampling.from_defaults(config)
        scored = tiny_bi.score_logprobs(prompt, frames, sampling, mode, penalty_window=0)
        assert scored.shape == (len(frames), 16)
        assert not scored.requires_grad  # serving weights: no graph (a training copy has one)
        recorded = np.array(
            [r.logprobs if mode == "processed" else r.policy_logprobs for r in records],
            dtype=np.float32,
        )
        delta = np.abs(scored.detach().numpy() - recorded).max()
        print(f"\nscore {mode}: max |d| {delta:.3g} over {recorded.size}")
        assert delta <= 1e-6
        assert (recorded[:, 1:] != 0).all()  # the predictor's draws are recorded too


@pytest.mark.parametrize("mode", ["processed", "policy"])
def test_default_mode_score_teacher_forces_the_predictor_in_one_forward(tiny, tok, mode):
    """Without ``batch_invariant`` score runs the code predictor teacher-forced in one causal
    forward of 16 rows per frame (``CodePredictor.teacher_forced``): its logits equal serving's
    15 sub-steps (``run`` with the codes fed) within float32 rounding, the scored log-probs the
    recorded ones, and the gradient reaches exactly the tables that were fed."""
    [run] = drive(tiny, [Job(_cv(tiny, tok), seed=23, max_new_tokens=10, rollout=True)])
    records = run["result"].trajectory
    frames = [r.tokens for r in records]
    sampling = Qwen3TTSSampling.from_defaults(tiny.config)
    scored = tiny.score_logprobs(
        run["result"].info["prompt"], frames, sampling, mode, penalty_window=0
    )
    recorded = np.array(
        [r.logprobs if mode == "processed" else r.policy_logprobs for r in records],
        dtype=np.float32,
    )
    delta = np.abs(scored.detach().numpy() - recorded).max()
    print(f"\ndefault-mode score {mode}: max |d| {delta:.3g} over {recorded.size}")
    assert delta <= 1e-5 and (recorded[:, 1:] != 0).all()

    trainer = tiny.training_copy()
    weights = trainer.trainable_weights()
    predictor = trainer.predictor
    gen = torch.Generator().manual_seed(5)
    width = predictor.codec_embedding[0].shape[1]
    hidden, first = torch.randn(7, width, generator=gen), torch.randn(7, width, generator=gen)
    codes = torch.randint(0, predictor.config.vocab_size, (7, 15), generator=gen)
    stepwise = predictor.run(hidden, first, lambda j, _logits: codes[:, j])
    at_once = predictor.teacher_forced(hidden, first, codes)
    assert at_once.shape == stepwise.shape == (7, 15, predictor.config.vocab_size)
    gap = (at_once - stepwise).abs().max().item()
    print(f"teacher_forced vs run: max |d| {gap:.3g} (logits up to {stepwise.abs().max():.3g})")
    assert gap <= 1e-5 * max(1.0, stepwise.abs().max().item())
    at_once.sum().backward()
    prefix = "talker.code_predictor."
    for j in (0, 13):  # codes 1 and 14 are fed; code 15 only scored
        assert weights[f"{prefix}model.codec_embedding.{j}.weight"].grad.abs().sum() > 0
    assert weights[f"{prefix}lm_head.14.weight"].grad.abs().sum() > 0
    unused = weights[f"{prefix}model.codec_embedding.14.weight"].grad
    assert unused is None or not unused.any()
    with pytest.raises(ValueError, match="codes"):
        predictor.teacher_forced(hidden, first, codes[:, :14])


def test_score_backpropagates_into_talker_and_predictor_weights(folders, tokenizers):
    # voice_design (1b7): the predictor has its small_to_mtp_projection
    talker = _talker(folders["voice_design"], batch_invariant=True)
    [run] = drive(
        talker,
        [Job(_vd(talker, tokenizers["voice_design"]), seed=1, max_new_tokens=6, rollout=True)],
    )
    result = run["result"]
    frames = [r.tokens for r in result.trajectory]
    trainer = talker.training_copy()  # serving weights are never handed to an optimizer
    weights = trainer.trainable_weights()
    scored = trainer.score_logprobs(
        result.info["prompt"], frames, Qwen3TTSSampling.from_defaults(talker.config), "policy"
    )
    scored.sum().backward()
    for name in (
        "talker.model.layers.0.self_attn.q_norm.weight",
        "talker.model.layers.1.mlp.down_proj.weight",
        "talker.model.codec_embedding.weight",
        "talker.model.text_embedding.weight",
        "talker.text_projection.linear_fc1.weight",
        "talker.codec_head.weight",
        "talker.code_predictor.model.layers.0.self_attn.k_proj.weight",
        "talker.code_predictor.model.codec_embedding.3.weight",
        "talker.code_predictor.model.norm.weight",
        "talker.code_predictor.lm_head.14.weight",
        "talker.code_predictor.small_to_mtp_projection.weight",
    ):
        grad = weights[name].grad
        assert grad is not None and grad.abs().sum().item() > 0, name
