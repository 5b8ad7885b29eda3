"""Collect a request's whole stream: what the offline API and the parity gates both run.

Imports ``omnistep.core`` and the engine's ``AsyncEngine`` (numpy for the audio).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from omnistep.core import Modality, Request, StreamChunk
from omnistep.engine.engine import AsyncEngine


@dataclass
class Collected:
    """A request's whole stream.

    Attributes:
        chunks: every StreamChunk in order.
        audio: the concatenated audio, float32 ``[num_samples]``.
        text: the concatenated text deltas.
        sample_rate: Hz of ``audio`` (0 when there is none).
        seed: the seed the request ran with.
        trajectories: ROLLOUT records of its loops, by program node name (empty under SERVE).
        rollout_info: ROLLOUT replay information of its loops (prompt, stop reason, seed).
    """

    chunks: list[StreamChunk]
    audio: np.ndarray
    text: str
    sample_rate: int
    seed: int
    trajectories: dict[str, list] = field(default_factory=dict)
    rollout_info: dict[str, dict] = field(default_factory=dict)


async def collect(engine: AsyncEngine, request: Request) -> Collected:
    """Run one request to completion and gather its stream (errors propagate). Cancelled
    (the caller gave up: a sibling request failed, a client left), it aborts the request,
    which would otherwise run on for nobody."""
    stream = engine.add_request(request)
    try:
        chunks = [chunk async for chunk in stream]
    except BaseException:
        stream.cancel()
        raise
    audio = [c.audio for c in chunks if c.modality is Modality.AUDIO and c.audio is not None]
    rates = {c.sample_rate for c in chunks if c.modality is Modality.AUDIO}
    if len(rates) > 1:
        raise ValueError(f"request streamed audio at several sample rates: {rates}")
    return Collected(
        chunks=chunks,
        audio=np.concatenate(audio) if audio else np.zeros(0, np.float32),
        text="".join(c.text or "" for c in chunks if c.modality is Modality.TEXT),
        sample_rate=rates.pop() if rates else 0,
        seed=stream.seed,
        trajectories=dict(stream.trajectories),
        rollout_info=dict(stream.rollout_info),
    )
