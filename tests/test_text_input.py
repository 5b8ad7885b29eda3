"""Text streaming into a running request (``Request.text_input``, ``RequestStream.append_text``):
on the ``toy_stream`` card, whose loop consumes one input byte per step (a text track)."""

import asyncio

import numpy as np
import pytest

from omnistep.core import (
    CardValidationError,
    InvalidRequestError,
    Modality,
    ModelInstance,
    Request,
    RequestAbortedError,
)
from omnistep.engine import AsyncEngine
from omnistep.models.toy import card as toy
from omnistep.models.toy import stream as toy_stream
from omnistep.parity import collect

TEXT = "Please leave the package by the blue door."


@pytest.fixture
async def engine():
    eng = AsyncEngine(
        [ModelInstance.load(toy_stream.build_card()), ModelInstance.load(toy.build_card())]
    )
    yield eng
    await eng.shutdown()


def _units(engine: AsyncEngine) -> int:
    return sum(engine.units_by_kind.values())


async def _stream_in(engine, pieces, seed, pause=0.0):
    """Send ``pieces`` one by one into one running request; returns (audio, text, events)
    where events record when text went in and audio came out, in order."""
    stream = engine.add_request(
        Request("toy_stream", text="", seed=seed, text_input=True, request_id=f"s{seed}")
    )
    events: list[str] = []
    audio: list[np.ndarray] = []
    text: list[str] = []

    async def feed():
        for piece in pieces:
            stream.append_text(piece)
            events.append("text")
            await asyncio.sleep(pause)
        stream.end_text()
        events.append("end")

    async def read():
        async for chunk in stream:
            if chunk.modality is Modality.AUDIO:
                audio.append(chunk.audio)
                events.append("audio")
            else:
                text.append(chunk.text)

    await asyncio.gather(feed(), read())
    return np.concatenate(audio), "".join(text), events


@pytest.mark.parametrize("split", ["words", "chars", "one"])
async def test_streamed_text_equals_whole(engine, split):
    whole = await collect(engine, Request("toy_stream", text=TEXT, seed=11))
    if split == "words":
        pieces = [w + " " for w in TEXT.split(" ")]
        pieces[-1] = pieces[-1].rstrip()
    elif split == "chars":
        pieces = list(TEXT)
    else:
        pieces = [TEXT]
    audio, text, _ = await _stream_in(engine, pieces, seed=11)
    assert text == whole.text and len(text) > len(TEXT)
    assert np.array_equal(audio, whole.audio)
    assert text.count("<") == len(TEXT) + toy_stream.TAIL_STEPS
    other = await collect(engine, Request("toy_stream", text=TEXT.upper(), seed=11))
    assert other.text != whole.text  # the output depends on the text


async def test_first_audio_before_the_text_ends_and_no_steps_while_waiting(engine):
    words = [w + " " for w in TEXT.split(" ")]
    _, _, events = await _stream_in(engine, words, seed=3, pause=0.05)
    assert "audio" in events[: events.index("end")], events

    stream = engine.add_request(Request("toy_stream", text="ab", seed=4, text_input=True))
    await asyncio.sleep(0.2)  # the two bytes run, then the loop waits for text
    ran = _units(engine)
    await asyncio.sleep(0.3)
    assert _units(engine) == ran, "the scheduler ran units while the request waited for text"
    assert engine.stats()["live_requests"] == 1 and engine.stats()["queued_units"] == 0
    stream.append_text("cd")
    stream.end_text()
    chunks = [c async for c in stream]
    tokens = "".join(c.text for c in chunks if c.modality is Modality.TEXT)
    whole = await collect(engine, Request("toy_stream", text="abcd", seed=4))
    assert tokens == whole.text
    assert engine.stats() == dict.fromkeys(engine.stats(), 0)


async def test_batched_streams_equal_alone(engine):
    alone = [await collect(engine, Request("toy_stream", text=TEXT[i:], seed=i)) for i in range(4)]
    streamed = await asyncio.gather(
        *(_stream_in(engine, list(TEXT[i:]), seed=i, pause=0.001) for i in range(4))
    )
    for a, (audio, text, _) in zip(alone, streamed, strict=True):
        assert text == a.text and np.array_equal(audio, a.audio)
    assert max(engine.batch_sizes) > 1


async def test_abort_while_waiting_for_text_frees_everything(engine):
    stream = engine.add_request(Request("toy_stream", text="abc", seed=1, text_input=True))
    await asyncio.sleep(0.1)
    stream.cancel()
    with pytest.raises(RequestAbortedError):
        async for _ in stream:
            pass
    assert engine.stats() == dict.fromkeys(engine.stats(), 0)
    with pytest.raises(InvalidRequestError, match="not running"):
        stream.append_text("more")


async def test_bad_uses_are_typed_errors(engine):
    with pytest.raises(InvalidRequestError, match="cannot take text") as err:
        engine.add_request(Request("toy", text="hi", text_input=True))
    assert err.value.param == "input"
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request(Request("toy_stream", text="  "))
    whole = engine.add_request(Request("toy_stream", text="hello", seed=2))
    with pytest.raises(InvalidRequestError, match="not made with text_input"):
        whole.append_text("x")
    stream = engine.add_request(Request("toy_stream", text="hi", seed=2, text_input=True))
    with pytest.raises(InvalidRequestError, match="lone surrogate"):
        stream.append_text("\ud800")
    with pytest.raises(InvalidRequestError, match="must be a string"):
        stream.append_text(3)  # type: ignore[arg-type]
    stream.end_text()
    stream.end_text()  # idempotent
    with pytest.raises(InvalidRequestError, match="no more text"):
        stream.append_text("late")
    with pytest.raises(InvalidRequestError, match="not running"):
        engine.append_text("req-unknown", "x")
    assert [c async for c in whole] and [c async for c in stream]
    assert engine.stats() == dict.fromkeys(engine.stats(), 0)


def test_capability_and_program_input_go_together():
    import dataclasses

    card = toy_stream.build_card()
    with pytest.raises(CardValidationError, match="go together"):
        dataclasses.replace(
            card,
            capabilities=frozenset(card.capabilities)
            - {c for c in card.capabilities if c.value == "streaming_text_input"},
        ).validate()


async def test_a_request_waiting_for_its_text_does_not_hold_admission():
    """Under EDF admission, a stream whose audio ran out because its client has not sent more
    text is not a stream running low: new requests are admitted at once, not after the
    admission wait."""
    from omnistep.engine import EngineConfig

    engine = AsyncEngine(
        [ModelInstance.load(toy_stream.build_card()), ModelInstance.load(toy.build_card())],
        EngineConfig(scheduling="edf"),
    )
    try:
        idle = engine.add_request(Request("toy_stream", text="abcdefgh", seed=1, text_input=True))
        first = await idle.__anext__()  # its bytes are spoken (tens of ms of audio) ...
        while first.audio is None:
            first = await idle.__anext__()
        await asyncio.sleep(0.3)  # ... which ran out long ago: it waits for its client
        assert engine.stats()["queued_units"] == 0
        fresh = engine.add_request(Request("toy", text="hello", seed=2))
        assert engine.stats()["waiting_requests"] == 0, "held behind a client that is silent"
        assert [c async for c in fresh]
        idle.end_text()
        assert [c async for c in idle]
    finally:
        await engine.shutdown()
