"""The ``hibari`` card: the embedded default voice (hibari-tts, Apache-2.0, shipped on PyPI).

hibari-tts 0.2.1 ships one English voice, ``heart`` (American English, female, distilled from
Kokoro-82M's ``af_heart``), as a 7.9 MB int8 ONNX graph inside the package, and a complete
English G2P without espeak (a port of misaki's rules and lexicons): ``pip install
'omnistep[voice]'`` serves it with no other download and no GPL component.

Program (``sentence_card``): ``frontend`` (voice check; ``MisakiFrontend``: normalisation,
sentences and clauses, hibari's G2P, at most 400 phonemes per piece as hibari's
``MAX_PHONEMES``) then the ``sentences`` loop: one AUDIO_CHUNK unit per sentence on the ``voice``
component (``HibariVoiceComponent``: one ONNX call, then our DSP ``dsp.synthesize``), each
streamed as soon as it is synthesized, two at once on half the cores each, a request's first
unit on every core with its spinning session when it runs alone (``sentence_voice.SessionPool``).
Measured on the quiet 2-core CI machine (one 15-word sentence, 30 requests in a row, client
time to first audio): 20.4 ms with the first unit on 2 threads against 25.0 ms with every unit
on one (hibari's own ``Hibari()``, 1 thread by default: 21 ms). On a loaded machine (load 3-4)
the one-thread session was faster (30 against 50 ms): spinning threads then compete with other
jobs.

Seeds: sentence ``i`` of a request seeded ``s`` draws its noise from
``numpy.random.default_rng(sentence_seed(s, i))``: the same text, speed and seed give the same
bytes. ``speed`` is the graph's own ``speed`` input (2.0 about halves the duration).

Voices: the card has one voice, ``heart``. Every OpenAI voice name (alloy, ash, ballad, coral,
echo, fable, onyx, nova, sage, shimmer, verse, marin, cedar) is accepted and maps to ``heart``
(the same samples as ``heart`` for the same seed), so OpenAI clients work unchanged. hibari's
other voices (downloaded by hibari at run time) are not served by name; a downloaded ``.onnx``
can be served with ``--model hibari=/path/to/voice.onnx`` (it is then still called ``heart``).

Source: hibari-tts 0.2.1 ``hibari/tts.py`` (``MAX_PHONEMES``, ``vocab.json``, ``from_ids``),
``hibari/voices.py`` (``heart`` in the package).

Imports: stdlib, ``omnistep.core``, ``omnistep.models``.
"""

from __future__ import annotations

import json
from pathlib import Path

from omnistep.core import OPENAI_VOICES, ModelCard, ModelFilesError
from omnistep.models.hibari import dsp
from omnistep.models.hibari.voice import (
    HibariSettings,
    HibariVoiceComponent,
    embedded_model_path,
    vocab_path,
)
from omnistep.runners.misaki import MisakiFrontend
from omnistep.runners.sentence_voice import (
    FIRST_CHUNK_CHARS,
    first_unit_threads,
    sentence_card,
    session_threads,
)

CARD_ID = "hibari"
SPEAKER = "heart"
VOICES: tuple[str, ...] = (SPEAKER, *OPENAI_VOICES)
"""Voice names the card accepts; all are the one voice ``heart``."""
MAX_PHONEMES = 400
"""Phonemes per unit at most (hibari's ``tts.MAX_PHONEMES``): longer pieces are cut."""


def build_card(
    path: str | None = None, *, first_chunk_chars: int | None = FIRST_CHUNK_CHARS
) -> ModelCard:
    """The hibari card on the embedded voice ``heart`` (``path`` None), or on another hibari
    ``.onnx`` at ``path`` with the same inputs and outputs (e.g. a voice hibari downloaded).

    ``first_chunk_chars``: the first sentence is cut at clauses into pieces of at most this many
    characters (shorter first unit, sooner first audio); 0 or None keeps it whole.

    Raises:
        ModelFilesError: ``path`` is not a file (the message names it).
    """
    model_path = embedded_model_path() if path is None else Path(path)
    if not model_path.is_file():
        what = "is a folder" if model_path.is_dir() else "not found"
        raise ModelFilesError(
            f"hibari voice {model_path} {what} (expected a hibari .onnx file, e.g. "
            f"{embedded_model_path().name} of hibari-tts)"
        )
    with open(vocab_path(), encoding="utf-8") as f:
        vocab = json.load(f)
    frontend = MisakiFrontend(
        vocab, max_phonemes=MAX_PHONEMES, first_chunk_chars=first_chunk_chars or None
    )

    def build_voice(device: str) -> HibariVoiceComponent:
        return HibariVoiceComponent(
            model_path,
            device,
            num_threads=session_threads(),
            all_core_threads=first_unit_threads(),
        )

    source = "embedded voice heart" if path is None else f"voice file {model_path.name}"
    return sentence_card(
        card_id=CARD_ID,
        family="hibari",
        frontend=frontend,
        settings=HibariSettings(),
        build_voice=build_voice,
        voices=VOICES,
        default_voice=SPEAKER,
        sample_rate=dsp.SAMPLE_RATE,
        description=(
            "Embedded English voice: hibari heart (hibari-tts, Apache-2.0, distilled from "
            "Kokoro-82M af_heart), 24 kHz."
        ),
        component_description=f"hibari (ONNX int8) + spectral DSP, {source}",
        word_timestamps=True,
    )
