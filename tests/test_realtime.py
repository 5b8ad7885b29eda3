"""``WS /v1/realtime`` through the ``openai`` SDK's own realtime client
(``AsyncOpenAI().realtime.connect``) against a uvicorn server started in the test on a free port,
serving the ``toy_hear`` card: its answers say what it heard (``turn N heard D s rms R after A
chars``), so the values show the turn's audio (cut by the VAD, resampled to 16 kHz), the
history (N) and what the history kept of earlier answers (A: truncation). Also the energy VAD
alone, on synthetic speech.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json

import numpy as np
import pytest
import websockets

from omnistep.core import ModelInstance
from omnistep.engine import AsyncEngine
from omnistep.models import registry
from omnistep.models.toy import hear
from omnistep.server.realtime_protocol import truncate_transcript
from omnistep.server.realtime_vad import EnergyVad, SpeechStarted, SpeechStopped, VadSettings
from tests.serving import served_in_process

RATE = 24_000
NO_VAD = {"type": "realtime", "audio": {"input": {"turn_detection": None}}}


def pcm(samples: np.ndarray) -> str:
    """base64 pcm16 of float samples."""
    return base64.b64encode((samples * 32767).astype("<i2").tobytes()).decode()


def tone(seconds: float, amplitude: float = 0.3, freq: float = 220.0) -> np.ndarray:
    t = np.arange(int(seconds * RATE)) / RATE
    return (amplitude * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def silence(seconds: float) -> np.ndarray:
    return np.zeros(int(seconds * RATE), dtype=np.float32)


def heard(samples: np.ndarray) -> str:
    """What toy_hear says of a 24 kHz clip: its duration and RMS at 16 kHz (the same within
    the resampler's error; durations are exact)."""
    rms = float(np.sqrt(np.mean(samples.astype(np.float64) ** 2)))
    return f"heard {len(samples) / RATE:.2f} s rms {rms:.3f}"


@contextlib.asynccontextmanager
async def server(tmp_path, step_seconds: float = 0.0):
    """``(AsyncOpenAI client, engine)`` of a uvicorn server of toy_hear and toy."""
    cards = [hear.build_card(step_seconds=step_seconds), registry.build_card("toy")]
    engine = AsyncEngine([ModelInstance.load(card) for card in cards])
    try:
        async with served_in_process(engine, str(tmp_path / "voices.db")) as client:
            yield client, engine
    finally:
        await engine.shutdown()


async def until(conn, kind: str, seen: list | None = None, timeout: float = 20.0):
    """The next event of type ``kind``; the events before it are appended to ``seen``."""
    async with asyncio.timeout(timeout):
        while True:
            event = await conn.recv()
            if seen is not None:
                seen.append(event)
            if event.type == kind:
                return event


async def idle(engine: AsyncEngine) -> dict:
    for _ in range(200):
        stats = engine.stats()
        if not stats["live_requests"] and not stats["running_batches"]:
            return stats
        await asyncio.sleep(0.05)
    return engine.stats()


# ------------------------------------------------------------------ VAD alone
def test_energy_vad_finds_the_speech_and_its_end():
    vad = EnergyVad(VadSettings(silence_duration_ms=400))
    audio = np.concatenate([silence(0.5), tone(1.0), silence(0.6), tone(0.02)])  # + a click
    events = []
    for start in range(0, len(audio), 1234):  # uneven chunks
        events += vad.feed(audio[start : start + 1234])
    assert events == [SpeechStarted(500), SpeechStopped(500, 1500)]
    late = EnergyVad(VadSettings(silence_duration_ms=400), origin=RATE)  # on 1 s into a session
    assert late.feed(audio) == [SpeechStarted(1500), SpeechStopped(1500, 2500)]
    quiet = EnergyVad(VadSettings(threshold=0.9))  # -16 dBFS: a 0.1 tone (-23 dBFS) is quiet
    assert quiet.feed(tone(1.0, amplitude=0.1)) == []
    with pytest.raises(ValueError, match="threshold"):
        VadSettings(threshold=1.5)


def test_truncated_transcript_keeps_the_heard_fraction_in_whole_words():
    text = "one two three four"  # 18 characters
    assert truncate_transcript(text, 50, 100) == "one two"  # 9 chars: inside "three"
    assert truncate_transcript(text, 100, 100) == text
    assert truncate_transcript(text, 0, 100) == ""


# ------------------------------------------------------------------ sessions
async def test_server_vad_turns_are_heard_answered_and_kept_as_history(tmp_path):
    async with server(tmp_path) as (client, engine):
        sent: list = []
        add_request = engine.add_request
        engine.add_request = lambda req, *a, **k: sent.append(req) or add_request(req, *a, **k)
        async with client.realtime.connect(model="toy_hear") as conn:
            created = await until(conn, "session.created")
            assert created.session.audio.input.turn_detection.type == "server_vad"
            assert created.session.output_modalities == ["audio"]
            speech = tone(1.0)
            turn = np.concatenate([silence(0.5), speech, silence(0.8)])
            for start in range(0, len(turn), 4800):  # 200 ms appends, as a microphone
                await conn.input_audio_buffer.append(audio=pcm(turn[start : start + 4800]))
            started = await until(conn, "input_audio_buffer.speech_started")
            stopped = await until(conn, "input_audio_buffer.speech_stopped")
            assert (started.audio_start_ms, stopped.audio_end_ms) == (500, 1500)
            committed = await until(conn, "input_audio_buffer.committed")
            assert committed.item_id == started.item_id == stopped.item_id
            events: list = []
            done = await until(conn, "response.done", events)
            kinds = [e.type for e in events]
            for kind in (
                "conversation.item.added",
                "conversation.item.done",
                "response.created",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_audio.delta",
                "response.output_audio_transcript.delta",
                "response.output_audio.done",
                "response.output_audio_transcript.done",
                "response.content_part.done",
                "response.output_item.done",
            ):
                assert kind in kinds, kind
            # the turn: 300 ms of prefix padding before the speech, to the speech's end
            clip = np.concatenate([silence(0.3), speech])
            transcript = "".join(
                e.delta for e in events if e.type == "response.output_audio_transcript.delta"
            )
            assert transcript == f"turn 1 {heard(clip)} after 0 chars"
            assert done.response.status == "completed"
            assert done.response.output[0].content[0].transcript == transcript
            assert done.response.usage.output_tokens == len(transcript.split())
            audio = b"".join(
                base64.b64decode(e.delta) for e in events if e.type == "response.output_audio.delta"
            )
            # 80 samples at 8 kHz per character spoken, resampled to 24 kHz
            spoken = sum(len(w) for w in transcript.split())
            assert len(audio) // 2 == pytest.approx(spoken * 240, abs=240)
            # a second turn: the history holds the first question and answer
            await conn.input_audio_buffer.append(audio=pcm(turn))
            events = []
            await until(conn, "response.done", events)
            transcript2 = "".join(
                e.delta for e in events if e.type == "response.output_audio_transcript.delta"
            )
            assert transcript2 == f"turn 2 {heard(clip)} after {len(transcript)} chars"
            # both turns share the session's prefix-caching scope, and no one else's
            first, second = sent
            assert first.cache_salt == second.cache_salt and first.cache_salt.startswith("sess")
        assert (await idle(engine))["live_loops"] == 0


async def test_manual_commit_text_items_and_text_output(tmp_path):
    async with server(tmp_path) as (client, _), client.realtime.connect(model="toy_hear") as conn:
        await conn.session.update(
            session={**NO_VAD, "output_modalities": ["text"], "instructions": "Be brief."}
        )
        updated = await until(conn, "session.updated")
        assert updated.session.audio.input.turn_detection is None
        assert updated.session.instructions == "Be brief."
        clip = tone(0.6, amplitude=0.2)
        await conn.input_audio_buffer.append(audio=pcm(clip))
        await conn.input_audio_buffer.commit()
        await until(conn, "input_audio_buffer.committed")
        audio_item = await until(conn, "conversation.item.added")
        assert audio_item.item.content[0].type == "input_audio"
        await conn.conversation.item.create(
            item={
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "hello there"}],
            }
        )
        added = await until(conn, "conversation.item.added")
        assert added.item.content[0].text == "hello there"
        await conn.response.create()
        events: list = []
        done = await until(conn, "response.done", events)
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert text == "turn 2 read 11 chars after 0 chars"
        assert not [e for e in events if e.type == "response.output_audio.delta"]
        assert done.response.output[0].content[0].text == text
        # an audio message item, then a response asked for audio
        await conn.conversation.item.create(
            item={
                "type": "message",
                "role": "user",
                "content": [{"type": "input_audio", "audio": pcm(clip)}],
            }
        )
        await conn.response.create(response={"output_modalities": ["audio"]})
        events = []
        await until(conn, "response.done", events)
        transcript = "".join(
            e.delta for e in events if e.type == "response.output_audio_transcript.delta"
        )
        assert transcript == f"turn 3 {heard(clip)} after {len(text)} chars"


async def test_barge_in_cancels_and_truncation_keeps_what_was_played(tmp_path):
    async with server(tmp_path, step_seconds=0.15) as (client, engine):
        async with client.realtime.connect(model="toy_hear") as conn:
            await conn.session.update(
                session={
                    "type": "realtime",
                    "audio": {"input": {"turn_detection": {"type": "server_vad"}}},
                }
            )
            await conn.conversation.item.create(
                item={
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "tell me"}],
                }
            )
            await conn.response.create()
            first: list = []
            await until(conn, "response.output_audio.delta", first)
            item_id = first[-1].item_id
            # the user speaks over the answer: the answer is cancelled
            turn = np.concatenate([tone(0.5), silence(0.7)])
            await conn.input_audio_buffer.append(audio=pcm(turn))
            events = []
            done = await until(conn, "response.done", events)
            first += events
            sent_samples = sum(
                len(base64.b64decode(e.delta)) // 2
                for e in first
                if e.type == "response.output_audio.delta" and e.item_id == item_id
            )
            assert done.response.status == "cancelled"
            assert done.response.status_details.reason == "turn_detected"
            assert "input_audio_buffer.speech_started" in [e.type for e in events]
            sent = done.response.output[0].content[0].transcript
            assert sent and len(sent.split()) < 8  # "turn 1 read 7 chars after 0 chars": 8
            # the VAD's turn is answered; it saw the cancelled answer as far as it was sent
            events = []
            await until(conn, "response.done", events)
            second = "".join(
                e.delta for e in events if e.type == "response.output_audio_transcript.delta"
            )
            assert second.startswith("turn 2 heard") and second.endswith(f"after {len(sent)} chars")
            # the client played only 30 ms of the first answer: the history keeps that part
            await conn.send(
                {
                    "type": "conversation.item.truncate",
                    "item_id": item_id,
                    "content_index": 0,
                    "audio_end_ms": 30,
                }
            )
            truncated = await until(conn, "conversation.item.truncated")
            assert (truncated.item_id, truncated.audio_end_ms) == (item_id, 30)
            await conn.conversation.item.create(
                item={
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "and?"}],
                }
            )
            await conn.response.create(response={"output_modalities": ["text"]})
            events = []
            await until(conn, "response.done", events)
            third = "".join(e.delta for e in events if e.type == "response.output_text.delta")
            assert third.startswith("turn 3")
            kept = int(third.split("after ")[1].split()[0])
            heard_part = truncate_transcript(sent, 30 * 24, sent_samples)
            assert len(heard_part) < len(sent)
            assert kept == len(second) + len(heard_part)
        assert (await idle(engine))["live_loops"] == 0


async def test_bad_and_out_of_order_events_get_errors_and_the_session_goes_on(tmp_path):
    async with (
        server(tmp_path, step_seconds=0.1) as (client, _),
        client.realtime.connect(model="toy_hear") as conn,
    ):
        await until(conn, "session.created")
        cases = [
            (
                {"type": "input_audio_buffer.commit", "event_id": "e1"},
                "input_audio_buffer_commit_empty",
            ),
            ({"type": "input_audio_buffer.append", "audio": "%%%"}, "invalid_value"),
            ({"type": "no.such.event"}, "unknown_event_type"),
            ({"type": "response.cancel"}, "response_cancel_not_active"),
            (
                {
                    "type": "conversation.item.truncate",
                    "item_id": "nope",
                    "content_index": 0,
                    "audio_end_ms": 1,
                },
                "item_not_found",
            ),
            (
                {
                    "type": "session.update",
                    "session": {
                        "type": "realtime",
                        "audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}}},
                    },
                },
                "invalid_value",
            ),
            (
                {
                    "type": "session.update",
                    "session": {"type": "realtime", "audio": {"output": {"voice": "nobody"}}},
                },
                "unknown_voice",
            ),
            # kept, they failed every later response ('max_new_tokens': -1)
            ({"type": "session.update", "session": {"max_output_tokens": -1}}, "invalid_value"),
            ({"type": "session.update", "session": {"max_output_tokens": 0}}, "invalid_value"),
            ({"type": "session.update", "session": {"max_output_tokens": True}}, "invalid_value"),
            # an audio item of 2 ms: the omni encoders take no such clip, so it failed every
            # later response of the session
            (
                {
                    "type": "conversation.item.create",
                    "item": {
                        "type": "message",
                        "role": "user",
                        "content": [{"type": "input_audio", "audio": pcm(tone(0.002))}],
                    },
                },
                "audio_too_short",
            ),
            (
                {
                    "type": "conversation.item.create",
                    "item": {"type": "message", "role": "user", "content": []},
                },
                "invalid_value",
            ),
        ]
        for event, code in cases:
            await conn.send(event)
            error = await until(conn, "error")
            assert error.error.code == code, (event, error.error)
            if "max_output_tokens" in str(event):
                assert error.error.param == "session.max_output_tokens", error.error
        assert error.error.param == "item.content"
        first = cases[0][0]
        await conn.send(first)
        error = await until(conn, "error")
        assert error.error.event_id == "e1"
        await conn.send(
            {
                "type": "conversation.item.create",
                "item": {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "hi"}],
                },
            }
        )
        await conn.response.create()
        await until(conn, "response.created")
        await conn.response.create()  # one response at a time
        error = await until(conn, "error")
        assert error.error.code == "conversation_already_has_active_response"
        await conn.response.cancel()
        done = await until(conn, "response.done")
        assert (done.response.status, done.response.status_details.reason) == (
            "cancelled",
            "client_cancelled",
        )
        await conn.response.create()  # the session still answers
        done = await until(conn, "response.done")
        assert done.response.status == "completed"


async def test_frames_that_are_not_json_events_get_errors_and_the_session_goes_on(tmp_path):
    """A hand-written socket: frames the SDK cannot send (binary, broken JSON, no type)."""
    async with server(tmp_path) as (client, _):
        url = str(client.websocket_base_url or client.base_url).replace("http", "ws")
        async with websockets.connect(f"{url}realtime?model=toy_hear") as ws:
            assert json.loads(await ws.recv())["type"] == "session.created"
            for frame, code in (
                (b"\x00\x01", "invalid_event"),
                ("{oops", "invalid_json"),
                ("[1, 2]", "invalid_event"),
                ('{"type": 5}', "invalid_event"),
            ):
                await ws.send(frame)
                event = json.loads(await ws.recv())
                assert (event["type"], event["error"]["code"]) == ("error", code)
            await ws.send(json.dumps({"type": "input_audio_buffer.clear"}))
            assert json.loads(await ws.recv())["type"] == "input_audio_buffer.cleared"


async def test_refused_connections_get_an_error_then_a_close(tmp_path):
    async with server(tmp_path) as (client, _):
        for model, code in (("toy", "unsupported_model"), ("nope", "model_not_found")):
            async with client.realtime.connect(model=model) as conn:
                error = await until(conn, "error")
                assert error.error.code == code


async def test_twenty_dropped_sessions_leave_nothing_running(tmp_path):
    async with server(tmp_path, step_seconds=0.05) as (client, engine):
        for k in range(20):
            manager = client.realtime.connect(model="toy_hear")
            conn = await manager.__aenter__()
            await conn.input_audio_buffer.append(
                audio=pcm(np.concatenate([tone(0.3), silence(0.6)]))
            )
            if k % 2:
                await until(conn, "response.output_audio.delta")
                assert engine.stats()["kv_blocks_used"] > 0  # the answer holds its blocks
            else:
                await until(conn, "input_audio_buffer.speech_started")
            await conn.close()  # gone mid-answer (or mid-turn)
        stats = await idle(engine)
        assert (stats["live_requests"], stats["live_loops"], stats["kv_blocks_used"]) == (0, 0, 0)
