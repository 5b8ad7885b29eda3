"""Qwen2.5-Omni's media encoders from a request's ``MediaItem``s to thinker-width rows: the
reference feature extraction (the shared ``runners.media_features.MediaFeatures``, its
``log_mel`` cut), then the audio tower and the vision encoder, batched.

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
from omnistep.models.qwen2_5_omni.audio_encoder import AudioEncoderConfig, QwenAudioEncoder
from omnistep.models.qwen2_5_omni.vision_encoder import QwenVisionEncoder, VisionEncoderConfig
from omnistep.runners.media_features import (
    PREPROCESSOR_DEFAULTS,
    VIDEO_FPS,
    MediaFeatures,
    read_preprocessor,
)
from omnistep.runners.media_prompt import EncodedMedia

__all__ = ["PREPROCESSOR_DEFAULTS", "EncodedMedia", "OmniEncoders", "read_preprocessor"]


class OmniEncoders:
    """The audio tower and vision encoder of one checkpoint, with its feature extractors.

    Args:
        config: ``config.json`` (or its ``thinker_config``).
        weights: the encoder tensors by official name (``audio_tower.*``, ``visual.*``; as
            ``QwenThinker.encoder_weights`` keeps them; a ``thinker.`` prefix is removed).
        settings: the preprocessor settings (``read_preprocessor``).
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
        self.features = MediaFeatures(settings)
        self.audio = QwenAudioEncoder(AudioEncoderConfig.from_dict(config))
        self.vision = QwenVisionEncoder(VisionEncoderConfig.from_dict(config))
        names = {k.removeprefix("thinker."): v for k, v in weights.items()}
        for prefix, module in (("audio_tower.", self.audio), ("visual.", self.vision)):
            state = {k[len(prefix) :]: v for k, v in names.items() if k.startswith(prefix)}
            module.load_state_dict(state, strict=True)
            module.to(self.device, dtype).eval()

    @classmethod
    def from_folder(cls, root: str | Path, **kwargs: Any) -> OmniEncoders:
        """Load from a checkpoint folder in the official layout."""
        from omnistep.models.qwen2_5_omni.loader import QwenOmniFiles

        files = QwenOmniFiles.locate(root)
        weights = {
            **{f"audio_tower.{k}": v for k, v in files.tensors("thinker.audio_tower.").items()},
            **{f"visual.{k}": v for k, v in files.tensors("thinker.visual.").items()},
        }
        return cls(files.config(), weights, read_preprocessor(root), **kwargs)

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device, self.dtype)

    @torch.inference_mode()
    def encode_audio(self, clips: Sequence[MediaItem | np.ndarray]) -> list[torch.Tensor]:
        """Rows ``[num_audio_tokens, thinker hidden]`` per clip (all clips in one batch).

        Args:
            clips: audio ``MediaItem``s at the extractor's rate, or float32 samples ``[n]``.

        Raises:
            ValueError: an item that is not audio at ``features.sample_rate`` Hz, or empty.
        """
        mels = [self._tensor(self.features.log_mel(self.features.samples(c))) for c in clips]
        return self.audio(mels) if mels else []

    @torch.inference_mode()
    def encode_images(self, images: Sequence[MediaItem | np.ndarray]) -> list[torch.Tensor]:
        """Rows ``[t * h * w / merge**2, thinker hidden]`` per image (all images in one batch),
        in the processor's order; ``grids`` of the same images: ``image_grids``."""
        if not images:
            return []
        pairs = [self.features.image_patches(self.features.pixels(i)) for i in images]
        return self._vision_rows([p for p, _ in pairs], [g for _, g in pairs])

    @torch.inference_mode()
    def encode_videos(self, videos: Sequence[MediaItem]) -> list[torch.Tensor]:
        """Rows ``[t * h * w / merge**2, thinker hidden]`` per video (all in one batch)."""
        if not videos:
            return []
        outs = [
            self.features.video_patches(self.features.frames(v), v.fps or VIDEO_FPS) for v in videos
        ]
        return self._vision_rows([p for p, _, _ in outs], [g for _, g, _ in outs])

    def _vision_rows(
        self, patches: Sequence[np.ndarray], grids: Sequence[tuple[int, int, int]]
    ) -> list[torch.Tensor]:
        """The vision encoder over the items' patches in one forward; rows per item."""
        rows = self.vision(self._tensor(np.concatenate(patches)), list(grids))
        unit = self.vision.config.spatial_merge_size**2
        return list(rows.split([t * h * w // unit for t, h, w in grids]))

    @torch.inference_mode()
    def encode_items(self, items: Sequence[MediaItem]) -> list[EncodedMedia]:
        """``EncodedMedia`` per item, all of one kind, in one forward (features computed once:
        the grids come with the rows). The ENCODE component's ``encode``.

        Raises:
            ValueError: items of several kinds, or an item ``encode_*`` refuses.
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
            pairs = [self.features.image_patches(self.features.pixels(i)) for i in items]
            rows = self._vision_rows([p for p, _ in pairs], [g for _, g in pairs])
            return [EncodedMedia(self._host(r), g) for r, (_, g) in zip(rows, pairs, strict=True)]
        outs = [
            self.features.video_patches(self.features.frames(v), v.fps or VIDEO_FPS) for v in items
        ]
        rows = self._vision_rows([p for p, _, _ in outs], [g for _, g, _ in outs])
        return [EncodedMedia(self._host(r), g, s) for r, (_, g, s) in zip(rows, outs, strict=True)]

    @staticmethod
    def _host(rows: torch.Tensor) -> torch.Tensor:
        return rows.detach().float().cpu()

    def video_grids(self, videos: Sequence[MediaItem]) -> list[tuple[tuple[int, int, int], float]]:
        """``((t, h, w), seconds per temporal patch)`` of each video (for ``mrope``)."""
        outs = [
            self.features.video_patches(self.features.frames(v), v.fps or VIDEO_FPS) for v in videos
        ]
        return [(g, s) for _, g, s in outs]

    def image_grids(self, images: Sequence[MediaItem | np.ndarray]) -> list[tuple[int, int, int]]:
        """The ``(t, h, w)`` patch grid of each image (for ``mrope.rope_index``)."""
        return [self.features.image_patches(self.features.pixels(i))[1] for i in images]
