"""TMRoPE positions of a Qwen2.5-Omni thinker prompt holding audio, images and video.

A pure function of the prompt's token ids and its media's shapes, equal to transformers'
``Qwen2_5OmniPreTrainedModelForConditionalGeneration.get_rope_index`` (5.24) for one unpadded
sequence without ``use_audio_in_video``: three position rows (temporal, height, width). Text
tokens (and each media item's BOS/EOS token) advance all three rows by one from the previous
maximum; an audio item's ``n`` tokens take ``n`` consecutive positions in all rows; an image or
video item of grid ``(t, h, w)`` patches gives ``t * (h / m) * (w / m)`` tokens (``m`` the
spatial merge) whose rows are ``start + t_index``, ``start + row``, ``start + column`` with
``t_index = frame * seconds_per_grid * position_id_per_seconds`` (images: 0), so time is
aligned with audio's 25 positions per second. Decode positions continue at ``L + delta``.

Imports numpy only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class MediaTokenIds:
    """The placeholder token ids (``thinker_config``): ``audio_token_index``,
    ``image_token_index``, ``video_token_index``, and the rate of temporal positions."""

    audio: int
    image: int
    video: int
    position_id_per_seconds: float = 25.0

    @classmethod
    def from_config(cls, raw: dict) -> MediaTokenIds:
        """From ``config.json`` or its ``thinker_config``."""
        raw = raw.get("thinker_config", raw)
        return cls(
            audio=int(raw["audio_token_index"]),
            image=int(raw["image_token_index"]),
            video=int(raw["video_token_index"]),
            position_id_per_seconds=float(raw.get("position_id_per_seconds", 25)),
        )


def _run(start: int, length: int) -> np.ndarray:
    return np.broadcast_to(np.arange(length) + start, (3, length))


def _vision(start: int, grid: Sequence[int], merge: int, t_scale: float) -> np.ndarray:
    t, h, w = (int(v) for v in grid)
    gh, gw = h // merge, w // merge
    t_index = (np.arange(t) * t_scale).astype(np.int64)
    rows = np.stack(
        [
            np.repeat(t_index, gh * gw),
            np.tile(np.repeat(np.arange(gh), gw), t),
            np.tile(np.arange(gw), t * gh),
        ]
    )
    return rows + start


def rope_index(
    input_ids: Sequence[int],
    ids: MediaTokenIds,
    audio_lengths: Sequence[int] = (),
    image_grids: Sequence[Sequence[int]] = (),
    video_grids: Sequence[Sequence[int]] = (),
    video_seconds_per_grid: Sequence[float] = (),
    spatial_merge_size: int = 2,
) -> tuple[np.ndarray, int]:
    """Positions ``[3, len(input_ids)]`` int64 and the decode delta (``max + 1 - L``).

    Args:
        input_ids: the prompt, each media item as ``<bos> placeholder * n <eos>``.
        audio_lengths: tokens of each audio item, in prompt order.
        image_grids, video_grids: ``(t, h, w)`` patch grids, in prompt order.
        video_seconds_per_grid: seconds per temporal patch of each video
            (``temporal_patch_size / fps``).

    Raises:
        ValueError: a media item whose placeholder run does not match its size, or more
            placeholders than items.
    """
    tokens = list(input_ids)
    kinds = {ids.audio: "audio", ids.image: "image", ids.video: "video"}
    queues = {"audio": list(audio_lengths), "image": list(image_grids), "video": list(video_grids)}
    seconds = list(video_seconds_per_grid)
    parts: list[np.ndarray] = []
    st = 0

    def start() -> int:
        return int(parts[-1].max()) + 1 if parts else 0

    while True:
        ed = next((i for i in range(st, len(tokens)) if tokens[i] in kinds), None)
        if ed is None:
            break
        kind = kinds[tokens[ed]]
        if not queues[kind]:
            raise ValueError(f"more {kind} placeholders than {kind} items")
        size = queues[kind].pop(0)
        if ed - st - 1 > 0:
            parts.append(_run(start(), ed - st - 1))
        parts.append(_run(start(), 1))  # the item's BOS
        if kind == "audio":
            item = _run(start(), int(size))
        else:
            scale = ids.position_id_per_seconds * (1.0 if kind == "image" else seconds.pop(0))
            item = _vision(start(), size, spatial_merge_size, 0.0 if kind == "image" else scale)
        n = item.shape[1]
        if tokens[ed : ed + n] != [tokens[ed]] * n:
            raise ValueError(f"a {kind} item of {n} tokens has a shorter placeholder run")
        parts.append(item)
        parts.append(_run(start(), 1))  # the item's EOS
        st = ed + n + 1
    if st < len(tokens):
        parts.append(_run(start(), len(tokens) - st))
    positions = np.concatenate(parts, axis=1) if parts else np.zeros((3, 0), np.int64)
    return positions.astype(np.int64), int(positions.max(initial=-1)) + 1 - len(tokens)
