"""The ``toy`` card's ``vocoder`` component: tokens -> sine segments, numpy only."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from omnistep.core import WorkUnitKind
from omnistep.loops import AudioChunkInput

SAMPLE_RATE = 8000
SAMPLES_PER_TOKEN = 80


class ToyVocoder:
    """Each token becomes ``SAMPLES_PER_TOKEN`` samples of a sine at ``200 + 20 * token`` Hz."""

    def __init__(self, device: str = "cpu"):
        self.t = np.arange(SAMPLES_PER_TOKEN) / SAMPLE_RATE

    def execute(self, kind: WorkUnitKind, payloads: Sequence[AudioChunkInput]) -> list[np.ndarray]:
        """Returns float32 ``[chunk * SAMPLES_PER_TOKEN]`` per unit (context frames unused)."""
        if any(p.extras and p.extras.get("fail_vocoder") for p in payloads):
            raise RuntimeError("injected fault in toy vocoder")
        tokens = np.array([p.frames[p.left : p.left + p.chunk] for p in payloads])  # [batch, chunk]
        freqs = 200.0 + 20.0 * tokens
        wave = 0.3 * np.sin(2 * np.pi * freqs[..., None] * self.t)  # [batch, chunk, samples]
        return [w.reshape(-1).astype(np.float32) for w in wave]
