"""VoxCPM2's AudioVAE decoder as the chunked vocoder component (AUDIO_CHUNK units).

``AudioVAEComponent`` is the shared ``ChunkVocoder`` over ``AudioVAEDecoder``, with two kinds
of unit, both equal to the whole decode within float rounding:

- Stateful (``seq_id`` set; the audio loop's ``stream_state``): the component keeps each
  stream's conv tails (``AudioVAEDecoder.init_state``: the last inputs of every causal conv and
  transposed conv, ~1.3k floats per channel group at the published size), so a chunk costs its
  own frames only; ``free_sequence`` drops a stream. A unit whose first frame is not where its
  stream stands raises ValueError.
- Stateless (``seq_id`` None): the window carries its own left context; exact when the loop
  gives ``left_context >= decoder.left_context_frames`` (21 latent frames: five patches and a
  frame), which costs ``(21 + chunk) / chunk`` times the chunk's own work.

Frames are latent frames, ``[C]`` float tensors or arrays (a patch is ``patch_size`` of them).
Stateful units of one batch are decoded together when their chunks have equal lengths (the
tails are stacked per layer), else in groups of equal length; ``batch_invariant`` decodes every
unit alone. Weight updates reach the decoder under the published ``audiovae`` file's names
(``weight_specs`` / ``update_weights``, ``vae_weights.VAEWeights``).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import torch

from omnistep.loops import AudioChunkInput
from omnistep.models.voxcpm.audio_vae import AudioVAEDecoder, State
from omnistep.models.voxcpm.vae_weights import VAEWeights
from omnistep.runners.vocoder import ChunkVocoder


def _latents(frames: Sequence[object], device: torch.device) -> torch.Tensor:
    """Latent frames -> ``[C, T]`` float32."""
    rows = [torch.as_tensor(np.asarray(f), dtype=torch.float32) for f in frames]
    return torch.stack(rows, dim=1).to(device)


class AudioVAEComponent(ChunkVocoder):
    """Runs AUDIO_CHUNK units over latent frames; returns float32 ``[chunk * hop]`` samples at
    48 kHz per unit (see the module docstring for the two kinds of unit)."""

    def __init__(
        self,
        decoder: AudioVAEDecoder,
        batch_invariant: bool = False,
        normed: frozenset[str] = frozenset(),
    ):
        super().__init__(decoder, "the VoxCPM2 AudioVAE decoder", batch_invariant)
        self._streams: dict[str, tuple[int, State]] = {}  # seq_id -> (next frame, tails)
        self._lock = threading.Lock()
        self._weights = VAEWeights(decoder, "decoder", normed)

    def weight_specs(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """``name -> (shape, dtype)`` of the decoder's tensors under the published
        ``audiovae`` file's names (``decoder.*``; ``weight_g`` / ``weight_v`` for the convs
        the file holds weight-normed: ``vae_weights.VAEWeights``)."""
        return self._weights.specs()

    def weight_problems(self, tensors: dict[str, object]) -> list[str]:
        """What ``ModelInstance.check_weights`` refuses beyond names, shapes and dtypes: a
        ``weight_v`` with an output channel of norm 0 (``vae_weights.VAEWeights.problems``)."""
        return self._weights.problems(tensors)

    def update_weights(self, tensors: dict[str, object]) -> None:
        """Copy checked tensors (``ModelInstance.check_weights``) into the decoder in place;
        call only between steps. Streams keep their conv tails (computed with the old
        weights), as a running request keeps its KV cache.

        Raises:
            KeyError: a name ``weight_specs`` does not list.
            WeightNormError: a ``weight_v`` with an output channel of norm 0 (nothing changed).
        """
        self._weights.update(tensors)

    @property
    def num_streams(self) -> int:
        """Streams whose state is held."""
        return len(self._streams)

    def free_sequence(self, seq_id: str) -> None:
        """Drop stream ``seq_id``'s state; idempotent."""
        with self._lock:
            self._streams.pop(seq_id, None)

    @torch.inference_mode()
    def decode(self, payloads: Sequence[AudioChunkInput]) -> list[torch.Tensor]:
        """Every unit's chunk samples ``[chunk * hop]``.

        Raises:
            ValueError: a stateful unit that does not continue its stream, or two units of one
                stream in a batch.
        """
        decoder: AudioVAEDecoder = self.decoder
        device = next(decoder.parameters()).device
        out: list[torch.Tensor | None] = [None] * len(payloads)
        for i, p in enumerate(payloads):
            if p.seq_id is None:
                window = _latents(p.frames, device)[None]
                out[i] = decoder.decode_chunk(window, p.left, p.chunk)[0]
        stateful = [i for i, p in enumerate(payloads) if p.seq_id is not None]
        ids = [payloads[i].seq_id for i in stateful]
        if len(set(ids)) != len(ids):
            raise ValueError(f"two chunks of one stream in a batch: {sorted(ids)}")  # type: ignore[arg-type]
        groups: dict[int, list[int]] = {}
        for i in stateful:
            key = i if self.batch_invariant else payloads[i].chunk
            groups.setdefault(key, []).append(i)
        new: dict[str, tuple[int, State]] = {}
        for members in groups.values():
            states = [self._state(payloads[i]) for i in members]
            state = {k: torch.cat([s[k] for s in states]) for k in states[0]}
            z = torch.stack(
                [
                    _latents(payloads[i].frames[payloads[i].left :][: payloads[i].chunk], device)
                    for i in members
                ]
            )
            wave = decoder.decode(z, state)
            for row, i in enumerate(members):
                unit = payloads[i]
                tails = {k: v[row : row + 1] for k, v in state.items()}
                new[unit.seq_id] = (unit.start + unit.left + unit.chunk, tails)  # type: ignore[index]
                out[i] = wave[row]
        with self._lock:  # states change only once the whole batch has run
            self._streams.update(new)
        return out  # type: ignore[return-value]

    def _state(self, unit: AudioChunkInput) -> State:
        first = unit.start + unit.left
        if first == 0:
            return self.decoder.init_state()
        with self._lock:
            entry = self._streams.get(unit.seq_id)  # type: ignore[arg-type]
        if entry is None or entry[0] != first:
            where = "no state" if entry is None else f"its state at frame {entry[0]}"
            raise ValueError(
                f"stream {unit.seq_id!r}: a chunk from frame {first}, but the decoder holds {where}"
            )
        return dict(entry[1])
