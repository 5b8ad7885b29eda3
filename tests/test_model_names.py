"""Model names: the family name as an alias, ``--served-model-name``, ``GET /v1/models[/{id}]``,
and the errors for an unknown model or one that cannot serve an endpoint.

In-process (the app on httpx's ASGI transport) on toy cards; one real server for the flag.
"""

import dataclasses
from contextlib import asynccontextmanager

import httpx
import openai
import pytest

from omnistep.cli import build_parser, load_engine
from omnistep.core import Capability, InvalidRequestError, ModelInstance, OmnistepError
from omnistep.engine import AsyncEngine
from omnistep.models import registry
from omnistep.models.registry import build_card, distinct_names, public_names
from omnistep.models.toy.card import build_card as build_toy
from omnistep.server import ServerConfig, build_app
from tests.serving import running_server

SPEECH = "/v1/audio/speech"
CHAT = "/v1/chat/completions"


@pytest.fixture
def toy_family(monkeypatch):
    """A family registered as ``toy_family`` whose card id is ``toy``: like ``qwen2_5_omni``,
    whose card id is ``qwen2.5-omni``."""
    monkeypatch.setitem(registry.FAMILIES, "toy_family", registry.FAMILIES["toy"])
    return "toy_family"


@asynccontextmanager
async def client(cards, tmp_path):
    """An in-process httpx client (and an AsyncOpenAI on it) of an app serving ``cards``."""
    engine = AsyncEngine([ModelInstance.load(c) for c in cards])
    app = build_app(engine, ServerConfig(voices_db=str(tmp_path / "voices.db")))
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://test/") as c:
            oai = openai.AsyncOpenAI(
                base_url="http://test/v1", api_key="unused", http_client=c, max_retries=0
            )
            yield c, oai
    finally:
        await engine.shutdown()


def _speech(model: str) -> dict:
    return {"model": model, "input": "hello", "seed": 1, "max_new_tokens": 10, "stream": False}


def _chat(model: str, **extra) -> dict:
    messages = [{"role": "user", "content": "hi"}]
    return {"model": model, "messages": messages, "max_tokens": 5, "seed": 1, **extra}


# ------------------------------------------------------------------ names of a card


def test_family_name_is_an_alias_when_it_differs_from_the_card_id(toy_family):
    assert build_card("toy").model_ids == ("toy", "toy-tts")  # family == card id: no extra
    assert build_card(toy_family).model_ids == ("toy", "toy_family", "toy-tts")


def test_served_name_replaces_card_id_and_family_but_keeps_the_card_aliases(toy_family):
    card = build_card(toy_family, served_name="org/voice-1")
    assert card.card_id == "org/voice-1"
    assert card.model_ids == ("org/voice-1", "toy-tts")
    assert public_names(build_toy(), "toy", "toy-tts").model_ids == ("toy-tts",)


@pytest.mark.parametrize("bad", ["", " ", "two words", "tab\there", "x" * 201, "nul\x00"])
def test_bad_served_names_are_refused(bad):
    with pytest.raises(InvalidRequestError, match="served model name"):
        public_names(build_toy(), "toy", bad)


def test_distinct_names_gives_shared_aliases_to_the_first_and_refuses_equal_ids():
    a, b = build_card("toy", "a"), build_card("toy", "b")
    first, second = distinct_names(["toy", "toy"], [a, b])
    assert first.model_ids == ("a", "toy-tts") and second.model_ids == ("b",)
    with pytest.raises(InvalidRequestError, match="--served-model-name"):
        distinct_names(["toy", "toy"], [build_card("toy"), build_card("toy")])


def test_load_engine_checks_served_names_before_loading():
    with pytest.raises(OmnistepError, match="one name per --model"):
        load_engine(["toy"], "cpu", 1, served_names=["a", "b"])
    with pytest.raises(OmnistepError, match="both answer to the model name 'toy'"):
        load_engine(["toy", "toy"], "cpu", 1)
    engine = load_engine(["toy", "toy"], "cpu", 1, served_names=["a", "b"])
    assert engine.model_ids() == ("a", "toy-tts", "b")


def test_served_model_name_flag_is_repeatable():
    parse = build_parser().parse_args
    assert parse(["serve"]).served_model_name is None
    args = parse(["serve", "--served-model-name", "x", "--served-model-name", "y/z"])
    assert args.served_model_name == ["x", "y/z"]


# ------------------------------------------------------------------ routes


async def test_family_name_serves_speech_and_chat_and_is_listed(toy_family, tmp_path):
    async with client([build_card(toy_family)], tmp_path) as (c, oai):
        listed = (await c.get("/v1/models")).json()["data"]
        assert [m["id"] for m in listed] == ["toy", "toy_family", "toy-tts"]
        assert {m["root"] for m in listed} == {"toy"}
        by_family = await c.post(SPEECH, json=_speech("toy_family"))
        by_id = await c.post(SPEECH, json=_speech("toy"))
        assert by_family.status_code == 200 and by_family.content == by_id.content
        chat = await c.post(CHAT, json=_chat("toy_family"))
        assert chat.status_code == 200 and chat.json()["model"] == "toy_family"


async def test_retrieve_every_listed_model_and_404_for_others(tmp_path):
    card = build_card("toy", "org/voice-1")
    async with client([card], tmp_path) as (c, oai):
        listed = (await c.get("/v1/models")).json()["data"]
        assert [m["id"] for m in listed] == ["org/voice-1", "toy-tts"]
        for entry in listed:
            assert (await c.get(f"/v1/models/{entry['id']}")).json() == entry
        model = await oai.models.retrieve("org/voice-1")  # sent as org%2Fvoice-1
        assert (model.id, model.object, model.owned_by) == ("org/voice-1", "model", "omnistep")
        assert (await oai.models.retrieve("toy-tts")).id == "toy-tts"
        with pytest.raises(openai.NotFoundError) as info:
            await oai.models.retrieve("toy")  # the served name replaced the card id
        error = info.value.body
        assert error["code"] == "model_not_found" and error["param"] == "model"
        assert "org/voice-1, toy-tts" in error["message"]
        r = await c.get("/v1/models/nope")
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


async def test_unknown_model_lists_the_served_ones_everywhere(tmp_path):
    async with client([build_toy()], tmp_path) as (c, _):
        for path, body in ((SPEECH, _speech("nope")), (CHAT, _chat("nope"))):
            r = await c.post(path, json=body)
            assert r.status_code == 404, r.text
            error = r.json()["error"]
            assert error["code"] == "model_not_found" and error["param"] == "model"
            assert error["message"] == (
                "The model 'nope' does not exist; this server serves: toy, toy-tts."
            )


# ------------------------------------------------------------------ capability errors


def _only(card_id: str, *caps: Capability):
    return dataclasses.replace(
        build_toy(), card_id=card_id, aliases=(), capabilities=frozenset(caps)
    )


async def test_capability_errors_say_what_to_use_instead(tmp_path):
    reader = _only("reader", Capability.TEXT_TO_SPEECH)
    talker = _only("talker", Capability.CHAT_TEXT, Capability.CHAT_AUDIO)
    typist = _only("typist", Capability.CHAT_TEXT)
    async with client([reader, talker, typist], tmp_path) as (c, _):

        async def error(path: str, body: dict) -> dict:
            r = await c.post(path, json=body)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["code"] == "unsupported_model" and "chat_" not in err["message"]
            return err

        err = await error(CHAT, _chat("reader"))
        assert err["param"] == "model"
        assert err["message"] == (
            "Model 'reader' cannot chat: it only turns text into speech; send the text to POST "
            "/v1/audio/speech instead (chat models served here: talker, typist)."
        )
        audio = {"modalities": ["text", "audio"], "audio": {"voice": "default"}}
        err = await error(CHAT, _chat("reader", **audio))  # cannot chat at all: says so
        assert err["param"] == "model" and "cannot chat" in err["message"]
        err = await error(CHAT, _chat("typist", **audio))
        assert err["param"] == "modalities"
        assert err["message"] == (
            "Model 'typist' can chat but not answer with audio; ask for modalities [\"text\"] "
            "only (models served here that answer with audio: talker)."
        )
        err = await error(SPEECH, _speech("talker"))
        assert err["message"] == (
            "Model 'talker' cannot read text aloud on /v1/audio/speech; it is a chat model: ask "
            'POST /v1/chat/completions with modalities ["text", "audio"] for a spoken reply '
            "(speech models served here: reader)."
        )
        ok = await c.post(CHAT, json=_chat("talker", **audio))
        assert ok.status_code == 200


# ------------------------------------------------------------------ the real server


def test_served_model_name_on_the_real_server():
    with running_server("--model", "toy", "--served-model-name", "my-voice") as base:
        ids = [m["id"] for m in httpx.get(base + "/v1/models").json()["data"]]
        assert ids == ["my-voice", "toy-tts"]
        ok = httpx.post(base + SPEECH, json=_speech("my-voice"), timeout=60)
        assert ok.status_code == 200 and ok.content
        gone = httpx.post(base + SPEECH, json=_speech("toy"), timeout=60)
        assert gone.status_code == 404 and "my-voice, toy-tts" in gone.json()["error"]["message"]
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        assert client.models.retrieve("my-voice").id == "my-voice"
