"""The hibari voice as a Component: phoneme ids -> float32 24 kHz waveform, with seeded noise.

ONNX graph (``hibari/assets/hibari.onnx`` of hibari-tts 0.2.1, int8, 7,936,868 bytes):
    inputs:  ``ids`` int64 ``[1, T]`` (``vocab.json`` ids with a 0 pad at both ends),
             ``speed`` float32 ``[1]`` (1.0: the teacher's pace; larger is faster).
    outputs: ``lh``, ``theta``, ``ln``, ``lr``, ``phi`` float32 ``[1, 601, F]`` and ``f0`` float32
             ``[1, F]``: F frames of 12.5 ms (hop 300 at 24 kHz); and, exposed at load
             (``sentence_voice.add_graph_output``), the predicted durations ``[T]`` per id in
             frames of 25 ms (``F = 2 * sum``).
The waveform is made from these by ``omnistep.models.hibari.dsp.synthesize`` (ours), whose
noise is drawn from ``numpy.random.default_rng(unit.seed)``: a unit's samples are a pure
function of (phoneme ids, speed, seed, all_cores), bit-identical run to run.

Source: ``hibari/tts.py`` (``Hibari.__init__``: CPU session; ``Hibari.from_ids``: the feeds,
fewer than 3 ids give no audio; ``Hibari.from_phonemes``: ``default_rng(seed)`` draws the noise)
of hibari-tts 0.2.1.

Also here: the card-side settings of the voice (``HibariSettings``, the ``SentenceVoice`` the
sentence loop reads) and the packaged vocabulary (``vocab_path``).

Imports: stdlib, numpy, onnxruntime, hibari-tts (its asset path only), ``omnistep.core``,
``omnistep.models``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import hibari
import numpy as np
import onnxruntime as ort

from omnistep.core import InvalidRequestError, ModelFilesError, WorkUnitKind
from omnistep.models.hibari import dsp
from omnistep.runners.sentence_voice import (
    Sentence,
    SentenceAudio,
    SessionPool,
    add_graph_output,
    first_unit_threads,
    session_threads,
)

INPUTS = ("ids", "speed")
"""The graph's input names."""
OUTPUTS = ("lh", "theta", "ln", "lr", "phi", "f0")
"""The graph's output names, in ``dsp.synthesize``'s argument order."""
DURATIONS = "/Clip_output_0"
"""The graph's predicted frames per id, float32 ``[T]``: the output of its only ``Clip``, after
its only ``Round`` (hexgrad/kokoro ``KModel.forward_with_tokens``: ``pred_dur = round(duration /
speed).clamp(min=1)``), added as a graph output at load (``sentence_voice.add_graph_output``).
"""
SAMPLES_PER_DURATION_FRAME = 2 * dsp.HOP
"""Output samples per predicted duration frame: each lasts two 12.5 ms DSP frames (measured:
``F = 2 * sum(durations)`` for every sentence), 600 samples at 24 kHz, as Kokoro's 40 frames/s."""
_ORT_LOAD_ERRORS = (
    ort.capi.onnxruntime_pybind11_state.Fail,
    ort.capi.onnxruntime_pybind11_state.InvalidProtobuf,
    ort.capi.onnxruntime_pybind11_state.InvalidGraph,
)
"""What onnxruntime raises for a file that is not a loadable graph."""
_ORT_RUN_ERRORS = (
    ort.capi.onnxruntime_pybind11_state.Fail,
    ort.capi.onnxruntime_pybind11_state.InvalidArgument,
    ort.capi.onnxruntime_pybind11_state.RuntimeException,
)
"""What onnxruntime raises for a graph that loads but cannot run a sentence."""
WARM_UP_IDS = (0, 50, 83, 54, 156, 31, 4, 0)
"""``"həlˈO."`` in hibari's vocab, with the pads: the sentence each session runs once at load."""
MIN_IDS = 3
"""Fewer ids (pads only, or one phoneme) give no audio, as in hibari's ``from_ids``."""


def embedded_model_path() -> Path:
    """The voice ``heart`` shipped inside hibari-tts: ``hibari/assets/hibari.onnx``."""
    return Path(hibari.__file__).parent / "assets" / "hibari.onnx"


def check_speed(speed: float) -> float:
    """``speed`` as a float when it is finite and > 0.

    Raises:
        InvalidRequestError: (``param="speed"``, ``code="invalid_value"``) otherwise.
    """
    if not (isinstance(speed, int | float) and math.isfinite(speed) and speed > 0):
        raise InvalidRequestError(
            f"'speed' must be a finite number > 0, got {speed!r}",
            param="speed",
            code="invalid_value",
        )
    return float(speed)


@dataclass(frozen=True, slots=True)
class HibariUnit:
    """One sentence to synthesize: the payload of an AUDIO_CHUNK unit.

    Attributes:
        phoneme_ids: model input ids with the 0 pads (``Sentence.phoneme_ids``).
        speed: > 0, finite; the graph's ``speed`` input (2.0 about halves the duration).
        seed: in [0, 2**63); ``numpy.random.default_rng(seed)`` draws the unit's noise.
        all_cores: run on the session with every core (a request's first unit; see
            ``SessionPool``). Part of the unit, not of the load: onnxruntime's results depend
            on its thread count in the last bits.

    Raises:
        InvalidRequestError: (``param="speed"``) a bad speed.
        ValueError: another field out of range (the message names it).
    """

    phoneme_ids: tuple[int, ...]
    speed: float
    seed: int
    all_cores: bool = False

    def __post_init__(self) -> None:
        check_speed(self.speed)
        checks = [
            ("phoneme_ids", all(isinstance(i, int) and i >= 0 for i in self.phoneme_ids)),
            ("seed", isinstance(self.seed, int) and 0 <= self.seed < 2**63),
            ("all_cores", isinstance(self.all_cores, bool)),
        ]
        for name, ok in checks:
            if not ok:
                raise ValueError(f"HibariUnit.{name} out of range: {getattr(self, name)!r}")


class HibariVoiceComponent:
    """The hibari ONNX voice running AUDIO_CHUNK units of ``HibariUnit`` payloads.

    Each output is a ``SentenceAudio``: float32 ``[F * 300]`` at 24000 Hz (about [-1, 1], not
    normalized) and the samples each id lasts; one onnxruntime call on the unit's session
    (``SessionPool``: ``all_cores`` units on every core), then ``dsp.synthesize`` with
    ``numpy.random.default_rng(unit.seed)``. Units always run one by one (hibari's graph takes
    a batch of one).

    Args:
        model_path: a hibari ``.onnx`` with the inputs ``ids``/``speed`` and the outputs
            ``lh, theta, ln, lr, phi, f0``; None: the embedded voice ``heart``.
        device: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
        num_threads: intra-op threads of the session of ordinary units (default:
            ``session_threads()``, half the cores).
        all_core_threads: intra-op threads of the session of ``all_cores`` units (default:
            ``first_unit_threads()``, every core).

    Raises:
        ModelFilesError: ``model_path`` is missing, or is not a graph with hibari's inputs and
            outputs (the message names the file).
        ValueError: bad ``device``.
    """

    sample_rate = dsp.SAMPLE_RATE

    def __init__(
        self,
        model_path: str | Path | None = None,
        device: str = "cpu",
        num_threads: int | None = None,
        all_core_threads: int | None = None,
    ):
        path = Path(model_path) if model_path is not None else embedded_model_path()
        if not path.is_file():
            raise ModelFilesError(f"hibari voice {path} not found (expected a hibari .onnx file)")
        try:
            graph = add_graph_output(path.read_bytes(), DURATIONS)
        except ValueError as exc:
            raise ModelFilesError(f"hibari voice {path} is not an ONNX graph: {exc}") from None
        try:
            self.pool = SessionPool(
                graph,
                device,
                session_threads() if num_threads is None else num_threads,
                first_unit_threads() if all_core_threads is None else all_core_threads,
            )
        except _ORT_LOAD_ERRORS as exc:
            raise ModelFilesError(f"hibari voice {path} is not an ONNX graph: {exc}") from None
        session = self.pool.session
        inputs = tuple(sorted(i.name for i in session.get_inputs()))
        outputs = {o.name for o in session.get_outputs()}
        if inputs != tuple(sorted(INPUTS)) or not set(OUTPUTS) <= outputs:
            raise ModelFilesError(
                f"hibari voice {path} has inputs {list(inputs)} and outputs {sorted(outputs)}; "
                f"expected inputs {list(INPUTS)} and outputs {list(OUTPUTS)}"
            )
        self.model_path = path
        self.device = device
        # the first run of a session costs ~10 ms more (onnxruntime's memory planning, the
        # DSP's cached windows): pay it at load, not in the first request's time to audio
        try:
            self.pool.warm_up(lambda s: self._synthesize(s, HibariUnit(WARM_UP_IDS, 1.0, 0)))
        except _ORT_RUN_ERRORS as exc:
            raise ModelFilesError(f"hibari voice {path} failed a test sentence: {exc}") from None

    def execute(self, kind: WorkUnitKind, payloads: Sequence[HibariUnit]) -> list[SentenceAudio]:
        """Synthesize each payload; returns its ``SentenceAudio`` (24000 Hz) per payload.

        Raises:
            ValueError: ``kind`` is not AUDIO_CHUNK.
        """
        if kind is not WorkUnitKind.AUDIO_CHUNK:
            raise ValueError(f"HibariVoiceComponent runs AUDIO_CHUNK units, got {kind}")
        return [self.synthesize(unit) for unit in payloads]

    def synthesize(self, unit: HibariUnit) -> SentenceAudio:
        """One unit -> float32 ``[samples]`` at 24000 Hz (empty, every id 0 samples, under
        ``MIN_IDS`` ids) and int64 samples per id, on the session the unit picks
        (``SessionPool.run``)."""
        if len(unit.phoneme_ids) < MIN_IDS:
            return SentenceAudio(np.zeros(0, np.float32), np.zeros(len(unit.phoneme_ids), np.int64))
        return self.pool.run(unit.all_cores, lambda session: self._synthesize(session, unit))

    def _synthesize(self, session: ort.InferenceSession, unit: HibariUnit) -> SentenceAudio:
        """``unit`` on ``session``: the graph's outputs (batch axis dropped: five float32
        [601, F], f0 float32 [F]), then ``dsp.synthesize`` with ``default_rng(unit.seed)``;
        durations times ``SAMPLES_PER_DURATION_FRAME``."""
        feeds = {
            "ids": np.asarray([unit.phoneme_ids], dtype=np.int64),
            "speed": np.asarray([unit.speed], dtype=np.float32),
        }
        *frames, durations = session.run([*OUTPUTS, DURATIONS], feeds)
        audio = dsp.synthesize(*(f[0] for f in frames), np.random.default_rng(unit.seed))
        samples = np.rint(np.asarray(durations).reshape(-1)).astype(np.int64)
        return SentenceAudio(audio, samples * SAMPLES_PER_DURATION_FRAME)


def vocab_path() -> Path:
    """hibari's phoneme vocabulary, ``hibari/assets/vocab.json`` (character -> id, 0 = pad)."""
    return embedded_model_path().parent / "vocab.json"


@dataclass(frozen=True)
class HibariSettings:
    """The card-side settings of the voice (a ``SentenceVoice``): no ONNX session here.

    Attributes:
        sample_rate: 24000 Hz.
        batched: False: each unit runs alone (hibari's graph takes one sentence per call).
    """

    sample_rate: int = dsp.SAMPLE_RATE
    batched: bool = False

    def make_unit(
        self, sentence: Sentence, *, seed: int, speed: float, voice: str | None, all_cores: bool
    ) -> HibariUnit:
        """The unit of ``sentence``; ``voice`` is ignored (every accepted name is ``heart``).

        Raises:
            InvalidRequestError: (``param="speed"``) speed not finite and > 0.
        """
        return HibariUnit(sentence.phoneme_ids, speed, seed, all_cores)  # the unit checks speed

    def finish(self, audio: np.ndarray) -> np.ndarray:
        """The component's audio as is (hibari does not normalize)."""
        return audio
