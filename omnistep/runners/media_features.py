"""The reference feature extraction of the Qwen omni families' media encoders: transformers'
own pieces (no mel or resize code here), with one checkpoint folder's settings.

``WhisperFeatureExtractor`` (128-bin log-mel, 16 kHz, hop 160, n_fft 400) and
``Qwen2VLImageProcessorPil`` (smart resize to multiples of ``patch * merge``, normalisation,
temporal patches of 2 copies of an image). Settings come from the folder's
``preprocessor_config.json`` when it has one, else ``PREPROCESSOR_DEFAULTS`` (the published
Qwen2.5-Omni-7B values; a family passes its own defaults to ``read_preprocessor``).

Two ways to cut a clip's log-mel, one per processor:

- ``log_mel`` (Qwen2.5-Omni's processor pads every clip to ``n_samples``, 300 s, before the
  STFT): here a clip is padded with ``n_fft + hop`` zeros only. Every frame that touches the
  clip sees the same samples either way (the rest are silence, below the ``max - 8`` floor), so
  the kept frames are equal (checked in tests/test_omni_encoders.py); it saves computing up to
  30,000 frames per clip and does not cut clips longer than ``n_samples``.
- ``log_mel_unpadded`` (Qwen3-Omni's processor calls the extractor with ``padding=True,
  truncation=False``: one clip is not padded at all): the same call, so the frames are the
  processor's (``n // hop`` of them; the STFT's reflect padding at the clip's end differs from
  the zero-padded one, which is why the two ways exist).

Imports numpy, ``omnistep.core``, transformers (inside ``MediaFeatures``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from omnistep.core import MediaItem, MediaKind

PREPROCESSOR_DEFAULTS: dict[str, Any] = {
    "feature_size": 128,
    "sampling_rate": 16000,
    "hop_length": 160,
    "n_fft": 400,
    "chunk_length": 300,
    "padding_value": 0.0,
    "dither": 0.0,
    "min_pixels": 3136,
    "max_pixels": 12845056,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
}
"""``preprocessor_config.json`` of Qwen/Qwen2.5-Omni-7B (the values this module reads)."""

VIDEO_PIXELS = (128 * 28 * 28, 768 * 28 * 28)
"""Per-frame pixel bounds of a video (``Qwen2_5OmniProcessor.videos_kwargs``'s size)."""
VIDEO_FPS = 2.0
"""The frame rate the processor assumes when none is given (its ``video_second_per_grid`` is
``temporal_patch_size / fps``)."""

_AUDIO_KEYS = ("feature_size", "sampling_rate", "hop_length", "n_fft", "chunk_length")
_IMAGE_KEYS = ("min_pixels", "max_pixels", "patch_size", "temporal_patch_size", "merge_size")


def read_preprocessor(
    root: str | Path | None, defaults: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """``defaults`` (None: ``PREPROCESSOR_DEFAULTS``) updated with the folder's
    ``preprocessor_config.json`` (the keys ``defaults`` has)."""
    defaults = PREPROCESSOR_DEFAULTS if defaults is None else defaults
    settings = dict(defaults)
    path = None if root is None else Path(root) / "preprocessor_config.json"
    if path is not None and path.is_file():
        raw = json.loads(path.read_text())
        settings.update({k: raw[k] for k in defaults if k in raw})
    return settings


class MediaFeatures:
    """The reference feature extractors with one folder's settings (``image_mean`` /
    ``image_std`` passed on when the settings have them; ``video_pixels``: the per-frame pixel
    bounds of a video, the processor's ``videos_kwargs`` size)."""

    def __init__(
        self,
        settings: Mapping[str, Any] | None = None,
        video_pixels: tuple[int, int] = VIDEO_PIXELS,
    ):
        from transformers import WhisperFeatureExtractor

        try:  # transformers 5.x: the PIL backend (the default one needs torchvision)
            from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
                Qwen2VLImageProcessorPil,
            )
        except ImportError:  # transformers 4.x: the slow processor is the PIL one
            from transformers import Qwen2VLImageProcessor as Qwen2VLImageProcessorPil

        s = {**PREPROCESSOR_DEFAULTS, **(settings or {})}
        self.sample_rate = int(s["sampling_rate"])
        self.mel = WhisperFeatureExtractor(
            **{k: s[k] for k in _AUDIO_KEYS}, padding_value=s["padding_value"], dither=s["dither"]
        )
        norm = {k: s[k] for k in ("image_mean", "image_std") if s.get(k) is not None}
        self.image = Qwen2VLImageProcessorPil(**{k: s[k] for k in _IMAGE_KEYS}, **norm)
        self.video_pixels = video_pixels

    def samples(self, clip: Any) -> np.ndarray:
        """Mono float32 samples of an audio ``MediaItem`` at ``sample_rate`` (or an array, as
        given).

        Raises:
            ValueError: an item that is not audio at ``sample_rate`` Hz.
        """
        if not isinstance(clip, MediaItem):
            return np.asarray(clip, dtype=np.float32)
        if clip.kind is not MediaKind.AUDIO or clip.sample_rate != self.sample_rate:
            raise ValueError(
                f"expected audio at {self.sample_rate} Hz, got {clip.kind} at {clip.sample_rate} Hz"
            )
        return clip.data

    @staticmethod
    def pixels(image: Any) -> np.ndarray:
        """RGB uint8 ``[h, w, 3]`` of an image ``MediaItem`` (or an array, as given).

        Raises:
            ValueError: an item that is not an image.
        """
        if isinstance(image, MediaItem):
            if image.kind is not MediaKind.IMAGE:
                raise ValueError(f"expected an image, got {image.kind}")
            return image.data
        return np.asarray(image)

    @staticmethod
    def frames(video: MediaItem) -> np.ndarray:
        """RGB uint8 frames ``[n, h, w, 3]`` of a video ``MediaItem``.

        Raises:
            ValueError: an item that is not a video.
        """
        if video.kind is not MediaKind.VIDEO:
            raise ValueError(f"expected a video, got {video.kind}")
        return video.data

    def log_mel(self, samples: np.ndarray) -> np.ndarray:
        """float32 ``[feature_size, num_frames]`` of mono samples at ``sample_rate`` (``num_frames
        = ceil(n / hop)``, the frames the processor's attention mask keeps).

        Raises:
            ValueError: no samples.
        """
        samples = np.asarray(samples, dtype=np.float32)
        if samples.ndim != 1 or samples.size == 0:
            raise ValueError(f"audio must be non-empty mono [n], got shape {samples.shape}")
        hop = self.mel.hop_length
        padded = -(-(samples.size + self.mel.n_fft + hop) // hop) * hop
        out = self.mel(
            samples,
            sampling_rate=self.sample_rate,
            padding="max_length",
            max_length=padded,
            return_attention_mask=True,
            return_tensors="np",
        )
        frames = int(out["attention_mask"][0].sum())
        return np.ascontiguousarray(out["input_features"][0, :, :frames], dtype=np.float32)

    def log_mel_unpadded(self, samples: np.ndarray) -> np.ndarray:
        """float32 ``[feature_size, n // hop]`` of mono samples at ``sample_rate``: the
        extractor called as Qwen3-Omni's processor calls it for one clip (``padding=True``,
        ``truncation=False``: no padding), the frames its attention mask keeps.

        Raises:
            ValueError: no samples, or fewer than one hop of them.
        """
        samples = np.asarray(samples, dtype=np.float32)
        if samples.ndim != 1 or samples.size < self.mel.hop_length:
            raise ValueError(
                f"audio must be mono [n] with n >= {self.mel.hop_length}, got {samples.shape}"
            )
        out = self.mel(
            [samples],
            sampling_rate=self.sample_rate,
            padding=True,
            truncation=False,
            return_attention_mask=True,
            return_tensors="np",
        )
        keep = out["attention_mask"][0].astype(bool)
        return np.ascontiguousarray(out["input_features"][0][:, keep], dtype=np.float32)

    def image_patches(self, pixels: np.ndarray) -> tuple[np.ndarray, tuple[int, int, int]]:
        """Flattened patches ``[t * h * w, 3 * temporal_patch * patch**2]`` float32 and the grid
        ``(1, h, w)`` of an RGB uint8 ``[height, width, 3]`` image."""
        out = self.image(images=[pixels], return_tensors="np")
        grid = tuple(int(v) for v in out["image_grid_thw"][0])
        return np.asarray(out["pixel_values"], dtype=np.float32), grid  # type: ignore[return-value]

    def video_patches(
        self, frames: np.ndarray, fps: float = VIDEO_FPS
    ) -> tuple[np.ndarray, tuple[int, int, int], float]:
        """Flattened patches, the grid ``(t, h, w)`` and the seconds per temporal patch of RGB
        uint8 frames ``[num_frames, height, width, 3]`` sampled at ``fps``.

        Each frame goes through the image processor (resize within ``video_pixels``, CLIP
        normalisation, patches); frames ``2g`` and ``2g + 1`` then fill the two temporal slots
        of group ``g``'s patches (the last frame repeats to an even count), the layout of
        ``Qwen2VLVideoProcessor.patchify``. That processor resizes with torchvision, which
        does not load beside this torch: here PIL's bicubic resize (the image path's) is used,
        so pixels can differ from it slightly where frames are resized.
        """
        frames = np.asarray(frames)
        if frames.ndim != 4 or frames.shape[0] == 0:
            raise ValueError(f"frames must be [num_frames, h, w, 3], got {frames.shape}")
        tp = self.image.temporal_patch_size
        if pad := -frames.shape[0] % tp:
            frames = np.concatenate([frames, np.repeat(frames[-1:], pad, axis=0)])
        lo, hi = self.video_pixels
        size = {"shortest_edge": lo, "longest_edge": hi}
        per_frame = [self.image(images=[f], size=size, return_tensors="np") for f in frames]
        _, gh, gw = (int(v) for v in per_frame[0]["image_grid_thw"][0])
        patch = self.image.patch_size
        slots = [  # [patches, C, tp, p, p]: this frame in every temporal slot
            np.asarray(out["pixel_values"]).reshape(gh * gw, -1, tp, patch, patch)
            for out in per_frame
        ]
        groups = [
            np.stack([slots[g * tp + k][:, :, k] for k in range(tp)], axis=2)
            for g in range(len(slots) // tp)
        ]
        patches = np.concatenate(groups).reshape(len(groups) * gh * gw, -1)
        return patches.astype(np.float32), (len(groups), gh, gw), tp / fps
