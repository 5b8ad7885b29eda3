"""The ChatTTS card on a tiny checkpoint in the official layout (random weights; the official
file set exactly, GPT width 768 as the official one, so the shipped speaker statistics apply):
reference parity with the upstream ``chattts`` package (speakers included), parity gates
C1/C2/C3, streaming and KV hygiene."""

import asyncio
import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from omnistep.core import (
    OPENAI_VOICES,
    ExecutionProfile,
    InvalidRequestError,
    ModelInstance,
    ProgramContext,
    Request,
    SamplingParams,
)
from omnistep.engine import AsyncEngine
from omnistep.models.chattts.card import ChatTTSOptions, build_card
from omnistep.models.chattts.frontend import SPEAKER_SEED_BASE
from omnistep.models.chattts.speaker import (
    decode_speaker,
    encode_speaker,
    random_speaker,
    shipped_spk_stat,
)
from omnistep.models.chattts.tiny import SERVABLE_SIZES, write_servable_tiny_chattts
from omnistep.parity import collect, run_alone, run_interleaved
from omnistep.sampling import policy_logprobs, recompute_logprobs
from tests.chattts_ref import reference

TEXT = "hello world this is a test"
TEXTS = ["hello world", "this is a longer test of the voice", "good morning", "a b c d e f"]
GREEDY = SamplingParams(temperature=0.0, repetition_penalty=1.0, max_new_tokens=32)
FULL_CONTEXT = {"left_context": 64, "lookahead": 64, "trim_threshold": None}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return write_servable_tiny_chattts(tmp_path_factory.mktemp("chattts") / "ckpt")


@pytest.fixture(scope="module")
def speaker(root) -> str:
    return reference.upstream_random_speaker(root, 3)


def _model(root, **options) -> ModelInstance:
    opts = ChatTTSOptions(**{"kv_cache_gb": 0.02, **options})
    return ModelInstance.load(build_card(str(root), opts))


@pytest.fixture(scope="module")
def model(root):
    return _model(root)


@pytest.fixture
async def engine(model):
    eng = AsyncEngine([model])
    yield eng
    await eng.shutdown()
    assert model.components["gpt"].blocks.num_used_blocks == 0


def _prompt(model, text, voice, seed=0):
    ctx = ProgramContext(Request("chattts", text=text, voice=voice, seed=seed), model)
    model.card.program.nodes[0].fn(ctx)
    return ctx.slots["prompt"]


def test_prompt_ids_and_prefill_logits_match_upstream(model, root, speaker):
    prompt = _prompt(model, TEXT, speaker)
    upstream = reference.upstream_prompt_inputs(root, TEXT, speaker)
    assert list(prompt.input_ids) == upstream.input_ids[0, :, 0].tolist()
    ours = model.components["gpt"].teacher_forced_logits(prompt)[0]
    theirs = reference.upstream_prefill_logits(root, TEXT, speaker)
    assert ours.shape == theirs.shape == (4, 626)
    assert (ours - theirs).abs().max().item() <= 1e-4


async def test_greedy_codes_and_waveform_match_upstream(root, speaker):
    """32 greedy decode steps: identical codes; the audio of our streamed, chunked decode with
    full receptive-field context equals upstream's whole-utterance Decoder+Vocos within 1e-4."""
    up = reference.upstream_greedy_codes(root, TEXT, speaker, steps=32)
    model = _model(root, first_chunk=5, chunk=9, **FULL_CONTEXT)
    eng = AsyncEngine([model])
    req = Request(
        "chattts",
        text=TEXT,
        voice=speaker,
        seed=1,
        sampling=GREEDY,
        profile=ExecutionProfile.ROLLOUT,
    )
    stream = eng.add_request(req)
    out = [c async for c in stream]
    await eng.shutdown()
    codes = [list(r.tokens) for r in stream.trajectories["decode"]]
    assert len(codes) >= len(up.codes) > 8
    assert codes[: len(up.codes)] == up.codes.tolist()
    # the logits of every decode step, replayed through our decode path, equal upstream's
    prompt = _prompt(model, TEXT, speaker)
    steps = up.logits.shape[0]
    ours = model.components["gpt"].teacher_forced_logits(
        prompt, [tuple(c) for c in up.codes.tolist()][: steps - 1], incremental=True
    )
    assert ours.shape == up.logits.shape
    assert (ours - up.logits).abs().max().item() <= 1e-4
    audio = np.concatenate([c.audio for c in out])
    wav = reference.upstream_decode_wav(root, up.hiddens)
    n = min(audio.size, wav.size)
    assert n >= 512 * len(up.codes) - 256
    assert np.abs(audio[:n] - wav[:n]).max() <= 1e-4


async def test_same_seed_same_codes_and_samples(engine, speaker):  # C1
    req = Request("chattts", text=TEXT, seed=7, sampling=SamplingParams(max_new_tokens=40))
    a, b = await run_alone(engine, [req, req])
    assert a.audio.size > 0 and np.array_equal(a.audio, b.audio)
    other = await collect(engine, dataclasses.replace(req, seed=8))
    assert not np.array_equal(a.audio[: other.audio.size], other.audio[: a.audio.size])


def _requests(voice=None):
    return [
        Request(
            "chattts",
            text=t,
            voice=voice,
            seed=10 + i,
            profile=ExecutionProfile.ROLLOUT,
            sampling=SamplingParams(max_new_tokens=20 + 6 * i),
        )
        for i, t in enumerate(TEXTS)
    ]


async def _codes(engine, reqs, together):
    streams = []

    async def one(r):
        r = dataclasses.replace(r, request_id=f"{r.request_id}-{together}-{len(streams)}")
        stream = engine.add_request(r)
        streams.append(stream)
        chunks = [c async for c in stream]
        return [r.tokens for r in stream.trajectories["decode"]], np.concatenate(
            [c.audio for c in chunks]
        )

    if together:
        return await asyncio.gather(*(one(r) for r in reqs))
    return [await one(r) for r in reqs]


async def test_interleaved_equals_alone(engine):  # C3 (default batched kernels)
    reqs = _requests()
    alone = await _codes(engine, reqs, together=False)
    engine.batch_sizes.clear()
    together = await _codes(engine, reqs, together=True)
    assert max(engine.batch_sizes) >= 3, "the requests should have decoded in one batch"
    for (codes_a, audio_a), (codes_b, audio_b) in zip(alone, together, strict=True):
        assert codes_a == codes_b
        assert np.abs(audio_a - audio_b).max() <= 1e-5


async def test_batch_invariant_mode_is_bit_identical(root):
    eng = AsyncEngine([_model(root, batch_invariant=True)])
    reqs = _requests()
    alone = await run_alone(eng, reqs)
    together = await run_interleaved(eng, reqs)
    await eng.shutdown()
    for a, b in zip(alone, together, strict=True):
        assert np.array_equal(a.audio, b.audio)


async def test_rollout_logprobs_recompute(engine, model):  # C2
    req = Request(
        "chattts",
        text=TEXT,
        seed=5,
        profile=ExecutionProfile.ROLLOUT,
        sampling=SamplingParams(max_new_tokens=24),
    )
    stream = engine.add_request(req)
    [c async for c in stream]
    trajectory = stream.trajectories["decode"]
    frames = [r.tokens for r in trajectory]
    recorded = torch.tensor([r.logprobs for r in trajectory])
    prompt = _prompt(model, TEXT, None, seed=5)
    gpt = model.components["gpt"]
    row = model.loops["decode"].config.make_sampling(req)
    history = [
        torch.tensor(frames[max(0, i - 16) : i], dtype=torch.long).reshape(-1, 4).T
        for i in range(len(frames))
    ]

    def recompute(logits):
        return recompute_logprobs(
            logits, [row] * len(frames), history, list(range(len(frames))), torch.tensor(frames)
        )

    replayed = gpt.teacher_forced_logits(prompt, frames[:-1], incremental=True)  # [n, 4, V]
    assert (recompute(replayed) - recorded).abs().max().item() <= 1e-6
    policy = torch.tensor([r.policy_logprobs for r in trajectory])
    rescored = policy_logprobs(replayed, [row] * len(frames), torch.tensor(frames))
    assert (rescored - policy).abs().max().item() <= 1e-6
    # the processed distribution (top-p/top-k, repetition penalty) is another one
    assert (recorded - policy).abs().max().item() > 1e-3
    assert {r.weight_version for r in trajectory} == {0}
    one_pass = gpt.teacher_forced_logits(prompt, frames[:-1])
    assert (recompute(one_pass) - recorded).abs().max().item() <= 1e-4


async def test_chunked_decode_equals_whole_with_full_context(root):
    req = Request("chattts", text=TEXT, seed=3, sampling=SamplingParams(max_new_tokens=40))
    outs = []
    for opts in (
        {"first_chunk": 3, "chunk": 7, **FULL_CONTEXT},
        {"first_chunk": 10_000, **FULL_CONTEXT},
    ):
        eng = AsyncEngine([_model(root, **opts)])
        outs.append(await collect(eng, req))
        await eng.shutdown()
    chunked, whole = outs
    assert len(chunked.chunks) > 3 and len(whole.chunks) == 1
    assert chunked.audio.size == whole.audio.size
    assert np.abs(chunked.audio - whole.audio).max() <= 1e-5


async def test_aborted_requests_free_every_kv_block(engine, model):
    gpt = model.components["gpt"]
    streams = [
        engine.add_request(
            Request(
                "chattts", text=f"{TEXT} {i}", seed=i, sampling=SamplingParams(max_new_tokens=200)
            )
        )
        for i in range(50)
    ]
    for i, stream in enumerate(streams):
        for _ in range(i % 3):
            await asyncio.sleep(0.01)
        stream.cancel()
    await asyncio.sleep(0.2)
    for _ in range(600):  # a batch in flight frees its units' blocks when it returns
        if not engine.stats()["running_batches"]:
            break
        await asyncio.sleep(0.05)
    assert engine.stats()["live_requests"] == 0
    assert gpt.blocks.num_used_blocks == 0 and not gpt.lengths


async def test_kv_pool_exhaustion_preempts_and_recomputes(root):
    s = SERVABLE_SIZES
    block_bytes = 2 * s.num_layers * 16 * s.hidden * 4  # K+V, layers, 16 tokens, hidden, fp32
    model = _model(root, kv_cache_gb=7 * block_bytes / 2**30)  # one request fits, four do not
    gpt = model.components["gpt"]
    assert gpt.blocks.num_blocks == 7
    eng = AsyncEngine([model])
    reqs = [dataclasses.replace(r, sampling=GREEDY) for r in _requests()]
    alone = await _codes(eng, reqs, together=False)
    together = await _codes(eng, reqs, together=True)
    await eng.shutdown()
    assert gpt.num_preemptions > 0
    for (codes_a, _), (codes_b, _) in zip(alone, together, strict=True):
        assert codes_a == codes_b
    assert gpt.blocks.num_used_blocks == 0


def test_speaker_strings_match_upstream(root, speaker):
    ours = decode_speaker(speaker, 768)
    theirs = torch.as_tensor(reference.decode_speaker(speaker)).float()
    assert torch.equal(ours, theirs)
    assert decode_speaker(encode_speaker(ours), 768).equal(ours)
    with pytest.raises(InvalidRequestError) as info:
        decode_speaker("not a speaker", 768)
    assert info.value.param == "voice"


def test_speaker_statistics_are_upstreams(root, model):
    """The statistics omnistep ships, as the card uses them on the official file set, equal
    chattts 0.2.5's: ``Speaker(768, Config().spk_stat).std / .mean`` (float16), which is also
    what upstream's ``Chat`` loaded from this folder uses."""
    from tests.chattts_ref.shims import install_shims

    install_shims()
    from ChatTTS.config.config import Config
    from ChatTTS.model.speaker import Speaker

    upstream = Speaker(768, Config().spk_stat)
    frontend = model.card.program.nodes[0].fn
    for stat in (shipped_spk_stat(), frontend.spk_stat):
        std, mean = stat.chunk(2)
        assert stat.dtype == torch.float16 and std.shape == (768,)
        assert torch.equal(std, upstream.std) and torch.equal(mean, upstream.mean)
    chat = reference.load_upstream_chat(root)
    assert torch.equal(chat.speaker.std, upstream.std)
    assert torch.equal(chat.speaker.mean, upstream.mean)


def test_random_speakers_equal_upstream_sample_random_speaker(root, model):
    """Seed N draws the speaker of upstream's ``torch.manual_seed(N);
    Chat.sample_random_speaker()`` (global CPU RNG there, a seeded generator here): the same
    string, and the card writes upstream's normalised vector for ``seed:N``, for each OpenAI
    name (``seed:1000+i``) and for no voice (the request's seed)."""
    upstream_apply = torch.nn.functional.normalize  # what Speaker.apply does to the fp16 vector

    def upstream_vector(n: int) -> torch.Tensor:
        spk = torch.from_numpy(reference.decode_speaker(reference.upstream_random_speaker(root, n)))
        return upstream_apply(spk, p=2.0, dim=0, eps=1e-12).float()

    stat = shipped_spk_stat()
    for n in (0, 3, 42, 123_456_789):
        up = reference.upstream_random_speaker(root, n)
        assert encode_speaker(random_speaker(stat, n)) == up
        assert torch.equal(_prompt(model, TEXT, f"seed:{n}").speaker, upstream_vector(n))
        assert torch.equal(_prompt(model, TEXT, None, seed=n).speaker, upstream_vector(n))
    for i, name in enumerate(OPENAI_VOICES):
        assert torch.equal(
            _prompt(model, TEXT, name).speaker, upstream_vector(SPEAKER_SEED_BASE + i)
        )


def test_missing_file_is_named(root, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(root, broken)
    (broken / "asset" / "Vocos.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="asset/Vocos.safetensors"):
        build_card(str(broken))
    with pytest.raises(FileNotFoundError, match="not found"):
        build_card(str(tmp_path / "nope"))


def test_server_streams_chattts_and_takes_sampling_fields(root, speaker):
    import httpx

    from tests.serving import running_server

    with running_server("--model", f"chattts={root}", "--kv-cache-gb", "0.02") as base:
        body = {
            "model": "chattts",
            "input": TEXT,
            "voice": speaker,
            "seed": 4,
            "response_format": "pcm",
            "temperature": 0.5,
            "top_p": 0.9,
            "top_k": 30,
            "repetition_penalty": 1.1,
            "max_new_tokens": 30,
        }
        url = base + "/v1/audio/speech"
        full = httpx.post(url, json={**body, "stream": False}, timeout=120)
        assert full.status_code == 200, full.text
        with httpx.stream("POST", url, json=body, timeout=120) as r:
            pieces = list(r.iter_raw())
        assert len(pieces) > 1 and b"".join(pieces) == full.content
        assert 0 < len(full.content) <= 2 * 30 * 512  # 24 kHz s16le, at most 30 tokens
        hotter = httpx.post(url, json={**body, "temperature": 1.5, "stream": False}, timeout=120)
        assert hotter.status_code == 200 and hotter.content != full.content
        bad = httpx.post(url, json={**body, "voice": "not-a-speaker"}, timeout=30)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "voice"
        bad = httpx.post(url, json={**body, "top_p": 0}, timeout=30)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "top_p"
        assert httpx.get(base + "/health").json()["live_requests"] == 0


def test_refine_text_logits_match_upstream(model, root):
    gpt = model.components["gpt"]
    tok = model.card.program.nodes[0].fn.tokenizer
    from omnistep.models.chattts.gpt import ChatTTSPromptInput

    ids = tok.refine_prompt(TEXT)
    ours = gpt.teacher_forced_logits(ChatTTSPromptInput(tuple(ids), text_mode=True))[0, 0]
    chat = reference.load_upstream_chat(root)
    decorated = chat.speaker.decorate_text_prompts([TEXT], "")
    input_ids, _, text_mask = chat.tokenizer.encode(decorated, 4)
    assert input_ids[0, :, 0].tolist() == ids
    with torch.no_grad():
        emb = chat.embed(input_ids, text_mask)
        hidden = chat.gpt.gpt(inputs_embeds=emb).last_hidden_state[0, -1]
        theirs = chat.gpt.head_text(hidden)
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max().item() <= 1e-4


async def test_refine_stage_runs_before_the_code_stage(root):
    eng = AsyncEngine([_model(root, refine_text=True)])
    req = Request(
        "chattts",
        text=TEXT,
        seed=2,
        profile=ExecutionProfile.ROLLOUT,
        sampling=SamplingParams(max_new_tokens=20),
    )
    stream = eng.add_request(req)
    chunks = [c async for c in stream]
    await eng.shutdown()
    refined = stream.trajectories["refine"]
    assert refined and all(len(r.tokens) == 1 for r in refined)
    assert stream.trajectories["decode"] and sum(c.audio.size for c in chunks) > 0
