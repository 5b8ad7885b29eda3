"""The ``toy`` card's ``vocoder`` component: tokens -> sine segments, numpy only."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from omnistep.core import LoopKind, LoopNode, LoopSpec, Modality, WorkUnitKind
from omnistep.loops import AudioChunkInput, AudioDecodeConfig, AudioDecodeLoop

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


def audio_loop_spec(
    *, first_chunk: int = 2, chunk: int = 4, lookahead: int = 1, extras_slot: str | None = None
) -> LoopSpec:
    """The toy cards' ``audio`` loop: the generic AUDIO_DECODE loop over the ``vocoder``
    component, reading tokens from the ``token_stream`` slot (chunk sizes in tokens, one token
    of left context; ``extras_slot``: see ``AudioDecodeConfig``)."""
    config = AudioDecodeConfig(
        loop_id="audio",
        component="vocoder",
        in_slot="token_stream",
        sample_rate=SAMPLE_RATE,
        first_chunk=first_chunk,
        chunk=chunk,
        left_context=1,
        lookahead=lookahead,
        extras_slot=extras_slot,
    )
    return LoopSpec(
        "audio",
        LoopKind.AUDIO_DECODE,
        (WorkUnitKind.AUDIO_CHUNK,),
        ("vocoder",),
        lambda: AudioDecodeLoop(config),
    )


def vocode_node(*, when_audio_out: bool = True) -> LoopNode:
    """The program node running the ``audio`` loop on ``token_stream`` into ``samples``;
    ``when_audio_out``: only for requests whose ``output_modalities`` hold audio (chat cards)."""
    if not when_audio_out:
        return LoopNode("vocode", "audio", needs=("token_stream",), binds="samples")
    return LoopNode(
        "vocode",
        "audio",
        needs=("token_stream",),
        binds="samples",
        when=lambda req: Modality.AUDIO in req.output_modalities,
    )
