"""Which Qwen3-TTS prompt layout a request gets (``card.text_layout``), how many frames its
``max_new_tokens`` allows (``card.talker_frames``), and the ``non_streaming_mode`` field of
``Request`` and of the speech API's body. No model: fast."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from omnistep.core import InvalidRequestError, Request
from omnistep.models.qwen3_tts.text_loop import talker_frames, text_layout
from omnistep.server.protocol import SpeechRequest


@pytest.mark.parametrize(
    ("variant", "text_input", "chosen", "option", "non_streaming"),
    [
        # a whole text: the default of upstream's public call for the variant
        ("custom_voice", False, None, None, True),
        ("voice_design", False, None, None, True),
        ("base", False, None, None, False),
        # text that streams in: the streaming-text layout
        ("custom_voice", True, None, None, False),
        ("voice_design", True, None, None, False),
        ("base", True, None, None, False),
        # the request's choice wins over everything
        ("custom_voice", False, False, True, False),
        ("base", False, True, False, True),
        ("custom_voice", True, True, None, True),
        # the card's option, for requests that do not choose
        ("custom_voice", False, None, False, False),
        ("base", True, None, True, True),
    ],
)
def test_text_layout(variant, text_input, chosen, option, non_streaming):
    req = Request("qwen3-tts", text="hi", text_input=text_input, non_streaming_mode=chosen)
    assert text_layout(req, variant, option) is non_streaming


def test_max_new_tokens_counts_as_upstreams():
    assert [talker_frames(n) for n in (1, 2, 3, 24, 8192)] == [1, 1, 2, 23, 8191]


@pytest.mark.parametrize("value", [1, 0, "true", 1.0])
def test_request_rejects_a_non_bool_layout(value):
    with pytest.raises(InvalidRequestError) as err:
        Request("qwen3-tts", text="hi", non_streaming_mode=value)
    assert err.value.param == "non_streaming_mode"


def test_speech_body_carries_the_layout():
    body = {"model": "qwen3-tts", "input": "Hello there."}
    assert SpeechRequest(**body).to_request("qwen3-tts").non_streaming_mode is None
    for value in (True, False):
        req = SpeechRequest(**body, non_streaming_mode=value).to_request("qwen3-tts")
        assert req.non_streaming_mode is value
    with pytest.raises(ValidationError, match="non_streaming_mode"):
        SpeechRequest(**body, non_streaming_mode="yes")
    with pytest.raises(ValidationError, match="non_streaming_mode"):
        SpeechRequest(**body, non_streaming_mode=1)
