"""A whole-text request equals upstream's public call with its defaults, on held-out tiny
folders written by the reference's own classes (``upstream_heldout.write_heldout``:
``save_pretrained`` of the upstream modules, float32, other sizes than the fixtures; seed 0 as
the fixtures): CustomVoice (``generate_custom_voice``, non-streaming layout by default),
VoiceDesign (``generate_voice_design``, non-streaming) and a Base cloned voice
(``generate_voice_clone``, streaming-text layout by default), greedy (``do_sample=False``,
``subtalker_dosample=False``) with the same ``max_new_tokens``: codes equal, frame counts equal
(upstream gives ``max_new_tokens - 1`` frames unless EOS comes first), audio within
``AUDIO_TOL``."""

from __future__ import annotations

import dataclasses

import httpx
import numpy as np
import pytest

from omnistep.core import ExecutionProfile, ModelInstance, Request, SamplingParams
from omnistep.engine import AsyncEngine
from omnistep.models.qwen3_tts import tiny as assets
from omnistep.models.qwen3_tts.card import Qwen3TTSOptions, build_card
from omnistep.models.qwen3_tts.clone import VoiceCloneEncoder, VoiceClonePrompt
from omnistep.models.qwen3_tts.loader import LAYOUT
from omnistep.parity import collect
from omnistep.server import ServerConfig, build_app
from tests.qwen3_tts_ref.env import call_reference
from tests.test_qwen3_tts_clone import chirp

HOP = 1920
MAX_NEW_TOKENS = 16
AUDIO_TOL = 5e-5
"""Max abs sample difference allowed (float32 both sides; measured 3.2e-6 .. 4.7e-6, against
1.8 .. 1.9 in the other layout)."""
SEED = 0
TEXT = "Please leave the package by the blue door."
TRANSCRIPT = "Hi there."

HELDOUT_SIZES = dataclasses.replace(
    assets.TINY_SIZES,
    hidden=40,
    intermediate=80,
    layers=3,
    heads=2,
    kv_heads=1,
    head_dim=24,
    mrope_section=(6, 3, 3),
    text_hidden=36,
    cp_hidden_1b7=32,
    cp_intermediate=48,
    cp_layers=1,
    cp_heads=2,
    cp_kv_heads=1,
    cp_head_dim=16,
    dec_layers=1,
)
"""Other widths and depths than the fixtures' ``TINY_SIZES`` (talker, code predictor, codec)."""

VARIANTS = {"custom_voice": "1b7", "voice_design": "1b7", "base": "0b6"}


def write_heldout(root, variant: str, model_size: str) -> list[str]:
    """A held-out folder of ``variant`` under ``root``, written by upstream's classes."""
    tok_dir = root.parent / f"{root.name}-tokenizer"
    tok_dir.mkdir(parents=True)
    files, ids = assets.tokenizer_files()
    for name, text in files.items():
        (tok_dir / name).write_text(text, encoding="utf-8")
    preprocessor = {
        k: v for k, v in assets.SPEECH_PREPROCESSOR_CONFIG.items() if k != "feature_extractor_type"
    }
    return call_reference(
        "tests.qwen3_tts_ref.upstream_heldout:write_heldout",
        root=root,
        config=assets.config_dict(HELDOUT_SIZES, ids, variant, model_size),
        codec_config=assets.speech_tokenizer_config_dict(HELDOUT_SIZES),
        generation=assets.GENERATION_CONFIG,
        tokenizer_dir=tok_dir,
        speech_preprocessor=preprocessor,
        configuration=assets.CONFIGURATION,
        preprocessor=assets.PREPROCESSOR_CONFIG,
        seed=SEED,
    )


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    base = tmp_path_factory.mktemp("qwen3_tts_heldout")
    out = {}
    for variant, size in VARIANTS.items():
        files = write_heldout(base / variant, variant, size)
        assert set(LAYOUT) <= set(files), sorted(set(LAYOUT) - set(files))
        out[variant] = base / variant
    return out


@pytest.fixture(scope="module")
def spec(folders):
    encoder = VoiceCloneEncoder.from_pretrained(folders["base"])
    return encoder(chirp(24000, 1.0, seed=4), 24000, TRANSCRIPT).to_spec()


async def _whole_text(root, **fields):
    """A whole-text request as ``/v1/audio/speech`` makes it (no layout chosen), greedy."""
    card = build_card(str(root), Qwen3TTSOptions(kv_cache_gb=0.01))
    engine = AsyncEngine([ModelInstance.load(card)])
    request = Request(
        "qwen3-tts",
        text=TEXT,
        seed=1,
        profile=ExecutionProfile.ROLLOUT,  # records the codes; changes nothing else
        sampling=SamplingParams(temperature=0, max_new_tokens=MAX_NEW_TOKENS),
        **fields,
    )
    try:
        got = await collect(engine, request)
    finally:
        await engine.shutdown()
    return np.array([r.tokens for r in got.trajectories["decode"]]), got.audio


def _check(codes, audio, ref) -> None:
    n = len(ref["codes"])
    assert n >= 8  # random weights: EOS rarely comes early; the cap is what is compared
    assert codes.shape == ref["codes"].shape == (n, 16)
    np.testing.assert_array_equal(codes, ref["codes"])
    assert audio.shape == ref["wav"].shape == (n * HOP,)
    np.testing.assert_allclose(audio, ref["wav"], atol=AUDIO_TOL, rtol=0)
    assert np.abs(ref["wav"]).max() > 1e-2


@pytest.mark.parametrize(
    ("variant", "fields", "upstream"),
    [
        ("custom_voice", {"voice": "ryan", "language": "English"}, {"speaker": "Ryan"}),
        ("custom_voice", {"voice": "eric"}, {"speaker": "eric"}),  # "Auto": eric's dialect
        ("voice_design", {"instructions": "a calm low voice"}, {"instruct": "a calm low voice"}),
    ],
    ids=["custom_voice", "custom_voice-auto-dialect", "voice_design"],
)
async def test_whole_text_equals_the_public_call_with_its_defaults(
    folders, variant, fields, upstream
):
    language = fields.get("language")
    ref = call_reference(
        "tests.qwen3_tts_ref.upstream:generate",
        root=folders[variant],
        text=TEXT,
        max_new_tokens=MAX_NEW_TOKENS,
        seed=SEED,
        **({"language": language} if language else {"language": None}),
        **upstream,
    )
    codes, audio = await _whole_text(folders[variant], **fields)
    _check(codes, audio, ref)
    assert len(ref["codes"]) == MAX_NEW_TOKENS - 1  # no EOS within the cap: upstream's count


async def test_cloned_voice_whole_text_equals_generate_voice_clone(folders, spec):
    voice = VoiceClonePrompt.from_spec(spec)
    ref = call_reference(
        "tests.qwen3_tts_ref.upstream_clone:generate_clone",
        root=folders["base"],
        text=TEXT,
        ref_code=voice.ref_codes,
        ref_spk_embedding=voice.speaker_embedding,
        ref_text=voice.ref_text,
        language=None,
        max_new_tokens=MAX_NEW_TOKENS,
    )
    codes, audio = await _whole_text(folders["base"], voice=spec)
    _check(codes, audio, ref)


async def test_speech_api_equals_generate_custom_voice(folders):
    """The reported path: ``POST /v1/audio/speech`` with ``temperature: 0`` against
    ``generate_custom_voice(text, language="English", speaker="Ryan", do_sample=False,
    subtalker_dosample=False, max_new_tokens=16)``: as many samples, equal within the 16-bit
    PCM step."""
    ref = call_reference(
        "tests.qwen3_tts_ref.upstream:generate",
        root=folders["custom_voice"],
        text=TEXT,
        speaker="Ryan",
        language="English",
        max_new_tokens=MAX_NEW_TOKENS,
        seed=SEED,
    )
    card = build_card(str(folders["custom_voice"]), Qwen3TTSOptions(kv_cache_gb=0.01))
    engine = AsyncEngine([ModelInstance.load(card)])
    body = {
        "model": "qwen3-tts",
        "input": TEXT,
        "voice": "ryan",
        "language": "English",
        "temperature": 0,
        "max_new_tokens": MAX_NEW_TOKENS,
        "response_format": "pcm",
    }
    try:
        transport = httpx.ASGITransport(app=build_app(engine, ServerConfig()))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            r = await c.post("/v1/audio/speech", json=body)
    finally:
        await engine.shutdown()
    assert r.status_code == 200, r.text
    pcm = np.frombuffer(r.content, dtype="<i2").astype(np.float32) / 32768
    assert pcm.shape == ref["wav"].shape == ((MAX_NEW_TOKENS - 1) * HOP,)
    np.testing.assert_allclose(pcm, ref["wav"], atol=2 / 32768 + AUDIO_TOL, rtol=0)
