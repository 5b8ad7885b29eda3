"""Qwen3-TTS speech tokenizer's encoder: 24 kHz audio -> codes ``[T, 16]`` at 12.5 Hz.

Upstream (``qwen_tts`` 0.1.1): ``Qwen3TTSTokenizer.encode`` (``inference/qwen3_tts_tokenizer.py``)
pads a batch to its longest clip (``EncodecFeatureExtractor``, right padding; one clip is used
as is), then ``Qwen3TTSTokenizerV2Model.encode``
(``core/tokenizer_12hz/modeling_qwen3_tts_tokenizer_v2.py``) runs transformers' ``MimiModel``
encoder (``Qwen3TTSTokenizerV2Encoder`` subclasses it and drops the decoder half) with the
config's ``num_quantizers`` (32) codebooks, keeps the first ``encoder_valid_num_quantizers``
(16: the semantic codebook, then 15 acoustic ones) and the first ``ceil(samples / 1920)``
frames of each clip.

Attention window: the Mimi config says ``sliding_window`` 250 (10 s at the transformer's 25 Hz),
but transformers 4.57's Mimi (upstream's) applies it only under flash-attention 2; its default
sdpa and eager paths build a plain causal mask, and ``qwen-tts`` loads the speech tokenizer with
the default (``Qwen3TTSForConditionalGeneration.from_pretrained`` pops ``attn_implementation``
before loading it). Upstream's codes of a clip longer than 10 s are therefore those of full
causal attention, and so are ours by default (``sliding_window=None``); transformers 5.x
applies the window on every path, so it is widened past any clip here.

Here the model IS transformers' ``MimiModel`` (5.x), built from ``speech_tokenizer/config.json``'s
``encoder_config`` with its decoder half dropped (``decoder_config = None``); this module only
maps the checkpoint names (upstream's transformers 4.57 flat Mimi layout under ``encoder.``) to
the 5.x layout, and applies upstream's codebook and length rules. Asking Mimi for 16 codebooks
directly gives upstream's first 16 of 32: both residual quantizers are sequential (codebook k
depends on codebooks < k only), and the split quantizer's semantic (first) and acoustic (rest)
parts each see the same latents.

Imports: torch, transformers (MimiConfig, MimiModel).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

TENSOR_PREFIX = "encoder."
"""Name prefix of the encoder's tensors in ``speech_tokenizer/model.safetensors``."""

FULL_CAUSAL_WINDOW = 1 << 30
"""A window wider than any clip: transformers 5.x's Mimi mask is then plain causal."""

_RENAMES: tuple[tuple[str, str], ...] = (
    ("encoder.encoder.", "encoder.encoder_seanet."),
    ("encoder.encoder_transformer.", "encoder.encoder_transformer."),
    ("encoder.downsample.", "encoder.downsample."),
    ("encoder.quantizer.", "quantizer."),
)
"""Checkpoint name prefix (``encoder.`` + transformers 4.57's flat Mimi names) -> transformers
5.x ``MimiModel`` name prefix (its ``encoder`` half is ``MimiEncoderModel``)."""


def mimi_state_dict(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The ``encoder.*`` tensors of ``speech_tokenizer/model.safetensors`` renamed for a
    transformers 5.x ``MimiModel`` without decoder (other names are ignored).

    Raises:
        KeyError: an ``encoder.*`` name outside the known Mimi parts.
    """
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if not name.startswith(TENSOR_PREFIX):
            continue
        for old, new in _RENAMES:
            if name.startswith(old):
                out[new + name[len(old) :]] = tensor
                break
        else:
            raise KeyError(f"unknown speech tokenizer encoder tensor {name}")
    return out


def _official_name(name: str) -> str:
    """A transformers 5.x ``MimiModel`` name -> its checkpoint name (``_RENAMES`` backwards)."""
    for old, new in _RENAMES:
        if name.startswith(new):
            return old + name[len(new) :]
    return name


class SpeechTokenizerEncoder(nn.Module):
    """The 12 Hz speech tokenizer's encoder half: Mimi SEANet encoder -> sliding-window
    transformer -> downsample -> split RVQ, first ``num_quantizers`` codebooks.

    Args:
        mimi_config: ``speech_tokenizer/config.json``'s ``encoder_config`` (a ``MimiConfig``
            dict, as published).
        num_quantizers: ``encoder_valid_num_quantizers`` (16).
        downsample_rate: ``encode_downsample_rate``: input samples per code frame (1920).
        sample_rate: ``input_sample_rate`` (24000).
        sliding_window: the encoder transformer's attention window in 25 Hz frames; None (the
            default): full causal attention, as upstream runs it (see the module docstring).

    Raises:
        ValueError: ``num_quantizers`` outside ``[num_semantic_quantizers, num_quantizers]`` of
            the Mimi config, or a frame size other than ``downsample_rate``.
    """

    def __init__(
        self,
        mimi_config: Mapping[str, Any],
        num_quantizers: int,
        downsample_rate: int,
        sample_rate: int,
        sliding_window: int | None = None,
    ):
        super().__init__()
        from transformers import MimiConfig, MimiModel

        config = MimiConfig(**dict(mimi_config))
        config.decoder_config = None  # the encoder half and the quantizer only
        config.sliding_window = FULL_CAUSAL_WINDOW if sliding_window is None else sliding_window
        if not config.num_semantic_quantizers <= num_quantizers <= config.num_quantizers:
            raise ValueError(
                f"encoder_valid_num_quantizers {num_quantizers} is outside "
                f"[{config.num_semantic_quantizers}, {config.num_quantizers}]"
            )
        if config.frame_size != downsample_rate:
            raise ValueError(
                f"encode_downsample_rate {downsample_rate} differs from the Mimi encoder's "
                f"frame size {config.frame_size}"
            )
        self.mimi = MimiModel(config)
        self.num_quantizers = num_quantizers
        self.downsample_rate = downsample_rate
        self.sample_rate = sample_rate

    @classmethod
    def from_tensors(
        cls,
        mimi_config: Mapping[str, Any],
        tensors: Mapping[str, torch.Tensor],
        num_quantizers: int,
        downsample_rate: int,
        sample_rate: int,
        device: str | torch.device = "cpu",
        sliding_window: int | None = None,
    ) -> SpeechTokenizerEncoder:
        """Build and load the ``encoder.*`` tensors of ``speech_tokenizer/model.safetensors``
        (official names; ``decoder.*`` ignored). Runs in float32 (the published dtype).

        Raises:
            ValueError: a tensor is missing or misshapen (named as in the checkpoint).
            KeyError: an unknown ``encoder.*`` tensor.
        """
        model = cls(mimi_config, num_quantizers, downsample_rate, sample_rate, sliding_window)
        state = mimi_state_dict(tensors)
        for name, want in model.mimi.state_dict().items():
            if name not in state:
                raise ValueError(f"tensor {_official_name(name)} is missing")
            if tuple(state[name].shape) != tuple(want.shape):
                raise ValueError(
                    f"tensor {_official_name(name)} has shape {list(state[name].shape)}, "
                    f"expected {list(want.shape)}"
                )
        model.mimi.load_state_dict(state, strict=True)
        return model.to(device=device, dtype=torch.float32).eval()

    def num_frames(self, num_samples: int) -> int:
        """Code frames of a clip of ``num_samples``: ``ceil(num_samples / downsample_rate)``."""
        return -(-num_samples // self.downsample_rate)

    @torch.inference_mode()
    def encode(self, audio: torch.Tensor | np.ndarray) -> torch.Tensor:
        """``Qwen3TTSTokenizer.encode`` of one clip: mono ``audio`` float ``[N]`` at
        ``sample_rate`` -> int64 ``[ceil(N / downsample_rate), num_quantizers]`` (frames first;
        codebook 0 is the semantic one), on the CPU.

        Raises:
            ValueError: ``audio`` is not one-dimensional or empty.
        """
        param = next(self.mimi.parameters())
        x = torch.as_tensor(audio, dtype=torch.float32).to(param.device)
        if x.ndim != 1 or x.shape[0] == 0:
            raise ValueError(f"audio must be non-empty [N] mono, got shape {tuple(x.shape)}")
        out = self.mimi.encode(x.view(1, 1, -1), num_quantizers=self.num_quantizers)
        codes = out.audio_codes[0, :, : self.num_frames(x.shape[0])]  # [Q, T]
        return codes.transpose(0, 1).to(device="cpu", dtype=torch.int64).contiguous()
