"""Media files the HTTP tests send (as a client would upload or inline them): WAV bytes, a
PNG and an mp4 with an audio track, the last two base64-encoded for data URLs and
``input_audio``/``image_url``/``video_url`` parts."""

from __future__ import annotations

import base64
import io

import numpy as np


def wav_bytes(samples: np.ndarray, rate: int = 16000, subtype: str = "FLOAT") -> bytes:
    """``samples`` (float32 ``[N]`` in [-1, 1]) as a mono WAV file at ``rate`` Hz (soundfile;
    ``subtype`` "FLOAT" or "PCM_16")."""
    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, samples, rate, format="WAV", subtype=subtype)
    return buf.getvalue()


def png_b64(shape: tuple[int, int, int] = (64, 96, 3), seed: int = 4) -> str:
    """A random RGB PNG of ``shape`` (height, width, 3), base64 (PIL)."""
    from PIL import Image

    buf = io.BytesIO()
    pixels = np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)
    Image.fromarray(pixels).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def mp4_b64() -> str:
    """A 1 s 32 x 32 mp4 (4 frames at 4 fps, H.264) with a mono 16 kHz AAC track of a sine,
    base64 (PyAV)."""
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        video = out.add_stream("libx264", rate=4)
        video.width = video.height = 32
        video.pix_fmt = "yuv420p"
        audio = out.add_stream("aac", rate=16000, layout="mono")
        for i in range(4):
            frame = av.VideoFrame.from_ndarray(np.full((32, 32, 3), 40 * i, np.uint8), "rgb24")
            for packet in video.encode(frame):
                out.mux(packet)
        for packet in video.encode():
            out.mux(packet)
        samples = (0.1 * np.sin(np.arange(16000) / 5.0)).astype(np.float32)[None]
        aframe = av.AudioFrame.from_ndarray(samples, format="flt", layout="mono")
        aframe.sample_rate = 16000
        for packet in audio.encode(aframe):
            out.mux(packet)
        for packet in audio.encode():
            out.mux(packet)
    return base64.b64encode(buf.getvalue()).decode()
