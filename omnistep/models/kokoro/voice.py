"""The Kokoro-82M v1.0 ONNX model as a Component: one sentence's phoneme ids -> 24 kHz audio.

ONNX graph (kokoro-onnx's v1.0 export; see ``loader``):
    inputs:  ``tokens`` int64 ``[1, T]`` = ``[0, *ids, 0]``, ``T <= 512``;
             ``style`` float32 ``[1, 256]``, the voice pack's row for ``T - 2`` phonemes;
             ``speed`` float32 ``[1]``, durations are divided by it (each phoneme keeps at
             least one frame).
    output:  ``audio`` float32 ``[N]`` at 24 kHz; and, exposed at load
             (``sentence_voice.expose_durations``), the predicted durations per token ``[1, T]``
             in frames of 600 samples (``N = 600 * sum``; hexgrad/kokoro ``KPipeline``: "pred_dur
             frames" times 600 at 24 kHz).

The graph has no random ops, so a unit's samples are a pure function of (ids, style, speed)
and of the session's thread count (onnxruntime splits its products by threads): a request's
audio is the same for every seed, bit for bit, and the unit, never the load, picks the session
(``KokoroUnit.all_cores``). Units run one per call: the export's batch dim is fixed at 1.

Source: kokoro-onnx ``src/kokoro_onnx/__init__.py`` (``Kokoro._create_audio``: the inputs),
hexgrad/kokoro ``kokoro/model.py`` (``KModel.forward_with_tokens``: ``pred_dur =
round(duration / speed).clamp(min=1)``).

Imports: stdlib, numpy, onnxruntime (through ``sentence_voice``), ``omnistep.core``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from omnistep.core.enums import WorkUnitKind
from omnistep.core.errors import ModelFilesError
from omnistep.models.kokoro.loader import MAX_PHONEMES, SAMPLE_RATE, STYLE_DIM
from omnistep.models.kokoro.voices import VoiceBank
from omnistep.runners.sentence_voice import (
    Sentence,
    SentenceAudio,
    SessionPool,
    expose_durations,
)

SAMPLES_PER_FRAME = 600
"""Output samples per predicted duration frame (40 frames/s at 24 kHz)."""


@dataclass(frozen=True, slots=True, eq=False)
class KokoroUnit:
    """One sentence to synthesize: the payload of an AUDIO_CHUNK unit.

    Attributes:
        phoneme_ids: the model's ``tokens``: phoneme ids with a 0 pad at both ends, 3 to 512 of
            them (``Sentence.phoneme_ids``).
        style: float32 ``[256]``, the voice's style for ``len(phoneme_ids) - 2`` phonemes.
        speed: > 0; the model divides durations by it.
        all_cores: run on the pool's all-core session (a request's first unit), see
            ``SessionPool``; part of the unit because the thread count changes the last bits.

    Raises:
        ValueError: a field out of range (the message names it).
    """

    phoneme_ids: tuple[int, ...]
    style: np.ndarray
    speed: float
    all_cores: bool = False

    def __post_init__(self) -> None:
        style, ids = self.style, self.phoneme_ids
        checks = [
            (
                "phoneme_ids",
                3 <= len(ids) <= MAX_PHONEMES + 2 and ids[0] == 0 == ids[-1],
            ),
            (
                "style",
                isinstance(style, np.ndarray)
                and style.shape == (STYLE_DIM,)
                and style.dtype == np.float32
                and bool(np.isfinite(style).all()),
            ),
            ("speed", isinstance(self.speed, int | float) and math.isfinite(self.speed)),
            ("all_cores", isinstance(self.all_cores, bool)),
        ]
        for name, ok in checks:
            if not ok or (name == "speed" and self.speed <= 0):
                raise ValueError(f"KokoroUnit.{name} out of range: {getattr(self, name)!r}")


@dataclass(frozen=True)
class KokoroSettings:
    """The card-side settings of a Kokoro folder (``SentenceVoice``): no ONNX session here.

    Attributes:
        bank: the folder's voice packs.
        sample_rate: 24000 Hz.
        batched: False: every unit runs alone.
    """

    bank: VoiceBank
    sample_rate: int = SAMPLE_RATE
    batched: bool = False

    def make_unit(
        self, sentence: Sentence, *, seed: int, speed: float, voice: str | None, all_cores: bool
    ) -> KokoroUnit:
        """The unit of ``sentence`` in ``voice`` (None: the folder's default; a name, an
        OpenAI name or a blend, see ``voices``). ``seed`` is unused: the graph draws no noise.

        Raises:
            InvalidRequestError: a bad ``voice`` (param ``voice``).
            ValueError: ``speed`` not finite and > 0.
        """
        ids = tuple(sentence.phoneme_ids)
        style = self.bank.style(voice, len(ids) - 2)
        return KokoroUnit(ids, style, float(speed), all_cores)

    def finish(self, audio: np.ndarray) -> np.ndarray:
        """The model's audio clipped to [-1, 1] (float32 ``[samples]``). Kokoro's output is not
        bounded (measured: peaks up to ~1.0015 on plain sentences); Kokoro-FastAPI clips when it
        converts to int16 (``AudioNormalizer.normalize``); no gain is applied."""
        return np.clip(audio, -1.0, 1.0)


class KokoroVoiceComponent:
    """Kokoro-82M (ONNX) running AUDIO_CHUNK units of ``KokoroUnit`` payloads; each output is a
    ``SentenceAudio``: float32 ``[num_samples]`` at 24 kHz and the samples each token lasts.

    Args:
        model_path: the ONNX file (checked by ``loader.check_graph`` before).
        device: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
        num_threads: intra-op threads of the session that runs most units (None: onnxruntime's
            default).
        all_core_threads: intra-op threads of the session that runs ``all_cores`` units (CPU).

    Raises:
        ValueError: bad ``device``.
        ModelFilesError: the graph has no duration predictor output (``expose_durations``).
    """

    def __init__(
        self,
        model_path: str | Path,
        device: str = "cpu",
        num_threads: int | None = None,
        all_core_threads: int | None = None,
    ):
        self.device = device
        self.sample_rate = SAMPLE_RATE
        import onnx

        graph = onnx.load(str(model_path))
        self._audio = graph.graph.output[0].name  # the audio (``loader.check_graph``: the only one)
        try:
            self._durations = expose_durations(graph)
        except ValueError as exc:
            raise ModelFilesError(f"kokoro model {model_path}: {exc}") from None
        model = graph.SerializeToString()
        del graph
        self._pool = SessionPool(model, device, num_threads, all_core_threads)
        self.intra_op_threads = self._pool.intra_op_threads

    def execute(self, kind: WorkUnitKind, payloads: Sequence[KokoroUnit]) -> list[SentenceAudio]:
        """Synthesize each payload alone; a ``SentenceAudio`` per payload, in order.

        Raises:
            ValueError: ``kind`` is not AUDIO_CHUNK.
        """
        if kind is not WorkUnitKind.AUDIO_CHUNK:
            raise ValueError(f"KokoroVoiceComponent runs AUDIO_CHUNK units, got {kind}")
        return [self.run(unit) for unit in payloads]

    def run(self, unit: KokoroUnit) -> SentenceAudio:
        """One onnxruntime call for ``unit``: float32 ``[num_samples]`` and int64 samples per
        token (``SAMPLES_PER_FRAME`` times the predicted frames)."""
        feed = {
            "tokens": np.asarray([unit.phoneme_ids], dtype=np.int64),
            "style": unit.style.reshape(1, STYLE_DIM),
            "speed": np.asarray([unit.speed], dtype=np.float32),
        }
        names = [self._audio, self._durations]
        audio, frames = self._pool.run(unit.all_cores, lambda session: session.run(names, feed))
        durations = np.rint(np.asarray(frames).reshape(-1)).astype(np.int64) * SAMPLES_PER_FRAME
        return SentenceAudio(np.asarray(audio, dtype=np.float32).reshape(-1), durations)
