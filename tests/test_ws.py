"""``WS /v1/audio/speech/stream`` on the toy card, and the ``SentenceBuffer`` it splits with.

The server is the real one (``omnistep serve`` in a subprocess, uvicorn with the ``websockets``
package); the client is ``websockets``' synchronous client.
"""

import dataclasses
import doctest
import importlib
import json
import socket
import time

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from omnistep.core import ModelInstance
from omnistep.engine import AsyncEngine, PlaybackClock
from omnistep.models.toy.card import build_card
from omnistep.server import ServerConfig, build_app
from omnistep.server.protocol import SpeechRequest
from omnistep.server.speech_stream import PATH, WINDOW, SpeechSession, segment_seed
from omnistep.text import SentenceBuffer, split_text
from tests.serving import running_server

SENTENCES = ["Hello there my good friend.", "This is the second sentence!", "And a third one"]
KEY = "sk-ws-0123456789"
ORIGIN = "http://app.example"


@pytest.fixture(scope="module")
def base():
    with running_server("--model", "toy") as url:
        yield url


@pytest.fixture(scope="module")
def guarded():
    with running_server("--model", "toy", "--api-key", KEY, "--cors-origin", ORIGIN) as url:
        yield url


def _open(base: str, query: str = "", **options):
    url = base.replace("http://", "ws://") + PATH + query
    return connect(url, proxy=None, open_timeout=30, **options)


def _send(ws, kind: str, **fields) -> None:
    ws.send(json.dumps({"type": kind, **fields}))


def _config(ws, **fields) -> None:
    _send(ws, "session.config", model="toy", seed=11, **fields)


def _recv(ws, timeout: float = 30):
    """The next frame: a dict for JSON events, bytes for audio."""
    frame = ws.recv(timeout=timeout)
    return json.loads(frame) if isinstance(frame, str) else frame


def _until(ws, kind: str) -> tuple[list, bytes]:
    """Frames up to and including the event ``kind``, and the audio among them."""
    frames = []
    while True:
        frame = _recv(ws)
        frames.append(frame)
        if isinstance(frame, dict) and frame["type"] == kind:
            audio = b"".join(f for f in frames if isinstance(f, bytes))
            return frames, audio


def _closed(ws) -> tuple[list, int]:
    """The frames left until the server closes; returns them and the close code."""
    frames = []
    try:
        while True:
            frames.append(_recv(ws))
    except ConnectionClosed as exc:
        assert exc.rcvd is not None, "the server did not send a close frame"
        return frames, exc.rcvd.code


def _wait_idle(base: str) -> dict:
    deadline = time.monotonic() + 15
    while True:
        health = httpx.get(base + "/health").json()
        busy = [health[k] for k in ("live_requests", "live_loops", "queued_units")]
        if not any(busy) and health["running_batches"] == 0 or time.monotonic() > deadline:
            return health
        time.sleep(0.05)


def _speech_pcm(base: str, text: str, seed: int, **fields) -> bytes:
    body = {
        "model": "toy",
        "input": text,
        "seed": seed,
        "response_format": "pcm",
        "stream": False,
        **fields,
    }
    r = httpx.post(base + "/v1/audio/speech", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.content


# ------------------------------------------------------------------ protocol


def test_speech_starts_at_the_first_sentence_boundary(base):
    words = " ".join(SENTENCES).split(" ")
    first_len = len(SENTENCES[0].split(" "))
    with _open(base) as ws:
        _config(ws)
        for word in words[: first_len + 1]:  # the first sentence and one word of the second
            _send(ws, "input.text", text=word + " ")
        start = _recv(ws)
        assert start == {"type": "audio.start", "sample_rate": 24000, "format": "pcm_s16le"} | {
            "seed": 11
        }
        assert isinstance(_recv(ws), bytes)  # audio before input.done was sent
        for word in words[first_len + 1 :]:
            _send(ws, "input.text", text=word + " ")
        _send(ws, "input.done")
        frames, audio = _until(ws, "audio.done")
        assert frames[-1] == {"type": "audio.done", "segments": 3}
        assert all(isinstance(f, bytes) for f in frames[:-1])
        _send(ws, "session.close")
        assert _closed(ws) == ([{"type": "session.done"}], 1000)


def test_audio_is_what_the_speech_route_gives_each_sentence(base):
    """Per-sentence seeds S + k; the bytes are those of /v1/audio/speech pcm, in order, even
    though the sentences synthesise concurrently."""
    with _open(base) as ws:
        _config(ws, max_new_tokens=60)
        for piece in " ".join(SENTENCES):  # character by character
            _send(ws, "input.text", text=piece)
        _send(ws, "input.done")
        frames, audio = _until(ws, "audio.done")
        assert frames[0]["type"] == "audio.start" and frames[-1]["segments"] == len(SENTENCES)
    expected = [
        _speech_pcm(base, text, segment_seed(11, k), max_new_tokens=60)
        for k, text in enumerate(SENTENCES)
    ]
    assert len(audio) == sum(len(e) for e in expected) > 0
    assert audio == b"".join(expected)


def test_full_protocol_order_over_two_turns(base):
    with _open(base) as ws:
        _config(ws)
        _send(ws, "input.text", text="One sentence here. And another")
        _send(ws, "input.done")
        turn1, audio1 = _until(ws, "audio.done")
        _send(ws, "input.text", text="The second turn speaks on.")
        _send(ws, "input.done")
        turn2, audio2 = _until(ws, "audio.done")
        _send(ws, "input.done")  # a turn with nothing to say
        turn3, audio3 = _until(ws, "audio.done")
        _send(ws, "session.close")
        rest, code = _closed(ws)
    for frames, segments in ((turn1, 2), (turn2, 1), (turn3, 0)):
        assert frames[0]["type"] == "audio.start"
        assert frames[-1] == {"type": "audio.done", "segments": segments}
        assert all(isinstance(f, bytes) for f in frames[1:-1])
    assert audio1 and audio2 and not audio3
    assert rest == [{"type": "session.done"}] and code == 1000
    # the segment index runs on across turns: the third segment has seed 11 + 2
    assert audio2 == _speech_pcm(base, "The second turn speaks on.", 13)


def test_same_seed_same_audio_and_drawn_seed_reported(base):
    def run(**fields) -> tuple[int, bytes]:
        with _open(base) as ws:
            _send(ws, "session.config", model="toy-tts", **fields)
            _send(ws, "input.text", text="Same words. Same sound.")
            _send(ws, "input.done")
            frames, audio = _until(ws, "audio.done")
        return frames[0]["seed"], audio

    assert run(seed=5) == run(seed=5)
    seed, audio = run()
    assert run(seed=seed) == (seed, audio)


def test_unspeakable_pieces_are_skipped(base):
    with _open(base) as ws:
        _config(ws)
        _send(ws, "input.text", text="* * *\n\nWords to say. ... ")
        _send(ws, "input.done")
        frames, audio = _until(ws, "audio.done")
    assert frames[-1]["segments"] == 1  # "* * *" and "..." have nothing to speak
    assert audio == _speech_pcm(base, "Words to say.", 11)


# ------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    ("message", "code", "param", "error_code"),
    [
        ({"type": "input.text", "text": "hi"}, 1008, "type", "session_not_configured"),
        ({"type": "session.config", "model": "toy", "speed": 10}, 1008, "speed", "invalid_value"),
        ({"type": "session.config", "model": "toy", "seed": -1}, 1008, "seed", "invalid_value"),
        ({"type": "session.config"}, 1008, "model", "invalid_value"),
        ({"type": "session.config", "model": "nope"}, 1008, "model", "model_not_found"),
        (
            {"type": "session.config", "model": "toy", "response_format": "mp3"},
            1008,
            "response_format",
            "unsupported_format",
        ),
        (
            {"type": "session.config", "model": "toy", "response_format": "m4a"},
            1008,
            "response_format",
            "invalid_value",
        ),
        ({"type": "session.config", "model": "toy", "voice": 5}, 1008, "voice", "invalid_value"),
        ("not json", 1003, None, "invalid_json"),
        ([1, 2], 1003, "type", "invalid_message"),
        (b"\x00\x01", 1003, None, "unsupported_data"),
    ],
)
def test_bad_config_gets_an_error_then_a_close(base, message, code, param, error_code):
    with _open(base) as ws:
        if isinstance(message, bytes | str):
            ws.send(message)
        else:
            ws.send(json.dumps(message))
        frames, close = _closed(ws)
    assert close == code
    assert len(frames) == 1 and frames[0]["type"] == "error"
    error = frames[0]["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert (error["param"], error["code"]) == (param, error_code)
    assert httpx.get(base + "/health").json()["status"] == "ok"


def test_unknown_voice_ends_the_session_at_config(base):
    with _open(base) as ws:
        _config(ws, voice="nobody")
        frames, code = _closed(ws)
    assert code == 1008 and len(frames) == 1
    error = frames[0]["error"]
    assert (error["param"], error["code"]) == ("voice", "unknown_voice")
    r = httpx.post(
        base + "/v1/audio/speech", json={"model": "toy", "input": "Hi.", "voice": "nobody"}
    )
    assert r.status_code == 400 and r.json()["error"] == error  # the speech route's error
    assert _wait_idle(base)["live_requests"] == 0


def test_saved_voice_speaks_as_in_the_speech_route(tmp_path):
    """A voice saved through POST /v1/audio/voices is resolved at session.config: the session
    speaks with it what /v1/audio/speech speaks, and a voice saved for another model only is
    refused with the speech route's error."""
    toy2 = dataclasses.replace(build_card(), card_id="toy2", aliases=())
    engine = AsyncEngine([ModelInstance.load(build_card()), ModelInstance.load(toy2)])
    app = build_app(engine, ServerConfig(voices_db=str(tmp_path / "voices.db")))
    text = "Hello there my good friend."
    with TestClient(app) as client:
        saved = {"name": "narrator", "model": "toy", "voice": "default"}
        assert client.post("/v1/audio/voices", json=saved).status_code == 201
        body = {"model": "toy", "input": text, "seed": 11, "response_format": "pcm"}
        speech = client.post("/v1/audio/speech", json={**body, "voice": "narrator"})
        assert speech.status_code == 200 and len(speech.content) > 0
        with client.websocket_connect(PATH) as ws:
            ws.send_json(
                {"type": "session.config", "model": "toy", "seed": 11, "voice": "narrator"}
            )
            ws.send_json({"type": "input.text", "text": text})
            ws.send_json({"type": "input.done"})
            audio = b""
            while True:
                message = ws.receive()
                if message.get("bytes") is not None:
                    audio += message["bytes"]
                elif json.loads(message["text"])["type"] == "audio.done":
                    break
        assert audio == speech.content
        other = client.post("/v1/audio/speech", json={**body, "model": "toy2", "voice": "narrator"})
        assert other.status_code == 400
        with client.websocket_connect(PATH) as ws:
            ws.send_json({"type": "session.config", "model": "toy2", "voice": "narrator"})
            assert ws.receive_json() == {"type": "error", "error": other.json()["error"]}
            assert ws.receive()["code"] == 1008
    assert "saved for toy" in other.json()["error"]["message"]


def test_bad_pieces_get_an_error_event_and_the_session_goes_on(base):
    with _open(base) as ws:
        _config(ws)
        _send(ws, "input.text", text=5)
        _send(ws, "input.text", text="bell \u0007")
        _send(ws, "input.text", text="x" * 4097)
        _send(ws, "response.create")
        _send(ws, "session.config", model="toy")
        errors = [_recv(ws) for _ in range(5)]
        _send(ws, "input.text", text="Still here.")
        _send(ws, "input.done")
        frames, audio = _until(ws, "audio.done")
    assert [e["type"] for e in errors] == ["error"] * 5
    codes = [e["error"]["code"] for e in errors]
    assert codes == ["invalid_value"] * 3 + ["unknown_message_type", "already_configured"]
    assert frames[-1]["segments"] == 1 and audio


def test_failure_in_the_engine_is_an_error_event_and_close_1011(base):
    with _open(base) as ws:
        _config(ws)
        _send(ws, "input.text", text="A good one. <fail-late> this one breaks later on. ")
        _send(ws, "input.done")
        frames, code = _closed(ws)
    assert code == 1011
    assert frames[0]["type"] == "audio.start" and isinstance(frames[1], bytes)
    error = frames[-1]["error"]
    assert error["code"] == "generation_failed" and "injected fault" in error["message"]
    assert _wait_idle(base)["live_requests"] == 0


# ------------------------------------------------------------------ aborts


SLOW = " ".join(f"<slow> Sentence number {i} goes on and on." for i in range(8))


def test_disconnect_mid_speech_aborts_every_segment(base):
    """Eight slow sentences (about a minute of toy steps): gone in well under that."""
    with _open(base, close_timeout=1) as ws:
        _config(ws, max_new_tokens=2000)
        _send(ws, "input.text", text=SLOW)
        _send(ws, "input.done")
        assert _recv(ws)["type"] == "audio.start"
        assert isinstance(_recv(ws), bytes)
        live = httpx.get(base + "/health").json()["live_requests"]
        assert 1 <= live <= WINDOW  # the window, not all eight sentences
        ws.socket.shutdown(socket.SHUT_RDWR)  # gone without a close frame
        gone = time.monotonic()
    health = _wait_idle(base)
    assert health["live_requests"] == health["live_loops"] == health["queued_units"] == 0
    assert time.monotonic() - gone < 5


def test_session_close_mid_speech_aborts_and_says_done(base):
    with _open(base) as ws:
        _config(ws, max_new_tokens=2000)
        _send(ws, "input.text", text=SLOW)
        assert _recv(ws)["type"] == "audio.start"
        assert isinstance(_recv(ws), bytes)
        _send(ws, "session.close")
        closed = time.monotonic()
        frames, code = _closed(ws)
    assert frames[-1] == {"type": "session.done"} and code == 1000
    assert all(isinstance(f, bytes) for f in frames[:-1])
    health = _wait_idle(base)
    assert health["live_requests"] == health["live_loops"] == health["queued_units"] == 0
    assert time.monotonic() - closed < 5


def test_draining_server_refuses_new_sessions():
    engine = AsyncEngine([ModelInstance.load(build_card())])
    app = build_app(engine)
    with TestClient(app) as client:
        app.state.drain.start()
        with client.websocket_connect(PATH) as ws:
            event = ws.receive_json()
            assert event["error"]["code"] == "server_shutting_down"
            assert ws.receive() == {
                "type": "websocket.close",
                "code": 1013,
                "reason": "server_shutting_down",
            }


LONG_SENTENCE = "Hello there my good friend, here is a much longer first sentence to speak."


def test_later_sentences_follow_the_sessions_playback_clock():
    """The second sentence, submitted once the first has audio, continues the session's clock:
    its deadline is when the audio made so far runs out, not a new request's."""
    engine = AsyncEngine([ModelInstance.load(build_card())])
    submitted = []  # (stream, clock passed, deadline, audio on the clock, new request's deadline)
    add_request = engine.add_request

    def spy(request, clock=None):
        stream = add_request(request, clock=clock)
        run = engine._runs[request.request_id]
        fresh = run.waiting_since + engine.config.first_audio_s
        submitted.append((stream, clock, engine._priority(run), stream.clock.audio_sent_s, fresh))
        return stream

    engine.add_request = spy
    with TestClient(build_app(engine)) as client, client.websocket_connect(PATH) as ws:
        ws.send_json({"type": "session.config", "model": "toy", "seed": 11, "max_new_tokens": 400})
        # about 4 s of audio: the session still plays it when the second sentence comes
        ws.send_json({"type": "input.text", "text": f"{LONG_SENTENCE} And"})
        while ws.receive().get("bytes") is None:  # audio.start, then the first audio
            pass
        ws.send_json({"type": "input.text", "text": " a second one."})
        ws.send_json({"type": "input.done"})
        while "audio.done" not in (ws.receive().get("text") or ""):
            pass
    (first, none, first_deadline, _, fresh0), (second, clock, deadline, sent, fresh) = submitted
    assert none is None and first_deadline == fresh0  # the first sentence: a new request
    assert clock is first.clock and second.clock is first.clock
    assert sent > 0 and deadline == clock.first_audio_at + sent and deadline != fresh


def test_a_session_whose_audio_ran_out_starts_a_new_clock():
    engine = AsyncEngine([ModelInstance.load(build_card())])
    session = SpeechSession(None, engine, SpeechRequest(model="toy", input="x"))
    now = time.monotonic()
    playing = PlaybackClock(now - 1.0, 1.0, first_audio_at=now - 0.5, audio_sent_s=5.0)
    ran_out = PlaybackClock(now - 9.0, 1.0, first_audio_at=now - 8.0, audio_sent_s=5.0)
    session.clock = playing
    assert session._clock() is playing
    session.clock = ran_out
    assert session._clock() is None  # the client waited for text: a fresh first-audio deadline
    session.in_flight.append(None)
    assert session._clock() is ran_out  # the engine is behind: the session is late


# ------------------------------------------------------------------ API key and origin


def _rejected(ws) -> dict:
    frames, code = _closed(ws)
    assert code == 1008 and len(frames) == 1
    return frames[0]["error"]


@pytest.mark.parametrize(
    ("query", "headers"),
    [
        ("", {}),
        ("?api_key=wrong", {}),
        ("", {"Authorization": "Bearer wrong"}),
        ("", {"Authorization": f"Basic {KEY}"}),
    ],
    ids=["none", "wrong-query", "wrong-header", "basic"],
)
def test_api_key_is_required(guarded, query, headers):
    with _open(guarded, query, additional_headers=headers) as ws:
        error = _rejected(ws)
    assert error["code"] == "invalid_api_key" and KEY not in error["message"]


@pytest.mark.parametrize(
    ("query", "headers"),
    [("", {"Authorization": f"Bearer {KEY}"}), (f"?api_key={KEY}", {})],
    ids=["header", "query"],
)
def test_api_key_in_header_or_query(guarded, query, headers):
    with _open(guarded, query, additional_headers=headers, origin=ORIGIN) as ws:
        _config(ws)
        _send(ws, "input.text", text="Let me in.")
        _send(ws, "input.done")
        frames, audio = _until(ws, "audio.done")
    assert frames[-1]["segments"] == 1 and audio


def test_browser_origins_follow_the_cors_settings(base, guarded):
    auth = {"Authorization": f"Bearer {KEY}"}
    with _open(guarded, additional_headers=auth, origin="http://evil.example") as ws:
        assert _rejected(ws)["code"] == "origin_not_allowed"
    with _open(base, origin=ORIGIN) as ws:  # CORS off: no foreign page may connect
        assert _rejected(ws)["code"] == "origin_not_allowed"
    with _open(base, origin=base) as ws:  # the server's own pages may
        _config(ws)
        _send(ws, "session.close")
        assert _closed(ws) == ([{"type": "session.done"}], 1000)


# ------------------------------------------------------------------ sentence buffering


def test_sentence_buffer_releases_a_sentence_once_the_next_starts():
    buffer = SentenceBuffer()
    assert buffer.feed("Dr. Smith paid 3.") == []
    assert buffer.feed("14 dollars, etc. and left.") == []
    assert buffer.feed(' "Next') == ["Dr. Smith paid 3.14 dollars, etc. and left."]
    assert buffer.feed(" one.") == [] and buffer.pending == ' "Next one.'
    assert buffer.flush() == ['"Next one.']
    assert buffer.feed("(") == [] and buffer.feed("ok.) (") == []
    assert buffer.feed("see") == [] and buffer.flush() == ["(ok.) (see"]


def test_sentence_buffer_cuts_long_sentences_at_clauses_as_they_come():
    buffer = SentenceBuffer(max_chars=20)
    out = []
    text = "one two three, four five six, seven eight nine ten"
    for word in text.split():
        out += buffer.feed(word + " ")
    assert out == ["one two three,", "four five six,"]
    assert buffer.flush() == ["seven eight nine ten"]


_WORDS = ["Hello", "world.", "Dr.", "Smith", "e.g.", "etc.", "and", "3.", "14", "It", "rained!"]
_WORDS += ["\n\n", "why?", "J.", "one,", "two;", "-", "x" * 25, '"Hi."', "“Hi.”", "(", "(ok.)"]
_WORDS += ["then", "The", "...", "…", "No.", "U.S.", "[a", "«"]


@st.composite
def _chunked_text(draw):
    words = draw(st.lists(st.sampled_from(_WORDS), max_size=30))
    gaps = draw(st.lists(st.sampled_from([" ", "", "\n", "  "]), min_size=len(words)))
    text = "".join(w + g for w, g in zip(words, gaps, strict=False))
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=12)))
    return text, cuts, draw(st.integers(5, 60))


@settings(max_examples=400, deadline=None)
@given(_chunked_text())
def test_sentence_buffer_matches_split_text_for_any_chunking(case):
    text, cuts, max_chars = case
    buffer = SentenceBuffer(max_chars)
    out, start = [], 0
    for cut in [*cuts, len(text)]:
        out += buffer.feed(text[start:cut])
        start = cut
    assert out + buffer.flush() == split_text(text, max_chars)


def test_sentence_buffer_docstring_examples():
    results = doctest.testmod(importlib.import_module("omnistep.text.stream"))
    assert results.attempted > 0 and results.failed == 0


@pytest.fixture(scope="module")
def streaming():
    with running_server("--model", "toy_stream") as url:
        yield url


def test_text_input_model_speaks_each_turn_as_one_request_fed_as_text_arrives(streaming):
    """A model with STREAMING_TEXT_INPUT: one request per turn, text appended as it arrives,
    audio before the turn's text is complete, and the turn's bytes equal /v1/audio/speech for
    its whole text with seed S + t."""
    turns = ["Please leave the package by the blue door.", "Then ring twice"]
    with _open(streaming) as ws:
        _send(ws, "session.config", model="toy_stream", seed=21)
        words = turns[0].split(" ")
        for word in words[:4]:
            _send(ws, "input.text", text=word + " ")
        start = _recv(ws)
        early = _recv(ws)  # audio of the first words, before the rest of the text exists
        assert start["type"] == "audio.start" and isinstance(early, bytes) and early
        _send(ws, "input.text", text=" ".join(words[4:]))
        _send(ws, "input.done")
        frames, audio = _until(ws, "audio.done")
        assert frames[-1]["segments"] == 1
        first = early + audio
        for piece in ["  ", *turns[1]]:  # a blank piece first: skipped, not part of the turn
            _send(ws, "input.text", text=piece)
        _send(ws, "input.done")
        frames, second = _until(ws, "audio.done")
        assert frames[0]["type"] == "audio.start" and frames[-1]["segments"] == 1
    expected = [
        _speech_pcm(streaming, text, segment_seed(21, t), model="toy_stream")
        for t, text in enumerate(turns)
    ]
    assert first == expected[0] and second == expected[1] and first != second


def test_text_after_the_turns_speech_ended_is_dropped_with_one_warning(streaming):
    """The turn's request stops at max_new_tokens before its text ends: later pieces get one
    ``turn_ended`` warning, the session goes on, and the next turn speaks normally."""
    with _open(streaming) as ws:
        _send(ws, "session.config", model="toy_stream", seed=5, max_new_tokens=5)
        _send(ws, "input.text", text="Hello world, here we go")
        assert _recv(ws)["type"] == "audio.start"
        assert isinstance(_recv(ws), bytes)
        time.sleep(0.5)  # the 5 steps are done: the turn's request has ended
        for piece in [" and more", " and more"]:
            _send(ws, "input.text", text=piece)
        _send(ws, "input.done")
        frames, _ = _until(ws, "audio.done")
        warnings = [f for f in frames if isinstance(f, dict) and f["type"] == "error"]
        assert [w["error"]["code"] for w in warnings] == ["turn_ended"], frames
        assert frames[-1]["segments"] == 1
        _send(ws, "input.text", text="Second turn")
        _send(ws, "input.done")
        frames, audio = _until(ws, "audio.done")
        assert audio == _speech_pcm(
            streaming, "Second turn", segment_seed(5, 1), model="toy_stream", max_new_tokens=5
        )
