"""One AUDIO_CHUNK component for every chunked vocoder.

A family's vocoder module decodes a window of frames (left context + chunk + look-ahead) and
returns the chunk's samples: ``decode_chunk(window, left, chunk) -> [B, chunk * hop]``. The
audio loop (``loops.audio_decode``) cuts the windows; ``ChunkVocoder`` runs one batch of them:
it checks the unit kind, stacks the windows' frames ``[B, W, dim]`` (``channels_first``:
``[B, dim, W]``, as BigVGAN takes mels) on the module's device, decodes them in one call, and
returns float32 numpy rows. All windows of one batch have the same ``left``/``chunk`` (they
share a ShapeSignature). ``batch_invariant`` decodes each unit alone, so a unit's samples never
depend on its batch neighbours (batched CPU convolutions pick kernels by shape: ~1e-6).

A vocoder with per-request state (Qwen3-TTS's causal codec keeps a KV cache and conv inputs
per stream) subclasses it and overrides ``decode``.

Imports: torch, numpy, ``omnistep.core``, ``omnistep.loops`` (payload type).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from omnistep.core import WorkUnitKind
from omnistep.loops import AudioChunkInput


class ChunkVocoder:
    """Runs AUDIO_CHUNK units of a chunked vocoder.

    Args:
        decoder: the vocoder module, with ``decode_chunk(window, left, chunk)`` returning
            ``[B, chunk * hop]`` samples of a ``[B, W, dim]`` window (``channels_first``:
            ``[B, dim, W]``).
        name: how errors name it (``"BigVGAN"``).
        batch_invariant: run every unit alone (bit-identical whatever the batch; slower).
        channels_first: hand ``decode_chunk`` ``[B, dim, W]`` instead of ``[B, W, dim]``.
    """

    def __init__(
        self,
        decoder: nn.Module,
        name: str,
        batch_invariant: bool = False,
        channels_first: bool = False,
    ):
        self.decoder = decoder
        self.name = name
        self.batch_invariant = batch_invariant
        self.channels_first = channels_first

    def execute(self, kind: WorkUnitKind, payloads: Sequence[AudioChunkInput]) -> list[np.ndarray]:
        """Each unit's chunk samples, float32 numpy ``[chunk * hop]``, in the units' order.

        Raises:
            ValueError: ``kind`` is not AUDIO_CHUNK (and whatever ``decode`` raises for a bad
                window).
        """
        if kind is not WorkUnitKind.AUDIO_CHUNK:
            raise ValueError(f"{self.name} runs AUDIO_CHUNK units, got {kind}")
        # here, not only on ``decode``: a subclass's own ``decode`` (the codec component's,
        # VoxCPM's AudioVAE) does not inherit the decorator, and with autograd on every chunk
        # recorded a graph (Qwen3-TTS at C=1 ran ~20% slower for it)
        with torch.inference_mode():
            rows = self.decode(payloads)
            return [np.ascontiguousarray(row.float().cpu().numpy()) for row in rows]

    @torch.inference_mode()
    def decode(self, payloads: Sequence[AudioChunkInput]) -> Sequence[torch.Tensor]:
        """The units' samples as tensors, one ``[chunk * hop]`` row each: the windows' frames
        (``[dim]`` tensors each) stacked and decoded in one ``decode_chunk`` call, or one call
        per unit under ``batch_invariant``."""
        if self.batch_invariant and len(payloads) > 1:
            return [row for p in payloads for row in self.decode([p])]
        first = payloads[0]
        device = next(self.decoder.parameters()).device
        window = torch.stack([torch.stack(list(p.frames)) for p in payloads]).to(device)
        if self.channels_first:
            window = window.transpose(1, 2)  # [B, dim, W]
        return list(self.decoder.decode_chunk(window, first.left, first.chunk))  # [B, samples]
