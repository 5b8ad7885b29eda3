"""Qwen3-Omni's code2wav on the shared codec decoder (layers/codec_decoder.py with
``code_embedding``): parity with transformers' ``Qwen3OmniMoeCode2Wav`` on the tiny
checkpoint's weights, and chunked / streamed decoding equal to the whole decode."""

from __future__ import annotations

import pytest
import torch

from omnistep.layers.codec_decoder import CodecDecoderConfig, DecoderStream
from omnistep.models.qwen3_omni.loader import Qwen3OmniCheckpoint
from omnistep.models.qwen3_omni.tiny import TINY_SIZES

FRAMES = 30
"""Longer than the tiny decoder's left context (24 frames), so chunks cut their windows."""


@pytest.fixture(scope="module")
def decoders(qwen3_omni_folder):
    """(ours, transformers' Qwen3OmniMoeCode2Wav) on the same weights."""
    from transformers import Qwen3OmniMoeForConditionalGeneration

    ours = Qwen3OmniCheckpoint.open(qwen3_omni_folder).load_code2wav()
    ref = Qwen3OmniMoeForConditionalGeneration.from_pretrained(qwen3_omni_folder).code2wav
    return ours, ref.eval()


def _codes(batch: int = 2, frames: int = FRAMES, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, TINY_SIZES.codebook_size, (batch, frames, 16), generator=g)


def test_code2wav_config_geometry():
    """The published code2wav_config: hop 1920, the wave starts 555 samples late (the left
    trims of the transposed convs), 10 conv frames + 8 x 71 transformer frames of context."""
    c = CodecDecoderConfig.from_code2wav(
        {"hidden_size": 1024, "num_hidden_layers": 8, "sliding_window": 72,
         "rope_parameters": {"rope_type": "default", "rope_theta": 10000}}
    )  # fmt: skip
    assert (c.hop_length, c.output_shift) == (1920, 555)
    assert (c.conv_context_frames, c.transformer_context_frames) == (10, 568)
    assert c.latent_dim == 1024 and c.code_embedding
    assert CodecDecoderConfig().output_shift == 0
    with pytest.raises(ValueError, match="rope_scaling"):
        CodecDecoderConfig.from_code2wav({"rope_parameters": {"rope_type": "yarn"}})
    with pytest.raises(ValueError, match="latent_dim"):
        CodecDecoderConfig(code_embedding=True, latent_dim=8, hidden_size=16)


def test_whole_decode_matches_transformers(decoders):
    ours, ref = decoders
    codes = _codes(frames=12)
    with torch.no_grad():
        want = ref(codes.transpose(1, 2))[:, 0]  # [B, T * hop - 555]
    got = ours.decode(codes)
    assert got.shape == want.shape == (2, 12 * 1920 - 555)
    assert want.abs().max() > 0.05 and (want.abs() < 1).float().mean() > 0.99  # not clamped
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_chunked_decode_equals_whole(decoders):
    ours, _ = decoders
    codes = _codes(batch=1, seed=1)
    whole = ours.decode(codes)
    assert ours.left_context_frames == 24
    chunked = ours.chunked_decode(codes, [2, 9])  # windows cut at 11, 20, 29 frames
    assert chunked.shape == whole.shape
    torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=0)
    # too little context is visibly wrong: the check can fail
    assert (ours.chunked_decode(codes, 10, left_context=2) - whole).abs().max() > 1e-3


def test_streamed_decode_equals_whole(decoders):
    """decode_stream: the first chunk of a stream is output_shift samples short; later ones
    are chunk * hop; streams at different points batch together."""
    ours, _ = decoders
    codes = _codes(frames=12, seed=2)
    whole = ours.decode(codes)
    streamed = ours.streamed_decode(codes, [1, 4, 3])
    torch.testing.assert_close(streamed, whole, atol=1e-5, rtol=0)
    # row 0 starts a stream while row 1 continues one: one batch, per-row lengths
    _, (primed,) = ours.decode_stream([codes[1, :5]], [DecoderStream()])
    waves, _ = ours.decode_stream([codes[0, :3], codes[1, 5:8]], [DecoderStream(), primed])
    assert waves[0].shape == (3 * 1920 - 555,) and waves[1].shape == (3 * 1920,)
    torch.testing.assert_close(waves[0], whole[0, : 3 * 1920 - 555], atol=1e-5, rtol=0)
    span = slice(5 * 1920 - 555, 8 * 1920 - 555)
    torch.testing.assert_close(waves[1], whole[1, span], atol=1e-5, rtol=0)
