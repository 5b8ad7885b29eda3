"""Qwen3-Omni's media encoders from a request's ``MediaItem``s to thinker-width rows: the
reference feature extraction (the shared ``runners.media_features.MediaFeatures``, cut as
``Qwen3OmniMoeProcessor`` calls it: ``log_mel_unpadded``), then the audio tower
(``audio_encoder.Qwen3AudioEncoder``), batched. The ENCODE component's ``encode`` is
``encode_items``.

Settings: the folder's ``preprocessor_config.json`` over ``PREPROCESSOR_DEFAULTS`` (the
published Qwen3-Omni values: Whisper's 128-bin log-mel at 16 kHz, hop 160, n_fft 400).

Imports numpy, torch, ``omnistep.core``, ``omnistep.runners`` and this family's encoder
modules.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from omnistep.core import MediaItem, MediaKind
from omnistep.models.qwen3_omni.audio_encoder import AudioEncoderConfig, Qwen3AudioEncoder
from omnistep.runners.media_features import (
    PREPROCESSOR_DEFAULTS as QWEN2_5_DEFAULTS,
)
from omnistep.runners.media_features import MediaFeatures, read_preprocessor
from omnistep.runners.media_prompt import EncodedMedia

PREPROCESSOR_DEFAULTS: dict[str, Any] = {**QWEN2_5_DEFAULTS, "patch_size": 16}
"""``preprocessor_config.json`` of Qwen/Qwen3-Omni-30B-A3B-Instruct as this module reads it: the
feature extractor's values are Qwen2.5-Omni's; the image processor's patch is 16 (Qwen3-VL)."""

AUDIO_PREFIX = "audio_tower."
"""Thinker tensors of the audio tower (``thinker.`` removed)."""


def read_settings(root: str | Path | None) -> dict[str, Any]:
    """``PREPROCESSOR_DEFAULTS`` updated with the folder's ``preprocessor_config.json``."""
    return read_preprocessor(root, PREPROCESSOR_DEFAULTS)


class Qwen3OmniEncoders:
    """The audio tower of one checkpoint with its feature extractor.

    Args:
        config: ``config.json`` (or its ``thinker_config``).
        weights: the audio tower's tensors by official name (``audio_tower.*``; a leading
            ``thinker.`` is removed).
        settings: the preprocessor settings (``read_settings``).

    Raises:
        RuntimeError: a missing, unexpected or mis-shaped audio tower tensor (named).
    """

    def __init__(
        self,
        config: Mapping[str, Any],
        weights: Mapping[str, torch.Tensor],
        settings: Mapping[str, Any] | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
    ):
        self.device, self.dtype = torch.device(device), dtype
        self.features = MediaFeatures({**PREPROCESSOR_DEFAULTS, **(settings or {})})
        self.audio = Qwen3AudioEncoder(AudioEncoderConfig.from_dict(config))
        names = {k.removeprefix("thinker."): v for k, v in weights.items()}
        state = {k[len(AUDIO_PREFIX) :]: v for k, v in names.items() if k.startswith(AUDIO_PREFIX)}
        self.audio.load_state_dict(state, strict=True)
        self.audio.to(self.device, dtype).eval()

    @classmethod
    def from_checkpoint(cls, checkpoint: Any, **kwargs: Any) -> Qwen3OmniEncoders:
        """Load from a ``loader.Qwen3OmniCheckpoint`` (its config, tensors and folder)."""
        weights = checkpoint.tensors("thinker." + AUDIO_PREFIX)
        return cls(checkpoint.config, weights, read_settings(checkpoint.root), **kwargs)

    def log_mel(self, clip: MediaItem | np.ndarray) -> torch.Tensor:
        """The processor's log-mel ``[128, n // hop]`` of one clip, on the encoder's device."""
        mel = self.features.log_mel_unpadded(self._samples(clip))
        return torch.from_numpy(mel).to(self.device, self.dtype)

    @torch.inference_mode()
    def encode_audio(self, clips: Sequence[MediaItem | np.ndarray]) -> list[torch.Tensor]:
        """Rows ``[num_audio_tokens, thinker hidden]`` per clip (all clips in one batch; each
        clip's rows as if it ran alone, see ``audio_encoder``).

        Raises:
            ValueError: an item that is not audio at the extractor's rate, or too short.
        """
        mels = [self.log_mel(c) for c in clips]
        return self.audio(mels) if mels else []

    @torch.inference_mode()
    def encode_items(self, items: Sequence[MediaItem]) -> list[EncodedMedia]:
        """``EncodedMedia`` per item, all of one kind, in one forward.

        Raises:
            ValueError: items of several kinds, or of a kind this checkpoint does not encode.
        """
        kinds = {item.kind for item in items}
        if len(kinds) > 1:
            raise ValueError(f"one kind per encoder batch, got {sorted(kinds)}")
        if not items:
            return []
        if items[0].kind is not MediaKind.AUDIO:
            raise ValueError(f"Qwen3-Omni's encoder takes audio only here, got {items[0].kind}")
        return [EncodedMedia(r.detach().float().cpu()) for r in self.encode_audio(items)]

    def _samples(self, clip: MediaItem | np.ndarray) -> np.ndarray:
        if not isinstance(clip, MediaItem):
            return np.asarray(clip, dtype=np.float32)
        if clip.kind is not MediaKind.AUDIO or clip.sample_rate != self.features.sample_rate:
            raise ValueError(
                f"expected audio at {self.features.sample_rate} Hz, got {clip.kind} "
                f"at {clip.sample_rate} Hz"
            )
        return clip.data
