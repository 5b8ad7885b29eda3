"""Regressions found by probing issue 25's work as a new user would (p0-probe).

- Ctrl-C while the models load: the shutdown cancels the task awaiting the load, which cancels
  the future the loader thread would settle; ``LoadingApp.loading`` must still say the thread
  runs, so that ``cmd_serve`` leaves with ``os._exit`` instead of an interpreter shutdown that
  aborts inside torch ("terminate called without an active exception", SIGABRT).
"""

from __future__ import annotations

import asyncio
import threading

from omnistep.core import ModelInstance
from omnistep.engine import AsyncEngine
from omnistep.models.toy.card import build_card
from omnistep.server import ServerConfig, build_app
from omnistep.server.lifecycle import Drain
from omnistep.server.loading import LoadingApp
from tests.test_lifecycle import Lifespan, _wait_for


async def test_loading_stays_true_when_the_server_stops_during_the_load():
    release = threading.Event()
    returned = threading.Event()

    def load(progress) -> AsyncEngine:
        progress("loading toy: lm (1/2)")
        assert release.wait(10)
        try:
            return AsyncEngine([ModelInstance.load(build_card())])
        finally:
            returned.set()

    drain = Drain()
    app = LoadingApp(load, lambda e: build_app(e, ServerConfig(), drain), drain, "toy")
    lifespan = Lifespan(app)
    await lifespan.start()
    await _wait_for(lambda: app.status.endswith("(1/2)"))
    assert app.loading
    await lifespan.stop()  # what Ctrl-C does: uvicorn's lifespan shutdown while loading
    await asyncio.sleep(0.05)
    assert app.loading, "the loader thread still runs: the process must not shut down normally"
    release.set()
    assert await asyncio.to_thread(returned.wait, 10)
    await _wait_for(lambda: not app.loading)
    assert app.app is None and app.error is None


def _body_fields() -> list[tuple[type, str]]:
    from omnistep.server.protocol import SpeechRequest
    from omnistep.server.rollouts import RolloutBody

    return [(m, f) for m in (SpeechRequest, RolloutBody) for f in m.model_fields]


def test_every_request_field_is_named_in_its_validation_message():
    """A bad value of any body field (vllm-omni's ref_audio, task_type, language, ...) is
    reported as "Invalid value for 'FIELD'", not "Invalid value for 'body'"."""
    from fastapi.exceptions import RequestValidationError

    from omnistep.server.errors import validation_message

    for model, field in _body_fields():
        errors = [{"type": "string_too_short", "loc": ("body", field), "msg": "too short"}]
        message, param = validation_message(RequestValidationError(errors), "application/json")
        assert (message, param) == (f"Invalid value for '{field}': too short", field), model


def test_a_mistyped_model_path_says_it_does_not_exist(tmp_path):
    """``--model /wrong/path`` (or ``./x``, ``~/x``) names the missing path instead of calling
    it an unknown model name."""
    import pytest

    from omnistep.core import InvalidRequestError
    from omnistep.models.registry import resolve_model_spec

    for name in (str(tmp_path / "nothere"), "./nothere-p0", "~/nothere-p0", "a/b/c"):
        with pytest.raises(InvalidRequestError, match="no such file or folder") as info:
            resolve_model_spec(name)
        assert info.value.param == "model" and name.lstrip("~./") in str(info.value)
    with pytest.raises(InvalidRequestError, match="unknown model 'nothere'"):
        resolve_model_spec("nothere")  # a bare word is still read as a model name


def test_say_with_a_chat_model_says_it_is_one(tmp_path, monkeypatch, capsys):
    """``omnistep say --model QWEN2.5-OMNI-FOLDER`` said "messages are required"; now it says
    the model is a chat model that say cannot read text with (TEXT and --file alike), and
    writes nothing."""
    from omnistep import cli
    from omnistep.models.toy.null import build_null_card

    def load(specs, *args, **kwargs):
        return AsyncEngine([ModelInstance.load(build_null_card())])

    monkeypatch.setattr(cli, "resolve_model_spec", lambda name: "null")
    monkeypatch.setattr(cli, "load_engine", load)
    book = tmp_path / "book.txt"
    book.write_text("One sentence. Another one.")
    for args in (["Hello there."], ["--file", str(book), "--no-progress"]):
        out = tmp_path / "x.wav"
        assert cli.main(["say", *args, "-o", str(out)]) == 2
        err = capsys.readouterr().err
        assert "omnistep: error: model 'null' cannot read text aloud" in err, err
        assert "chat model" in err and "/v1/chat/completions" in err, err
        assert not out.exists() and not list(tmp_path.glob("x.wav*"))


def test_an_interrupted_weights_write_leaves_no_half_folder(tmp_path, monkeypatch):
    """Ctrl-C (or an error) during ``omnistep weights`` left a folder without its weights, which
    the next run refused as "not empty"; the folder appears only once it is complete."""
    import importlib

    import pytest

    from omnistep.models import registry

    writer = importlib.import_module(registry.WEIGHT_WRITERS["chattts"])

    def interrupted(path, variant, seed):
        (path / "asset").mkdir(parents=True)
        (path / "asset" / "half.json").write_text("{}")
        raise KeyboardInterrupt

    def complete(path, variant, seed):
        path.mkdir(parents=True, exist_ok=True)
        (path / "done.json").write_text("{}")
        return path

    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setattr(writer, "write_folder", interrupted)
    for target in (tmp_path / "new", empty, tmp_path / "a" / "b"):
        with pytest.raises(KeyboardInterrupt):
            registry.write_weights("chattts", target)
        assert not target.exists() or not any(target.iterdir()), target
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "empty"]
    assert list((tmp_path / "a").iterdir()) == []
    monkeypatch.setattr(writer, "write_folder", complete)
    for target in (tmp_path / "new", empty):
        assert registry.write_weights("chattts", target) == target
        assert [p.name for p in target.iterdir()] == ["done.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "empty", "new"]


async def test_a_ref_audio_path_that_is_a_folder_is_named_as_one(tmp_path):
    """A folder (or a FIFO) under --allowed-local-media-path was reported as a file that
    "does not exist"; it now says it is no regular file. A missing one still does not exist."""
    import os

    import pytest

    from omnistep.core import InvalidRequestError
    from omnistep.server.voice_fields import MediaPolicy, read_ref_audio

    (tmp_path / "sub").mkdir()
    os.mkfifo(tmp_path / "pipe.wav")
    policy = MediaPolicy(allowed_local_media_path=tmp_path)
    for name in ("sub", "pipe.wav"):
        with pytest.raises(InvalidRequestError, match="is not a regular file") as info:
            await read_ref_audio(str(tmp_path / name), policy)
        assert info.value.param == "ref_audio" and info.value.code == "invalid_value"
    with pytest.raises(InvalidRequestError, match="does not exist") as info:
        await read_ref_audio(str(tmp_path / "gone.wav"), policy)
    assert info.value.code == "file_not_found"
