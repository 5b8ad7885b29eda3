"""Upstream's 12 Hz speech tokenizer decoder, run inside the reference subprocess
(``tests.qwen3_tts_ref.env.call_reference``); never imported by omnistep's own process.

``decode_with_state`` builds ``Qwen3TTSTokenizerV2Decoder`` (``qwen-tts`` 0.1.1,
``qwen_tts/core/tokenizer_12hz/modeling_qwen3_tts_tokenizer_v2.py``) from a ``decoder_config``
dict, loads the given tensors strictly and decodes as ``Qwen3TTSTokenizerV2Model.decode`` does
(``chunked_decode`` with its chunk of 300 frames and 25 frames of left context, then the
samples of the real frames), or as one ``forward``. ``decode_folder`` loads a whole
``speech_tokenizer/`` folder with ``Qwen3TTSTokenizerV2Model.from_pretrained`` and calls its
``decode``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


def decode_with_state(
    decoder_config: dict,
    state: dict[str, np.ndarray],
    codes: np.ndarray,
    method: str = "decode",
    attn_implementation: str = "sdpa",
) -> np.ndarray:
    """Codes int64 ``[B, T, Q]`` -> float32 wave ``[B, T * 1920]``.

    Args:
        decoder_config: ``Qwen3TTSTokenizerV2DecoderConfig`` fields.
        state: the decoder's tensors by upstream names (``decoder.`` prefix removed), float32.
        method: ``"decode"`` (``Qwen3TTSTokenizerV2Model.decode``'s path: ``chunked_decode``
            300 / 25, every code >= 0 so no sample is cut) or ``"forward"`` (one pass).
        attn_implementation: ``"sdpa"`` or ``"eager"``.
    """
    import torch
    from qwen_tts.core.tokenizer_12hz.configuration_qwen3_tts_tokenizer_v2 import (
        Qwen3TTSTokenizerV2DecoderConfig,
    )
    from qwen_tts.core.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2 import (
        Qwen3TTSTokenizerV2Decoder,
    )

    config = Qwen3TTSTokenizerV2DecoderConfig(**decoder_config)
    config._attn_implementation = attn_implementation
    decoder = Qwen3TTSTokenizerV2Decoder(config).eval()
    decoder.load_state_dict({k: torch.from_numpy(np.asarray(v)) for k, v in state.items()})
    codes_t = torch.from_numpy(np.asarray(codes)).long().transpose(1, 2)  # [B, Q, T]
    with torch.inference_mode():
        if method == "forward":
            wave = decoder(codes_t)
        elif method == "decode":
            wave = decoder.chunked_decode(codes_t)
        else:
            raise ValueError(f"unknown method {method!r}")
    return wave[:, 0].float().numpy()


def decode_folder(path: str | Path, codes: np.ndarray) -> list[np.ndarray]:
    """``Qwen3TTSTokenizerV2Model.from_pretrained(path).decode(codes)``: codes int64
    ``[B, T, Q]`` (-1 pads) -> one float32 wave per row."""
    import torch
    from qwen_tts.core.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2 import (
        Qwen3TTSTokenizerV2Model,
    )

    model = Qwen3TTSTokenizerV2Model.from_pretrained(str(path)).eval()
    with torch.inference_mode():
        out = model.decode(torch.from_numpy(np.asarray(codes)).long(), return_dict=True)
    return [w.float().numpy() for w in out.audio_values]
