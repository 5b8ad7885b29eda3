"""The Qwen3-TTS codec decoder: ``codec_from_checkpoint`` loads the speech tokenizer's causal
decoder (``omnistep.layers.codec_decoder``) from a published folder; the serving component
(``CodecDecoderComponent``, ``CodecPrefix``, ``codec_decode_config``) is the runner plane's
``omnistep.runners.codec_vocoder``, shared with Qwen3-Omni's code2wav, re-exported here.

Imports: torch, ``omnistep.layers.codec_decoder``, ``omnistep.runners.codec_vocoder`` and this
family's ``loader``.
"""

from __future__ import annotations

import torch

from omnistep.layers.codec_decoder import (
    CodecDecoder,
    load_codec_decoder,
)
from omnistep.models.qwen3_tts.loader import Qwen3TTSCheckpoint
from omnistep.runners.codec_vocoder import (
    CodecDecoderComponent,
    CodecPrefix,
    codec_decode_config,
)

__all__ = ["CodecDecoderComponent", "CodecPrefix", "codec_decode_config", "codec_from_checkpoint"]


def codec_from_checkpoint(
    checkpoint: Qwen3TTSCheckpoint,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> CodecDecoder:
    """The decoder of an opened published folder (``loader.Qwen3TTSCheckpoint``): its
    ``speech_tokenizer/config.json`` ``decoder_config`` and ``decoder.*`` tensors.

    Raises:
        Qwen3TTSCheckpointError / ModelFilesError: a tensor missing or misshapen (named).
    """
    tensors = checkpoint.speech_tokenizer_tensors(prefix="decoder.")
    source = str(checkpoint.root / "speech_tokenizer" / "model.safetensors")
    decoder = checkpoint.config.speech_tokenizer.decoder
    return load_codec_decoder(tensors, decoder, device, dtype, source)
