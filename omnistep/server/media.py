"""Chat content parts that carry media, and their decoding into ``MediaItem``s.

Parts (in any message, mixed with text parts in any order):

- ``{"type": "input_audio", "input_audio": {"data": <base64>, "format": "wav"}}`` (OpenAI;
  format wav, mp3, flac, ogg, webm, m4a: the bytes are probed, the format is a hint; ``data``
  may also be a ``data:`` URL);
- ``{"type": "image_url", "image_url": {"url": ...}}`` (OpenAI: a ``data:`` URL, or http(s)
  with ``--allow-remote-media``; a file under ``--allowed-local-media-path`` too, as vLLM);
- ``{"type": "audio_url", "audio_url": {"url": ...}}`` and ``{"type": "video_url",
  "video_url": {"url": ...}}`` (vLLM's parts; the same URL forms).

URLs are read by ``media_fetch.read_media`` (the fetcher ``ref_audio`` uses). Audio is decoded
by libsndfile or PyAV (``omnistep.audio.decode``), mixed to mono and resampled with the project's
soxr resampler to ``ModelCard.media_sample_rate``; images and video frames by PyAV (FFmpeg) to
RGB; video frames are sampled at ``MediaLimits.video_fps``; with ``use_audio_in_video`` a
video's audio track is decoded too (``decode_video_audio``) and rides on the video item
(``MediaItem.audio``). Every violation is an
``InvalidRequestError`` (a 400) whose ``param`` names the part, ``messages[1].content[2]``.

Imports numpy, av, pydantic, FastAPI (its thread pool), ``omnistep.core``, ``omnistep.audio``
and the server's ``protocol`` and ``media_fetch`` modules.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Annotated, Literal

import numpy as np
from fastapi.concurrency import run_in_threadpool
from pydantic import Field

from omnistep.audio.decode import AudioDecodeError, decode_audio
from omnistep.audio.resample import Resampler
from omnistep.core import InvalidRequestError, MediaItem, MediaKind, ModelCard
from omnistep.server.media_fetch import MediaPolicy, b64decode, read_media
from omnistep.server.protocol import OpenAIBody

INPUT_AUDIO_FORMATS = ("wav", "mp3", "flac", "ogg", "webm", "m4a")


@dataclass(frozen=True, slots=True)
class MediaLimits:
    """Operator limits on the media of one chat request (``omnistep serve`` flags).

    Attributes:
        max_audio_seconds: longest audio part (``--max-audio-seconds``).
        max_video_seconds: longest video part (``--max-video-seconds``).
        max_video_frames: most frames sampled from one video (``--max-video-frames``).
        max_image_pixels: largest image or video frame, width x height, checked from the
            file's header before decoding (``--max-image-pixels``).
        max_media_items: most media parts in one request, all messages together
            (``--max-media-items``).
        max_video_frame_pixels: larger video frames are scaled down to this many pixels at
            decode (aspect kept; FFmpeg's bicubic scaler), which bounds a video's memory to
            ``max_video_frames * max_video_frame_pixels * 3`` bytes (256 x 602,112 x 3 = 462 MB
            by default). The default is Qwen2.5-Omni's own per-frame maximum (768 x 28 x 28),
            to which its processor resizes frames anyway.
        video_fps: frames sampled per second of video (2: what Qwen2.5-Omni's processor
            assumes for its temporal positions).

    Raises:
        ValueError: a limit that is not positive (the field is named).
    """

    max_audio_seconds: float = 300.0
    max_video_seconds: float = 300.0
    max_video_frames: int = 256
    max_image_pixels: int = 36_000_000
    max_media_items: int = 16
    video_fps: float = 2.0
    max_video_frame_pixels: int = 768 * 28 * 28

    def __post_init__(self) -> None:
        for name in (
            "max_audio_seconds",
            "max_video_seconds",
            "max_video_frames",
            "max_image_pixels",
            "max_media_items",
            "video_fps",
            "max_video_frame_pixels",
        ):
            value = getattr(self, name)
            if not 0 < value < float("inf"):
                raise ValueError(f"{name} must be > 0, got {value}")


# ----------------------------------------------------------------------------- the parts


class TextPart(OpenAIBody):
    """A text content part: ``{"type": "text", "text": ...}``."""

    type: Literal["text"]
    text: str


class InputAudio(OpenAIBody):
    """``input_audio``: the base64 of an audio file and its format."""

    data: str
    format: Literal[INPUT_AUDIO_FORMATS]  # type: ignore[valid-type]


class InputAudioPart(OpenAIBody):
    """OpenAI's audio part: ``{"type": "input_audio", "input_audio": {data, format}}``."""

    type: Literal["input_audio"]
    input_audio: InputAudio


class MediaURL(OpenAIBody):
    """``{"url": ...}``: a data URL, an http(s) URL or a local file (see module docstring)."""

    url: str = Field(min_length=1)
    detail: Literal["auto", "low", "high"] | None = None


class ImageURLPart(OpenAIBody):
    """OpenAI's image part: ``{"type": "image_url", "image_url": {"url", "detail"}}``
    (``detail`` is accepted and has no effect)."""

    type: Literal["image_url"]
    image_url: MediaURL


class AudioURLPart(OpenAIBody):
    """vLLM's audio part: ``{"type": "audio_url", "audio_url": {"url"}}``."""

    type: Literal["audio_url"]
    audio_url: MediaURL


class VideoURLPart(OpenAIBody):
    """vLLM's video part: ``{"type": "video_url", "video_url": {"url"}}``."""

    type: Literal["video_url"]
    video_url: MediaURL


MediaPart = InputAudioPart | ImageURLPart | AudioURLPart | VideoURLPart
ContentPart = Annotated[TextPart | MediaPart, Field(discriminator="type")]

_KIND = {
    "input_audio": MediaKind.AUDIO,
    "audio_url": MediaKind.AUDIO,
    "image_url": MediaKind.IMAGE,
    "video_url": MediaKind.VIDEO,
}


def part_kind(part: MediaPart) -> MediaKind:
    """What a media part holds."""
    return _KIND[part.type]


def part_param(message_index: int, part_index: int, prefix: str = "messages") -> str:
    """The name errors give a part: ``messages[1].content[2]`` (a rollout input's:
    ``inputs[0][1].content[2]``)."""
    return f"{prefix}[{message_index}].content[{part_index}]"


def _bad(message: str, param: str, code: str) -> InvalidRequestError:
    return InvalidRequestError(message, param=param, code=code)


# ----------------------------------------------------------------------------- checks


def check_media_parts(parts: list[tuple[str, MediaPart]], card: ModelCard, limits: MediaLimits):
    """Refuse, before anything is read, media the card cannot take or too many parts.

    Args:
        parts: ``(param, part)`` of every media part of the request, in order.

    Raises:
        InvalidRequestError: a kind the card has no capability for (code
            ``unsupported_modality``), more than ``limits.max_media_items`` parts
            (``too_many_media_items``; param: the first part over the limit).
    """
    for param, part in parts:
        kind = part_kind(part)
        if kind.capability not in card.capabilities:
            raise _bad(
                f"model '{card.card_id}' cannot take {kind.value} input ({param} is a "
                f"{part.type} part); send text only, or serve a model that takes {kind.value}",
                param,
                "unsupported_modality",
            )
    if len(parts) > limits.max_media_items:
        raise _bad(
            f"a request may hold at most {limits.max_media_items} media parts, this one holds "
            f"{len(parts)} (--max-media-items)",
            parts[limits.max_media_items][0],
            "too_many_media_items",
        )


# ----------------------------------------------------------------------------- decoding


def decode_audio_item(data: bytes, param: str, limits: MediaLimits, rate: int) -> MediaItem:
    """Decode an audio file to a mono float32 ``MediaItem`` at ``rate`` Hz.

    Raises:
        InvalidRequestError: empty or undecodable audio (``invalid_audio``), longer than
            ``limits.max_audio_seconds`` (``audio_too_long``).
    """
    try:
        decoded = decode_audio(data, limits.max_audio_seconds)
    except AudioDecodeError as exc:
        message = f"{param} is not audio this server decodes: {exc}"
        raise _bad(message, param, "invalid_audio") from None
    if decoded.truncated:
        raise _bad(
            f"{param} lasts more than {limits.max_audio_seconds:g} s (--max-audio-seconds)",
            param,
            "audio_too_long",
        )
    resampler = Resampler(decoded.sample_rate, rate, quality="VHQ")
    samples = np.concatenate([resampler.process(decoded.samples), resampler.flush()])
    return MediaItem.of(MediaKind.AUDIO, samples, sample_rate=rate, source=param)


def _open_video_stream(data: bytes, param: str, what: str):  # noqa: ANN202 - av types
    import av

    if not data:
        raise _bad(f"{param} is empty", param, f"invalid_{what}")
    try:
        container = av.open(io.BytesIO(data), mode="r")
    except (av.FFmpegError, ValueError, OSError):
        raise _bad(
            f"{param} is not {'an image' if what == 'image' else 'a video'} this server decodes "
            "(FFmpeg cannot read its format)",
            param,
            f"invalid_{what}",
        ) from None
    stream = next((s for s in container.streams if s.type == "video"), None)
    if stream is None:
        container.close()
        raise _bad(f"{param} holds no {what}", param, f"invalid_{what}")
    return container, stream


def _check_pixels(width: int, height: int, param: str, limits: MediaLimits) -> None:
    if width * height > limits.max_image_pixels:
        raise _bad(
            f"{param} is {width}x{height} pixels, over {limits.max_image_pixels} "
            "(--max-image-pixels)",
            param,
            "image_too_large",
        )


def decode_image_item(data: bytes, param: str, limits: MediaLimits) -> MediaItem:
    """Decode an image file (PNG, JPEG, WebP, ... anything FFmpeg reads) to an RGB uint8
    ``[height, width, 3]`` ``MediaItem``; the size is checked from the header first.

    Raises:
        InvalidRequestError: not an image (``invalid_image``), too many pixels
            (``image_too_large``).
    """
    import av

    container, stream = _open_video_stream(data, param, "image")
    with container:
        ctx = stream.codec_context
        _check_pixels(int(ctx.width or 0), int(ctx.height or 0), param, limits)
        try:
            frame = next(container.decode(stream), None)
        except (av.FFmpegError, ValueError):
            frame = None
        if frame is None:
            raise _bad(f"{param} could not be decoded as an image", param, "invalid_image")
        _check_pixels(frame.width, frame.height, param, limits)
        pixels = frame.to_ndarray(format="rgb24")
    return MediaItem.of(MediaKind.IMAGE, pixels, source=param)


def _video_too_long(param: str, limits: MediaLimits) -> InvalidRequestError:
    return _bad(
        f"{param} lasts more than {limits.max_video_seconds:g} s (--max-video-seconds)",
        param,
        "video_too_long",
    )


def _frame_size(width: int, height: int, max_pixels: int) -> tuple[int, int]:
    """``(width, height)`` scaled down (aspect kept, even sizes) to at most ``max_pixels``."""
    if width * height <= max_pixels:
        return width, height
    scale = (max_pixels / (width * height)) ** 0.5
    return max(2, int(width * scale) // 2 * 2), max(2, int(height * scale) // 2 * 2)


def decode_video_audio(data: bytes, param: str, limits: MediaLimits, rate: int) -> MediaItem:
    """A video file's audio track (its first audio stream) as a mono float32 AUDIO
    ``MediaItem`` at ``rate`` Hz: decoded by PyAV, resampled with soxr (the ``input_audio``
    path's resampler); what ``use_audio_in_video`` reads.

    Raises:
        InvalidRequestError: the file has no audio stream (``video_without_audio``: the part
            is named; transformers' ``get_rope_index`` cannot place a silent video among
            ``use_audio_in_video`` ones either), a track that does not decode
            (``invalid_video``), longer than ``max_video_seconds`` (``video_too_long``).
    """
    import av

    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            has_audio = any(s.type == "audio" for s in container.streams)
    except (av.FFmpegError, ValueError, OSError):
        raise _bad(f"{param} is not a video this server decodes", param, "invalid_video") from None
    if not has_audio:
        raise _bad(
            f"{param} has no audio track, and use_audio_in_video asks for one: send the video "
            "without use_audio_in_video, or a video with sound",
            param,
            "video_without_audio",
        )
    try:
        decoded = decode_audio(data, limits.max_video_seconds)
    except AudioDecodeError as exc:
        raise _bad(
            f"{param}: its audio track does not decode: {exc}", param, "invalid_video"
        ) from None
    if decoded.truncated:
        raise _video_too_long(param, limits)
    resampler = Resampler(decoded.sample_rate, rate, quality="VHQ")
    samples = np.concatenate([resampler.process(decoded.samples), resampler.flush()])
    return MediaItem.of(MediaKind.AUDIO, samples, sample_rate=rate, source=param)


def decode_video_item(
    data: bytes, param: str, limits: MediaLimits, audio_rate: int | None = None
) -> MediaItem:
    """Decode a video file with PyAV to RGB uint8 frames ``[num_frames, height, width, 3]``
    sampled at ``limits.video_fps`` (the first frame at or after each ``k / video_fps``
    seconds), scaled down to ``limits.max_video_frame_pixels``. With ``audio_rate``
    (``use_audio_in_video``) its audio track comes along as ``MediaItem.audio`` at that rate
    (``decode_video_audio``); otherwise the track is not read.

    Raises:
        InvalidRequestError: not a video or no frame (``invalid_video``), longer than
            ``max_video_seconds`` (``video_too_long``), more than ``max_video_frames`` sampled
            frames (``video_too_many_frames``), frames over ``max_image_pixels``
            (``image_too_large``); with ``audio_rate``, what ``decode_video_audio`` raises.
    """
    import av

    container, stream = _open_video_stream(data, param, "video")
    frames: list[np.ndarray] = []
    with container:
        ctx = stream.codec_context
        _check_pixels(int(ctx.width or 0), int(ctx.height or 0), param, limits)
        if container.duration is not None and container.duration / 1e6 > limits.max_video_seconds:
            raise _video_too_long(param, limits)
        next_time = 0.0
        try:
            for frame in container.decode(stream):
                t = float(frame.time or 0.0)
                if t > limits.max_video_seconds:
                    raise _video_too_long(param, limits)
                if t + 1e-6 < next_time:
                    continue
                _check_pixels(frame.width, frame.height, param, limits)
                if len(frames) == limits.max_video_frames:
                    raise _bad(
                        f"{param} has more than {limits.max_video_frames} frames at "
                        f"{limits.video_fps:g} fps (--max-video-frames)",
                        param,
                        "video_too_many_frames",
                    )
                width, height = _frame_size(
                    frame.width, frame.height, limits.max_video_frame_pixels
                )
                rgb = frame.to_ndarray(
                    format="rgb24", width=width, height=height, interpolation="BICUBIC"
                )
                frames.append(rgb)
                next_time = len(frames) / limits.video_fps
        except InvalidRequestError:
            raise
        except (av.FFmpegError, ValueError):  # a damaged tail: keep the frames decoded so far
            if not frames:
                raise _bad(f"{param} could not be decoded", param, "invalid_video") from None
    if not frames:
        raise _bad(f"{param} holds no video frames", param, "invalid_video")
    if len({f.shape for f in frames}) > 1:
        raise _bad(f"{param} changes frame size mid-stream", param, "invalid_video")
    audio = None if audio_rate is None else decode_video_audio(data, param, limits, audio_rate)
    return MediaItem.of(
        MediaKind.VIDEO, np.stack(frames), fps=limits.video_fps, source=param, audio=audio
    )


async def part_bytes(part: MediaPart, param: str, policy: MediaPolicy) -> bytes:
    """The file bytes a part carries or names (``media_fetch.read_media``)."""
    if isinstance(part, InputAudioPart):  # base64 (OpenAI); a data: URL is taken too
        data = part.input_audio.data
        if data[:5].lower() == "data:":
            return await read_media(data, policy, param)
        return b64decode(data, param)
    url = {"image_url": "image_url", "audio_url": "audio_url", "video_url": "video_url"}[part.type]
    return await read_media(getattr(part, url).url, policy, param)


async def decode_part(
    part: MediaPart,
    param: str,
    card: ModelCard,
    policy: MediaPolicy,
    limits: MediaLimits,
    use_audio_in_video: bool = False,
) -> MediaItem:
    """Read and decode one media part (decoding runs in the thread pool); a video part with
    ``use_audio_in_video`` carries its audio track at ``card.media_sample_rate``."""
    data = await part_bytes(part, param, policy)
    kind = part_kind(part)
    if kind is MediaKind.AUDIO:
        if not data:
            raise _bad(f"{param} is empty", param, "invalid_audio")
        return await run_in_threadpool(
            decode_audio_item, data, param, limits, card.media_sample_rate
        )
    if kind is MediaKind.IMAGE:
        return await run_in_threadpool(decode_image_item, data, param, limits)
    rate = card.media_sample_rate if use_audio_in_video else None
    return await run_in_threadpool(decode_video_item, data, param, limits, rate)
