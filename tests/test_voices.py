"""Saved voices (``/v1/audio/voices``, SQLite): CRUD, persistence, errors, use in requests.

Most tests run the app in-process on the toy card; the ChatTTS ones use the tiny official-layout
checkpoint of tests/test_chattts.py, for the speaker-string and ``seed:N`` validation.
"""

import base64
import dataclasses
import sqlite3
import threading
from contextlib import asynccontextmanager

import httpx
import pytest
import torch

from omnistep.cli import build_parser, server_config
from omnistep.core import InvalidRequestError, ModelInstance
from omnistep.engine import AsyncEngine
from omnistep.models.toy.card import build_card as build_toy
from omnistep.server import ServerConfig, build_app
from omnistep.server.voices import VoiceExistsError, VoiceStore, default_voices_db

VOICES = "/v1/audio/voices"
SPEECH = "/v1/audio/speech"
CHAT = "/v1/chat/completions"


def _toy2():
    """A second toy card under another id, to check that voices belong to one model."""
    return dataclasses.replace(build_toy(), card_id="toy2", aliases=())


@asynccontextmanager
async def client(db, cards=None, **config):
    """An in-process client of an app serving ``cards`` (default: the toy) with voices in
    ``db``; the engine is shut down after."""
    models = [ModelInstance.load(c) for c in (cards or [build_toy()])]
    engine = AsyncEngine(models)
    app = build_app(engine, ServerConfig(voices_db=str(db), **config))
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            yield c
    finally:
        await engine.shutdown()


def _speech(voice, model="toy", seed=3):
    body = {"model": model, "input": "hello there", "seed": seed, "max_new_tokens": 20}
    return {**body, "voice": voice, "response_format": "pcm", "stream": False}


def _error(r, status, code=None, param=None):
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    if code is not None:
        assert error["code"] == code, error
    if param is not None:
        assert error["param"] == param, error
    return error


def _names(r, builtin=None):
    assert r.status_code == 200, r.text
    return [v["name"] for v in r.json()["data"] if builtin is None or v["builtin"] is builtin]


# ------------------------------------------------------------------ CRUD and persistence


async def test_crud_round_trip(tmp_path):
    db = tmp_path / "voices.db"
    async with client(db) as c:
        r = await c.get(VOICES)
        assert r.json() == {
            "object": "list",
            "data": [{"object": "audio.voice", "name": "default", "model": "toy", "builtin": True}],
            "voices": [{"id": "default", "name": "default"}],  # Kokoro-FastAPI's shape
        }
        assert not db.exists()  # nothing saved yet: no file

        r = await c.post(VOICES, json={"name": "narrator", "model": "toy-tts", "voice": "default"})
        assert r.status_code == 201, r.text
        saved = r.json()
        assert saved["name"] == "narrator" and saved["model"] == "toy"  # the card id, not alias
        assert saved["voice"] == "default" and saved["builtin"] is False
        assert isinstance(saved["created_at"], int)
        assert db.exists()

        for query in ("", "?model=toy", "?model=toy-tts"):
            r = await c.get(VOICES + query)
            assert _names(r, builtin=True) == ["default"]
            assert _names(r, builtin=False) == ["narrator"]
            assert r.json()["data"][1] == saved
            assert [v["id"] for v in r.json()["voices"]] == ["default", "narrator"]

        r = await c.delete(VOICES + "/narrator?model=toy")
        assert r.status_code == 200, r.text
        assert r.json() == {
            "object": "audio.voice.deleted",
            "name": "narrator",
            "model": "toy",
            "deleted": True,
        }
        assert _names(await c.get(VOICES), builtin=False) == []
        _error(await c.delete(VOICES + "/narrator?model=toy"), 404, "voice_not_found", "name")


async def test_voices_survive_a_restart(tmp_path):
    db = tmp_path / "sub" / "dir" / "voices.db"  # folders are created on the first save
    async with client(db) as c:
        r = await c.post(VOICES, json={"name": "keep.me_1", "model": "toy", "voice": "default"})
        assert r.status_code == 201, r.text
        before = (await c.post(SPEECH, json=_speech("keep.me_1"))).content
    async with client(db) as c:  # a new engine and app on the same file
        r = await c.get(VOICES + "?model=toy")
        assert _names(r, builtin=False) == ["keep.me_1"]
        after = await c.post(SPEECH, json=_speech("keep.me_1"))
        assert after.status_code == 200 and after.content == before
        assert (await c.delete(VOICES + "/keep.me_1")).status_code == 200  # model inferred
    async with client(db) as c:
        assert _names(await c.get(VOICES), builtin=False) == []


# ------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    "name",
    ["", "a" * 65, "has space", "../etc/passwd", "a/b", "dé", "tab\t", "new\nline", "x:y"],
)
async def test_bad_names_are_400(tmp_path, name):
    async with client(tmp_path / "v.db") as c:
        r = await c.post(VOICES, json={"name": name, "model": "toy", "voice": "default"})
        _error(r, 400, "invalid_name", "name")
    assert not (tmp_path / "v.db").exists()


async def test_create_errors(tmp_path):
    async with client(tmp_path / "v.db") as c:
        ok = {"name": "n", "model": "toy", "voice": "default"}
        assert (await c.post(VOICES, json={**ok, "name": "a" * 64})).status_code == 201

        for missing in ("name", "model", "voice"):
            body = {k: v for k, v in ok.items() if k != missing}
            _error(await c.post(VOICES, json=body), 400, "missing_required_parameter", missing)
        _error(await c.post(VOICES, json={**ok, "voice": 5}), 400, param="voice")
        _error(await c.post(VOICES, json={**ok, "name": ["n"]}), 400, param="name")
        _error(await c.post(VOICES, content=b"not json"), 400)
        _error(await c.post(VOICES, json={**ok, "model": "nope"}), 404, "model_not_found", "model")
        # the card vets the spec: the toy accepts only its built-in name
        _error(await c.post(VOICES, json={**ok, "voice": "nobody"}), 400, "unknown_voice", "voice")
        _error(await c.post(VOICES, json={**ok, "voice": "x" * 20000}), 400, param="voice")
        # a built-in name cannot be taken
        _error(await c.post(VOICES, json={**ok, "name": "default"}), 409, "builtin_voice", "name")

        assert (await c.post(VOICES, json=ok)).status_code == 201
        _error(await c.post(VOICES, json=ok), 409, "voice_exists", "name")

        _error(await c.get(VOICES + "?model=nope"), 404, "model_not_found", "model")
        _error(await c.delete(VOICES + "/default?model=toy"), 409, "builtin_voice", "name")
        _error(await c.delete(VOICES + "/ghost?model=toy"), 404, "voice_not_found", "name")
        _error(await c.delete(VOICES + "/ghost"), 404, "voice_not_found", "name")
        _error(await c.delete(VOICES + "/n?model=nope"), 404, "model_not_found", "model")
        _error(await c.delete(VOICES + "/%2E%2E%2Fx"), 404)  # no route: a name has no "/"
        _error(await c.delete(VOICES + "/sp%20ace"), 404, "voice_not_found", "name")
        assert _names(await c.get(VOICES), builtin=False) == ["a" * 64, "n"]


async def test_api_key_guards_the_voice_routes(tmp_path):
    async with client(tmp_path / "v.db", api_key="sekrit") as c:
        body = {"name": "n", "model": "toy", "voice": "default"}
        for r in (
            await c.get(VOICES),
            await c.post(VOICES, json=body),
            await c.delete(VOICES + "/n?model=toy"),
        ):
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        auth = {"Authorization": "Bearer sekrit"}
        assert (await c.post(VOICES, json=body, headers=auth)).status_code == 201
        assert (await c.get(VOICES, headers=auth)).status_code == 200
        assert (await c.delete(VOICES + "/n?model=toy", headers=auth)).status_code == 200


# ------------------------------------------------------------------ use in requests


async def test_saved_voice_speaks_like_its_spec_and_is_unknown_once_deleted(tmp_path):
    async with client(tmp_path / "v.db") as c:
        r = await c.post(VOICES, json={"name": "narrator", "model": "toy", "voice": "default"})
        assert r.status_code == 201
        direct = await c.post(SPEECH, json=_speech("default"))
        saved = await c.post(SPEECH, json=_speech("narrator"))
        assert direct.status_code == 200 and saved.status_code == 200, saved.text
        assert saved.content == direct.content and len(saved.content) > 0
        as_object = await c.post(SPEECH, json=_speech({"id": "narrator"}))
        assert as_object.content == direct.content
        alias = await c.post(SPEECH, json=_speech("narrator", model="toy-tts"))
        assert alias.content == direct.content

        chat = {
            "model": "toy",
            "messages": [{"role": "user", "content": "hello"}],
            "modalities": ["text", "audio"],
            "max_tokens": 10,
            "seed": 5,
        }
        replies = []
        for voice in ("default", "narrator"):
            r = await c.post(CHAT, json={**chat, "audio": {"voice": voice, "format": "pcm16"}})
            assert r.status_code == 200, r.text
            replies.append(base64.b64decode(r.json()["choices"][0]["message"]["audio"]["data"]))
        assert replies[0] == replies[1] and len(replies[0]) > 0

        assert (await c.delete(VOICES + "/narrator?model=toy")).status_code == 200
        _error(await c.post(SPEECH, json=_speech("narrator")), 400, "unknown_voice", "voice")
        r = await c.post(CHAT, json={**chat, "audio": {"voice": "narrator", "format": "wav"}})
        _error(r, 400, "unknown_voice", "voice")


async def test_a_voice_belongs_to_its_model(tmp_path):
    async with client(tmp_path / "v.db", cards=[build_toy(), _toy2()]) as c:
        r = await c.post(VOICES, json={"name": "mine", "model": "toy", "voice": "default"})
        assert r.status_code == 201
        assert (await c.post(SPEECH, json=_speech("mine"))).status_code == 200
        error = _error(
            await c.post(SPEECH, json=_speech("mine", model="toy2")), 400, "unknown_voice", "voice"
        )
        assert "saved for toy" in error["message"]
        assert _names(await c.get(VOICES + "?model=toy2"), builtin=False) == []
        assert _names(await c.get(VOICES), builtin=True) == ["default", "default"]

        # the same name on both models: DELETE must say which
        r = await c.post(VOICES, json={"name": "mine", "model": "toy2", "voice": "default"})
        assert r.status_code == 201
        _error(await c.delete(VOICES + "/mine"), 400, "ambiguous_voice", "model")
        assert (await c.delete(VOICES + "/mine?model=toy2")).json()["model"] == "toy2"
        assert (await c.delete(VOICES + "/mine")).json()["model"] == "toy"


# ------------------------------------------------------------------ store, config


def test_store_is_parameterised_and_thread_safe(tmp_path):
    path = tmp_path / "v.db"
    store = VoiceStore(path)
    assert store.list() == [] and store.get("m", "x") is None and not store.delete("m", "x")
    assert not path.exists()  # reads create nothing

    hostile = "x'); DROP TABLE voices; --"
    store.add("m", hostile, "spec ' \" ; --")
    assert store.get("m", hostile).voice == "spec ' \" ; --"
    with pytest.raises(VoiceExistsError):
        store.add("m", hostile, "other")

    errors = []

    def add_many(k):
        try:
            for i in range(20):
                store.add(f"model{k}", f"v{i}", f"spec{k}.{i}")
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=add_many, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(store.list()) == 81 and len(store.find("v3")) == 4
    assert [v.name for v in store.list("model2")][:3] == ["v0", "v1", "v10"]
    assert store.delete("model2", "v3") and store.get("model2", "v3") is None
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT count(*) FROM voices").fetchone() == (80,)


def test_default_path_and_cli_flag(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    assert default_voices_db() == tmp_path / "omnistep" / "voices.db"
    monkeypatch.setenv("XDG_DATA_HOME", "relative/dir")  # ignored, as the XDG spec says
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_voices_db() == tmp_path / "home" / ".local" / "share" / "omnistep" / "voices.db"
    monkeypatch.delenv("XDG_DATA_HOME")
    assert default_voices_db() == tmp_path / "home" / ".local" / "share" / "omnistep" / "voices.db"

    args = build_parser().parse_args(["serve", "--voices-db", str(tmp_path / "x.db")])
    assert server_config(args).voices_db == str(tmp_path / "x.db")
    assert server_config(build_parser().parse_args(["serve"])).voices_db is None


def test_cards_validate_voices_without_a_request():
    toy = build_toy()
    toy.validate_voice("default")
    with pytest.raises(InvalidRequestError) as info:
        toy.validate_voice("nobody")
    assert info.value.param == "voice" and info.value.code == "unknown_voice"

    from omnistep.models.qwen2_5_omni.frontend import ChatFrontend, MediaRules

    qwen = ChatFrontend(None, {"Chelsie": {}, "Ethan": {}}, MediaRules())
    assert qwen.speaker_name("Ethan") == "Ethan" and qwen.speaker_name("alloy") == "Chelsie"
    with pytest.raises(InvalidRequestError, match="unknown voice"):
        qwen.speaker_name("Nobody")


# ------------------------------------------------------------------ ChatTTS speakers


@pytest.fixture(scope="module")
def chattts_root(tmp_path_factory):
    from omnistep.models.chattts.tiny import write_servable_tiny_chattts

    return write_servable_tiny_chattts(tmp_path_factory.mktemp("chattts") / "ckpt")


@pytest.fixture(scope="module")
def chattts_card(chattts_root):
    from omnistep.models.chattts.card import ChatTTSOptions, build_card

    return build_card(str(chattts_root), ChatTTSOptions(kv_cache_gb=0.02))


def test_chattts_card_validates_speaker_strings_and_seeds(chattts_root, chattts_card):
    from omnistep.models.chattts.speaker import encode_speaker, random_speaker, shipped_spk_stat

    speaker = encode_speaker(random_speaker(shipped_spk_stat(), 3))
    for good in (speaker, "seed:5", "alloy"):
        chattts_card.validate_voice(good)
    for bad in ("not a speaker", "seed:x", "seed:" + "9" * 30, encode_speaker(torch.ones(7))):
        with pytest.raises(InvalidRequestError) as info:
            chattts_card.validate_voice(bad)
        assert info.value.param == "voice" and info.value.code == "invalid_voice"


def _chattts_speaker(card, voice, seed=0):
    """The normalised speaker vector the card's front-end writes for ``voice`` (None: none)."""
    from omnistep.core import ProgramContext, Request

    ctx = ProgramContext(Request("chattts", text="hi", voice=voice, seed=seed), None)
    card.program.nodes[0].fn(ctx)
    return ctx.slots["prompt"].speaker


def test_chattts_without_statistics_takes_speaker_strings_only(tmp_path):
    """Another GPT width (64) and no ``asset/spk_stat.pt``: the shipped 768-dim statistics do not
    fit, so ``seed:N`` and OpenAI names are refused (saying why), speaker strings work, and no
    voice is upstream's ``[empty_spk]`` prompt."""
    from omnistep.models.chattts.card import build_card
    from omnistep.models.chattts.speaker import encode_speaker
    from omnistep.models.chattts.tiny import write_tiny_chattts

    card = build_card(str(write_tiny_chattts(tmp_path / "h64")))
    speaker = encode_speaker(torch.linspace(-1, 1, 64))
    card.validate_voice(speaker)  # speaker strings need no statistics
    for voice in ("seed:5", "alloy"):
        with pytest.raises(InvalidRequestError, match="hidden size 64 is not the 768") as info:
            card.validate_voice(voice)
        assert "asset/spk_stat.pt" in str(info.value) and info.value.code == "invalid_voice"
    assert _chattts_speaker(card, None) is None
    assert _chattts_speaker(card, speaker) is not None


def test_chattts_folder_spk_stat_overrides_the_shipped_statistics(chattts_root, tmp_path):
    """``asset/spk_stat.pt`` (older layout, or a user's own statistics) is used when present,
    at any width; one of the wrong size is refused when the card is built, naming the file."""
    import shutil

    from omnistep.models.chattts.card import build_card
    from omnistep.models.chattts.speaker import normalize_speaker, random_speaker
    from omnistep.models.chattts.tiny import write_tiny_chattts

    g = torch.Generator().manual_seed(0)
    h64 = write_tiny_chattts(tmp_path / "h64")
    h768 = tmp_path / "h768"
    shutil.copytree(chattts_root, h768)
    for root, hidden in ((h64, 64), (h768, 768)):
        stat = torch.cat([1 + torch.rand(hidden, generator=g), torch.randn(hidden, generator=g)])
        torch.save(stat, root / "asset" / "spk_stat.pt")
        card = build_card(str(root))
        want = normalize_speaker(random_speaker(stat, 5))
        assert torch.equal(_chattts_speaker(card, "seed:5"), want)
        assert torch.equal(_chattts_speaker(card, None, seed=5), want)
    shipped = build_card(str(chattts_root))
    assert not torch.equal(_chattts_speaker(shipped, "seed:5"), want)
    torch.save(torch.ones(100), h768 / "asset" / "spk_stat.pt")
    with pytest.raises(ValueError, match="asset/spk_stat.pt holds 100 values.* needs 1536"):
        build_card(str(h768))


async def test_chattts_saved_speakers_speak_like_their_spec(chattts_root, chattts_card, tmp_path):
    from omnistep.models.chattts.speaker import encode_speaker, random_speaker, shipped_spk_stat

    speaker = encode_speaker(random_speaker(shipped_spk_stat(), 3))
    async with client(tmp_path / "v.db", cards=[chattts_card]) as c:
        for name, spec in (("spk", speaker), ("seven", "seed:7")):
            r = await c.post(VOICES, json={"name": name, "model": "chattts", "voice": spec})
            assert r.status_code == 201, r.text
            body = {
                "model": "chattts",
                "input": "hello world",
                "seed": 4,
                "max_new_tokens": 12,
                "response_format": "pcm",
                "stream": False,
            }
            direct = await c.post(SPEECH, json={**body, "voice": spec})
            saved = await c.post(SPEECH, json={**body, "voice": name})
            assert direct.status_code == 200 and saved.status_code == 200, saved.text
            assert saved.content == direct.content and len(direct.content) > 0
        r = await c.post(VOICES, json={"name": "bad", "model": "chattts", "voice": "garbage"})
        _error(r, 400, "invalid_voice", "voice")
        r = await c.post(VOICES, json={"name": "alloy", "model": "chattts", "voice": "seed:1"})
        _error(r, 409, "builtin_voice", "name")
        listed = (await c.get(VOICES + "?model=chattts")).json()["data"]
        assert [v["name"] for v in listed if not v["builtin"]] == ["seven", "spk"]
        assert {v["voice"] for v in listed if not v["builtin"]} == {speaker, "seed:7"}


OFFICIAL_CHATTTS_FILES = {
    "asset/gpt/config.json",
    "asset/gpt/model.safetensors",
    "asset/Embed.safetensors",
    "asset/Decoder.safetensors",
    "asset/DVAE.safetensors",
    "asset/Vocos.safetensors",
    "asset/tokenizer/tokenizer.json",
    "asset/tokenizer/tokenizer_config.json",
    "asset/tokenizer/special_tokens_map.json",
}


async def test_chattts_official_folder_serves_every_voice_form(
    chattts_root, chattts_card, tmp_path
):
    """A folder holding exactly the published ChatTTS files (no ``asset/spk_stat.pt``): every
    OpenAI voice name, no voice, ``seed:N`` and a speaker string each get audio, each its own
    speaker; no voice is the speaker drawn from the request's seed."""
    from omnistep.core import OPENAI_VOICES
    from tests.chattts_ref import reference

    files = {p.relative_to(chattts_root).as_posix() for p in chattts_root.rglob("*")}
    assert {f for f in files if (chattts_root / f).is_file()} == OFFICIAL_CHATTTS_FILES
    speaker = reference.upstream_random_speaker(chattts_root, 3)
    body = {
        "model": "chattts",
        "input": "hello world",
        "seed": 4,
        "max_new_tokens": 12,
        "response_format": "pcm",
        "stream": False,
    }
    audio = {}
    async with client(tmp_path / "v.db", cards=[chattts_card]) as c:
        for voice in (*OPENAI_VOICES, None, "seed:7", speaker):
            r = await c.post(SPEECH, json=body if voice is None else {**body, "voice": voice})
            assert r.status_code == 200, (voice, r.text)
            assert len(r.content) > 0
            audio[voice] = r.content
        seeded = await c.post(SPEECH, json={**body, "voice": "seed:4"})
        assert seeded.status_code == 200 and seeded.content == audio[None]
    assert len(set(audio.values())) == len(audio)
