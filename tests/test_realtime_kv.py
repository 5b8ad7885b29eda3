"""A realtime session keeps its KV between turns (issue 27, item 4): prefix caching in the
block manager (``BlockManager.cache(keep=True)``: an evictable cache) used by salted requests
(``Request.cache_salt``, a session's id), on the tiny Qwen2.5-Omni checkpoint: turn 2
prefills only what turn 1's sequence did not hold, answers as a fresh session with the same
history does, and dropped sessions leave only evictable blocks that a burst reclaims. The
realtime route's side (the salt, the answer's ids fed back) runs through the openai SDK on
``toy_hear`` and on the tiny checkpoint."""

from __future__ import annotations

import asyncio
import contextlib

import numpy as np
import pytest

from omnistep.core import (
    ChatMessage,
    MediaItem,
    MediaKind,
    Modality,
    ModelInstance,
    Request,
    RequestAbortedError,
    SamplingParams,
    WorkUnitKind,
)
from omnistep.engine import AsyncEngine
from omnistep.loops.ar_decode import ARPrefillInput
from omnistep.models.qwen2_5_omni.card import SPEECH_SYSTEM_PROMPT, QwenOmniOptions, build_card
from omnistep.models.qwen2_5_omni.frontend import splice_replies
from omnistep.models.qwen2_5_omni.tiny import write_tiny_qwen_omni
from omnistep.sampling import SamplingRow
from tests.serving import record_requests, served_in_process

BLOCK = 16
OPTIONS = QwenOmniOptions(
    kv_cache_gb=0.0006,  # the thinker's pool: 89 blocks of 16 tokens
    block_size=BLOCK,
    thinker_max_new_tokens=8,
    talker_max_new_tokens=8,
    talker_sampling=SamplingRow(temperature=0.0, min_keep=1),
    dit_chunking=None,
)
GREEDY = SamplingParams(temperature=0.0)
SHORT = SamplingParams(temperature=0.0, max_new_tokens=3)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> ModelInstance:
    root = write_tiny_qwen_omni(tmp_path_factory.mktemp("rtkv") / "ckpt")
    return ModelInstance.load(build_card(str(root), OPTIONS))


def _audio(seed: int, seconds: float = 1.0) -> MediaItem:
    rng = np.random.default_rng(seed)
    data = (0.1 * rng.standard_normal(int(16000 * seconds))).astype(np.float32)
    return MediaItem.of(MediaKind.AUDIO, data, sample_rate=16000, source=f"clip{seed}")


def _user(seed: int) -> ChatMessage:
    item = _audio(seed)
    return ChatMessage("user", "", parts=(item,))


def _request(
    messages, salt: str | None, audio: bool = True, sampling: SamplingParams = GREEDY
) -> Request:
    outputs = {Modality.TEXT, Modality.AUDIO} if audio else {Modality.TEXT}
    return Request(
        "qwen2.5-omni",
        messages=(ChatMessage("system", SPEECH_SYSTEM_PROMPT), *messages),
        seed=0,
        sampling=sampling,
        output_modalities=frozenset(outputs),
        cache_salt=salt,
    )


async def _answer(engine: AsyncEngine, request: Request):
    """(text, generated ids, audio, input tokens) of one request; ``LAST_USAGE`` keeps its
    usage."""
    stream = engine.add_request(request)
    text, audio = [], []
    async for chunk in stream:
        if chunk.text:
            text.append(chunk.text)
        elif chunk.audio is not None:
            audio.append(chunk.audio)
    samples = np.concatenate(audio) if audio else np.zeros(0, np.float32)
    LAST_USAGE.clear()
    LAST_USAGE.update(stream.usage)
    return "".join(text), stream.text_ids, samples, stream.usage["input_tokens"]


LAST_USAGE: dict[str, int] = {}


def test_splice_replies_puts_ids_after_each_assistant_head():
    head = [7, 8]
    ids = [1, 7, 8, 9, 2, 7, 8, 9, 7, 8]  # two rendered (empty) assistant turns + gen prompt
    assert splice_replies(ids, [(50, 51), None], head) == [1, 7, 8, 50, 51, 9, 2, 7, 8, 9, 7, 8]
    with pytest.raises(ValueError, match="3 assistant turns"):
        splice_replies(ids, [None, None, (1,)], [5, 5])


async def test_second_turn_prefills_only_new_rows_and_answers_as_a_fresh_history(model):
    thinker = model.components["thinker"]
    engine = AsyncEngine([model])
    try:
        first = [_user(1)]
        rows0 = thinker.num_prefill_rows
        text1, ids1, audio1, n1 = await _answer(engine, _request(first, "session-a"))
        assert thinker.num_prefill_rows - rows0 == n1  # nothing cached yet: the whole prompt
        assert LAST_USAGE.get("cached_tokens", 0) == 0
        assert ids1 and audio1.size
        # the cached sequence: the prompt and every fed reply id (the last sampled is not fed
        # when the cap stopped it)
        fed = n1 + len(ids1) - (len(ids1) == OPTIONS.thinker_max_new_tokens)
        assert thinker.blocks.num_cached_blocks == fed // BLOCK
        assert thinker.kv_blocks()[0] == 0  # cached blocks count as free
        history = [*first, ChatMessage("assistant", text1, token_ids=ids1), _user(2)]
        rows0, cached0 = thinker.num_prefill_rows, thinker.num_cached_rows
        text2, ids2, audio2, n2 = await _answer(engine, _request(history, "session-a"))
        computed = thinker.num_prefill_rows - rows0
        cached = thinker.num_cached_rows - cached0
        assert cached == fed // BLOCK * BLOCK and computed == n2 - cached
        assert LAST_USAGE["cached_tokens"] == cached  # the request's usage says so
        assert computed < n2 - n1 + BLOCK  # the new turn and a partly filled block
        # a fresh session (another salt) on the same history computes all of it ...
        rows0 = thinker.num_prefill_rows
        text3, ids3, audio3, n3 = await _answer(engine, _request(history, "session-b"))
        assert thinker.num_prefill_rows - rows0 == n3 == n2
        # ... and answers the same: greedy ids equal; the spoken answer (talker conditioned on
        # rows that came from other forwards: float rounding) equal in length and close
        assert (ids3, text3) == (ids2, text2)
        assert audio3.shape == audio2.shape
        np.testing.assert_allclose(audio2, audio3, atol=1e-3)
        # no salt: nothing is looked up, nothing is kept
        cached_blocks = thinker.blocks.num_cached_blocks
        rows0 = thinker.num_prefill_rows
        _, ids4, _, n4 = await _answer(engine, _request(history, None, audio=False))
        assert thinker.num_prefill_rows - rows0 == n4 and ids4 == ids2
        assert thinker.blocks.num_cached_blocks == cached_blocks
    finally:
        await engine.shutdown()


def test_a_sequence_freed_before_its_prefill_ran_leaves_nothing_cached(model):
    """Blocks admitted for a salted prefill hold no K/V until it runs: freed before (an abort
    between admission and the batch), nothing is cached under their hashes."""
    thinker = model.components["thinker"]
    thinker.blocks.drop_cached()
    unit = ARPrefillInput("early/think", tuple(range(10, 60)), (), (), None, None, None, False, "s")
    assert thinker.admit(unit) and thinker.kv_blocks()[0] == 4
    thinker.free_sequence(unit.seq_id)
    assert thinker.execute(WorkUnitKind.PREFILL, []) == []  # the admitted batch, never run
    assert (thinker.kv_blocks()[0], thinker.blocks.num_cached_blocks) == (0, 0)


async def test_dropped_sessions_leave_only_evictable_blocks_that_a_burst_reclaims(model):
    thinker = model.components["thinker"]
    engine = AsyncEngine([model])
    try:
        thinker.blocks.drop_cached()
        streams = []
        for k in range(20):  # 20 sessions: half answered, half dropped mid-answer
            request = _request([_user(10 + k)], f"drop-{k}", audio=False, sampling=SHORT)
            stream = engine.add_request(request)
            streams.append(stream)
            if k % 2:
                async for chunk in stream:
                    if chunk.text:
                        stream.cancel()
                        break
        for stream in streams:
            with contextlib.suppress(RequestAbortedError):
                async for _ in stream:
                    pass
        for _ in range(100):
            if not engine.stats()["live_requests"]:
                break
            await asyncio.sleep(0.05)
        used, free = thinker.kv_blocks()
        assert used == 0 and engine.stats()["kv_blocks_used"] == 0
        cached = thinker.blocks.num_cached_blocks
        assert cached >= 20  # every session left its prompt's full blocks, evictable
        assert free == thinker.blocks.num_blocks
        # a burst that needs more blocks than were never used evicts cached ones and runs
        never_used = thinker.blocks.num_free_blocks - cached
        burst = [_request([_user(100 + k)], None, False, SHORT) for k in range(12)]
        results = await asyncio.gather(*(_answer(engine, r) for r in burst))
        need = sum(-(-(n + len(ids)) // BLOCK) for _, ids, _, n in results)
        assert need > never_used  # it could not have run without evicting
        assert all(ids for _, ids, _, _ in results)
        assert thinker.blocks.num_cached_blocks < cached
        assert thinker.kv_blocks()[0] == 0
    finally:
        await engine.shutdown()


async def test_realtime_session_turn_two_reuses_turn_one_through_the_sdk(model, tmp_path):
    """Two spoken turns over ``client.realtime.connect``: both requests carry the session id
    as their salt, the second's history holds the first answer's generated ids, and the
    thinker computes only the rows turn 1 did not leave cached."""
    import base64

    thinker = model.components["thinker"]
    engine = AsyncEngine([model])
    sent = record_requests(engine)
    rows, cached, reported = [], [], []
    try:
        async with (
            served_in_process(engine, str(tmp_path / "voices.db")) as client,
            client.realtime.connect(model="qwen2.5-omni") as conn,
        ):
            session = {"type": "realtime", "output_modalities": ["text"]}
            await conn.session.update(
                session={**session, "audio": {"input": {"turn_detection": None}}}
            )
            for seed in (1, 2):
                clip = 0.1 * np.random.default_rng(seed).standard_normal(24000)
                pcm = base64.b64encode((clip * 32767).astype("<i2").tobytes()).decode()
                before = thinker.num_prefill_rows, thinker.num_cached_rows
                await conn.input_audio_buffer.append(audio=pcm)
                await conn.input_audio_buffer.commit()
                await conn.response.create()
                async with asyncio.timeout(300):
                    async for event in conn:
                        assert event.type != "error", event
                        if event.type == "response.done":
                            details = event.response.usage.input_token_details
                            reported.append(details.cached_tokens)
                            break
                rows.append(thinker.num_prefill_rows - before[0])
                cached.append(thinker.num_cached_rows - before[1])
    finally:
        await engine.shutdown()
    first, second = sent
    assert first.cache_salt == second.cache_salt and first.cache_salt.startswith("sess")
    (reply,) = [m for m in second.messages if m.role == "assistant"]
    assert reply.token_ids and cached[0] == 0 and cached[1] >= BLOCK
    assert reported == cached  # response.done's usage.input_token_details.cached_tokens
    assert rows[1] < rows[0] + BLOCK  # only the new turn (and a partly filled block) computed
