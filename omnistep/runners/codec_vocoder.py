"""The 12.5 Hz causal codec decoder as a serving component (Qwen3-TTS's speech tokenizer
decoder and Qwen3-Omni's code2wav, both ``omnistep.layers.codec_decoder``):
``CodecDecoderComponent`` runs AUDIO_CHUNK units of the chunked vocoder loop, keeping each
request's stream state, and ``codec_decode_config`` is the loop's settings for it.

Imports: torch, numpy, ``omnistep.layers.codec_decoder``, ``omnistep.loops`` (config types
only), ``omnistep.runners.vocoder`` (the component is the shared ``ChunkVocoder`` with stream
state).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from omnistep.layers.codec_decoder import (
    SAMPLE_RATE,
    CodecDecoder,
    CodecDecoderConfig,
    DecodeRow,
    DecoderStream,
)
from omnistep.loops import AudioChunkInput, AudioDecodeConfig
from omnistep.runners.vocoder import ChunkVocoder


@dataclass(frozen=True, eq=False)
class CodecPrefix:
    """Codes decoded before a request's own frames, as context only: int64 ``[P, Q]``.

    Voice cloning (upstream ``generate_voice_clone``) decodes ``ref_code + codes`` and cuts the
    reference's share of the samples off; a request carrying its reference codes here (as the
    audio loop's ``extras``) gets the same samples for its own frames, without the reference's.
    """

    codes: torch.Tensor


class CodecDecoderComponent(ChunkVocoder):
    """Runs AUDIO_CHUNK units (``AudioChunkInput``): ``frames`` are code frames (``Q`` ints
    each: tuples, lists, arrays or int tensors), ``extras`` None or a ``CodecPrefix``; returns
    float32 numpy ``[chunk * hop]`` at 24 kHz per unit.

    Two kinds of unit, both exact (the whole decode's samples within float rounding):

    - Stateful (``seq_id`` set; the loop's ``stream_state``, the card's default): the component
      keeps each stream's ``DecoderStream`` (KV cache of the last ``sliding_window - 1``
      positions of every layer, every causal conv's last inputs; about 5 MB at the published
      size), made at the stream's first chunk (``start + left == 0``; primed with a
      ``CodecPrefix``'s codes) and freed by ``free_sequence(seq_id)``, which the audio loop
      calls when the request finishes, fails or is aborted. A chunk then costs its own frames
      only. A unit whose first chunk frame is not where its stream stands raises ValueError
      (its state was lost or it skipped frames).
    - Stateless (``seq_id`` None): the window carries its own left context; the loop must
      give ``left_context >= decoder.left_context_frames`` (a ``CodecPrefix`` is prepended to
      windows that start at the request's frame 0, which with that context are the windows with
      ``left < left_context_frames``).

    Units run as one batch (stateful and stateless ones in one batch each; rows right-padded,
    exact for this causal decoder); a batched row differs from the row alone only by float
    rounding (CPU and GPU kernels pick algorithms by shape). ``batch_invariant`` runs every row
    alone, so its samples are bit-identical whatever else is in the batch. A batch that raises
    changes no stream's state (states are replaced only once the whole batch has run), so the
    executor's unit-by-unit rerun sees them as they were.
    """

    def __init__(
        self, decoder: CodecDecoder, batch_invariant: bool = False, name: str = "the codec decoder"
    ):
        super().__init__(decoder, name, batch_invariant)
        self._streams: dict[str, tuple[int, DecoderStream]] = {}  # seq_id -> (next frame, state)
        self._lock = threading.Lock()  # free_sequence may come from another thread

    @property
    def num_streams(self) -> int:
        """Streams whose state is held (0 when no request is decoding)."""
        return len(self._streams)

    def free_sequence(self, seq_id: str) -> None:
        """Drop the state of stream ``seq_id``; idempotent (an unknown id is a no-op)."""
        with self._lock:
            self._streams.pop(seq_id, None)

    def decode(self, payloads: Sequence[AudioChunkInput]) -> list[torch.Tensor]:
        """Decode every unit's chunk (``execute`` checks the kind and makes numpy rows).

        Raises:
            ValueError: a unit's frames are not ``Q`` codes in ``[0, codebook_size)``; a
                stateful unit does not continue its stream (or two units of one stream in a
                batch).
            TypeError: ``extras`` neither None nor a ``CodecPrefix``.
        """
        out: list[torch.Tensor | None] = [None] * len(payloads)
        stateless = [i for i, p in enumerate(payloads) if p.seq_id is None]
        stateful = [i for i, p in enumerate(payloads) if p.seq_id is not None]
        if stateless:
            rows = [self._row(payloads[i]) for i in stateless]
            if self.batch_invariant:
                waves = [self.decoder.decode_rows([row])[0] for row in rows]
            else:
                waves = self.decoder.decode_rows(rows)
            for i, wave in zip(stateless, waves, strict=True):
                out[i] = wave
        if stateful:
            units = [payloads[i] for i in stateful]
            for i, wave in zip(stateful, self._decode_streams(units), strict=True):
                out[i] = wave
        return out  # type: ignore[return-value]

    def _decode_streams(self, units: Sequence[AudioChunkInput]) -> list[torch.Tensor]:
        ids = [u.seq_id for u in units]
        if len(set(ids)) != len(ids):
            raise ValueError(f"two chunks of one stream in a batch: {sorted(ids)}")  # type: ignore[arg-type]
        chunks, streams = [], []
        with self._lock:
            held = {i: self._streams.get(i) for i in ids}  # type: ignore[index]
        for unit in units:
            first = unit.start + unit.left
            codes = _codes(unit.frames[unit.left : unit.left + unit.chunk])
            if first == 0:
                stream = self._new_stream(unit.extras)
            else:
                entry = held[unit.seq_id]  # type: ignore[index]
                if entry is None or entry[0] != first:
                    where = "no state" if entry is None else f"its state at frame {entry[0]}"
                    raise ValueError(
                        f"stream {unit.seq_id!r}: a chunk from frame {first}, but the decoder "
                        f"holds {where}"
                    )
                stream = entry[1]
            chunks.append(codes)
            streams.append(stream)
        if self.batch_invariant:
            pairs = [
                self.decoder.decode_stream([c], [s]) for c, s in zip(chunks, streams, strict=True)
            ]
            waves, new = [w for (w,), _ in pairs], [s for _, (s,) in pairs]
        else:
            waves, new = self.decoder.decode_stream(chunks, streams)
        with self._lock:
            for unit, state in zip(units, new, strict=True):
                self._streams[unit.seq_id] = (unit.start + unit.left + unit.chunk, state)  # type: ignore[index]
        return waves

    def _new_stream(self, extras: Any) -> DecoderStream:
        if extras is not None and not isinstance(extras, CodecPrefix):
            raise TypeError(f"extras must be None or a CodecPrefix, got {type(extras).__name__}")
        if extras is None or not extras.codes.shape[0]:
            return DecoderStream()
        return self.decoder.prime_stream(torch.as_tensor(extras.codes, dtype=torch.long))

    def _row(self, unit: AudioChunkInput) -> DecodeRow:
        codes = _codes(unit.frames)
        left = unit.left
        prefix = unit.extras
        if prefix is not None and not isinstance(prefix, CodecPrefix):
            raise TypeError(f"extras must be None or a CodecPrefix, got {type(prefix).__name__}")
        need = self.decoder.left_context_frames - left
        if prefix is not None and need > 0 and prefix.codes.shape[0]:
            ref = torch.as_tensor(prefix.codes, dtype=torch.long)[-need:]
            codes, left = torch.cat([ref, codes]), left + ref.shape[0]
        return DecodeRow(codes, left, unit.chunk)


def _codes(frames: Sequence[Any]) -> torch.Tensor:
    """Code frames (tuples, lists, arrays or int tensors of ``Q`` ints) as int64 ``[T, Q]``."""
    return torch.as_tensor(np.asarray([np.asarray(f) for f in frames]), dtype=torch.long)


def codec_decode_config(
    decoder_config: CodecDecoderConfig,
    loop_id: str = "vocode",
    component: str = "codec",
    in_slot: str = "codes_stream",
    *,
    first_chunk: int = 2,
    chunk: int = 8,
    chunk_growth: float = 2.0,
    max_chunk: int = 64,
    bucket_frames: int = 64,
    trim_threshold: float | None = None,
    extras_slot: str | None = None,
    sample_rate: int = SAMPLE_RATE,
    stream_state: bool = True,
) -> AudioDecodeConfig:
    """The audio loop's settings for this decoder: no look-ahead (causal), and either

    - ``stream_state`` (default): the component keeps each request's decoder state between
      chunks (``CodecDecoderComponent``), so units carry only their new frames and the
      request's stream id; chunks batch across requests whatever their positions, keyed by
      their size rounded up to one of the schedule's sizes (a short last chunk joins the
      others); or
    - stateless: every window carries the exact left context (``left_context_frames``, 580
      frames published), windows bucketed to multiples of ``bucket_frames`` so chunks of
      different requests batch (same chunk size, window lengths in one bucket).

    ``sample_rate``: the speech tokenizer's ``output_sample_rate`` (24000 published).

    Defaults: a 2-frame first chunk (160 ms of audio: first audio as soon as the talker has
    2 frames), then 8 frames doubling up to 64 (5.1 s); the card starts with 1 frame, the
    prefill's own (``Qwen3TTSOptions.first_chunk``). With stream state a chunk costs its
    own frames only; stateless, each chunk reruns the transformer over its 570 frames of
    context and the conv stack over ``conv_context_frames`` (10) before the chunk (1.25x the
    chunk at 8 frames). Figures: ``bench/qwen3_tts_codec_stream.py``.
    """
    config = AudioDecodeConfig(
        loop_id=loop_id,
        component=component,
        in_slot=in_slot,
        sample_rate=sample_rate,
        first_chunk=first_chunk,
        chunk=chunk,
        chunk_growth=chunk_growth,
        max_chunk=max_chunk,
        lookahead=0,
        trim_threshold=trim_threshold,
        extras_slot=extras_slot,
        stream_state=stream_state,
    )
    if stream_state:  # chunk_size's exponent stops at 64: these indices give every size
        sizes = tuple(sorted({config.chunk_size(i) for i in range(66)}))
        return dataclasses.replace(config, window_buckets=sizes)
    left = decoder_config.left_context_frames
    buckets = tuple(range(bucket_frames, left + max_chunk + bucket_frames, bucket_frames))
    return dataclasses.replace(config, left_context=left, window_buckets=buckets)
