"""The WebSocket speech stream (``/v1/audio/speech/stream``) on the families that joined last
(Higgs Audio v2, Chatterbox, VoxCPM2), each served by ``omnistep serve --model FAMILY=DIR`` from
the folder ``omnistep weights FAMILY DIR`` writes, with ``--batch-invariant`` (a turn's
sentences synthesise concurrently): a turn's text fed word by word is spoken as
``/v1/audio/speech`` speaks each sentence with that sentence's seed, byte for byte, and the
speech route streams the bytes it returns whole."""

from __future__ import annotations

import json

import httpx
import pytest
from websockets.sync.client import connect

from omnistep.models.registry import write_weights
from omnistep.server.speech_stream import PATH, segment_seed
from tests.serving import running_server

SENTENCES = ("The cat sat down.", "A hat fell off.")
SEED = 5
STEPS = 16
"""Decode steps a sentence: Higgs' first 8 only fill its codebook delay."""


def _speech(url: str, model: str, text: str, seed: int, stream: bool = False) -> bytes:
    body = {
        "model": model,
        "input": text,
        "seed": seed,
        "max_new_tokens": STEPS,
        "response_format": "pcm",
        "stream": stream,
    }
    r = httpx.post(url + "/v1/audio/speech", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.content


@pytest.mark.parametrize("family", ["higgs_audio_v2", "chatterbox", "voxcpm"])
def test_speech_stream_speaks_each_sentence_as_the_speech_route(family, tmp_path):
    folder = write_weights(family, tmp_path / family, seed=1)
    # the sentences of a turn run concurrently: --batch-invariant makes them equal alone
    args = ("--model", f"{family}={folder}", "--batch-invariant")
    with running_server(*args, timeout=300) as url:
        model = httpx.get(url + "/v1/models").json()["data"][0]["root"]  # the card's id
        expected = [
            _speech(url, model, text, segment_seed(SEED, k)) for k, text in enumerate(SENTENCES)
        ]
        assert all(expected) and expected[0] != expected[1]
        streamed = _speech(url, model, SENTENCES[0], segment_seed(SEED, 0), stream=True)
        assert streamed == expected[0]  # streamed == whole
        with connect(url.replace("http://", "ws://") + PATH, proxy=None, open_timeout=60) as ws:
            config = {
                "model": model,
                "seed": SEED,
                "max_new_tokens": STEPS,
                "response_format": "pcm",
            }
            ws.send(json.dumps({"type": "session.config", **config}))
            for i, word in enumerate(" ".join(SENTENCES).split(" ")):
                ws.send(json.dumps({"type": "input.text", "text": (" " if i else "") + word}))
            ws.send(json.dumps({"type": "input.done"}))
            audio = b""
            while True:
                frame = ws.recv(timeout=300)
                if isinstance(frame, bytes):
                    audio += frame
                    continue
                event = json.loads(frame)
                assert event["type"] != "error", event
                if event["type"] == "audio.done":
                    assert event["segments"] == len(SENTENCES)
                    break
    assert audio == b"".join(expected)
