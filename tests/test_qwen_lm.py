"""Qwen2.5-Omni thinker and talker components against transformers' ``qwen2_5_omni`` on tiny
configs with random weights of real scale: logits and greedy tokens, the thinker -> talker
conditioning as ``Qwen2_5OmniForConditionalGeneration.generate`` builds it, batch invariance,
preemption and KV hygiene."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers  # noqa: F401
from transformers.models.qwen2_5_omni import modeling_qwen2_5_omni as hf
from transformers.models.qwen2_5_omni.configuration_qwen2_5_omni import (
    Qwen2_5OmniConfig,
    Qwen2_5OmniTalkerConfig,
    Qwen2_5OmniThinkerConfig,
)
from transformers.utils import logging as hf_logging

from omnistep.core import WorkUnitKind
from omnistep.kv import KVCacheConfig
from omnistep.layers.rope import rope_cos_sin
from omnistep.loops.ar_decode import ARPrefillInput, ARStepInput
from omnistep.models.qwen2_5_omni.talker import (
    TEXT_EOS,
    TEXT_PAD,
    ConditionKind,
    QwenTalker,
    TalkerConfig,
    TalkerPrompt,
    condition_for_step,
    load_talker,
)
from omnistep.models.qwen2_5_omni.thinker import (
    QwenThinker,
    ThinkerConfig,
    load_thinker,
)
from omnistep.sampling import SamplingRow, make_generator

PREFILL, AR_TOKEN = WorkUnitKind.PREFILL, WorkUnitKind.AR_TOKEN
GREEDY = SamplingRow(temperature=0.0)
SAMPLED = SamplingRow(temperature=0.9, top_k=40, top_p=0.8, min_keep=1)
STEPS = 16
TOL = 1e-4
HIDDEN = 64
MROPE = [2, 3, 3]  # sums to head_dim / 2 = 8
ROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": MROPE}
# Thinker-vocab ids (256): multimodal placeholders unused by text prompts, the talker's text ids.
MM_IDS = {
    "audio_token_index": 240,
    "image_token_index": 241,
    "video_token_index": 242,
    "audio_start_token_id": 243,
    "audio_end_token_id": 244,
    "vision_start_token_id": 245,
}
TEXT_START, TEXT_END, TEXT_PAD_ID, SPEAKER_BOS = 250, 251, 249, 252
CODEC = {"pad": 90, "start": 91, "end": 92, "mask": 94}  # codec vocab 96
PROMPTS = [[5, 17, 33, 2, 9], list(range(100, 111)), [(7 * i) % 230 for i in range(23)]]
KV = KVCacheConfig(num_blocks=96, block_size=4)

hf_logging.set_verbosity_error()  # tiny talker vocab: text ids "outside the vocabulary" warnings


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny GEMMs: a second intra-op thread only adds spin-waits on the shared cores (measured
    100x slower under load)."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


# ---------------------------------------------------------------- tiny transformers models
def _thinker_config() -> Qwen2_5OmniThinkerConfig:
    text = dict(
        vocab_size=256,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_parameters=ROPE,
    )
    audio = dict(
        num_mel_bins=16,
        encoder_layers=1,
        encoder_attention_heads=2,
        encoder_ffn_dim=64,
        d_model=32,
        output_dim=HIDDEN,
        max_source_positions=64,
        n_window=8,
    )
    vision = dict(
        depth=1,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=HIDDEN,
        fullatt_block_indexes=[0],
        patch_size=4,
        window_size=16,
    )
    return Qwen2_5OmniThinkerConfig(
        text_config=text, audio_config=audio, vision_config=vision, user_token_id=246, **MM_IDS
    )


def _talker_config() -> Qwen2_5OmniTalkerConfig:
    return Qwen2_5OmniTalkerConfig(
        vocab_size=96,
        embedding_size=HIDDEN,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        rope_parameters=ROPE,
        tts_text_start_token_id=TEXT_START,
        tts_text_end_token_id=TEXT_END,
        tts_text_pad_token_id=TEXT_PAD_ID,
        tts_codec_start_token_id=CODEC["start"],
        tts_codec_end_token_id=CODEC["end"],
        tts_codec_pad_token_id=CODEC["pad"],
        tts_codec_mask_token_id=CODEC["mask"],
        vision_end_token_id=247,
        **MM_IDS,
    )


def _randomize(module: torch.nn.Module, seed: int) -> None:
    """Weights of real scale: matrices ~ N(0, 1/fan_in), heads 3x that, norms 1 + N(0, 0.1^2),
    biases N(0, 0.1^2) (stock init gives near-uniform logits)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if param.ndim > 1:
                scale = (3.0 if "head" in name else 1.0) / param[0].numel() ** 0.5
                param.copy_(noise * scale)
            elif name.endswith("bias"):
                param.copy_(0.1 * noise)
            else:
                param.copy_(1.0 + 0.1 * noise)


@pytest.fixture(scope="module")
def hf_thinker():
    model = hf.Qwen2_5OmniThinkerForConditionalGeneration(_thinker_config()).eval()
    _randomize(model, seed=0)
    return model


@pytest.fixture(scope="module")
def hf_talker():
    model = hf.Qwen2_5OmniTalkerForConditionalGeneration(_talker_config()).eval()
    _randomize(model, seed=1)
    return model


def _official_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A v5 thinker state dict under the official checkpoint names (``thinker.`` removed)."""
    out = {}
    for key, value in model.state_dict().items():
        if key.startswith("model.language_model."):
            key = "model." + key.removeprefix("model.language_model.")
        elif key.startswith(("model.audio_tower.", "model.visual.")):
            key = key.removeprefix("model.")
        out[key] = value
    return out


def _thinker(hf_thinker, batch_invariant=False, kv=KV) -> QwenThinker:
    config = {"thinker_config": hf_thinker.config.to_dict()}
    return load_thinker(_official_state(hf_thinker), config, kv, batch_invariant=batch_invariant)


def _talker(hf_talker, hf_thinker, batch_invariant=False) -> QwenTalker:
    embed = hf_thinker.get_input_embeddings().weight.detach()
    config = {"talker_config": hf_talker.config.to_dict()}
    return load_talker(
        hf_talker.state_dict(),
        config,
        KV,
        embed,
        speaker_bos_ids=[SPEAKER_BOS],
        batch_invariant=batch_invariant,
    )


@pytest.fixture(scope="module")
def thinker(hf_thinker) -> QwenThinker:
    return _thinker(hf_thinker)


@pytest.fixture(scope="module")
def talker(hf_talker, hf_thinker) -> QwenTalker:
    return _talker(hf_talker, hf_thinker)


class _Recorder:
    """Wraps a component's ``_head`` to keep the raw logits of every call, ``[B, V]`` each."""

    def __init__(self, component):
        self.calls: list[torch.Tensor] = []
        self._head = component._head
        component._head = self

    def __call__(self, hidden, seq_id):
        out = self._head(hidden, seq_id)
        self.calls.append(out[:, 0].float().clone())
        return out


def _assert_free(component) -> None:
    assert component.blocks.num_free_blocks == component.blocks.num_blocks
    assert not component.lengths


# ---------------------------------------------------------------- driving our components
def _run_thinker(thinker, prompts, steps, sampling=GREEDY, seeds=None, seq="t"):
    """Prefill all prompts in one batch, then ``steps`` batched decode steps.

    Returns per prompt: frames ``[steps + 1]``, logprobs, streamed hidden rows (list).
    """
    n = len(prompts)
    gens = [None if seeds is None else make_generator(s, "cpu") for s in (seeds or [0] * n)]
    ids = [f"{seq}{i}" for i in range(n)]
    units = [
        ARPrefillInput(ids[i], tuple(p), (), (), sampling, gens[i]) for i, p in enumerate(prompts)
    ]
    outs = thinker.execute(PREFILL, units)
    frames = [[o.tokens] for o in outs]
    logprobs = [[o.logprobs] for o in outs]
    hidden = [[o.hidden] for o in outs]
    for step in range(1, steps + 1):
        units = [
            ARStepInput(ids[i], frames[i][-1], step, tuple(frames[i][-16:]), sampling, gens[i])
            for i in range(n)
        ]
        for i, out in enumerate(thinker.execute(AR_TOKEN, units)):
            assert not out.preempted
            frames[i].append(out.tokens)
            logprobs[i].append(out.logprobs)
            hidden[i].append(out.hidden)
    for seq_id in ids:
        thinker.free_sequence(seq_id)
    return frames, logprobs, hidden


def _talker_prompt(thinker_hidden, num_replies) -> tuple[TalkerPrompt, list[torch.Tensor]]:
    """Our talker prompt and reply rows from a thinker run's streamed hidden rows, as if the
    thinker stopped after streaming ``num_replies`` reply rows."""
    replies = thinker_hidden[1 : num_replies + 1]
    return TalkerPrompt(thinker_hidden[0], replies[0], SPEAKER_BOS), replies


def _run_talker(talker, prompts, replies, steps, sampling=GREEDY, seeds=None, seq="k"):
    """One batched talker prefill and ``steps`` batched decode steps; frames and logprobs."""
    n = len(prompts)
    gens = [None if seeds is None else make_generator(s, "cpu") for s in (seeds or [0] * n)]
    ids = [f"{seq}{i}" for i in range(n)]
    units = [ARPrefillInput(ids[i], p, (), (), sampling, gens[i]) for i, p in enumerate(prompts)]
    outs = talker.execute(PREFILL, units)
    frames = [[o.tokens] for o in outs]
    logprobs = [[o.logprobs] for o in outs]
    for step in range(1, steps + 1):
        units = [
            ARStepInput(
                ids[i],
                frames[i][-1],
                step,
                tuple(frames[i][-16:]),
                sampling,
                gens[i],
                extra=condition_for_step(step, replies[i], thinker_done=True),
            )
            for i in range(n)
        ]
        for i, out in enumerate(talker.execute(AR_TOKEN, units)):
            frames[i].append(out.tokens)
            logprobs[i].append(out.logprobs)
    for seq_id in ids:
        talker.free_sequence(seq_id)
    return frames, logprobs


# ---------------------------------------------------------------- transformers references
def _hf_talker_inputs(hf_thinker, prompt_rows, replies):
    """``inputs_embeds`` ``[1, L + 2, E]`` and ``thinker_reply_part`` as
    ``Qwen2_5OmniForConditionalGeneration.generate`` builds them (thinker done after
    ``len(replies)`` reply rows)."""
    embed = hf_thinker.get_input_embeddings()
    with torch.no_grad():
        text = embed(torch.tensor([SPEAKER_BOS, TEXT_END, TEXT_PAD_ID]))
    inputs = torch.cat([prompt_rows, text[:1], replies[0]])[None]
    reply_part = torch.cat([*replies[1:], text[1:2], text[2:3]])[None]
    return inputs, reply_part


@torch.no_grad()
def _hf_talker_logits(hf_talker, inputs_embeds, reply_part, codes):
    """transformers' talker forward: the prefill (with a mask, so the codec pad/bos embeddings
    are added), then one call per fed code; raw logits ``[len(codes) + 1, V]``."""
    hf_talker.rope_deltas = None
    num_rows = inputs_embeds.shape[1]
    mask = torch.ones(1, num_rows, dtype=torch.long)
    out = hf_talker(inputs_embeds=inputs_embeds.clone(), attention_mask=mask, use_cache=True)
    logits, cache = [out.logits[0, -1]], out.cache
    for code in codes:
        out = hf_talker(
            input_ids=torch.tensor([[code]]), thinker_reply_part=reply_part, cache=cache
        )
        logits.append(out.logits[0, -1])
        cache, reply_part = out.cache, out.thinker_reply_part
    return torch.stack(logits)


# ---------------------------------------------------------------- tests: config, rope, loading
def test_config_from_official_layouts(hf_thinker, hf_talker):
    official = {
        "thinker_config": {
            "text_config": {
                "hidden_size": 3584,
                "num_attention_heads": 28,
                "rope_theta": 1000000.0,
                "rope_scaling": {"mrope_section": [16, 24, 24], "rope_type": "default"},
                "use_sliding_window": False,
            }
        },
        "talker_config": {"hidden_size": 896, "head_dim": 128, "tts_codec_end_token_id": 8294},
    }
    cfg = ThinkerConfig.from_dict(official)
    assert (cfg.head_dim, cfg.rope_theta, cfg.mrope_section) == (128, 1e6, (16, 24, 24))
    assert cfg.llama().qkv_bias and not cfg.llama().attention_bias
    talker_cfg = TalkerConfig.from_dict(official)
    assert talker_cfg.eos_token_ids == (8292, 8294) and talker_cfg.hidden_size == 896
    ours = ThinkerConfig.from_dict({"thinker_config": hf_thinker.config.to_dict()})
    assert (ours.hidden_size, ours.mrope_section, ours.rope_theta) == (HIDDEN, (2, 3, 3), 1e4)
    with pytest.raises(ValueError, match="use_sliding_window"):
        ThinkerConfig.from_dict({"use_sliding_window": True})
    with pytest.raises(ValueError, match="mrope_section"):
        ThinkerConfig.from_dict({"hidden_size": 64, "num_attention_heads": 4})


def test_text_only_mrope_is_1d_rope(hf_thinker):
    ids = torch.tensor([PROMPTS[2]])
    positions, deltas = hf_thinker.model.get_rope_index(ids, attention_mask=torch.ones_like(ids))
    assert positions.shape == (3, 1, len(PROMPTS[2]))
    assert (positions == torch.arange(len(PROMPTS[2]))).all() and (deltas == 0).all()
    rotary = hf_thinker.model.language_model.rotary_emb
    pos = torch.arange(200)
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), pos.view(1, 1, -1).expand(3, 1, -1))
    our_cos, our_sin = rope_cos_sin(pos, 16, 10000.0, torch.float32, "cpu")
    assert torch.equal(cos[0], our_cos) and torch.equal(sin[0], our_sin)


def test_loader_keeps_encoders_and_checks_keys(hf_thinker, thinker):
    state = _official_state(hf_thinker)
    encoder_keys = {k for k in state if k.startswith(("audio_tower.", "visual."))}
    assert encoder_keys and set(thinker.encoder_weights) == encoder_keys
    for key in encoder_keys:
        assert torch.equal(thinker.encoder_weights[key], state[key])
    # transformers v5 names (and a ``thinker.`` prefix) load the same weights
    v5 = _thinker(hf_thinker)
    v5.load_weights({f"thinker.{k}": v for k, v in hf_thinker.state_dict().items()})
    assert torch.equal(v5.lm_head, thinker.lm_head)
    assert set(v5.encoder_weights) == encoder_keys
    with pytest.raises(ValueError, match="unexpected"):
        thinker.load_weights({**state, "talker.codec_head.weight": torch.zeros(1)})


# ---------------------------------------------------------------- tests: thinker parity
@pytest.fixture(scope="module")
def thinker_run(thinker):
    """The three prompts in one varlen batch, greedy, with every step's logits recorded."""
    recorder = _Recorder(thinker)
    try:
        frames, logprobs, hidden = _run_thinker(thinker, PROMPTS, STEPS)
    finally:
        del thinker._head
    _assert_free(thinker)
    # recorder.calls[s]: [3, V] logits of step s (0: prefill)
    logits = torch.stack(recorder.calls, dim=1)  # [3, STEPS + 1, V]
    return frames, logits, hidden


@pytest.mark.parametrize("index", range(len(PROMPTS)))
def test_thinker_matches_transformers(hf_thinker, thinker_run, index):
    frames, logits, hidden = thinker_run
    ids = torch.tensor([PROMPTS[index]])
    with torch.no_grad():
        ref = hf_thinker.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=STEPS + 1,
            do_sample=False,
            output_logits=True,
            output_hidden_states=True,
            return_dict_in_generate=True,
        )
    ref_tokens = ref.sequences[0, ids.shape[1] :].tolist()
    assert [f[0] for f in frames[index]] == ref_tokens
    ref_logits = torch.cat(ref.logits).float()  # [STEPS + 1, V]
    assert ref_logits.std(dim=-1).min() > 0.5  # real-scale weights, not near-uniform
    torch.testing.assert_close(logits[index], ref_logits, rtol=0, atol=TOL)
    # the talker conditioning: embedding (hidden_states[s][0]) + last hidden ([s][-1])
    for step, rows in enumerate(hidden[index]):
        states = ref.hidden_states[step]
        expected = (states[0] + states[-1])[0]
        assert rows.dtype == torch.float32 and rows.shape == expected.shape
        torch.testing.assert_close(rows, expected, rtol=0, atol=TOL)


def test_thinker_teacher_forced_logits(thinker, thinker_run):
    frames, logits, _ = thinker_run
    incremental = thinker.teacher_forced_logits(PROMPTS[1], frames[1][:-1], incremental=True)
    one_pass = thinker.teacher_forced_logits(PROMPTS[1], [f[0] for f in frames[1][:-1]])
    assert incremental.shape == (STEPS + 1, 1, 256)
    torch.testing.assert_close(incremental[:, 0], logits[1], rtol=0, atol=1e-5)
    torch.testing.assert_close(one_pass, incremental, rtol=0, atol=1e-5)
    _assert_free(thinker)


# ---------------------------------------------------------------- tests: conditioning hand-off
class _Captured(Exception):
    pass


@pytest.fixture(scope="module")
def generate_capture(hf_thinker, hf_talker, thinker_run):
    """What ``Qwen2_5OmniForConditionalGeneration.generate`` hands ``talker.generate`` for
    prompt 0, with the thinker's EOS set to the greedy token at index ``num_replies``."""
    frames = [f[0] for f in thinker_run[0][0]]
    num_replies = next(j for j in range(3, len(frames)) if frames[j] not in frames[:j])
    config = Qwen2_5OmniConfig(
        thinker_config=_thinker_config().to_dict(),
        talker_config=_talker_config().to_dict(),
        enable_audio_output=False,
    )
    omni = hf.Qwen2_5OmniForConditionalGeneration(config).eval()
    omni.thinker, omni.talker, omni.has_talker = hf_thinker, hf_talker, True
    omni.speaker_map = {"Chelsie": {"bos_token": SPEAKER_BOS}}
    captured = {}

    def fake_generate(**kwargs):
        captured.update(kwargs)
        raise _Captured

    omni.talker.generate = fake_generate
    try:
        with pytest.raises(_Captured):
            omni.generate(
                input_ids=torch.tensor([PROMPTS[0]]),
                thinker_max_new_tokens=STEPS + 1,
                thinker_eos_token_id=frames[num_replies],
                talker_eos_token_id=[CODEC["pad"], CODEC["end"]],
            )
    finally:
        del omni.talker.generate
    return captured, num_replies


def test_conditioning_matches_generate(thinker, talker, thinker_run, generate_capture):
    captured, num_replies = generate_capture
    _, _, hidden = thinker_run
    prompt, replies = _talker_prompt(hidden[0], num_replies)
    num_prompt = len(PROMPTS[0])
    inputs = captured["inputs_embeds"][0]  # [L + 2, E]
    torch.testing.assert_close(inputs[:num_prompt], prompt.prompt_conditions, rtol=0, atol=TOL)
    assert torch.equal(inputs[num_prompt], thinker.embed([SPEAKER_BOS])[0])
    torch.testing.assert_close(inputs[num_prompt + 1], prompt.first_reply[0], rtol=0, atol=TOL)
    codec_ids = [CODEC["mask"]] * num_prompt + [CODEC["pad"], CODEC["start"]]
    assert captured["input_ids"][0].tolist() == codec_ids
    assert captured["suppress_tokens"] == [CODEC["start"]]
    # thinker_reply_part: the rows of steps 1.., then text EOS, then text pad (repeated forever)
    reply_part = captured["thinker_reply_part"][0]
    assert reply_part.shape[0] == num_replies + 1
    for step in range(1, num_replies + 2):
        cond = condition_for_step(step, replies, thinker_done=True)
        row = talker._conditions([cond])[0]
        torch.testing.assert_close(reply_part[step - 1], row, rtol=0, atol=TOL)
    assert condition_for_step(num_replies, replies, True) is TEXT_EOS
    assert condition_for_step(num_replies + 5, replies, True) is TEXT_PAD
    assert condition_for_step(num_replies, replies, False) is None
    assert condition_for_step(1, replies, False).kind is ConditionKind.REPLY


# ---------------------------------------------------------------- tests: talker parity
NUM_REPLIES = (5, 3, STEPS)  # prompts 0, 1 reach text EOS then pad; prompt 2 EOS at the end


@pytest.fixture(scope="module")
def talker_run(talker, thinker_run):
    _, _, hidden = thinker_run
    pairs = [_talker_prompt(hidden[i], n) for i, n in enumerate(NUM_REPLIES)]
    prompts, replies = [p for p, _ in pairs], [r for _, r in pairs]
    recorder = _Recorder(talker)
    try:
        frames, _ = _run_talker(talker, prompts, replies, STEPS)
    finally:
        del talker._head
    _assert_free(talker)
    return prompts, replies, frames, torch.stack(recorder.calls, dim=1)  # [3, STEPS + 1, V]


@pytest.mark.parametrize("index", range(len(PROMPTS)))
def test_talker_matches_transformers(hf_thinker, hf_talker, talker_run, index):
    prompts, replies, frames, logits = talker_run
    inputs, reply_part = _hf_talker_inputs(
        hf_thinker, prompts[index].prompt_conditions, replies[index]
    )
    codes = [f[0] for f in frames[index]]
    ref = _hf_talker_logits(hf_talker, inputs, reply_part, codes[:-1])
    assert ref.std(dim=-1).min() > 0.5
    torch.testing.assert_close(logits[index], ref, rtol=0, atol=TOL)
    suppressed = ref.clone()
    suppressed[:, CODEC["start"]] = float("-inf")  # generate's suppress_tokens
    assert suppressed.argmax(dim=-1).tolist() == codes
    assert CODEC["start"] not in codes


def test_talker_replay_and_teacher_forcing(talker, talker_run):
    prompts, replies, frames, logits = talker_run
    codes = [f[0] for f in frames[1][:-1]]
    conds = tuple(condition_for_step(t, replies[1], True) for t in range(1, len(codes) + 1))
    prompt = dataclasses.replace(prompts[1], replay=conds)
    incremental = talker.teacher_forced_logits(prompt, codes, incremental=True)
    one_pass = talker.teacher_forced_logits(prompt, codes)  # the preemption replay path
    torch.testing.assert_close(incremental[:, 0], logits[1], rtol=0, atol=1e-5)
    torch.testing.assert_close(one_pass, incremental, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="replay"):
        talker.teacher_forced_logits(prompts[1], codes)
    _assert_free(talker)


# ---------------------------------------------------------------- tests: batching, KV
def test_batch_invariant_alone_equals_batched(hf_thinker, hf_talker):
    thinker = _thinker(hf_thinker, batch_invariant=True)
    alone = _run_thinker(thinker, PROMPTS[:1], 8, SAMPLED, seeds=[7])
    batched = _run_thinker(thinker, PROMPTS, 8, SAMPLED, seeds=[7, 8, 9])
    assert alone[0][0] == batched[0][0] and alone[1][0] == batched[1][0]
    assert all(torch.equal(a, b) for a, b in zip(alone[2][0], batched[2][0], strict=True))
    _assert_free(thinker)

    talker = _talker(hf_talker, hf_thinker, batch_invariant=True)
    pairs = [_talker_prompt(batched[2][i], n) for i, n in enumerate((4, 2, 8))]
    prompts, replies = [p for p, _ in pairs], [r for _, r in pairs]
    solo = _run_talker(talker, prompts[:1], replies[:1], 8, SAMPLED, seeds=[3])
    many = _run_talker(talker, prompts, replies, 8, SAMPLED, seeds=[3, 4, 5])
    assert solo[0][0] == many[0][0] and solo[1][0] == many[1][0]
    _assert_free(talker)


def test_thinker_preemption_resumes(hf_thinker, thinker_run):
    """A pool too small for both sequences: the younger is preempted, re-prefilled with its
    frames, and continues with the same greedy tokens; every block comes back."""
    frames_ref, _, hidden_ref = thinker_run
    thinker = _thinker(hf_thinker, kv=KVCacheConfig(num_blocks=9, block_size=4))
    ids, prompts = ["a", "b"], PROMPTS[:2]  # 5 + 11 tokens: 2 + 3 blocks after prefill
    outs = thinker.execute(
        PREFILL,
        [
            ARPrefillInput(s, tuple(p), (), (), GREEDY, None)
            for s, p in zip(ids, prompts, strict=True)
        ],
    )
    frames = [[o.tokens] for o in outs]
    preempted_at = None
    for step in range(1, 12):
        active = [i for i in range(2) if frames[i] is not None]
        units = [ARStepInput(ids[i], frames[i][-1], step, (), GREEDY, None) for i in active]
        for i, out in zip(active, thinker.execute(AR_TOKEN, units), strict=True):
            if out.preempted:
                preempted_at, frames_b = step, frames[i]
                frames[i] = None
            else:
                frames[i].append(out.tokens)
        if preempted_at is not None:
            break
    assert preempted_at is not None and thinker.num_preemptions == 1
    assert [f[0] for f in frames[0]] == [f[0] for f in frames_ref[0][: len(frames[0])]]
    thinker.free_sequence("a")
    replay = ARPrefillInput("b", tuple(prompts[1]), tuple(frames_b), (), GREEDY, None)
    (out,) = thinker.execute(PREFILL, [replay])
    assert out.tokens == frames_ref[1][len(frames_b)]
    # the re-prefill streams only the newest row: that of the last replayed frame
    assert out.hidden.shape == (1, HIDDEN)
    torch.testing.assert_close(out.hidden, hidden_ref[1][len(frames_b)], rtol=0, atol=1e-5)
    thinker.free_sequence("b")
    _assert_free(thinker)


def test_payload_errors(thinker, talker, thinker_run):
    with pytest.raises(ValueError, match="without a prefill"):
        thinker.execute(AR_TOKEN, [ARStepInput("nope", (1,), 1, (), GREEDY, None)])
    with pytest.raises(ValueError, match="frame"):
        thinker.execute(PREFILL, [ARPrefillInput("x", (999,), (), (), GREEDY, None)])
    with pytest.raises(ValueError, match="TalkerPrompt"):
        talker.execute(PREFILL, [ARPrefillInput("y", (1, 2), (), (), GREEDY, None)])
    with pytest.raises(ValueError, match="cannot run"):
        thinker.execute(WorkUnitKind.ONESHOT, [])
    hidden = thinker_run[2][0]
    bad = TalkerPrompt(hidden[0], hidden[1], speaker_bos_id=253)
    with pytest.raises(ValueError, match="not loaded"):
        talker.execute(PREFILL, [ARPrefillInput("z", bad, (), (), GREEDY, None)])
    for component in (thinker, talker):
        for seq_id in ("x", "y", "z"):
            component.free_sequence(seq_id)
        _assert_free(component)
