"""Qwen3-Omni's media encoders from a request's ``MediaItem``s to thinker-width rows: the
reference feature extraction (the shared ``runners.media_features.MediaFeatures``, cut as
``Qwen3OmniMoeProcessor`` calls it: ``log_mel_unpadded``; the PIL image processor with
patch 16), then the audio tower (``audio_encoder.Qwen3AudioEncoder``) and the vision encoder
(``vision_encoder.Qwen3VisionEncoder``, its deepstack features kept with the rows), batched.
The ENCODE component's ``encode`` is ``encode_items``.

Settings: the folder's ``preprocessor_config.json`` over ``PREPROCESSOR_DEFAULTS`` (Whisper's
128-bin log-mel at 16 kHz, hop 160, n_fft 400; images in patches of 16, merged 2 x 2,
normalised with mean and std 0.5 as Qwen3-VL's processor does). Video frames are resized
within ``VIDEO_PIXELS`` (the processor's ``videos_kwargs``) with PIL's bicubic resize (the
processor's video path uses torchvision, which this torch does not load beside).

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
from omnistep.models.qwen3_omni.vision_encoder import Qwen3VisionEncoder, VisionEncoderConfig
from omnistep.runners.media_features import (
    PREPROCESSOR_DEFAULTS as QWEN2_5_DEFAULTS,
)
from omnistep.runners.media_features import VIDEO_FPS, MediaFeatures, read_preprocessor
from omnistep.runners.media_prompt import EncodedMedia

PREPROCESSOR_DEFAULTS: dict[str, Any] = {
    **QWEN2_5_DEFAULTS,
    "patch_size": 16,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}
"""The preprocessor settings this module reads when the folder has no
``preprocessor_config.json``: the feature extractor's values are Qwen2.5-Omni's; the image
processor's patch (16) and normalisation are Qwen3-VL's."""

VIDEO_PIXELS = (128 * 32 * 32, 768 * 32 * 32)
"""Per-frame pixel bounds of a video (``Qwen3OmniMoeProcessor.videos_kwargs``' size)."""

AUDIO_PREFIX = "audio_tower."
"""Thinker tensors of the audio tower (``thinker.`` removed)."""
VISION_PREFIX = "visual."
"""Thinker tensors of the vision encoder (``thinker.`` removed)."""


def read_settings(root: str | Path | None) -> dict[str, Any]:
    """``PREPROCESSOR_DEFAULTS`` updated with the folder's ``preprocessor_config.json``."""
    return read_preprocessor(root, PREPROCESSOR_DEFAULTS)


class Qwen3OmniEncoders:
    """The audio tower and (when ``weights`` hold it) the vision encoder of one checkpoint,
    with their feature extractors.

    Args:
        config: ``config.json`` (or its ``thinker_config``).
        weights: the encoders' tensors by official name (``audio_tower.*``, ``visual.*``; a
            leading ``thinker.`` is removed); without ``visual.*`` tensors, no vision.
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
        self.features = MediaFeatures({**PREPROCESSOR_DEFAULTS, **(settings or {})}, VIDEO_PIXELS)
        self.audio = Qwen3AudioEncoder(AudioEncoderConfig.from_dict(config))
        names = {k.removeprefix("thinker."): v for k, v in weights.items()}

        def part(prefix: str) -> dict[str, torch.Tensor]:
            return {k[len(prefix) :]: v for k, v in names.items() if k.startswith(prefix)}

        self.audio.load_state_dict(part(AUDIO_PREFIX), strict=True)
        self.audio.to(self.device, dtype).eval()
        self.vision: Qwen3VisionEncoder | None = None
        if part(VISION_PREFIX):
            self.vision = Qwen3VisionEncoder(VisionEncoderConfig.from_dict(config))
            self.vision.load_state_dict(part(VISION_PREFIX), strict=True)
            self.vision.to(self.device, dtype).eval()

    @classmethod
    def from_checkpoint(cls, checkpoint: Any, **kwargs: Any) -> Qwen3OmniEncoders:
        """Load from a ``loader.Qwen3OmniCheckpoint`` (its config, tensors and folder)."""
        weights = checkpoint.tensors("thinker." + AUDIO_PREFIX)
        weights.update(checkpoint.tensors("thinker." + VISION_PREFIX))
        return cls(checkpoint.config, weights, read_settings(checkpoint.root), **kwargs)

    def log_mel(self, clip: MediaItem | np.ndarray) -> torch.Tensor:
        """The processor's log-mel ``[128, n // hop]`` of one clip, on the encoder's device."""
        mel = self.features.log_mel_unpadded(self.features.samples(clip))
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
        kind = items[0].kind
        if kind is MediaKind.AUDIO:
            return [EncodedMedia(self._host(r)) for r in self.encode_audio(items)]
        if kind is MediaKind.IMAGE:
            outs = [(*self.features.image_patches(self.features.pixels(i)), None) for i in items]
        else:
            outs = [
                self.features.video_patches(self.features.frames(v), v.fps or VIDEO_FPS)
                for v in items
            ]
        return self.encode_patches(
            [p for p, _, _ in outs], [g for _, g, _ in outs], [s for _, _, s in outs]
        )

    @torch.inference_mode()
    def encode_patches(
        self,
        patches: Sequence[np.ndarray],
        grids: Sequence[tuple[int, int, int]],
        seconds: Sequence[float | None] | None = None,
    ) -> list[EncodedMedia]:
        """The vision encoder over items' flattened patches (the processor's
        ``pixel_values``) in one forward: per item its merged rows, grid, seconds per
        temporal patch and deepstack features.

        Raises:
            ValueError: no vision encoder in this checkpoint, or patches and grids that do not
                match.
        """
        if self.vision is None:
            raise ValueError("this checkpoint has no vision encoder")
        x = torch.from_numpy(np.concatenate(patches)).to(self.device, self.dtype)
        rows, deepstack = self.vision(x, list(grids))
        unit = self.vision.config.spatial_merge_size**2
        sizes = [t * h * w // unit for t, h, w in grids]
        split_rows = rows.split(sizes)
        split_deep = [d.split(sizes) for d in deepstack]
        seconds = list(seconds) if seconds is not None else [None] * len(grids)
        return [
            EncodedMedia(
                self._host(split_rows[i]),
                tuple(int(v) for v in grids[i]),
                seconds[i],
                tuple(self._host(d[i]) for d in split_deep),
            )
            for i in range(len(grids))
        ]

    @staticmethod
    def _host(rows: torch.Tensor) -> torch.Tensor:
        return rows.detach().float().cpu()
