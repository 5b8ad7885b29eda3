"""The ``qwen3_tts`` card end to end on tiny published folders: codes and audio equal upstream
``qwen-tts`` (greedy), seeds, batched == alone, streamed == whole, text streamed into a running
request, voices and instructions, rollouts scored, aborts."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from omnistep.core import (
    Capability,
    ExecutionProfile,
    InvalidRequestError,
    Modality,
    ModelInstance,
    Request,
    SamplingParams,
)
from omnistep.engine import AsyncEngine, EngineConfig
from omnistep.models.qwen3_tts.card import Qwen3TTSOptions, build_card
from omnistep.parity import collect
from tests.qwen3_tts_ref.env import call_reference
from tests.serving import abort_all

TEXT = "Please leave the package by the blue door."
HOP = 1920


@pytest.fixture(scope="module")
def folders(qwen3_tts_folders):
    return {variant: info.root for variant, info in qwen3_tts_folders.items()}


def _engine(path, **options) -> AsyncEngine:
    card = build_card(str(path), Qwen3TTSOptions(kv_cache_gb=0.01, **options))
    return AsyncEngine([ModelInstance.load(card)])


@pytest.fixture
async def custom(folders):
    engine = _engine(folders["custom_voice"])
    yield engine
    await engine.shutdown()


def _codes(collected) -> np.ndarray:
    """The frames a ROLLOUT request recorded, ``[T, 16]``."""
    return np.array([r.tokens for r in collected.trajectories["decode"]])


async def _run(engine, **fields):
    """Run a request under ROLLOUT (which records its codes and changes nothing else)."""
    return await collect(engine, Request("qwen3-tts", profile=ExecutionProfile.ROLLOUT, **fields))


@pytest.mark.parametrize("layout", [None, False], ids=["default", "streaming"])
@pytest.mark.parametrize(
    ("variant", "fields", "upstream"),
    [
        ("custom_voice", {"voice": "ryan", "language": "english"}, {"speaker": "ryan"}),
        ("custom_voice", {"voice": "dylan"}, {"speaker": "dylan", "language": "Auto"}),
        (
            "voice_design",
            {"instructions": "a calm low voice", "language": "english"},
            {"instruct": "a calm low voice"},
        ),
    ],
)
async def test_greedy_codes_and_audio_equal_upstream(folders, variant, fields, upstream, layout):
    """A whole text without ``non_streaming_mode`` equals upstream's public call with its
    default (the non-streaming layout); ``non_streaming_mode: False`` equals it with False.
    Frame counts equal too (``max_new_tokens`` 12: 11 frames unless EOS comes first)."""
    upstream = {"language": fields.get("language", "Auto").capitalize(), **upstream}
    ref = call_reference(
        "tests.qwen3_tts_ref.upstream:generate",
        root=folders[variant],
        text=TEXT,
        max_new_tokens=12,
        non_streaming_mode=layout,
        **upstream,
    )
    engine = _engine(folders[variant])
    try:
        got = await _run(
            engine,
            text=TEXT,
            seed=1,
            sampling=SamplingParams(temperature=0, max_new_tokens=12),
            non_streaming_mode=layout,
            **fields,
        )
    finally:
        await engine.shutdown()
    n = len(ref["codes"])
    assert n >= 8
    codes = _codes(got)
    assert codes.shape == (n, 16)
    np.testing.assert_array_equal(codes, ref["codes"])
    assert got.sample_rate == 24000 and got.audio.shape == ref["wav"].shape == (n * HOP,)
    np.testing.assert_allclose(got.audio, ref["wav"], atol=1e-4, rtol=0)
    assert np.abs(ref["wav"]).max() > 1e-2


async def test_seed_batch_and_stream_parity(custom):
    fields = {"text": TEXT, "voice": "vivian", "sampling": SamplingParams(max_new_tokens=10)}
    alone = [await _run(custom, seed=s, **fields) for s in (5, 6)]
    again = await _run(custom, seed=5, **fields)
    assert np.array_equal(again.audio, alone[0].audio)
    assert not np.array_equal(_codes(alone[0]), _codes(alone[1]))
    together = await asyncio.gather(
        *(_run(custom, seed=s, **fields) for s in (5, 6)),
        _run(
            custom,
            seed=9,
            text="Another one, longer than the others by far.",
            voice="ryan",
            sampling=SamplingParams(max_new_tokens=14),
        ),
    )
    for a, b in zip(alone, together, strict=False):
        assert np.array_equal(_codes(a), _codes(b))
        np.testing.assert_allclose(a.audio, b.audio, atol=1e-5, rtol=0)
    assert max(custom.batch_sizes) > 1


async def test_text_streamed_into_a_running_request_equals_the_whole_text(custom):
    """Streamed text uses the streaming-text layout: its audio equals the whole text's with
    ``non_streaming_mode=False``, and differs from the whole text's default layout."""
    sampling = SamplingParams(max_new_tokens=40)
    whole = await _run(
        custom, text=TEXT, voice="ryan", seed=3, sampling=sampling, non_streaming_mode=False
    )
    default = await _run(custom, text=TEXT, voice="ryan", seed=3, sampling=sampling)
    stream = custom.add_request(
        Request(
            "qwen3-tts",
            text="",
            voice="ryan",
            seed=3,
            text_input=True,
            sampling=SamplingParams(max_new_tokens=40),
        )
    )
    events: list[str] = []
    audio: list[np.ndarray] = []

    async def feed():
        for word in TEXT.split(" "):
            stream.append_text(word if not events else " " + word)
            events.append("text")
            await asyncio.sleep(0.15)
        stream.end_text()
        events.append("end")

    async def read():
        async for chunk in stream:
            if chunk.modality is Modality.AUDIO and chunk.audio.size:
                audio.append(chunk.audio)
                events.append("audio")

    await asyncio.gather(feed(), read())
    assert "audio" in events[: events.index("end")], events
    np.testing.assert_array_equal(np.concatenate(audio), whole.audio)
    n = min(len(default.audio), len(whole.audio))
    assert np.abs(default.audio[:n] - whole.audio[:n]).max() > 1e-2


async def test_streamed_text_in_the_non_streaming_layout_waits_for_its_end(custom):
    """``non_streaming_mode=True`` on streamed text: nothing is computed before the text ends,
    then the audio equals the whole text's default (the same layout)."""
    sampling = SamplingParams(max_new_tokens=8)
    whole = await _run(custom, text=TEXT, voice="ryan", seed=3, sampling=sampling)
    talker = custom.resolve("qwen3-tts").components["talker"]
    stream = custom.add_request(
        Request("qwen3-tts", text="", voice="ryan", seed=3, text_input=True, sampling=sampling,
                non_streaming_mode=True)
    )  # fmt: skip
    audio: list[np.ndarray] = []

    async def read():
        async for chunk in stream:
            if chunk.modality is Modality.AUDIO and chunk.audio.size:
                audio.append(chunk.audio)

    reader = asyncio.ensure_future(read())
    for i, word in enumerate(TEXT.split(" ")):
        stream.append_text(word if i == 0 else " " + word)
        await asyncio.sleep(0.05)
    assert not audio and talker.blocks.num_used_blocks == talker.kept_prefix_blocks
    stream.end_text()
    await reader
    np.testing.assert_array_equal(np.concatenate(audio), whole.audio)


async def test_voices_and_instructions(folders, custom):
    with pytest.raises(InvalidRequestError, match="unknown voice") as err:
        custom.add_request(Request("qwen3-tts", text="hi", voice="nobody"))
    assert err.value.param == "voice"
    with pytest.raises(InvalidRequestError) as err:
        custom.add_request(Request("qwen3-tts", text="hi", language="klingon"))
    assert err.value.param == "language"
    # an OpenAI name speaks as its mapped speaker
    mapped = await _run(
        custom, text="Hi there.", voice="ash", seed=2, sampling=SamplingParams(max_new_tokens=4)
    )
    named = await _run(
        custom, text="Hi there.", voice="Ryan", seed=2, sampling=SamplingParams(max_new_tokens=4)
    )
    assert np.array_equal(mapped.audio, named.audio)
    design = _engine(folders["voice_design"])
    try:
        with pytest.raises(InvalidRequestError, match="instructions") as err:
            design.add_request(Request("qwen3-tts", text="hi"))
        assert err.value.param == "instructions"
        calm, bright = [
            await _run(
                design,
                text="Hi there.",
                instructions=i,
                seed=2,
                sampling=SamplingParams(max_new_tokens=4),
            )
            for i in ("a calm low voice", "a bright fast voice")
        ]
        assert not np.array_equal(calm.audio, bright.audio)
    finally:
        await design.shutdown()


@pytest.mark.parametrize("layout", [None, False], ids=["default", "streaming"])
async def test_rollout_logprobs_are_reproduced_by_score(folders, layout):
    """Score replays a rollout in its own layout: the whole text's default (non-streaming:
    every text id in the prompt, ``tts_pad`` each step) and the streaming-text layout."""
    engine = _engine(folders["custom_voice"], batch_invariant=True)
    try:
        req = Request(
            "qwen3-tts",
            text=TEXT,
            voice="ryan",
            seed=4,
            profile=ExecutionProfile.ROLLOUT,
            sampling=SamplingParams(max_new_tokens=7),
            non_streaming_mode=layout,
        )
        got = await collect(engine, req)
        records = got.trajectories["decode"]
        info = got.rollout_info["decode"]
        replay = info["prompt"].replay_text
        if layout is None:  # the prompt ends tts_eos | codec_pad, tts_pad | codec_bos
            assert set(replay) == {info["prompt"].text_ids[-1]}
        else:
            assert len(set(replay)) > 1  # the text's ids, one per step
        recorded = np.array([r.logprobs for r in records], dtype=np.float32)
        assert recorded.shape == (6, 16) and np.all(recorded <= 0) and np.any(recorded < 0)
        model = engine.resolve("qwen3-tts")
        frames = [r.tokens for r in records]
        scored = model.loops["decode"].score(model, req, info["prompt"], frames)
        np.testing.assert_allclose(scored.detach().numpy(), recorded, atol=1e-6, rtol=0)
    finally:
        await engine.shutdown()


NEUTRAL = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0}


async def test_the_code_predictor_samples_with_the_requests_sub_stage_settings(folders):
    """Every stage is settable per request: the ``subtalker_*`` fields drive codebooks 1..15,
    and the recorded log-probs are those of the distribution each code was drawn from."""
    engine = _engine(folders["custom_voice"], batch_invariant=True)
    try:

        async def run(**sampling):
            sp = SamplingParams(max_new_tokens=8, **sampling)
            got = await _run(engine, text=TEXT, voice="ryan", seed=4, sampling=sp)
            records = got.trajectories["decode"]
            processed = np.array([r.logprobs for r in records], dtype=np.float64)
            policy = np.array([r.policy_logprobs for r in records], dtype=np.float64)
            return _codes(got), processed, policy

        neutral_sub = {"subtalker_temperature": 1.0, "subtalker_top_p": 1.0, "subtalker_top_k": 0}
        codes, processed, policy = await run(**NEUTRAL, **neutral_sub)
        assert codes.shape[1] == 16 and codes.shape[0] >= 3
        # neutral everywhere: the sampled distribution is the policy's, for all 16 codebooks
        # (codebook 0 past the first 2 frames, whose EOS mask is part of what was sampled)
        assert np.abs(processed[:, 1:] - policy[:, 1:]).max() <= 1e-6
        assert np.abs(processed[2:, 0] - policy[2:, 0]).max() <= 1e-6
        # the checkpoint's predictor defaults (temperature 0.9, top-k 50) are another row
        default_codes, default_processed, default_policy = await run(**NEUTRAL)
        assert np.abs(default_processed[:, 1:] - default_policy[:, 1:]).max() > 1e-2
        assert codes[0, 0] == default_codes[0, 0]  # codebook 0 is drawn before the predictor
        assert not np.array_equal(codes[:, 1:], default_codes[:, 1:])

        # temperature 0 is greedy in both stages (upstream's do_sample=False defaults), unless
        # the sub-stage's own temperature says otherwise: then seeds change codebooks 1..15 only
        async def greedy(seed: int, **sampling):
            sp = SamplingParams(max_new_tokens=4, min_new_tokens=4, temperature=0.0, **sampling)
            got = await _run(engine, text=TEXT, voice="ryan", seed=seed, sampling=sp)
            return _codes(got)

        assert np.array_equal(await greedy(1), await greedy(2))
        first, second = (
            await greedy(1, subtalker_temperature=1.0),
            await greedy(2, subtalker_temperature=1.0),
        )
        assert first[0, 0] == second[0, 0] and not np.array_equal(first[:, 1:], second[:, 1:])
        with pytest.raises(InvalidRequestError, match="subtalker_top_p"):
            SamplingParams(subtalker_top_p=0.0)
    finally:
        await engine.shutdown()


async def test_aborted_requests_leave_no_kv_blocks_or_codec_streams(custom):
    streams = [
        custom.add_request(Request("qwen3-tts", text=TEXT, seed=i, voice="ryan")) for i in range(50)
    ]
    await abort_all(custom, streams, 0.3)
    assert custom.stats() == dict.fromkeys(custom.stats(), 0)
    assert custom.resolve("qwen3-tts").components["codec"].num_streams == 0


@pytest.mark.parametrize("policy", ["edf", "fcfs"])
@pytest.mark.parametrize("layout", [False, True], ids=["streaming", "non_streaming"])
async def test_a_burst_that_outgrows_the_kv_pool_finishes_with_its_codes(
    folders, custom, layout, policy
):
    """A KV pool of 13 blocks for 8 requests of 24 frames (3 blocks each) under EDF and FCFS:
    requests are preempted and re-prefilled, every one ends with the codes it has in a roomy
    pool, no blocks stay held, and the talker never ran a prefill it had no room for (the
    scheduler admits prefills by the pool). (Before that, a preempted request's re-prefill,
    earliest due under EDF, ran before the decode steps that could free its room and failed
    again at once, forever: a livelock.) In both layouts: a non-streaming re-prefill replays
    ``tts_pad`` with each frame."""
    voices = ("ryan", "vivian", "eric")
    fields = [
        {
            "text": "Hello there, how are you today?",
            "voice": voices[i % 3],
            "seed": i,
            "sampling": SamplingParams(max_new_tokens=25),  # 24 frames, or EOS before
            "non_streaming_mode": layout,
        }
        for i in range(8)
    ]
    roomy = await asyncio.gather(*(_run(custom, **f) for f in fields))
    card = build_card(str(folders["custom_voice"]), Qwen3TTSOptions(kv_cache_gb=0.0001))
    model = ModelInstance.load(card)
    talker = model.components["talker"]
    assert talker.blocks.num_blocks == 13
    engine = AsyncEngine([model], EngineConfig(scheduling=policy))
    try:
        # a hang guard, not a timing: a few seconds alone, minutes on a loaded 2-core box
        tight = await asyncio.wait_for(asyncio.gather(*(_run(engine, **f) for f in fields)), 600)
        assert engine.stats()["kv_blocks_used"] == 0
    finally:
        await engine.shutdown()
    assert talker.num_preemptions > 0
    assert talker.num_refused_prefills == 0
    for a, b in zip(roomy, tight, strict=True):
        if not layout:  # (the non-streaming prompts draw EOS early on these random weights)
            assert _codes(a).shape == (24, 16)  # max_new_tokens 25: 24 frames, as upstream
        np.testing.assert_array_equal(_codes(a), _codes(b))
        np.testing.assert_allclose(a.audio, b.audio, atol=1e-5, rtol=0)


@pytest.mark.parametrize("alone", [True, False])
async def test_first_codec_chunk_runs_without_the_requests_talker(folders, alone):
    """``Qwen3TTSOptions.first_audio_alone``: the talker's second step becomes ready in the
    same fold as the first codec chunk (both wait on the prefill's frame); with the flag it
    is taken back out of the queue, so no talker step starts before the first chunk is
    decoded; without it the step runs beside the chunk. The audio is the same either way."""
    engine = _engine(folders["custom_voice"], first_audio_alone=alone)
    model = engine.resolve("qwen3-tts")
    calls: dict[str, list[tuple[str, float, float]]] = {"talker": [], "codec": []}
    for name, log in calls.items():
        component = model.components[name]
        inner = component.execute

        def execute(kind, payloads, inner=inner, log=log):
            start = time.perf_counter()
            try:
                return inner(kind, payloads)
            finally:
                log.append((kind.value, start, time.perf_counter()))

        component.execute = execute
    request = Request("qwen3-tts", text=TEXT, voice="ryan", seed=5,
                      sampling=SamplingParams(max_new_tokens=6))  # fmt: skip
    try:
        got = await collect(engine, request)
    finally:
        await engine.shutdown()
    (_, chunk_start, chunk_end), *_ = calls["codec"]
    steps = [start for kind, start, _ in calls["talker"] if kind == "ar_token"]
    assert len(steps) >= 4
    if alone:
        assert min(steps) >= chunk_end
    else:
        assert min(steps) < chunk_end
    reference = _engine(folders["custom_voice"], first_audio_alone=not alone)
    try:
        expected = await collect(reference, request)
    finally:
        await reference.shutdown()
    assert np.array_equal(got.audio, expected.audio) and got.audio.size >= 6 * HOP // 2


async def test_custom_voice_cannot_clone(custom):
    card = custom.resolve("qwen3-tts").card
    assert Capability.VOICE_CLONING not in card.capabilities and card.voice_enroller is None
    clip = np.zeros(48000, np.float32)
    with pytest.raises(InvalidRequestError) as err:
        await custom.clone_voice("qwen3-tts", clip, 24000, "hello")
    assert err.value.code == "voice_cloning_unsupported" and err.value.param == "model"


def test_served_over_http_and_the_speech_stream(folders):
    """``omnistep serve --model qwen3_tts=DIR``: /v1/audio/speech with language and voice, the
    voices listing, and the WebSocket feeding a turn's words into one running request."""
    import json

    import httpx
    from websockets.sync.client import connect

    from tests.serving import running_server

    with running_server("--model", f"qwen3_tts={folders['custom_voice']}", timeout=300) as url:
        body = {
            "model": "qwen3-tts",
            "input": TEXT,
            "voice": "ryan",
            "language": "english",
            "seed": 7,
            "max_new_tokens": 16,
            "response_format": "pcm",
        }
        pcm = httpx.post(url + "/v1/audio/speech", json=body, timeout=120)
        assert pcm.status_code == 200, pcm.text
        assert len(pcm.content) == 15 * HOP * 2  # max_new_tokens 16: 15 frames, as upstream
        # the WebSocket's turn uses the streaming-text layout: the POST gives it when asked
        streaming = {**body, "non_streaming_mode": False}
        pcm_streaming = httpx.post(url + "/v1/audio/speech", json=streaming, timeout=120)
        assert pcm_streaming.status_code == 200, pcm_streaming.text
        assert len(pcm_streaming.content) == len(pcm.content)
        assert pcm_streaming.content != pcm.content
        wrong = httpx.post(url + "/v1/audio/speech", json={**body, "non_streaming_mode": "yes"})
        assert wrong.status_code == 400
        bad = httpx.post(url + "/v1/audio/speech", json={**body, "language": "klingon"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "language"
        names = {v["name"] for v in httpx.get(url + "/v1/audio/voices").json()["data"]}
        assert {"ryan", "vivian", "alloy"} <= names
        ws_url = url.replace("http://", "ws://") + "/v1/audio/speech/stream"
        with connect(ws_url, proxy=None, open_timeout=30) as ws:
            config = {k: v for k, v in body.items() if k != "input"}
            ws.send(json.dumps({"type": "session.config", **config}))
            for i, word in enumerate(TEXT.split(" ")):
                ws.send(json.dumps({"type": "input.text", "text": (" " if i else "") + word}))
            ws.send(json.dumps({"type": "input.done"}))
            audio = b""
            while True:
                frame = ws.recv(timeout=120)
                if isinstance(frame, bytes):
                    audio += frame
                elif json.loads(frame)["type"] == "audio.done":
                    assert json.loads(frame)["segments"] == 1
                    break
        assert audio == pcm_streaming.content  # turn 0 has seed S + 0
