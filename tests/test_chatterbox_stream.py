"""Chatterbox's streamed form (``ChatterboxOptions.flow_chunk_tokens`` > 0) on a tiny random
folder: S3Gen's flow solves growing windows as T3's tokens arrive (each re-solving every frame,
the look-ahead tokens' rows cut, the frames already streamed kept) and HiFT decodes each chunk
with ``hift_context`` frames of context. Neither is chunk-exact (S3Gen's encoder and estimator
attend over the whole utterance; HiFT's generator convs see past the context): the join
errors against one window / one decode over the whole utterance (same noise) are measured
here and bounded. Served: streamed == whole bytes, C1, and the first audio chunk arrives while
T3 is still decoding."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from omnistep.core import Modality, ModelInstance, Request, SamplingParams, WorkUnitKind
from omnistep.engine import AsyncEngine, EngineConfig
from omnistep.engine.collect import collect
from omnistep.loops import AudioChunkInput
from omnistep.loops.denoise import DenoiseInput, Window
from omnistep.models.chatterbox import tiny
from omnistep.models.chatterbox.card import (
    ChatterboxOptions,
    _vocode_config,
    build_card,
    flow_windows,
)
from omnistep.models.chatterbox.loader import load_hift, load_s3gen, load_voice
from omnistep.models.chatterbox.stages import FlowDenoiser, FlowStart, HiFTVocoder

FIRST = 5
"""Tokens of the first streamed flow chunk in these tests (10 mel frames)."""


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny.write_folder(tmp_path_factory.mktemp("chatterbox-stream"))


def test_flow_windows_and_hift_chunks_line_up():
    nw = flow_windows(FIRST)
    assert nw(0, 15, False) is None  # 10 frames + 6 of look-ahead not there yet
    assert nw(0, 16, False) == Window(0, 0, 10, 16)
    assert nw(10, 25, False) is None and nw(10, 26, False) == Window(0, 10, 20, 26)
    assert nw(20, 46, False) == Window(0, 20, 40, 46)
    assert nw(20, 45, True) == Window(0, 20, 45, 45)  # the last window: no look-ahead
    assert nw(45, 45, True) is None
    cfg = _vocode_config(FIRST, 4)
    ends = np.cumsum([cfg.chunk_size(k) for k in range(4)])
    assert ends.tolist() == [6, 16, 36, 76]  # each flow chunk's end (10 * 2^k) less 4
    assert cfg.lookahead == 4 and cfg.left_context >= 1 << 30
    with pytest.raises(ValueError, match="hift_context"):
        ChatterboxOptions(flow_chunk_tokens=4, hift_context=8)


def _solve(denoiser: FlowDenoiser, start: FlowStart) -> list[torch.Tensor]:
    out = denoiser.execute(WorkUnitKind.DENOISE_STEP, [DenoiseInput(start=start)])[0]
    while not out.done:
        out = denoiser.execute(WorkUnitKind.DENOISE_STEP, [DenoiseInput(state=out.state)])[0]
    return out.result


def _streamed_mel(denoiser, voice, tokens, seed) -> torch.Tensor:
    """The frames the streamed schedule keeps, window by window (``DenoiseLoop``'s order)."""
    nw, frames, emitted = flow_windows(FIRST), [], 0
    while (w := nw(emitted, 2 * len(tokens), True)) is not None:
        part = None if w.out_end == w.end else w.out_end
        start = FlowStart(tokens[: w.end // 2], voice, seed, 0.0, part)
        frames += _solve(denoiser, start)[w.out_start : w.out_end]
        emitted = w.out_end
    return torch.stack(frames)


def test_streamed_flow_join_error(folder):
    """The streamed flow's mel against one window over every token, same frame-major noise:
    as many frames, the first chunk's frames within 0.25 of the whole's (max |diff| over mel
    values of std ~1), the error measured (printed) for the report."""
    denoiser = FlowDenoiser(load_s3gen(folder), streamed=True)
    voice = load_voice(folder)
    tokens = torch.randint(0, 6561, (40,), generator=torch.Generator().manual_seed(0))
    whole = torch.stack(_solve(denoiser, FlowStart(tokens, voice, 7)))
    streamed = _streamed_mel(denoiser, voice, tokens, 7)
    assert streamed.shape == whole.shape == (80, 80)
    diff = (streamed - whole).abs()
    per_chunk = [float(diff[a:b].max()) for a, b in ((0, 10), (10, 20), (20, 40), (40, 80))]
    print(f"flow join error per chunk {per_chunk}, whole std {float(whole.std()):.3f}")
    assert max(per_chunk) < 0.25 * float(whole.std()) + 0.25
    assert float(diff.max()) > 0  # not chunk-exact: full attention over the utterance
    again = _streamed_mel(denoiser, voice, tokens, 7)
    torch.testing.assert_close(again, streamed, rtol=0, atol=0)


def _hift_chunks(vocoder: HiFTVocoder, mel: torch.Tensor, context: int) -> np.ndarray:
    """The streamed units' samples, in the streamed card's HiFT schedule for 20-token flow
    chunks (chunks end at 40 x 2^k - context frames)."""
    cfg, out, decoded, k = _vocode_config(20, context), [], 0, 0
    frames = tuple(mel)
    while decoded < len(frames):
        end = min(decoded + cfg.chunk_size(k), len(frames))
        window = frames[: min(end + context, len(frames))]
        unit = AudioChunkInput(window, decoded, end - decoded, 11, None, 0)
        out.append(vocoder.execute(WorkUnitKind.AUDIO_CHUNK, [unit])[0])
        decoded, k = end, k + 1
    return np.concatenate(out)


@pytest.mark.parametrize("context,bound", [(4, 5e-3), (8, 5e-4), (16, 1e-6)])
def test_hift_chunks_against_the_whole_decode(folder, context, bound):
    """HiFT's streamed chunks against one unit over the whole mel (same noise, phase in
    float64): within ``bound`` per context size (the measured error printed)."""
    hift = load_hift(folder)
    g = torch.Generator().manual_seed(3)
    mel = torch.randn(120, 80, generator=g) - 4  # [frames, 80] around log-mel levels
    vocoder = HiFTVocoder(hift, context)
    whole = vocoder.execute(
        WorkUnitKind.AUDIO_CHUNK, [AudioChunkInput(tuple(mel), 0, 120, 11, None, 0)]
    )[0]
    streamed = _hift_chunks(vocoder, mel, context)
    assert streamed.shape == whole.shape == (120 * 480,) and np.abs(whole).max() > 1e-3
    err = float(np.abs(streamed - whole).max())
    print(f"HiFT join error with {context} frames of context: {err:.2e}")
    assert err <= bound


def _engine(folder, **config) -> tuple[AsyncEngine, ModelInstance]:
    opts = ChatterboxOptions(kv_cache_gb=0.01, flow_chunk_tokens=FIRST, hift_context=4)
    instance = ModelInstance.load(build_card(str(folder), opts))
    return AsyncEngine([instance], EngineConfig(**config)), instance


def _request(seed: int, tokens: int = 60) -> Request:
    sampling = SamplingParams(max_new_tokens=tokens, min_new_tokens=tokens)
    return Request("chatterbox", text="a long sentence to speak", seed=seed, sampling=sampling)


async def test_first_audio_arrives_while_t3_decodes(folder):
    """On a 60-token request the first audio chunk is out before T3 has taken its 60th
    step; the streamed chunks concatenate to the collected (non-streamed) audio, and the
    same seed gives the same samples (C1). One worker, so the count of T3 steps does not
    depend on how fast this machine runs the tiny T3 against the flow and HiFT (with two,
    T3 here outruns them in wall time: its steps are the cheapest units)."""
    engine, instance = _engine(folder, num_workers=1)
    steps: list[int] = []
    try:
        t3 = instance.components["t3"]
        run = t3.execute

        def counting(kind, payloads):
            if kind is WorkUnitKind.AR_TOKEN:
                steps.append(len(payloads))
            return run(kind, payloads)

        t3.execute = counting
        chunks, at_first = [], None
        async for chunk in engine.generate(_request(5)):
            if chunk.modality is Modality.AUDIO and chunk.audio.size:
                if at_first is None:
                    at_first = len(steps)
                chunks.append(chunk.audio)
        whole = await collect(engine, _request(5))
        other = await collect(engine, _request(6))
    finally:
        await engine.shutdown()
    assert at_first is not None and at_first < 60 - 10, (at_first, len(steps))
    assert len(chunks) >= 3
    streamed = np.concatenate(chunks)
    np.testing.assert_array_equal(streamed, whole.audio)  # C1, streamed == whole
    # T3's ids >= 6561 (the tiny T3 samples some) are dropped: 2 frames of 480 per S3 token
    assert whole.audio.size % 960 == 0 and whole.audio.size >= 30 * 960
    assert not np.array_equal(other.audio, whole.audio)


async def test_batched_streamed_requests_equal_each_alone(folder):
    engine, _ = _engine(folder)
    try:
        alone = [await collect(engine, _request(s, 30)) for s in (5, 6)]
        together = await asyncio.gather(*(collect(engine, _request(s, 30)) for s in (5, 6)))
    finally:
        await engine.shutdown()
    for a, b in zip(alone, together, strict=True):
        np.testing.assert_allclose(a.audio, b.audio, atol=1e-5, rtol=0)
