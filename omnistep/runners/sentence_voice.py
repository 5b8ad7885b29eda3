"""The card skeleton of voices that synthesize one sentence per ONNX call (piper, hibari, kokoro).

Such a voice has no autoregressive state: text becomes sentences of phoneme ids on the serving
thread (a ``SentenceFrontend``), and each sentence becomes one AUDIO_CHUNK WorkUnit on the card's
``voice`` component, streamed as soon as it is synthesized. What differs between families is the
front-end, the unit payload (``SentenceVoice.make_unit``), the component and an optional
per-sentence post-processing (``SentenceVoice.finish``); the program, the loop, the voice check,
the thread policy of the ONNX sessions and the noise seeds are shared here.

Program: ``frontend`` (kernel node: voice check, text -> sentences) then the ``sentences`` loop
(AUDIO_DECODE). The loop reads the voice's settings from the card (a ``SentenceVoice``), never from
the ``voice`` component, which may run in another process (the Ray executor).

Batching: by default each unit's ShapeSignature has a unique tag and runs as a batch of one
(measured for piper on a 2-core CPU: a padded batch of 4 sentences ran at 0.91x the speed of 4
single calls and differed from them by up to 1e-4). Two sentences (of different requests) run
at once on two executor workers (``MAX_CONCURRENT_SENTENCES``; onnxruntime sessions are
thread-safe).

Threads: each of the two sentences that run at once gets half the cores (``session_threads``),
except a request's first unit, which runs on a second session with every core
(``first_unit_threads``), so that one request alone reaches its first audio as fast as the
voice's own runtime. The unit, not the load, picks the session: onnxruntime's samples depend on
its thread count in the last bits, and a request's audio must not depend on what runs beside it.
``SessionPool`` holds the sessions.

Seeds: sentence ``i`` of a request with seed ``s`` draws its noise from ``sentence_seed(s, i)``,
so a request's audio depends only on its text, speed, voice and seed.

Word timestamps: these voices predict a duration for every phoneme id, and their components
return it with the audio (``SentenceAudio.durations``, in output samples). A front-end that
knows which ids spell which word (``Sentence.words``, e.g. ``MisakiFrontend``) lets the loop
time each word exactly in the output's timeline: a word runs from the first sample of its first
id to the last sample of its last id, plus the samples of every sentence before it
(``word_timings``). Such cards have ``Capability.WORD_TIMESTAMPS`` (``sentence_card``'s
``word_timestamps``).

Imports: stdlib, numpy, onnxruntime, ``omnistep.core``.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

import numpy as np
import onnxruntime as ort

from omnistep.core import (
    OPENAI_TTS_MODELS,
    Capability,
    ComponentSpec,
    Done,
    InvalidRequestError,
    KernelNode,
    LoopKind,
    LoopNode,
    LoopResult,
    LoopSpec,
    LoopState,
    ModelCard,
    ModelInstance,
    Program,
    ProgramContext,
    Request,
    ResourceRequest,
    ShapeSignature,
    StepResult,
    StreamChunk,
    WordTiming,
    WorkPlan,
    WorkUnitKind,
    derived_seed,
)

_LOGGER = logging.getLogger(__name__)
T = TypeVar("T")
P = TypeVar("P", str, list[str])

MAX_CONCURRENT_SENTENCES = 2
"""Sentences synthesised at once (two ONNX calls share the CPU better than one)."""

FIRST_CHUNK_CHARS = 80
"""Default cut of a request's first sentence, in characters (about 5 s of speech): the first
unit sets the time to first audio, so it is a clause rather than a whole long sentence."""


def session_threads() -> int:
    """onnxruntime intra-op threads per voice session: the cores shared out among the
    ``MAX_CONCURRENT_SENTENCES`` sentences that run at once (at least 1). onnxruntime's default
    (every core per session) oversubscribes the CPU when two sentences run: on the 2-core CI
    machine a burst of 16 piper requests finished in 16.5-17 s with 1 thread per session against
    19-21 s with the default, and its streams ran dry less often."""
    return max(1, (os.cpu_count() or 1) // MAX_CONCURRENT_SENTENCES)


def first_unit_threads() -> int:
    """onnxruntime intra-op threads of the session that runs each request's first unit: every
    core. Measured on the 2-core CI machine with piper (``bench/speech.py --text sentence``, one
    request at a time): time to first audio 1.80-1.88x piper's own first sentence on one thread,
    1.12-1.18x on two. The price is CPU: two first units at once on two threads each cost ~15%
    more CPU per audio second than on one."""
    return max(1, os.cpu_count() or 1)


def sentence_seed(seed: int, index: int) -> int:
    """The noise seed of sentence ``index`` of a request seeded ``seed``: in [0, 2**63)."""
    return derived_seed(seed, index)


def execution_providers(device: str) -> list[str | tuple[str, dict[str, object]]]:
    """onnxruntime providers for ``device``: ``"cpu"``, or ``"cuda"`` / ``"cuda:N"`` (CUDA first,
    CPU as fallback; CUDA is dropped with a warning when this onnxruntime build lacks it).

    Raises:
        ValueError: any other device string.
    """
    if device == "cpu":
        return ["CPUExecutionProvider"]
    if device != "cuda" and not device.startswith("cuda:"):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        _LOGGER.warning("onnxruntime has no CUDAExecutionProvider; running %s on CPU", device)
        return ["CPUExecutionProvider"]
    device_id = int(device.partition(":")[2] or 0)
    options: dict[str, object] = {"device_id": device_id, "cudnn_conv_algo_search": "HEURISTIC"}
    return [("CUDAExecutionProvider", options), "CPUExecutionProvider"]


def open_session(
    model: bytes | str | Path, device: str, num_threads: int | None, spinning: bool = False
) -> ort.InferenceSession:
    """An onnxruntime session on ``model`` (serialized graph or file path) with deterministic
    compute; with ``spinning``, idle intra-op workers spin until the end of each run instead of
    sleeping. ``num_threads``: ``intra_op_num_threads`` (None: onnxruntime's default).

    Raises:
        ValueError: bad ``device``; onnxruntime's errors for a file that is not an ONNX graph.
    """
    options = ort.SessionOptions()
    options.use_deterministic_compute = True
    options.log_severity_level = 3
    # Idle workers must not spin by default: the engine may run two sessions' calls at once on
    # few cores (measured with piper: spinning off cut CPU per audio second from 0.185 to 0.148).
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    if spinning:  # ... and never past the end of a run
        options.add_session_config_entry("session.force_spinning_stop", "1")
    if num_threads is not None:
        options.intra_op_num_threads = num_threads
    if isinstance(model, Path):
        model = str(model)
    return ort.InferenceSession(model, sess_options=options, providers=execution_providers(device))


class SessionPool:
    """The onnxruntime sessions of one voice graph, and which one runs a unit.

    One session with ``num_threads`` intra-op threads runs most units. On CPU, when
    ``all_core_threads`` differs from ``num_threads``, units marked ``all_cores`` (a request's
    first unit) run on a second session with ``all_core_threads``. That session has a twin whose
    idle workers spin between the graph's ops instead of sleeping; it runs an ``all_cores`` unit
    that starts while no other call runs (a request alone: measured with piper on 2 cores, its
    first unit 7-15% sooner), the twin without spinning runs it otherwise, so that spinning never
    takes a core from a call running beside it. The unit picks the thread count (results differ
    between thread counts in the last bits: measured with piper, 1 and 2 threads gave different
    samples for 4 of 37 lengths, up to ~2e-6); the load only picks spinning, which does not
    change results.

    Args:
        model: the serialized graph or its file path.
        device: ``"cpu"``, ``"cuda"`` or ``"cuda:N"`` (see ``execution_providers``).
        num_threads, all_core_threads: intra-op threads (None: onnxruntime's default; an equal
            or None ``all_core_threads`` keeps one session for every unit).

    Attributes:
        intra_op_threads: ``all_cores`` -> the thread count of the session that runs such units.
    """

    def __init__(
        self,
        model: bytes | str | Path,
        device: str,
        num_threads: int | None = None,
        all_core_threads: int | None = None,
    ):
        session = open_session(model, device, num_threads)
        # (all_cores, spinning) -> session; one session for all when there is no second
        self._sessions = dict.fromkeys([(False, False), (True, False), (True, True)], session)
        self.intra_op_threads: dict[bool, int | None] = {False: num_threads, True: num_threads}
        if device == "cpu" and all_core_threads not in (None, num_threads):
            self.intra_op_threads[True] = all_core_threads
            self._sessions[True, False] = open_session(model, device, all_core_threads)
            self._sessions[True, True] = open_session(model, device, all_core_threads, True)
        self._lock = threading.Lock()
        self._num_running = 0  # calls in progress (the engine may run two at once)

    @property
    def session(self) -> ort.InferenceSession:
        """The session of ordinary (not ``all_cores``) units: for reading inputs and outputs."""
        return self._sessions[False, False]

    def warm_up(self, fn: Callable[[ort.InferenceSession], object]) -> None:
        """``fn(session)`` once on every distinct session (e.g. a short sentence), so that the
        first request does not pay onnxruntime's first-run costs (memory planning, kernel
        selection)."""
        for session in {id(s): s for s in self._sessions.values()}.values():
            fn(session)

    def run(self, all_cores: bool, fn: Callable[[ort.InferenceSession], T]) -> T:
        """``fn(session)`` on the session for a unit with ``all_cores``; returns its result."""
        with self._lock:
            self._num_running += 1
            spinning = all_cores and self._num_running == 1  # alone: nothing to take a core from
        try:
            return fn(self._sessions[all_cores, spinning])
        finally:
            with self._lock:
                self._num_running -= 1


@dataclass(frozen=True, slots=True)
class WordSpan:
    """Which phoneme ids of a sentence spell one word.

    Attributes:
        word: the word's text (as the front-end read it, no surrounding punctuation).
        start, end: the word's ids are ``phoneme_ids[start:end]`` (pads included in the
            indexing), ``0 <= start < end``.
    """

    word: str
    start: int
    end: int


@dataclass(frozen=True, slots=True)
class Sentence:
    """One sentence (or clause) of the input, ready for the voice model.

    Attributes:
        index: 0-based position of the sentence in the input.
        phonemes: the sentence's phonemes as one string (with punctuation), e.g.
            ``"həlˈoʊ wˈɜːld."``.
        phoneme_ids: the model's input ids, pads included, non-empty.
        words: the sentence's words and their ids, in order; empty when the front-end does not
            know them (no word timestamps).
    """

    index: int
    phonemes: str
    phoneme_ids: tuple[int, ...]
    words: tuple[WordSpan, ...] = ()


@dataclass(frozen=True, slots=True)
class SentenceAudio:
    """A voice component's output for one sentence.

    Attributes:
        audio: float32 ``[samples]`` at the voice's sample rate.
        durations: int64 ``[num_ids]``: the output samples each phoneme id of the unit lasts
            (the model's predicted durations times its samples per frame); they sum to
            ``audio.size``.
    """

    audio: np.ndarray
    durations: np.ndarray


def expose_durations(model: Any) -> str:
    """Mark the predicted durations of a Kokoro-style graph (hibari, Kokoro-82M) as a graph
    output of ``model`` (an ``onnx.ModelProto``, changed in place); return the output's name.

    The durations are the output of the ``Clip`` that follows the graph's only ``Round``
    (hexgrad/kokoro ``KModel.forward_with_tokens``: ``pred_dur = round(duration /
    speed).clamp(min=1)``): frames per input id ``[1, T]`` or ``[T]``, float or int.

    Raises:
        ValueError: the graph has not exactly one ``Round`` feeding one ``Clip``.
    """
    from onnx import helper

    rounds = [n.output[0] for n in model.graph.node if n.op_type == "Round"]
    clips = [n.output[0] for n in model.graph.node if n.op_type == "Clip" and n.input[0] in rounds]
    if len(rounds) != 1 or len(clips) != 1:
        raise ValueError(
            f"expected one Round op feeding one Clip (the predicted durations), found "
            f"{len(rounds)} Round and {len(clips)} such Clip ops"
        )
    if clips[0] not in {o.name for o in model.graph.output}:
        model.graph.output.append(helper.make_empty_tensor_value_info(clips[0]))
    return clips[0]


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data):
            raise ValueError("truncated varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, pos


_MODEL_GRAPH = 7
"""``ModelProto.graph`` field number (onnx.proto)."""
_GRAPH_OUTPUT = 12
"""``GraphProto.output`` field number (a repeated ``ValueInfoProto``, whose ``name`` is 1)."""


def add_graph_output(model: bytes, name: str) -> bytes:
    """The serialized ONNX ``model`` with the tensor ``name`` added as a graph output.

    Works on the protobuf wire format (a repeated field may be appended anywhere, so the new
    ``ValueInfoProto {name}`` goes at the end of the graph message), so that voices whose
    card must start fast (hibari, the default) need not import ``onnx`` (measured here:
    ``import onnx`` 2-3 s on the 2-core machine, most of it ``ml_dtypes``). onnxruntime checks
    at session creation that the tensor exists.

    Raises:
        ValueError: ``model`` is not a protobuf message with a graph field.
    """
    pos, out = 0, bytearray()
    found = False
    while pos < len(model):
        start = pos
        tag, pos = _read_varint(model, pos)
        tag_end = pos
        field_number, wire_type = tag >> 3, tag & 7
        if wire_type == 0:
            _, pos = _read_varint(model, pos)
        elif wire_type == 1:
            pos += 8
        elif wire_type == 5:
            pos += 4
        elif wire_type == 2:
            length, body = _read_varint(model, pos)
            pos = body + length
            if pos > len(model):
                raise ValueError("not an ONNX model (truncated)")
            if field_number == _MODEL_GRAPH:
                value_info = b"\x0a" + _varint(len(name.encode())) + name.encode()
                extra = _varint(_GRAPH_OUTPUT << 3 | 2) + _varint(len(value_info)) + value_info
                out += model[start:tag_end] + _varint(length + len(extra))
                out += model[body:pos] + extra
                found = True
                continue
        else:
            raise ValueError(f"not an ONNX model (wire type {wire_type} at byte {start})")
        if pos > len(model):
            raise ValueError("not an ONNX model (truncated)")
        out += model[start:pos]
    if not found:
        raise ValueError("not an ONNX model (no graph)")
    return bytes(out)


def word_timings(
    words: Sequence[WordSpan], durations: np.ndarray, offset: int, sample_rate: int
) -> tuple[WordTiming, ...]:
    """The times of ``words`` in a sentence whose ids last ``durations`` samples each (int
    ``[num_ids]``), the sentence starting ``offset`` samples into the request's audio.

    A word starts at the first sample of its first id and ends after the last sample of its
    last id (Kokoro's ``KPipeline.join_timestamps`` also counts from the predicted durations;
    it splits the space between words in two, here spaces and punctuation belong to no word).
    Times are seconds, ``(offset + samples) / sample_rate``.

    Raises:
        ValueError: a span outside ``durations``.
    """
    ends = np.cumsum(np.asarray(durations, dtype=np.int64))
    starts = ends - np.asarray(durations, dtype=np.int64)
    out = []
    for w in words:
        if not 0 <= w.start < w.end <= ends.size:
            raise ValueError(f"word {w.word!r} spans ids {w.start}:{w.end} of {ends.size}")
        begin, stop = offset + int(starts[w.start]), offset + int(ends[w.end - 1])
        out.append(WordTiming(w.word, begin / sample_rate, stop / sample_rate))
    return tuple(out)


class SentenceFrontend(Protocol):
    """Text -> sentences of phoneme ids, on the serving thread."""

    def sentences(
        self, text: str, normalize_text: bool | None = None, voice: str | None = None
    ) -> list[Sentence]:
        """The sentences of ``text`` in reading order; ``normalize_text`` overrides the
        front-end's own setting (None keeps it); ``voice``: the request's (already checked)
        voice, for front-ends whose reading depends on it (Kokoro's British voices), else
        ignored.

        Raises:
            InvalidRequestError: (``param="input"``) nothing speakable.
        """
        ...


class SentenceVoice(Protocol):
    """The card-side settings of a voice (no ONNX session): what the loop needs in the serving
    process, also when the component runs elsewhere."""

    sample_rate: int
    """Output samples per second, Hz."""
    batched: bool
    """False: every unit runs alone (a unique shape tag); True: units of one shape batch."""

    def make_unit(
        self, sentence: Sentence, *, seed: int, speed: float, voice: str | None, all_cores: bool
    ) -> Any:
        """The payload of ``sentence``'s AUDIO_CHUNK unit. ``seed`` is already
        ``sentence_seed(request seed, sentence.index)``; ``voice`` is the request's voice (None:
        the card's default); ``all_cores``: the unit is the request's first (see
        ``SessionPool``).

        Raises:
            InvalidRequestError: a bad speed or voice.
        """
        ...

    def finish(self, audio: np.ndarray) -> np.ndarray:
        """Per-sentence post-processing of the component's float32 ``[samples]`` output; keeps
        the number of samples (word times are counted on the component's output)."""
        ...


@dataclass
class SentenceState(LoopState):
    """State of the sentence loop: the request's units, their sentences' words, and the audio
    produced so far (samples)."""

    units: list[Any] = field(default_factory=list)
    words: list[tuple[WordSpan, ...]] = field(default_factory=list)
    num_samples: int = 0


class SentenceLoop:
    """AUDIO_DECODE loop: one AUDIO_CHUNK unit per sentence (the ``sentences`` slot), each
    result streamed as a chunk of ``settings.sample_rate`` audio.

    Args:
        settings: the voice's settings; the loop reads them from here, never from the ``voice``
            component, so it runs the same when the component is in another process.
    """

    loop_id = "sentences"
    kind = LoopKind.AUDIO_DECODE

    def __init__(self, settings: SentenceVoice):
        self.settings = settings

    def init(self, req: Request, model: ModelInstance, ctx: ProgramContext) -> SentenceState:
        sentences: list[Sentence] = ctx.slots["sentences"]
        seed = int(req.seed or 0)
        units = [
            self.settings.make_unit(
                s,
                seed=sentence_seed(seed, s.index),
                speed=req.speed,
                voice=req.voice,
                all_cores=k == 0,
            )
            for k, s in enumerate(sentences)
        ]
        return SentenceState(
            request_id=req.request_id,
            loop_id=self.loop_id,
            profile=req.profile,
            units=units,
            words=[s.words for s in sentences],
        )

    def next(self, state: SentenceState) -> WorkPlan | Done:
        if state.step >= len(state.units):
            return Done()
        unit = state.units[state.step]
        num_ids = len(unit.phoneme_ids)
        tag = "" if self.settings.batched else f"{state.request_id}/{state.step}"
        shape = ShapeSignature(WorkUnitKind.AUDIO_CHUNK, (num_ids,), tag)
        # num_tokens lets the engine estimate the unit's run time (EDF less expected time)
        return WorkPlan(
            WorkUnitKind.AUDIO_CHUNK,
            "voice",
            shape,
            unit,
            ResourceRequest(num_tokens=num_ids),
            label=f"sentence{state.step}",
        )

    def advance(self, state: SentenceState, result: StepResult) -> SentenceState:
        output: SentenceAudio = result.output
        audio = self.settings.finish(np.asarray(output.audio, dtype=np.float32))
        rate = self.settings.sample_rate
        words = word_timings(state.words[state.step], output.durations, state.num_samples, rate)
        state.step += 1
        state.num_samples += audio.size
        state.outbox.append(StreamChunk.of_audio(audio, rate, words))
        return state

    def finalize(self, state: SentenceState) -> LoopResult:
        return LoopResult(
            state.num_samples, {"sentences": float(state.step), "samples": float(state.num_samples)}
        )

    def release(self, state: SentenceState) -> None:
        """Nothing outside the state to free."""


def _frontend_node(
    frontend: SentenceFrontend, check_voice: Callable[[str], None]
) -> Callable[[ProgramContext], None]:
    def frontend_fn(ctx: ProgramContext) -> None:
        if ctx.request.voice is not None:
            check_voice(ctx.request.voice)
        sentences = frontend.sentences(
            ctx.request.text, ctx.request.normalize_text, voice=ctx.request.voice
        )
        ctx.slots["sentences"] = sentences
        ctx.usage["input_tokens"] = sum(len(s.phoneme_ids) for s in sentences)

    return frontend_fn


def voice_checker(card_id: str, voices: tuple[str, ...]) -> Callable[[str], None]:
    """The default voice check: ``voice`` must be one of ``voices``.

    The returned function raises InvalidRequestError (``param="voice"``,
    ``code="unknown_voice"``) naming the voices."""

    def check(voice: str) -> None:
        if voice not in voices:
            raise InvalidRequestError(
                f"unknown voice '{voice}' for model '{card_id}'; choose one of {', '.join(voices)}",
                param="voice",
                code="unknown_voice",
            )

    return check


def sentence_card(
    *,
    card_id: str,
    family: str,
    frontend: SentenceFrontend,
    settings: SentenceVoice,
    build_voice: Callable[[str], Any],
    voices: tuple[str, ...],
    default_voice: str,
    sample_rate: int,
    description: str,
    component_description: str,
    check_voice: Callable[[str], None] | None = None,
    max_batch_size: int = 1,
    word_timestamps: bool = False,
    parity: frozenset[str] = frozenset({"C0", "C1", "C3", "stream"}),
    aliases: tuple[str, ...] = OPENAI_TTS_MODELS,
) -> ModelCard:
    """The card of a sentence voice.

    Program: ``frontend`` (kernel node: ``check_voice(request.voice)`` when a voice is given,
    default ``voice_checker(card_id, voices)``, also the card's ``voice_validator``; then
    ``frontend.sentences``) -> the
    ``sentences`` loop (``SentenceLoop``), one AUDIO_CHUNK unit per sentence on the component
    ``voice`` (``build_voice(device)``; its ``execute(kind, payloads)`` returns a
    ``SentenceAudio`` per payload), at most ``MAX_CONCURRENT_SENTENCES`` running at once.

    Args:
        voices: the voice names listed to clients (``GET /v1/audio/voices``), default first.
        sample_rate: output samples per second, Hz (``settings.sample_rate``).
        max_batch_size: units per component call (1 unless ``settings.batched``).
        word_timestamps: the front-end fills ``Sentence.words``, so audio chunks carry word
            times (``Capability.WORD_TIMESTAMPS``).
    """
    check_voice = check_voice or voice_checker(card_id, voices)
    program = Program(
        inputs=("request",),
        nodes=(
            KernelNode(
                "frontend",
                _frontend_node(frontend, check_voice),
                needs=("request",),
                binds=("sentences",),
            ),
            LoopNode("synthesize", SentenceLoop.loop_id, needs=("sentences",), binds="samples"),
        ),
    )
    return ModelCard(
        card_id=card_id,
        family=family,
        components=(
            ComponentSpec(
                "voice",
                build_voice,
                max_batch_size=max_batch_size,
                description=component_description,
                max_concurrency=MAX_CONCURRENT_SENTENCES,
            ),
        ),
        loops=(
            LoopSpec(
                SentenceLoop.loop_id,
                LoopKind.AUDIO_DECODE,
                (WorkUnitKind.AUDIO_CHUNK,),
                ("voice",),
                lambda: SentenceLoop(settings),
            ),
        ),
        program=program,
        capabilities=frozenset(
            {Capability.TEXT_TO_SPEECH}
            | ({Capability.WORD_TIMESTAMPS} if word_timestamps else set())
        ),
        sample_rate=sample_rate,
        aliases=aliases,
        voices=voices,
        default_voice=default_voice,
        # the same check as the frontend's, so that a saved voice may be any voice a request
        # may name (a Kokoro blend, not only a listed name)
        voice_validator=check_voice,
        parity=parity,
        description=description,
        # Sentences gain nothing from batching, so a burst starts as many requests at a time
        # as sentences run at once.
        max_starting=MAX_CONCURRENT_SENTENCES,
    )


CLAUSE_ENDS = frozenset(",;:")
"""Punctuation after which a long sentence is preferably cut."""


def split_long(phonemes: P, max_phonemes: int) -> list[P]:
    """Cut a phoneme list (or string) into pieces of at most ``max_phonemes``, keeping every
    phoneme.

    Cuts after the last clause punctuation (``, ; :``) followed by a space within the limit, else
    after the last space, else exactly at the limit. Spaces at a cut are dropped; nothing else is.
    """
    pieces: list[P] = []
    rest = phonemes
    while len(rest) > max_phonemes:
        cut = _cut_index(rest, max_phonemes)
        pieces.append(strip_spaces(rest[:cut]))
        rest = strip_spaces(rest[cut:])
    if rest:
        pieces.append(rest)
    return [p for p in pieces if p]


def _cut_index(phonemes: P, max_phonemes: int) -> int:
    window = phonemes[: max_phonemes + 1]
    spaces = [i for i in range(1, len(window)) if window[i] == " "]
    clause = [i for i in spaces if window[i - 1] in CLAUSE_ENDS]
    if clause:
        return clause[-1]
    return spaces[-1] if spaces else max_phonemes


def strip_spaces(phonemes: P) -> P:
    """``phonemes`` without its leading and trailing ``" "`` entries."""
    start, end = 0, len(phonemes)
    while start < end and phonemes[start] == " ":
        start += 1
    while end > start and phonemes[end - 1] == " ":
        end -= 1
    return phonemes[start:end]
