"""Qwen3-TTS Base folders served with cloned voices, end to end, on the tiny Base fixture:
greedy codes and audio equal upstream ``generate_voice_clone`` (both ICL layouts: text longer
than the reference frames and shorter), text streamed into a running cloned-voice request equals
the whole text, rollouts of a cloned voice are re-scored, a multipart enrollment over the ASGI
app then ``/v1/audio/speech`` with the saved name, every bad upload's 4xx JSON, a Base request
without a voice, and the engine serving other requests while a voice is enrolled."""

from __future__ import annotations

import asyncio
import io
import threading
from contextlib import asynccontextmanager

import httpx
import numpy as np
import pytest
import soundfile as sf

from omnistep.audio import encode_all
from omnistep.core import (
    ExecutionProfile,
    InvalidRequestError,
    Modality,
    ModelInstance,
    Request,
    SamplingParams,
)
from omnistep.engine import AsyncEngine
from omnistep.models.qwen3_tts.card import Qwen3TTSOptions, build_card
from omnistep.models.qwen3_tts.clone import VoiceCloneEncoder, VoiceClonePrompt
from omnistep.models.qwen3_tts.prompt import build_prompt
from omnistep.models.qwen3_tts.talker import CloneRows
from omnistep.parity import collect
from omnistep.server import ServerConfig, build_app
from tests.qwen3_tts_ref.assets import write_tiny_qwen3_tts_many
from tests.qwen3_tts_ref.env import call_reference
from tests.test_qwen3_tts_clone import chirp

REF = "tests.qwen3_tts_ref.upstream_clone"
TRANSCRIPT = "Hi there."
LONG = "Please leave the package by the blue door, and ring twice."
SHORT = "Hi there."
HOP = 1920
VOICES = "/v1/audio/voices"
SPEECH = "/v1/audio/speech"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_tts_clone_serving")
    infos = write_tiny_qwen3_tts_many({root / v: v for v in ("base", "custom_voice")}, seed=3)
    return {info.variant: info.root for info in infos}


@pytest.fixture(scope="module")
def clip():
    return chirp(24000, 2.0, seed=2)  # 25 reference frames: len(k) = 26


@pytest.fixture(scope="module")
def spec(folders, clip):
    encoder = VoiceCloneEncoder.from_pretrained(folders["base"])
    return encoder(clip, 24000, TRANSCRIPT).to_spec()


def _engine(path, **options) -> AsyncEngine:
    card = build_card(str(path), Qwen3TTSOptions(kv_cache_gb=0.01, **options))
    return AsyncEngine([ModelInstance.load(card)])


async def _run(engine, **fields):
    return await collect(engine, Request("qwen3-tts", profile=ExecutionProfile.ROLLOUT, **fields))


def _codes(collected) -> np.ndarray:
    return np.array([r.tokens for r in collected.trajectories["decode"]])


# ------------------------------------------------------------------ the prompt and parity


def test_icl_layouts(folders, spec):
    """Both streaming layouts of upstream ``generate_icl_prompt`` and the text track."""
    from omnistep.models.qwen3_tts.loader import Qwen3TTSCheckpoint

    config = Qwen3TTSCheckpoint.open(folders["base"]).config
    voice = VoiceClonePrompt.from_spec(spec)
    rows = CloneRows(voice.speaker_embedding, voice.ref_codes)
    ids = config.ids
    ref = [7, 8, 9]
    k = rows.num_frames + 1
    for n, longer in ((k, True), (3, False)):
        text = list(range(100, 100 + n))
        parts = build_prompt(config, [1, 2, 3, *text, 0, 0, 0, 0, 0], clone=rows, ref_ids=ref)
        p = parts.prompt
        assert p.clone is rows and p.codec_ids.count(-3) == rows.num_frames
        assert p.codec_ids[3:8] == (
            ids.codec_nothink,
            ids.codec_think_bos,
            ids.codec_think_eos,
            -2,
            ids.codec_pad,
        )
        assert p.text_ids[:8] == (
            1,
            2,
            3,
            ids.tts_pad,
            ids.tts_pad,
            ids.tts_pad,
            ids.tts_pad,
            ids.tts_bos,
        )
        assert p.codec_ids[8] == ids.codec_bos and len(p.text_ids) == 8 + k
        t = [*ref, *text, ids.tts_eos]
        if longer:
            assert list(p.text_ids[8:]) == t[:k] and parts.trailing == tuple(t[k:])
            assert parts.streams_text and parts.consumed == k - len(ref)
        else:
            assert list(p.text_ids[8:]) == t + [ids.tts_pad] * (k - len(t))
            assert parts.trailing == () and not parts.streams_text
    # a streamed text shorter than the layout needs cannot be built yet
    with pytest.raises(ValueError, match="needs"):
        build_prompt(
            config, [1, 2, 3, 100, 0, 0, 0, 0, 0], clone=rows, ref_ids=ref, text_complete=False
        )
    # the content key holds the voice: same text, another voice -> another key
    other = CloneRows(voice.speaker_embedding + 1, voice.ref_codes)
    a = build_prompt(config, [1, 2, 3, 100, 0, 0, 0, 0, 0], clone=rows, ref_ids=ref).prompt
    b = build_prompt(config, [1, 2, 3, 100, 0, 0, 0, 0, 0], clone=other, ref_ids=ref).prompt
    assert a.text_ids == b.text_ids and a.codec_ids == b.codec_ids and a.key() != b.key()


@pytest.mark.parametrize(("text", "language"), [(LONG, "english"), (SHORT, "auto")])
async def test_greedy_codes_and_audio_equal_upstream_generate_voice_clone(
    folders, spec, text, language
):
    voice = VoiceClonePrompt.from_spec(spec)
    ref = call_reference(
        f"{REF}:generate_clone",
        root=folders["base"],
        text=text,
        ref_code=voice.ref_codes,
        ref_spk_embedding=voice.speaker_embedding,
        ref_text=voice.ref_text,
        language=language.capitalize(),
        max_new_tokens=12,
        non_streaming_mode=False,
    )
    engine = _engine(folders["base"])
    try:
        got = await _run(
            engine,
            text=text,
            voice=spec,
            language=language,
            seed=1,
            sampling=SamplingParams(temperature=0, max_new_tokens=12),
        )
    finally:
        await engine.shutdown()
    n = len(ref["codes"])
    assert n >= 8
    codes = _codes(got)
    np.testing.assert_array_equal(codes[:n], ref["codes"])
    assert ref["cut"] == voice.num_frames * HOP  # upstream cuts exactly the reference's samples
    assert got.audio.shape == (codes.shape[0] * HOP,)
    np.testing.assert_allclose(got.audio[: n * HOP], ref["wav"], atol=1e-4, rtol=0)
    assert np.abs(ref["wav"]).max() > 1e-2
