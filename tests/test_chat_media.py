"""Chat media content parts on ``/v1/chat/completions``: parsing into ``MediaItem``s (order,
hashes, resampling, frames) and every 400 naming the part (``omnistep.server.media``).

Served in-process (httpx's ASGI transport) on the toy card, as is (no media capability: every
media part is refused) and with the media capabilities added (the toy ignores the media, the
requests it receives are inspected).
"""

from __future__ import annotations

import base64
import dataclasses
import io
from contextlib import asynccontextmanager
from fractions import Fraction
from pathlib import Path

import av
import httpx
import numpy as np
import pytest
import soundfile as sf

from omnistep.core import Capability, MediaItem, MediaKind, ModelInstance
from omnistep.engine import AsyncEngine
from omnistep.models import registry
from omnistep.server import ServerConfig, build_app
from omnistep.server.media import MediaLimits

URL = "/v1/chat/completions"
MEDIA_CAPS = {Capability.AUDIO_INPUT, Capability.IMAGE_INPUT, Capability.VIDEO_INPUT}


# ------------------------------------------------------------------ media files
def tone(seconds: float, rate: int, freq: float = 440.0) -> np.ndarray:
    """int16 samples (stored exactly by every 16-bit container)."""
    t = np.arange(int(seconds * rate)) / rate
    return (16000 * np.sin(2 * np.pi * freq * t)).astype(np.int16)


def audio_file(
    samples: np.ndarray, rate: int, fmt: str = "WAV", subtype: str | None = None
) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, samples, rate, format=fmt, subtype=subtype)
    return buf.getvalue()


def _encode(frames: np.ndarray, fmt: str, codec: str, rate: int = 1, pix: str = "yuv420p") -> bytes:
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as out:
        stream = out.add_stream(codec, rate=rate)
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], pix
        stream.time_base = Fraction(1, rate)
        for i, rgb in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")
            frame.pts = i
            out.mux(stream.encode(frame))
        out.mux(stream.encode(None))
    return buf.getvalue()


def png(pixels: np.ndarray) -> bytes:
    return _encode(pixels[None], "image2pipe", "png", pix="rgb24")


def video(num_frames: int, fps: int, size: tuple[int, int] = (32, 48)) -> bytes:
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 255, (num_frames, *size, 3), dtype=np.uint8)
    return _encode(frames, "mp4", "mpeg4", rate=fps)


def data_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def audio_part(data: bytes, fmt: str = "wav") -> dict:
    return {"type": "input_audio", "input_audio": {"data": b64(data), "format": fmt}}


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def body(*messages: dict) -> dict:
    return {"model": "toy", "messages": list(messages), "max_tokens": 3, "seed": 1}


# ------------------------------------------------------------------ servers
@asynccontextmanager
async def served(media: bool, tmp_path: Path, limits: MediaLimits | None = None, **config):
    """An in-process client of the toy card (with the media capabilities when ``media``);
    yields ``(client, requests)`` where ``requests`` collects the engine requests."""
    card = registry.build_card("toy")
    if media:
        card = dataclasses.replace(card, capabilities=card.capabilities | MEDIA_CAPS)
    engine = AsyncEngine([ModelInstance.load(card)])
    seen = []
    add = engine.add_request

    def recording(request, *args, **kwargs):
        seen.append(request)
        return add(request, *args, **kwargs)

    engine.add_request = recording  # type: ignore[method-assign]
    settings = ServerConfig(
        voices_db=str(tmp_path / "voices.db"), media_limits=limits or MediaLimits(), **config
    )
    app = build_app(engine, settings)
    try:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test/") as client:
            yield client, seen
    finally:
        await engine.shutdown()


async def _error(client: httpx.AsyncClient, payload: dict) -> dict:
    r = await client.post(URL, json=payload)
    assert r.status_code == 400, r.text
    return r.json()["error"]


# ------------------------------------------------------------------ tests
async def test_mixed_parts_become_ordered_media_items(tmp_path):
    clip = tone(0.5, 24000)
    pixels = np.random.default_rng(1).integers(0, 255, (20, 30, 3), dtype=np.uint8)
    messages = (
        {"role": "system", "content": "be brief"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "first "},
                audio_part(audio_file(clip, 24000)),
                {"type": "text", "text": "then "},
                image_part(data_url(png(pixels), "image/png")),
            ],
        },
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [audio_part(audio_file(clip, 24000, "FLAC"), "flac")]},
        {
            "role": "user",
            "content": [
                {
                    "type": "input_audio",
                    "input_audio": {
                        "data": data_url(audio_file(clip, 24000), "audio/wav"),
                        "format": "wav",
                    },
                }
            ],
        },
    )
    async with served(True, tmp_path) as (client, seen):
        r = await client.post(URL, json=body(*messages))
        assert r.status_code == 200, r.text
    (request,) = seen
    parts = request.messages[1].parts
    assert [type(p) for p in parts] == [str, MediaItem, str, MediaItem]
    assert parts[0] == "first " and parts[2] == "then "
    assert request.messages[1].content == "first then "
    audio, image = parts[1], parts[3]
    assert audio.kind is MediaKind.AUDIO and audio.sample_rate == 16000
    assert audio.data.dtype == np.float32 and audio.data.shape == (8000,)
    assert audio.source == "messages[1].content[1]"
    # resampled 24 kHz -> 16 kHz: the same 440 Hz tone, not a sped-up one
    spectrum = np.abs(np.fft.rfft(audio.data))
    assert abs(np.argmax(spectrum) * 16000 / audio.data.size - 440) < 3
    assert image.kind is MediaKind.IMAGE and np.array_equal(image.data, pixels)
    assert not audio.data.flags.writeable and not image.data.flags.writeable  # hashed: frozen
    # the same samples in another container hash the same; the text-only message has no parts
    assert request.messages[3].media[0].sha256 == audio.sha256
    assert request.messages[4].media[0].sha256 == audio.sha256  # given as a data: URL
    assert request.messages[0].parts == () and request.messages[2].parts == ()
    kinds = [MediaKind.AUDIO, MediaKind.IMAGE, MediaKind.AUDIO, MediaKind.AUDIO]
    assert [m.kind for m in request.media] == kinds
    assert len(image.sha256) == 64 and image.sha256 != audio.sha256


async def test_audio_url_and_video_url_from_allowed_dir(tmp_path):
    folder = tmp_path / "media"
    folder.mkdir()
    (folder / "clip.wav").write_bytes(audio_file(tone(0.25, 16000), 16000))
    (folder / "clip.mp4").write_bytes(video(num_frames=10, fps=4))
    content = [
        {"type": "video_url", "video_url": {"url": "clip.mp4"}},
        {"type": "text", "text": "what happens?"},
        {"type": "audio_url", "audio_url": {"url": f"file://{folder / 'clip.wav'}"}},
    ]
    async with served(True, tmp_path, allowed_local_media_path=str(folder)) as (client, seen):
        r = await client.post(URL, json=body({"role": "user", "content": content}))
        assert r.status_code == 200, r.text
    clip_video, _, clip_audio = seen[0].messages[0].parts
    assert clip_video.kind is MediaKind.VIDEO and clip_video.fps == 2.0
    # 10 frames at 4 fps = 2.5 s, sampled at 2 fps: t = 0, 0.5, 1.0, 1.5, 2.0
    assert clip_video.data.shape == (5, 32, 48, 3) and clip_video.data.dtype == np.uint8
    assert clip_audio.data.shape == (4000,) and clip_audio.sample_rate == 16000


async def test_a_card_without_media_capabilities_refuses_each_kind(tmp_path):
    wav = audio_file(tone(0.1, 16000), 16000)
    cases = [
        (audio_part(wav), "audio"),
        (image_part(data_url(png(np.zeros((4, 4, 3), np.uint8)), "image/png")), "image"),
        ({"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}, "video"),
    ]
    async with served(False, tmp_path) as (client, _):
        for part, kind in cases:
            content = [{"type": "text", "text": "hi"}, part]
            error = await _error(client, body({"role": "user", "content": content}))
            assert error["param"] == "messages[0].content[1]"
            assert error["code"] == "unsupported_modality"
            assert f"cannot take {kind} input" in error["message"]


async def test_bad_media_answers_400_naming_the_part(tmp_path):
    folder = tmp_path / "media"
    folder.mkdir()
    outside = tmp_path / "secret.wav"
    outside.write_bytes(audio_file(tone(0.1, 16000), 16000))
    limits = MediaLimits(
        max_audio_seconds=1.0, max_image_pixels=2000, max_media_items=3, max_video_frames=3
    )
    long_clip = audio_file(tone(1.5, 16000), 16000)
    big_image = data_url(png(np.zeros((50, 50, 3), np.uint8)), "image/png")
    cases = [
        (audio_part(b""), "invalid_audio"),  # base64 of nothing
        ({"type": "input_audio", "input_audio": {"data": "!!", "format": "wav"}}, "invalid_base64"),
        (audio_part(b"not audio at all" * 20), "invalid_audio"),
        (audio_part(audio_file(np.zeros(0, np.int16), 16000)), "invalid_audio"),
        (audio_part(long_clip), "audio_too_long"),
        # a float WAV of NaN: it reached the model and answered '!!!!' (NaN logits)
        (audio_part(audio_file(np.full(1600, np.nan), 16000, subtype="FLOAT")), "invalid_audio"),
        (audio_part(audio_file(np.full(1600, -np.inf), 16000, subtype="FLOAT")), "invalid_audio"),
        # was read as a relative path under the allowed folder: 'file_not_found'
        (image_part("ftp://example.com/cat.png"), "unsupported_url_scheme"),
        (image_part(big_image), "image_too_large"),
        (image_part("data:image/png;base64," + b64(b"\x89PNG broken")), "invalid_image"),
        (image_part("https://example.com/cat.png"), "remote_media_disabled"),
        ({"type": "audio_url", "audio_url": {"url": str(outside)}}, "local_media_forbidden"),
        ({"type": "audio_url", "audio_url": {"url": "../secret.wav"}}, "local_media_forbidden"),
        ({"type": "video_url", "video_url": {"url": "missing.mp4"}}, "file_not_found"),
        (
            {"type": "video_url", "video_url": {"url": data_url(video(12, 4), "video/mp4")}},
            "video_too_many_frames",
        ),
    ]
    async with served(True, tmp_path, limits, allowed_local_media_path=str(folder)) as (client, _):
        for part, code in cases:
            messages = (
                {"role": "user", "content": "hello"},
                {"role": "user", "content": [{"type": "text", "text": "look"}, part]},
            )
            error = await _error(client, body(*messages))
            assert (error["param"], error["code"]) == ("messages[1].content[1]", code), error
        many = [image_part(data_url(png(np.zeros((4, 4, 3), np.uint8)), "image/png"))] * 4
        error = await _error(client, body({"role": "user", "content": many}))
        assert (error["param"], error["code"]) == ("messages[0].content[3]", "too_many_media_items")
        # malformed parts fail the body's validation, which names the part too
        for part, words in [
            ({"type": "input_hologram", "input_hologram": {}}, "'input_hologram'"),
            ({"type": "input_audio", "input_audio": {"data": "", "format": "aiff"}}, "'m4a'"),
            ({"type": "image_url", "image_url": {}}, "image_url.url"),
        ]:
            content = [{"type": "text", "text": "look"}, part]
            error = await _error(client, body({"role": "user", "content": content}))
            assert error["param"] == "messages[0].content[1]" and words in error["message"]
        # the server stays usable
        r = await client.post(URL, json=body({"role": "user", "content": "hi"}))
        assert r.status_code == 200


async def test_local_paths_need_the_flag(tmp_path):
    async with served(True, tmp_path) as (client, _):
        part = {"type": "audio_url", "audio_url": {"url": "/etc/hostname"}}
        error = await _error(client, body({"role": "user", "content": [part]}))
        assert error["code"] == "local_media_disabled"
        assert "--allowed-local-media-path" in error["message"]


def test_media_limits_reject_non_positive_values():
    with pytest.raises(ValueError, match="max_media_items"):
        MediaLimits(max_media_items=0)


def test_large_video_frames_are_scaled_down_at_decode():
    from omnistep.server.media import decode_video_item

    limits = MediaLimits(max_video_frame_pixels=400)
    item = decode_video_item(video(num_frames=4, fps=2, size=(32, 48)), "v", limits)
    # 32 x 48 = 1536 pixels -> scale sqrt(400 / 1536): 16 x 24 (even sizes, aspect kept)
    assert item.data.shape == (4, 16, 24, 3) and item.fps == 2.0
    full = decode_video_item(video(num_frames=4, fps=2, size=(32, 48)), "v", MediaLimits())
    assert full.data.shape == (4, 32, 48, 3)
    assert abs(float(full.data.mean()) - float(item.data.mean())) < 10  # the same picture


@pytest.mark.parametrize("fmt", ["mp3", "opus", "aac", "flac"])
def test_compressed_audio_formats_decode_to_16k(fmt):
    """OpenAI's mp3, and what PyAV reads besides (Ogg Opus, AAC in ADTS, FLAC): the duration
    and the tone survive decoding and resampling."""
    from omnistep.audio import make_encoder
    from omnistep.server.media import decode_audio_item

    samples = tone(1.0, 24000).astype(np.float32) / 32768
    encoder = make_encoder(fmt, 24000)
    data = encoder.encode(samples) + encoder.flush()
    item = decode_audio_item(data, "p", MediaLimits(), 16000)
    assert item.sample_rate == 16000 and abs(item.seconds - 1.0) < 0.08
    spectrum = np.abs(np.fft.rfft(item.data))
    assert abs(np.argmax(spectrum) * 16000 / item.data.size - 440) < 5
