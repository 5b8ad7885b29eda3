"""The ``kokoro`` card: Kokoro-82M v1.0 (ONNX) on a folder as Kokoro-FastAPI / kokoro-onnx users
have it (``--model kokoro=/path/to/folder``; see ``loader`` for the layout).

Program (``sentence_voice.sentence_card``): the frontend node checks the request's voice (a
pack's name, an OpenAI name, or a Kokoro-FastAPI blend, see ``voices``), then English text ->
sentences -> Kokoro phoneme ids with hibari's G2P (a port of misaki's English rules and
lexicons, no espeak: ``misaki.MisakiFrontend``; British for ``b*`` voices, as Kokoro-FastAPI
picks the language from the voice name's first letter); a sentence whose phonemes exceed the model's
510 is cut at clause punctuation, else at a space (``max_phonemes=510``: the 512 positions of
Kokoro's text encoder less the two 0 pads; hexgrad/kokoro ``KModel.forward``'s
``len(input_ids) + 2 <= context_length``, kokoro-onnx ``MAX_PHONEME_LENGTH = 510``). Then one
AUDIO_CHUNK unit per sentence on the ``voice`` component, each streamed when synthesized, two
at once, a request's first unit on every core.

Seeds: the graph draws no noise (``loader``), so the audio does not depend on the seed: the
same seed (any seed) gives the same bytes.

Imports: stdlib, ``omnistep.core``, ``omnistep.models`` (onnxruntime is imported by the
component only).
"""

from __future__ import annotations

from omnistep.core import ModelCard, ModelFilesError
from omnistep.models.kokoro.loader import (
    MAX_PHONEMES,
    MODEL_FILES,
    SAMPLE_RATE,
    VOICES_FILE,
    check_graph,
    kokoro_files,
    kokoro_vocab,
    load_voice_packs,
)
from omnistep.models.kokoro.voices import VoiceBank
from omnistep.runners.misaki import MisakiFrontend
from omnistep.runners.sentence_voice import (
    FIRST_CHUNK_CHARS,
    first_unit_threads,
    sentence_card,
    session_threads,
)

CARD_ID = "kokoro"


def kokoro_frontend(
    first_chunk_chars: int | None = FIRST_CHUNK_CHARS, bank: VoiceBank | None = None
) -> MisakiFrontend:
    """The card's front-end: English G2P (hibari's; British for the voices ``bank`` calls
    British, ``VoiceBank.is_british``; American without a bank), Kokoro's vocab, sentences cut
    to at most ``MAX_PHONEMES`` (510) phonemes; the first sentence cut at clauses to
    ``first_chunk_chars`` characters (0 or None: kept whole)."""
    return MisakiFrontend(
        kokoro_vocab(),
        max_phonemes=MAX_PHONEMES,
        british=False if bank is None else bank.is_british,
        first_chunk_chars=first_chunk_chars or None,
    )


def build_card(
    path: str | None = None, *, first_chunk_chars: int | None = FIRST_CHUNK_CHARS
) -> ModelCard:
    """The kokoro card on the Kokoro v1.0 folder (or ``.onnx`` file) at ``path``.

    ``first_chunk_chars``: see ``kokoro_frontend`` (``--first-chunk-chars``).

    Raises:
        ModelFilesError: no ``path`` (the family has no embedded weights); missing or wrong
            files (see ``loader.kokoro_files``, ``load_voice_packs``, ``check_graph``).
    """
    if path is None:
        raise ModelFilesError(
            f"the kokoro family needs its weights: --model kokoro=/path/to/folder holding "
            f"{MODEL_FILES[0]} or {MODEL_FILES[1]} and {VOICES_FILE} (kokoro-onnx's release "
            "model-files-v1.0)"
        )
    files = kokoro_files(path)
    check_graph(files.model)
    bank = VoiceBank(load_voice_packs(files.voices))
    from omnistep.models.kokoro.voice import KokoroSettings

    settings = KokoroSettings(bank)

    def build_voice(device: str):
        from omnistep.models.kokoro.voice import KokoroVoiceComponent

        return KokoroVoiceComponent(
            files.model,
            device=device,
            num_threads=session_threads(),
            all_core_threads=first_unit_threads(),
        )

    return sentence_card(
        card_id=CARD_ID,
        family="kokoro",
        frontend=kokoro_frontend(first_chunk_chars, bank),
        settings=settings,
        build_voice=build_voice,
        voices=bank.voices,
        default_voice=bank.default_voice,
        sample_rate=SAMPLE_RATE,
        check_voice=bank.check,
        description=(
            f"Kokoro-82M v1.0 ({files.model.name}), {len(bank.names)} voices; blends as "
            "'a+b' or 'a(2)+b(1)'"
        ),
        component_description=f"Kokoro-82M v1.0 (ONNX, {files.model.name})",
        word_timestamps=True,
    )
