"""``POST /v1/audio/transcriptions`` through the ``openai`` SDK's own client
(``client.audio.transcriptions.create``), served in-process (httpx's ASGI transport) on the
``toy_hear`` card, whose "transcript" is the duration and RMS of what it heard: so the values
show that the clip was decoded, resampled to the card's media rate and reached the model
through the card's own ASR prompt.
"""

from __future__ import annotations

import io
import json
from contextlib import asynccontextmanager

import httpx
import numpy as np
import openai
import pytest
import soundfile as sf

from omnistep.core import ModelInstance
from omnistep.engine import AsyncEngine
from omnistep.models import registry
from omnistep.models.toy import hear
from omnistep.server import ServerConfig, build_app

RATE = 22_050  # not the card's 16 kHz: the server resamples


def clip(seconds: float, amplitude: float, rate: int = RATE, fmt: str = "WAV") -> bytes:
    """A sine clip of ``amplitude`` (RMS ``amplitude / sqrt(2)``) as an audio file."""
    t = np.arange(int(seconds * rate)) / rate
    buf = io.BytesIO()
    sf.write(buf, amplitude * np.sin(2 * np.pi * 300 * t), rate, format=fmt, subtype="PCM_16")
    return buf.getvalue()


def heard(seconds: float, amplitude: float) -> str:
    return f"heard {seconds:.2f} s rms {amplitude / np.sqrt(2):.3f}"


@asynccontextmanager
async def served(tmp_path):
    """``(openai client, httpx client, engine)`` of a server of toy_hear and toy."""
    engine = AsyncEngine(
        [
            ModelInstance.load(registry.build_card("toy_hear")),
            ModelInstance.load(registry.build_card("toy")),
        ]
    )
    app = build_app(engine, ServerConfig(voices_db=str(tmp_path / "voices.db")))
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://test/v1/") as http:
            client = openai.AsyncOpenAI(api_key="x", base_url="http://test/v1", http_client=http)
            yield client, http, engine
    finally:
        await engine.shutdown()


async def test_json_text_and_verbose_answers_hold_what_the_model_heard(tmp_path):
    async with served(tmp_path) as (client, _, engine):
        data = clip(1.5, 0.5)
        result = await client.audio.transcriptions.create(
            model="toy_hear", file=("q.wav", data, "audio/wav"), language="en", temperature=0.0
        )
        assert result.text == heard(1.5, 0.5)
        assert result.usage.type == "tokens"
        assert result.usage.output_tokens == 5
        # input: the ASR prompt's text and 25 tokens per second of audio
        prompt_chars = len(hear.ASR_SYSTEM) + len(hear.ASR_INSTRUCTION)
        assert result.usage.input_tokens == prompt_chars + round(25 * 1.5)
        text = await client.audio.transcriptions.create(
            model="toy_hear", file=("q.flac", clip(0.8, 0.2, fmt="FLAC")), response_format="text"
        )
        assert text == heard(0.8, 0.2)
        verbose = await client.audio.transcriptions.create(
            model="toy_hear", file=("q.wav", data), response_format="verbose_json", language="en"
        )
        assert (verbose.text, verbose.duration, verbose.language) == (heard(1.5, 0.5), 1.5, "en")
        assert [(s.start, s.end, s.text) for s in verbose.segments] == [(0.0, 1.5, verbose.text)]
        assert engine.stats()["live_requests"] == 0


@pytest.mark.parametrize(
    ("fmt", "expected"),
    [
        ("srt", "1\n00:00:00,000 --> 00:00:01,250\n{}\n\n"),
        ("vtt", "WEBVTT\n\n00:00:00.000 --> 00:00:01.250\n{}\n\n"),
    ],
)
async def test_subtitle_formats_hold_one_cue_over_the_clip(tmp_path, fmt, expected):
    async with served(tmp_path) as (client, _, _):
        text = await client.audio.transcriptions.create(
            model="toy_hear", file=("q.wav", clip(1.25, 0.3)), response_format=fmt
        )
        assert text == expected.format(heard(1.25, 0.3))


async def test_streamed_deltas_add_up_to_the_done_text(tmp_path):
    async with served(tmp_path) as (client, _, engine):
        stream = await client.audio.transcriptions.create(
            model="toy_hear", file=("q.wav", clip(2.0, 0.1)), stream=True
        )
        events = [event async for event in stream]
        kinds = [e.type for e in events]
        assert kinds == ["transcript.text.delta"] * 5 + ["transcript.text.done"]
        assert "".join(e.delta for e in events[:-1]) == heard(2.0, 0.1)
        assert events[-1].text == heard(2.0, 0.1)
        assert events[-1].usage.output_tokens == 5
        assert engine.stats()["live_requests"] == 0


async def test_models_say_which_transcribe(tmp_path):
    async with served(tmp_path) as (client, _, _):
        listed = {m.id: m for m in (await client.models.list()).data}
        assert "transcription" in listed["toy_hear"].capabilities
        assert "audio_input" in listed["toy_hear"].capabilities
        assert "transcription" not in listed["toy"].capabilities


@pytest.mark.parametrize(
    ("fields", "file", "param", "code"),
    [
        ({"model": "toy"}, True, "model", "unsupported_model"),
        ({"model": "nope"}, True, "model", "model_not_found"),
        ({}, True, "model", "missing_required_parameter"),
        ({"model": "toy_hear"}, False, "file", "missing_required_parameter"),
        ({"model": "toy_hear", "response_format": "xml"}, True, "response_format", "invalid_value"),
        ({"model": "toy_hear", "temperature": "2"}, True, "temperature", "invalid_value"),
        ({"model": "toy_hear", "temperature": "hot"}, True, "temperature", "invalid_value"),
        ({"model": "toy_hear", "language": "english!"}, True, "language", "invalid_value"),
        ({"model": "toy_hear", "stream": "maybe"}, True, "stream", "invalid_value"),
        (
            {"model": "toy_hear", "stream": "true", "response_format": "srt"},
            True,
            "stream",
            "unsupported_value",
        ),
    ],
)
async def test_bad_fields_are_400s_naming_the_field(tmp_path, fields, file, param, code):
    async with served(tmp_path) as (_, http, _):
        files = {"file": ("q.wav", clip(0.5, 0.3), "audio/wav")} if file else None
        r = await http.post("audio/transcriptions", data=fields, files=files or {"x": ("x", b"")})
        error = r.json()["error"]
        assert (r.status_code, error["param"], error["code"]) == (
            404 if code == "model_not_found" else 400,
            param,
            code,
        ), error


async def test_undecodable_or_empty_files_are_400s(tmp_path):
    async with served(tmp_path) as (client, http, _):
        with pytest.raises(openai.BadRequestError) as info:
            await client.audio.transcriptions.create(model="toy_hear", file=("q.wav", b"not audio"))
        assert info.value.body["code"] == "invalid_audio"
        r = await http.post(
            "audio/transcriptions", data={"model": "toy_hear"}, files={"file": ("q", b"")}
        )
        assert (r.status_code, r.json()["error"]["code"]) == (400, "invalid_audio")
        r = await http.post("audio/transcriptions", json={"model": "toy_hear"})
        assert (r.status_code, r.json()["error"]["param"]) == (400, "file")


async def test_a_failure_mid_stream_is_an_error_event(tmp_path, monkeypatch):
    async with served(tmp_path) as (_, http, engine):
        scribe = engine.models["toy_hear"].components["scribe"]

        def broken(kind, payloads):
            raise RuntimeError("injected")

        monkeypatch.setattr(scribe, "execute", broken)
        files = {"file": ("q.wav", clip(0.5, 0.3))}
        r = await http.post(
            "audio/transcriptions", data={"model": "toy_hear", "stream": "true"}, files=files
        )
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1]["error"]["code"] == "generation_failed"


def test_the_capability_and_the_prompt_hook_go_together():
    import dataclasses

    from omnistep.core import Capability, CardValidationError

    card = hear.build_card()
    card.validate()
    with pytest.raises(CardValidationError, match="transcription"):
        dataclasses.replace(card, transcription_prompt=None).validate()
    without_hearing = card.capabilities - {Capability.AUDIO_INPUT}
    with pytest.raises(CardValidationError, match="transcription"):
        dataclasses.replace(card, capabilities=without_hearing).validate()
    toy = registry.build_card("toy")
    with pytest.raises(CardValidationError, match="transcription"):
        dataclasses.replace(toy, transcription_prompt=hear.transcription_messages).validate()
