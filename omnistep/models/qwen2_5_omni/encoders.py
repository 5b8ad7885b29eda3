"""Qwen2.5-Omni's media encoders from a request's ``MediaItem``s to thinker-width rows: the
reference feature extraction, then the audio tower and the vision encoder, batched.

Feature extraction is transformers' own (the pieces ``Qwen2_5OmniProcessor`` holds; no mel or
resize code here): ``WhisperFeatureExtractor`` (128-bin log-mel, 16 kHz, hop 160, n_fft 400)
and ``Qwen2VLImageProcessorPil`` (smart resize to multiples of ``patch * merge``, CLIP
normalisation, temporal patches of 2 copies of the image). Settings come from the folder's
``preprocessor_config.json`` when it has one, else the published Qwen2.5-Omni-7B values
(``PREPROCESSOR_DEFAULTS``).

One difference from the processor, equal in result: it pads every clip to ``n_samples`` (300 s
in the published config) before the STFT; here a clip is padded with ``n_fft + hop`` zeros only.
Every frame that touches the clip sees the same samples either way (the rest are silence, below
the ``max - 8`` floor), so the kept frames are equal (checked in tests); it saves computing up to
30,000 frames per clip and does not cut clips longer than ``n_samples``.

Imports numpy, torch, transformers (feature extractor, PIL image processor), ``omnistep.core``
and this family's encoder modules.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from omnistep.core import MediaItem, MediaKind
from omnistep.models.qwen2_5_omni.audio_encoder import AudioEncoderConfig, QwenAudioEncoder
from omnistep.models.qwen2_5_omni.vision_encoder import QwenVisionEncoder, VisionEncoderConfig

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


def read_preprocessor(root: str | Path | None) -> dict[str, Any]:
    """``PREPROCESSOR_DEFAULTS`` updated with the folder's ``preprocessor_config.json``."""
    settings = dict(PREPROCESSOR_DEFAULTS)
    path = None if root is None else Path(root) / "preprocessor_config.json"
    if path is not None and path.is_file():
        raw = json.loads(path.read_text())
        settings.update({k: raw[k] for k in PREPROCESSOR_DEFAULTS if k in raw})
    return settings


@dataclass(frozen=True, eq=False)
class EncodedMedia:
    """One media item as the thinker takes it (an ENCODE unit's output).

    Attributes:
        rows: float32 ``[num_tokens, thinker hidden]`` on the CPU: one row per placeholder.
        grid: ``(t, h, w)`` patch grid of an image or video (None for audio).
        seconds_per_grid: a video's seconds per temporal patch (None otherwise).
    """

    rows: torch.Tensor
    grid: tuple[int, int, int] | None = None
    seconds_per_grid: float | None = None


class MediaFeatures:
    """The reference feature extractors with one folder's settings."""

    def __init__(self, settings: Mapping[str, Any] | None = None):
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
        self.image = Qwen2VLImageProcessorPil(**{k: s[k] for k in _IMAGE_KEYS})

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

        Each frame goes through the image processor (resize within ``VIDEO_PIXELS``, CLIP
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
        lo, hi = VIDEO_PIXELS
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
        mels = [self._tensor(self.features.log_mel(self._samples(c))) for c in clips]
        return self.audio(mels) if mels else []

    @torch.inference_mode()
    def encode_images(self, images: Sequence[MediaItem | np.ndarray]) -> list[torch.Tensor]:
        """Rows ``[t * h * w / merge**2, thinker hidden]`` per image (all images in one batch),
        in the processor's order; ``grids`` of the same images: ``image_grids``."""
        if not images:
            return []
        pairs = [self.features.image_patches(self._pixels(i)) for i in images]
        return self._vision_rows([p for p, _ in pairs], [g for _, g in pairs])

    @torch.inference_mode()
    def encode_videos(self, videos: Sequence[MediaItem]) -> list[torch.Tensor]:
        """Rows ``[t * h * w / merge**2, thinker hidden]`` per video (all in one batch)."""
        if not videos:
            return []
        outs = [self.features.video_patches(self._frames(v), v.fps or VIDEO_FPS) for v in videos]
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
            pairs = [self.features.image_patches(self._pixels(i)) for i in items]
            rows = self._vision_rows([p for p, _ in pairs], [g for _, g in pairs])
            return [EncodedMedia(self._host(r), g) for r, (_, g) in zip(rows, pairs, strict=True)]
        outs = [self.features.video_patches(self._frames(v), v.fps or VIDEO_FPS) for v in items]
        rows = self._vision_rows([p for p, _, _ in outs], [g for _, g, _ in outs])
        return [EncodedMedia(self._host(r), g, s) for r, (_, g, s) in zip(rows, outs, strict=True)]

    @staticmethod
    def _host(rows: torch.Tensor) -> torch.Tensor:
        return rows.detach().float().cpu()

    def video_grids(self, videos: Sequence[MediaItem]) -> list[tuple[tuple[int, int, int], float]]:
        """``((t, h, w), seconds per temporal patch)`` of each video (for ``mrope``)."""
        outs = [self.features.video_patches(self._frames(v), v.fps or VIDEO_FPS) for v in videos]
        return [(g, s) for _, g, s in outs]

    @staticmethod
    def _frames(video: MediaItem) -> np.ndarray:
        if video.kind is not MediaKind.VIDEO:
            raise ValueError(f"expected a video, got {video.kind}")
        return video.data

    def image_grids(self, images: Sequence[MediaItem | np.ndarray]) -> list[tuple[int, int, int]]:
        """The ``(t, h, w)`` patch grid of each image (for ``mrope.rope_index``)."""
        return [self.features.image_patches(self._pixels(i))[1] for i in images]

    def _samples(self, clip: MediaItem | np.ndarray) -> np.ndarray:
        if not isinstance(clip, MediaItem):
            return np.asarray(clip, dtype=np.float32)
        if clip.kind is not MediaKind.AUDIO or clip.sample_rate != self.features.sample_rate:
            raise ValueError(
                f"expected audio at {self.features.sample_rate} Hz, got {clip.kind} "
                f"at {clip.sample_rate} Hz"
            )
        return clip.data

    @staticmethod
    def _pixels(image: MediaItem | np.ndarray) -> np.ndarray:
        if isinstance(image, MediaItem):
            if image.kind is not MediaKind.IMAGE:
                raise ValueError(f"expected an image, got {image.kind}")
            return image.data
        return np.asarray(image)
