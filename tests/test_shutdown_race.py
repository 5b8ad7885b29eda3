"""Shutdown and cancellation racing the engine's wake-ups (Ctrl-C during ``omnistep say``).

Python 3.11's ``asyncio.wait_for`` returns the awaited result instead of raising when its task
is cancelled after the awaited future completed but before the task resumed (cpython
gh-86296, fixed in 3.12). The step loop waited that way while requests waited for admission,
and ``shutdown`` cancelled it right after something woke it, so the cancellation was lost and
``shutdown`` hung. A SIGINT lands in exactly that window: Python runs signal handlers only
while the main thread runs bytecode, i.e. while it handles the chunks of a step that just
finished, the step that also woke the loop.
"""

from __future__ import annotations

import asyncio
import dataclasses

from omnistep.audio import make_encoder
from omnistep.core import ModelInstance, Request, SamplingParams
from omnistep.engine import AsyncEngine
from omnistep.longform import synthesize_pieces
from omnistep.models.toy.card import build_card

RACES = 50


def _held_engine() -> AsyncEngine:
    """A toy engine where one request runs slowly and the others wait for admission (the
    card lets one request start at a time), so the step loop polls admission."""
    card = dataclasses.replace(build_card(), max_starting=1)
    return AsyncEngine([ModelInstance.load(card)])


def _request(text: str, seed: int) -> Request:
    return Request("toy", text=text, seed=seed, sampling=SamplingParams(max_new_tokens=40))


async def test_shutdown_right_after_a_wake_up_never_hangs():
    """50 shutdowns, each 0 to 4 loop turns after a new request woke the step loop."""
    hung = []
    for race in range(RACES):
        engine = _held_engine()
        engine.add_request(_request("<slow> first", 1))
        engine.add_request(_request("second", 2))
        await asyncio.sleep(0.02)  # the step loop now polls admission for "second"
        assert engine.stats()["waiting_requests"] == 1
        engine.add_request(_request("third", 3))  # wakes the step loop
        for _ in range(race % 5):
            await asyncio.sleep(0)
        task = engine._task
        shutdown = asyncio.ensure_future(engine.shutdown())
        done, _ = await asyncio.wait({shutdown}, timeout=2)
        if not done:
            hung.append(race)
            task.cancel()  # the cancellation shutdown sent was lost: send another
            await asyncio.wait({shutdown}, timeout=2)
        assert engine.stats()["live_requests"] == 0
    assert not hung, f"shutdown hung in races {hung} of {RACES}"


async def test_shutdown_passes_on_its_callers_cancellation():
    """A timeout (or Ctrl-C) around ``shutdown`` still ends it: it used to be swallowed with
    the step loop's own CancelledError."""
    engine = _held_engine()
    engine.add_request(_request("<slow> first", 1))
    await asyncio.sleep(0.01)
    shutdown = asyncio.ensure_future(engine.shutdown())
    await asyncio.sleep(0)  # shutdown now waits for the step loop to end
    shutdown.cancel()
    done, _ = await asyncio.wait({shutdown}, timeout=2)
    assert done and shutdown.cancelled()
    assert engine.stats()["live_requests"] == 0


async def _say(engine: AsyncEngine, texts: list[str]) -> None:
    """What ``omnistep say --file`` runs: a window of requests, the audio encoded in order,
    the engine shut down at the end (or when cancelled)."""
    requests = [_request(t, k) for k, t in enumerate(texts)]
    try:
        await synthesize_pieces(engine, requests, make_encoder("mp3", 8000), lambda _: None)
    finally:
        await engine.shutdown()


async def test_cancelling_say_ends_within_a_second_50_times():
    """Ctrl-C as ``asyncio.run`` delivers it (the main task cancelled) at 50 points of a
    long-form run whose requests wait for admission."""
    texts = ["<slow> one", "two", "three", "four", "five", "six"]
    for race in range(RACES):
        engine = _held_engine()
        task = asyncio.create_task(_say(engine, texts))
        await asyncio.sleep(0.001 * (race % 25))
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=1)
        assert done, f"race {race}: the cancelled run did not end"
        assert task.cancelled()
        assert engine.stats()["live_requests"] == 0
