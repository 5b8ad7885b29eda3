"""The command line as a newcomer meets it: start-up errors are one line with exit status 2,
the banner comes once the server listens and its curl line works as pasted, ``say`` checks what
it can before synthesising and takes the server's model names, ``bench`` stops after a failed
warm-up, and every option is described with its default (issue 16, item 7).

Commands run as ``python -m omnistep.cli`` in a subprocess where the whole process matters (its
exit status, every line it prints); the rest calls ``main`` in-process with the toy card.
"""

from __future__ import annotations

import contextlib
import io
import os
import queue
import re
import socket
import subprocess
import sys
import threading
import tomllib
from pathlib import Path

import av
import httpx
import pytest
import soundfile as sf

import omnistep
import omnistep.cli
from omnistep.audio import format_for_path
from omnistep.bench.client import WarmupFailedError, run_bench
from omnistep.cli import build_parser, is_loopback, main, output_format
from omnistep.core import (
    OPENAI_TTS_MODELS,
    InvalidRequestError,
    MissingDependencyError,
    OmnistepError,
)
from omnistep.models import registry
from omnistep.server.launcher import free_port
from omnistep.server.lifecycle import bind_socket

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
ENV.pop("OMNISTEP_API_KEY", None)


def omnistep_cmd(
    *args: str, env: dict | None = None, timeout: float = 120
) -> subprocess.CompletedProcess:
    """``omnistep ARGS`` in a subprocess (this checkout first on the path)."""
    return subprocess.run(
        [sys.executable, "-m", "omnistep.cli", *args],
        capture_output=True,
        text=True,
        env=env or ENV,
        timeout=timeout,
        cwd=ROOT,
    )


def assert_one_error_line(proc: subprocess.CompletedProcess, *fragments: str) -> str:
    """Exit status 2, nothing on stdout, and stderr exactly one error line holding
    ``fragments``; returns that line."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(("omnistep: error: ", "omnistep serve: error: ")), lines[0]
    for fragment in fragments:
        assert fragment in lines[0]
    assert "is serving" not in proc.stdout
    return lines[0]


# ------------------------------------------------------------------ start-up errors


def _partial_chattts(tmp: Path) -> str:
    (tmp / "asset" / "gpt").mkdir(parents=True)
    (tmp / "asset" / "gpt" / "config.json").write_text("{}")
    return str(tmp)


def _piper_without_config(tmp: Path) -> str:
    (tmp / "voice.onnx").write_bytes(b"not really onnx")
    return str(tmp / "voice.onnx")


def _piper_folder(tmp: Path) -> str:
    (tmp / "a.onnx").write_bytes(b"x")
    return str(tmp)


@pytest.mark.parametrize(
    ("family", "make_path", "fragments"),
    [
        ("chattts", lambda t: "/nonexistent", ["/nonexistent", "asset/gpt/model.safetensors"]),
        ("chattts", _partial_chattts, ["missing asset/gpt/model.safetensors", "asset/tokenizer"]),
        ("qwen2_5_omni", lambda t: "/nonexistent", ["/nonexistent", "spk_dict.pt"]),
        ("piper", lambda t: "/nonexistent.onnx", ["/nonexistent.onnx", "VOICE.onnx.json"]),
        ("piper", _piper_folder, ["is a folder", "it holds a.onnx"]),
        ("piper", _piper_without_config, ["voice.onnx.json", "beside it"]),
        ("hibari", lambda t: "/nonexistent.onnx", ["/nonexistent.onnx", "hibari .onnx"]),
        ("hibari", _piper_folder, ["is a folder", "hibari .onnx"]),
    ],
    ids=[
        "chattts-missing",
        "chattts-partial",
        "qwen-missing",
        "piper-missing",
        "piper-folder",
        "piper-no-config",
        "hibari-missing",
        "hibari-folder",
    ],
)
def test_missing_weights_are_one_line(tmp_path, family, make_path, fragments):
    spec = f"{family}={make_path(tmp_path)}"
    proc = omnistep_cmd("serve", "--model", spec, "--port", str(free_port()))
    assert_one_error_line(proc, *fragments)


def test_say_with_missing_weights_is_one_line(tmp_path):
    out = tmp_path / "x.wav"
    proc = omnistep_cmd("say", "Hello", "--model", "chattts=/nonexistent", "-o", str(out))
    assert_one_error_line(proc, "/nonexistent", "asset/Vocos.safetensors")
    assert not out.exists()


def test_python_m_omnistep_is_the_command():
    """``python -m omnistep`` runs the CLI, as ``omnistep`` does (a venv not on PATH)."""
    proc = subprocess.run(
        [sys.executable, "-m", "omnistep", "serve", "--help"],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: omnistep serve")
    bad = subprocess.run(
        [sys.executable, "-m", "omnistep", "serve", "--model", "nope"],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
        cwd=ROOT,
    )
    assert_one_error_line(bad, "nope")


def test_a_model_given_twice_is_one_line():
    proc = omnistep_cmd("serve", "--model", "toy", "--model", "toy", "--port", str(free_port()))
    assert_one_error_line(proc, "both answer to the model name 'toy'", "--served-model-name")


def test_a_missing_package_names_the_extra(tmp_path, monkeypatch):
    (tmp_path / "needs_absent_pkg.py").write_text("import omnistep_absent_package\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(registry.FAMILIES, "fake", "needs_absent_pkg")
    monkeypatch.setitem(registry.EXTRAS, "fake", "fakeextra")
    with pytest.raises(MissingDependencyError, match=r"omnistep_absent_package.*\[fakeextra\]"):
        registry.build_card("fake")


def test_check_device(monkeypatch):
    import torch

    from omnistep.core import DeviceUnavailableError
    from omnistep.layers.device import check_device

    assert check_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for device in ("cuda", "cuda:1", "bogus"):
        with pytest.raises(DeviceUnavailableError, match=re.escape(device)):
            check_device(device)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert check_device("cuda:0") == torch.device("cuda:0")
    with pytest.raises(DeviceUnavailableError, match="only 1 CUDA device"):
        check_device("cuda:3")


def test_cuda_without_cuda_is_one_line_for_a_torch_family(tmp_path, capsys, monkeypatch):
    import torch

    from omnistep.models.chattts.tiny import write_tiny_chattts

    root = write_tiny_chattts(tmp_path / "chattts")  # the official files only
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "x.wav"
    argv = ["Hi.", "--model", f"chattts={root}", "--device", "cuda", "-o", str(out)]
    assert _say(*argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("omnistep: error: --device cuda:"), err
    assert not out.exists()


@pytest.mark.parametrize(
    ("flags", "fragment"),
    [
        (["--log-level", "verbose"], "--log-level: invalid choice: 'verbose'"),
        (["--device", "gpu"], "--device: must be cpu, cuda or cuda:N"),
        (["--port", "99999"], "--port: must be a TCP port"),
        (["--kv-cache-gb", "0"], "--kv-cache-gb: must be GiB > 0"),
        (["--first-chunk-chars", "-1"], "--first-chunk-chars: must be >= 0"),
    ],
    ids=["log-level", "device", "port", "kv-cache-gb", "first-chunk-chars"],
)
def test_bad_flags_are_one_line_before_anything_loads(flags, fragment):
    proc = omnistep_cmd("serve", *flags, timeout=60)
    assert_one_error_line(proc, fragment)


def test_a_taken_port_is_one_line_and_no_banner():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = omnistep_cmd("serve", "--model", "toy", "--port", str(port))
    assert_one_error_line(proc, f"127.0.0.1:{port}", "in use", "--port")


def test_a_host_that_cannot_be_bound_is_one_line_without_the_open_host_warning():
    proc = omnistep_cmd("serve", "--model", "toy", "--host", "256.1.1.1", "--port", "0")
    assert_one_error_line(proc, "cannot serve on 256.1.1.1:0", "unknown host")


def test_bind_socket_errors_are_typed():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(OmnistepError, match="in use"):
            bind_socket("127.0.0.1", taken.getsockname()[1])
    with pytest.raises(OmnistepError, match="unknown host"):
        bind_socket("no-such-host.invalid", 0)
    sock = bind_socket("127.0.0.1", 0)  # a free port, bound, not listening: connections refused
    with sock, pytest.raises(ConnectionRefusedError):
        socket.create_connection(sock.getsockname()[:2], timeout=5).close()


# ------------------------------------------------------------------ banner


@contextlib.contextmanager
def _serving(*args: str, env: dict):
    """Start ``omnistep serve --model toy ARGS``; yield (banner lines, process) as soon as the
    banner is complete; stop the server after."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "omnistep.cli", "serve", "--model", "toy", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
    try:
        banner: list[str] = []
        while not (banner and banner[-1].lstrip().startswith("models:")):
            try:
                line = lines.get(timeout=120).rstrip("\n")
            except queue.Empty:
                raise AssertionError(f"no banner; exit status {proc.poll()}") from None
            if banner or "is serving" in line:
                banner.append(line)
        yield banner, proc
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _paste(command: str, env: dict) -> list[str]:
    """The argv a shell with ``env`` makes of ``command`` (quotes, line continuations and
    ``$VARIABLES`` as bash treats them)."""
    out = subprocess.run(
        ["bash", "-c", f"printf '%s\\0' {command}"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    return out.split("\0")[:-1]


def _post_like_curl(argv: list[str]) -> httpx.Response:
    """Send what ``curl URL -H H ... -d BODY -o FILE`` (``argv`` without ``curl``) sends."""
    headers, body, url = {}, None, None
    args = iter(argv)
    for arg in args:
        if arg == "-H":
            name, _, value = next(args).partition(":")
            headers[name.strip()] = value.strip()
        elif arg == "-d":
            body = next(args)
        elif arg == "-o":
            next(args)
        else:
            url = arg
    return httpx.post(url, headers=headers, content=body, timeout=60)


@pytest.mark.parametrize(
    ("host", "key_from", "warnings"),
    [("127.0.0.1", "flag", 0), ("0.0.0.0", "env", 0), ("0.0.0.0", None, 1)],
    ids=["flag-key", "env-key-open-host", "open-host-no-key"],
)
def test_banner_comes_once_listening_and_its_curl_line_works(host, key_from, warnings):
    key = "k3y-" + os.urandom(4).hex()
    env = dict(ENV)
    args = ["--host", host, "--port", "0"]  # port 0: the banner names the real one
    if key_from == "flag":
        args += ["--api-key", key]
    elif key_from == "env":
        env["OMNISTEP_API_KEY"] = key
    with _serving(*args, env=env) as (banner, proc):
        port = int(re.search(r"http://127\.0\.0\.1:(\d+)", banner[0]).group(1))
        assert ("every other interface" in banner[0]) == (host == "0.0.0.0")
        socket.create_connection(("127.0.0.1", port), timeout=5).close()  # already listening
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
        curl = "\n".join(banner[1:3])
        assert curl.lstrip().startswith("curl ")
        # pasted into a shell that has the key only where the server got it from the environment
        shell_env = {k: v for k, v in os.environ.items() if k != "OMNISTEP_API_KEY"}
        if key_from == "env":
            shell_env["OMNISTEP_API_KEY"] = key
            assert key not in "\n".join(banner)  # a key from the environment is not printed
        response = _post_like_curl(_paste(curl.lstrip()[len("curl ") :], shell_env))
        assert response.status_code == 200, (curl, response.text)
        with av.open(io.BytesIO(response.content)) as container:
            assert sum(f.samples for f in container.decode(audio=0)) > 0
    stderr = proc.stderr.read()
    assert stderr.count("without an API key") == warnings, stderr


def test_a_chat_only_server_banner_asks_chat_completions():
    """(A Qwen2.5-Omni server printed a /v1/audio/speech line, which refuses chat cards.)"""
    from types import SimpleNamespace

    from omnistep.core import Capability
    from omnistep.server.chat import ChatCompletionRequest

    chat = frozenset({Capability.CHAT_TEXT, Capability.CHAT_AUDIO})
    card = SimpleNamespace(card_id="qwen2.5-omni", capabilities=chat)
    engine = SimpleNamespace(models={"qwen2.5-omni": SimpleNamespace(card=card)})
    banner = omnistep.cli._usage_banner("127.0.0.1", 8000, engine).splitlines()
    argv = _paste("\n".join(banner[1:3]).lstrip()[len("curl ") :], dict(os.environ))
    assert argv[0] == "http://127.0.0.1:8000/v1/chat/completions" and "-o" not in argv
    request = ChatCompletionRequest.model_validate_json(argv[argv.index("-d") + 1]).to_request()
    assert request.model == "qwen2.5-omni" and request.messages[0].content == "Hello!"


def test_loopback_hosts():
    for host in ("127.0.0.1", "127.1.2.3", "::1", "localhost", "[::1]"):
        assert is_loopback(host), host
    for host in ("0.0.0.0", "::", "192.168.1.5", "example.com"):
        assert not is_loopback(host), host


# ------------------------------------------------------------------ say


def _say(*args: str) -> int:
    return main(["say", "--no-progress", *args])


def test_serve_takes_the_names_the_server_answers_to(monkeypatch):
    """``serve --model tts-1`` serves the embedded voice, as ``say --model tts-1`` does."""
    seen = []

    def fake_load_engine(specs, *args, **kwargs):
        seen.extend(specs)
        raise SystemExit(0)

    monkeypatch.setattr(omnistep.cli, "load_engine", fake_load_engine)
    with pytest.raises(SystemExit):
        main(["serve", "--model", "tts-1", "--model", "toy", "--port", "0"])
    assert seen == ["tts-1", "toy"]  # load_engine resolves them (paths, hub ids, names)
    assert [registry.resolve_model_spec(s) for s in seen] == [registry.DEFAULT_MODEL, "toy"]


def test_say_checks_the_output_path_before_synthesis(tmp_path, capsys, monkeypatch):
    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before the output path was checked")

    monkeypatch.setattr(omnistep.cli, "load_engine", no_loading)
    for out, message in [
        (tmp_path / "no" / "dir" / "x.wav", "no such directory"),
        (tmp_path, "is a directory"),
    ]:
        assert _say("Hello", "--model", "toy", "-o", str(out)) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
    book = tmp_path / "book.txt"
    book.write_text("Hello there.")
    assert _say("--file", str(book), "--model", "toy", "-o", str(tmp_path)) == 2
    assert "is a directory" in capsys.readouterr().err


def test_say_refuses_empty_text_before_loading(tmp_path, capsys, monkeypatch):
    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before the text was checked")

    monkeypatch.setattr(omnistep.cli, "load_engine", no_loading)
    for text in ("", "   ", "..."):
        assert _say(text, "-o", str(tmp_path / "x.wav")) == 2
        err = capsys.readouterr().err
        assert "nothing to speak" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "x.wav").exists()


def test_say_process_with_an_unwritable_path_is_one_line():
    proc = omnistep_cmd("say", "Hello", "--model", "toy", "-o", "/nonexistent/dir/x.wav")
    assert_one_error_line(proc, "no such directory /nonexistent/dir")


@pytest.mark.parametrize("ext", [".ogg", ".OGG", ".opus", ".oga"])
def test_say_writes_ogg_opus_for_ogg_names(tmp_path, ext):
    out = tmp_path / f"hello{ext}"
    assert _say("Hello there.", "--model", "toy", "-o", str(out), "--seed", "1") == 0
    with av.open(str(out)) as container:
        assert container.format.name == "ogg"
        assert container.streams.audio[0].codec_context.name == "opus"
        assert sum(f.samples for f in container.decode(audio=0)) > 0


def test_extensions_map_to_formats():
    expected = {
        "a.mp3": "mp3",
        "a.ogg": "opus",
        "dir.x/a.Opus": "opus",
        "a.aac": "aac",
        "a.flac": "flac",
        "a.WAV": "wav",
        "a.raw": "pcm",
        "a.pcm": "pcm",
        "a.m4a": None,
        "a": None,
    }
    assert {name: format_for_path(name) for name in expected} == expected
    assert output_format("a.m4a", "aac") == "aac"  # --format wins
    assert output_format("noext", None) == "wav"
    with pytest.raises(OmnistepError, match=r"'\.m4a'.*\.ogg"):
        output_format("a.m4a", None)


@pytest.mark.parametrize("name", OPENAI_TTS_MODELS)
def test_say_takes_the_names_the_server_answers_to(tmp_path, name, capsys):
    out = tmp_path / "x.wav"
    assert _say("Hi.", "--model", name, "-o", str(out), "--seed", "3") == 0
    assert sf.info(str(out)).frames > 0
    assert registry.resolve_model_spec(name) == "hibari"  # the default voice


def test_model_names_resolve_through_the_default_card():
    # exactly the ids the default card routes requests by, nothing copied
    default = registry.build_card(registry.DEFAULT_MODEL)
    for model_id in default.model_ids:
        assert registry.resolve_model_spec(model_id) == default.family
    assert registry.resolve_model_spec("chattts=/x") == "chattts=/x"  # a family spec as is
    assert registry.resolve_model_spec("toy") == "toy"
    with pytest.raises(InvalidRequestError, match=r"unknown model 'gpt-9'.*toy.*tts-1"):
        registry.resolve_model_spec("gpt-9")


# ------------------------------------------------------------------ bench


def test_bench_stops_after_a_failed_warmup(tmp_path, capsys):
    out = tmp_path / "r.json"
    dead = f"http://127.0.0.1:{free_port()}"
    argv = ["bench", "--url", dead, "--concurrency", "1,4", "--requests", "4", "--out", str(out)]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("benchmarking ")
    assert len(err) == 2 and err[1].startswith("omnistep: error: the warm-up request"), err
    assert "ConnectError" in err[1] and "is a server running there?" in err[1]
    assert not out.exists() and not out.with_suffix(".png").exists()
    with pytest.raises(WarmupFailedError):
        run_bench(dead, "toy", [1], 2, warmup=1)


# ------------------------------------------------------- help, version, docs/serving.md


def test_version_matches_the_package():
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    proc = omnistep_cmd("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"omnistep {version}"
    assert omnistep.__version__ == version


def _subparsers(parser):
    (action,) = [a for a in parser._actions if a.dest == "command"]
    return action.choices


def test_help_is_plain_whole_sentences():
    parser = build_parser()
    for p in [parser, *_subparsers(parser).values()]:
        text = p.format_help()
        assert "``" not in text and "`" not in text, p.prog
        description = " ".join(text.split("\n\n")[1].split())
        assert description.startswith(f"{p.prog}: ") and description.endswith("."), description
    assert "serve" in parser.description and "say" in parser.description


def _option_entries(help_text: str) -> dict[str, str]:
    """Long option -> its help text (whitespace collapsed) in an argparse help page."""
    entries: dict[str, str] = {}
    current = None
    for line in help_text.split("options:", 1)[1].splitlines():
        match = re.match(r"  (-\w( \S+)?, )?(--[\w-]+)", line)
        if match:
            current = match.group(3)
            entries[current] = line[match.end() :]
        elif current and line.startswith("    "):
            entries[current] += " " + line
    return {k: " ".join(v.split()) for k, v in entries.items()}


def test_every_option_of_every_command_has_help_with_its_default():
    for name, sub in _subparsers(build_parser()).items():
        entries = _option_entries(sub.format_help())
        for action in sub._actions:
            if not action.option_strings or action.dest == "help":
                continue
            flag = [s for s in action.option_strings if s.startswith("--")][0]
            text = entries[flag]
            words = text.split("}", 1)[-1].strip()  # past a {choices} metavar
            assert len(words.split()) >= 3, f"{name} {flag}: no description: {text!r}"
            if action.default not in (None, False):
                assert "default" in text and str(action.default) in text, f"{name} {flag}"


def test_serving_docs_synopsis_lists_every_flag():
    page = (ROOT / "docs" / "serving.md").read_text()
    section = page.split("## `omnistep serve`", 1)[1]
    synopsis = section.split("```", 2)[1]
    listed = set(re.findall(r"--[a-z][\w-]*", synopsis))
    serve = _subparsers(build_parser())["serve"]
    flags = {s for a in serve._actions for s in a.option_strings if s.startswith("--")}
    assert flags - {"--help"} - listed == set()
