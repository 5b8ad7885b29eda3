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

``use_audio_in_video`` (a video item carrying its audio track, ``MediaItem.audio``), as
``Qwen2_5OmniProcessor.replace_video_with_audio_token`` lays the prompt out and
``get_rope_index`` positions it: the video's ``<|vision_bos|>`` is followed by
``<|audio_bos|>``, then the frames' and the track's tokens interleaved in chunks of
``seconds_per_chunk`` (2 s: 50 temporal positions) -- chunk ``j`` of the frames, then chunk
``j`` of the audio -- then ``<|audio_eos|><|vision_eos|>``. Both BOS tokens take one position,
both EOS tokens one position (the last chunk's maximum + 1); the frames and the track start at
the same position, so a frame and the audio heard with it share their temporal position.

Shared by Qwen2.5-Omni and Qwen3-Omni (whose ``get_rope_index`` gives the same positions for
audio, images and videos; its ``use_audio_in_video`` interleaving differs, see
``audio_in_video_layout``).

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
    audio_start: int | None = None
    audio_end: int | None = None
    seconds_per_chunk: float = 2.0
    interleave: str = "chunks"
    """How ``use_audio_in_video`` interleaves a video's frames and its track: ``"chunks"``
    (Qwen2.5-Omni: chunks of ``seconds_per_chunk``, both BOS tokens at one position) or
    ``"time"`` (Qwen3-Omni: token by token in order of temporal position, a frame's tokens
    before the audio tokens at the same position; the two BOS and the two EOS tokens take
    two positions each)."""

    def __post_init__(self) -> None:
        if self.interleave not in ("chunks", "time"):
            raise ValueError(f"interleave must be 'chunks' or 'time', got {self.interleave!r}")

    @classmethod
    def from_config(cls, raw: dict, audio_end: int | None = None) -> MediaTokenIds:
        """From ``config.json`` or its ``thinker_config`` (``audio_start_token_id``,
        ``audio_end_token_id`` and ``seconds_per_chunk`` for ``use_audio_in_video``).
        Placeholders: Qwen2.5-Omni's ``*_token_index`` keys or Qwen3-Omni's ``*_token_id``;
        ``audio_end`` is used when the config has no ``audio_end_token_id`` (Qwen3-Omni's
        has none: the tokenizer's ``<|audio_end|>``)."""
        raw = raw.get("thinker_config", raw)
        start, end = raw.get("audio_start_token_id"), raw.get("audio_end_token_id", audio_end)

        def token(kind: str) -> int:
            return int(
                raw[f"{kind}_token_index"]
                if f"{kind}_token_index" in raw
                else raw[f"{kind}_token_id"]
            )

        return cls(
            audio=token("audio"),
            image=token("image"),
            video=token("video"),
            position_id_per_seconds=float(raw.get("position_id_per_seconds", 25)),
            audio_start=None if start is None else int(start),
            audio_end=None if end is None else int(end),
            seconds_per_chunk=float(raw.get("seconds_per_chunk", 2)),
        )

    @property
    def tokens_per_chunk(self) -> int:
        """Temporal positions per ``use_audio_in_video`` chunk (``int(25 * 2)`` = 50)."""
        return int(self.position_id_per_seconds * self.seconds_per_chunk)


def chunk_bounds(values: Sequence[float], tokens_per_chunk: int) -> list[tuple[int, int]]:
    """``(start, end)`` slices of non-decreasing temporal ``values``: a new slice starts at
    each value reaching the next multiple of ``tokens_per_chunk``, one multiple per value
    (``get_chunked_index`` of transformers' Qwen2.5-Omni: a jump over several chunks opens
    them one token at a time)."""
    bounds, start, limit = [], 0, tokens_per_chunk
    for i, value in enumerate(values):
        if value >= limit:
            bounds.append((start, i))
            start, limit = i, limit + tokens_per_chunk
    bounds.append((start, len(values)))
    return bounds


def video_time_index(grid: Sequence[int], merge: int, t_scale: float) -> np.ndarray:
    """int64 ``[t * h/m * w/m]``: the temporal position offset of each token of a video."""
    t, h, w = (int(v) for v in grid)
    return np.repeat((np.arange(t) * t_scale).astype(np.int64), (h // merge) * (w // merge))


def audio_in_video_layout(
    grid: Sequence[int],
    seconds_per_grid: float,
    num_audio: int,
    ids: MediaTokenIds,
    merge: int,
) -> list[tuple[str, int, int]]:
    """The interleaving of a video's tokens and its audio track's under
    ``use_audio_in_video``: ``("video" | "audio", start, end)`` slices of each, in prompt
    order (``ids.interleave`` "chunks": chunk ``j`` of the frames, then chunk ``j`` of the
    audio; "time": runs in order of temporal position, frames first at a tie, as
    ``Qwen3OmniMoeProcessor.replace_video_with_audio_token`` and ``get_rope_index`` order
    them)."""
    scale = ids.position_id_per_seconds * seconds_per_grid
    if ids.interleave == "time":
        return _time_layout(video_time_index(grid, merge, scale), num_audio)
    video = chunk_bounds(video_time_index(grid, merge, scale), ids.tokens_per_chunk)
    audio = chunk_bounds(np.arange(num_audio), ids.tokens_per_chunk)
    layout: list[tuple[str, int, int]] = []
    for j in range(max(len(video), len(audio))):
        layout += [("video", *video[j])] if j < len(video) else []
        layout += [("audio", *audio[j])] if j < len(audio) else []
    return [(kind, a, b) for kind, a, b in layout if b > a]


def _time_merge(video_times: np.ndarray, num_audio: int) -> tuple[list[tuple[str, int]], int]:
    """The frames' and the audio's tokens merged by temporal position (a frame token first
    when its position is <= the audio token's index), as ``(kind, index)``, and where the
    tail (what is left of one kind once the other is used up) starts in that list."""
    order: list[tuple[str, int]] = []
    v = a = 0
    while v < len(video_times) and a < num_audio:
        if video_times[v] <= a:
            order.append(("video", v))
            v += 1
        else:
            order.append(("audio", a))
            a += 1
    tail = len(order)
    order += [("video", k) for k in range(v, len(video_times))]
    order += [("audio", k) for k in range(a, num_audio)]
    return order, tail


def _time_layout(video_times: np.ndarray, num_audio: int) -> list[tuple[str, int, int]]:
    """Runs of ``_time_merge``'s order as ``(kind, start, end)`` slices."""
    layout: list[tuple[str, int, int]] = []
    for kind, index in _time_merge(video_times, num_audio)[0]:
        if layout and layout[-1][0] == kind and layout[-1][2] == index:
            layout[-1] = (kind, layout[-1][1], index + 1)
        else:
            layout.append((kind, index, index + 1))
    return layout


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


def _audio_in_video(
    parts: list[np.ndarray],
    tokens: list[int],
    ed: int,
    grid: Sequence[int],
    seconds: float,
    num_audio: int,
    ids: MediaTokenIds,
    merge: int,
) -> int:
    """Append the positions of a video block with its audio track (its first frame token at
    ``ed``, both BOS tokens before it); returns the index after its two EOS tokens."""
    bos = int(parts[-1].max()) + 1 if parts else 0
    if ids.interleave == "time":
        return _audio_in_video_time(parts, tokens, ed, bos, grid, seconds, num_audio, ids, merge)
    parts += [_run(bos, 1), _run(bos, 1)]  # <|vision_bos|> and <|audio_bos|>: one position
    video = _vision(bos + 1, grid, merge, ids.position_id_per_seconds * seconds)
    audio = _run(bos + 1, num_audio)
    layout = audio_in_video_layout(grid, seconds, num_audio, ids, merge)
    expected = [
        ids.video if k == "video" else ids.audio for k, a, b in layout for _ in range(b - a)
    ]
    if tokens[ed : ed + len(expected)] != expected:
        raise ValueError("a video with its audio track does not match its interleaved tokens")
    parts += [(video if kind == "video" else audio)[:, a:b] for kind, a, b in layout]
    eos = int(parts[-1].max()) + 1  # the last chunk's maximum, as get_rope_index
    parts += [_run(eos, 1), _run(eos, 1)]  # <|audio_eos|> and <|vision_eos|>
    return ed + len(expected) + 2


def _audio_in_video_time(
    parts: list[np.ndarray],
    tokens: list[int],
    ed: int,
    bos: int,
    grid: Sequence[int],
    seconds: float,
    num_audio: int,
    ids: MediaTokenIds,
    merge: int,
) -> int:
    """``_audio_in_video`` of Qwen3-Omni (``ids.interleave == "time"``; its ``get_rope_index``):
    the two BOS tokens at ``bos, bos + 1``, frames and track from ``bos + 2``, token by token
    in ``_time_merge`` order; the two EOS tokens from one past the maximum of the last piece
    transformers appends (the tail block, or the last merged token when there is no tail)."""
    parts.append(_run(bos, 2))
    video = _vision(bos + 2, grid, merge, ids.position_id_per_seconds * seconds)
    audio = _run(bos + 2, num_audio)
    order, tail = _time_merge(video[0] - (bos + 2), num_audio)
    expected = [ids.video if kind == "video" else ids.audio for kind, _ in order]
    if tokens[ed : ed + len(expected)] != expected:
        raise ValueError("a video with its audio track does not match its interleaved tokens")
    columns = [(video if kind == "video" else audio)[:, k] for kind, k in order]
    block = np.stack(columns, axis=1) if columns else np.zeros((3, 0), np.int64)
    parts.append(block)
    last = block[:, tail:] if tail < len(order) else block[:, -1:]
    eos = int(last.max()) + 1
    parts.append(_run(eos, 2))
    return ed + len(expected) + 2


def rope_index(
    input_ids: Sequence[int],
    ids: MediaTokenIds,
    audio_lengths: Sequence[int] = (),
    image_grids: Sequence[Sequence[int]] = (),
    video_grids: Sequence[Sequence[int]] = (),
    video_seconds_per_grid: Sequence[float] = (),
    spatial_merge_size: int = 2,
    video_audio_lengths: Sequence[int | None] = (),
) -> tuple[np.ndarray, int]:
    """Positions ``[3, len(input_ids)]`` int64 and the decode delta (``max + 1 - L``).

    Args:
        input_ids: the prompt, each media item as ``<bos> placeholder * n <eos>`` (a video
            with its audio track: the interleaved block of the module docstring).
        audio_lengths: tokens of each audio item, in prompt order (not the videos' tracks).
        image_grids, video_grids: ``(t, h, w)`` patch grids, in prompt order.
        video_seconds_per_grid: seconds per temporal patch of each video
            (``temporal_patch_size / fps``).
        video_audio_lengths: per video, the tokens of its audio track when it is read with
            ``use_audio_in_video``, else None; empty: no video has one.

    Raises:
        ValueError: a media item whose placeholder run does not match its size, or more
            placeholders than items.
    """
    tokens = list(input_ids)
    kinds = {ids.audio: "audio", ids.image: "image", ids.video: "video"}
    queues = {"audio": list(audio_lengths), "image": list(image_grids), "video": list(video_grids)}
    seconds = list(video_seconds_per_grid)
    tracks = list(video_audio_lengths) or [None] * len(video_grids)
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
        track = tracks.pop(0) if kind == "video" else None
        if track is not None:
            if ed - st - 2 > 0:
                parts.append(_run(start(), ed - st - 2))
            grid, merge = size, spatial_merge_size
            st = _audio_in_video(parts, tokens, ed, grid, seconds.pop(0), track, ids, merge)
            continue
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
