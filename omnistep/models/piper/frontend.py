"""Text -> sentences -> phoneme ids for a Piper voice, with piper-tts's own phonemizer.

The text first goes through the model-independent front-end ``omnistep.text``: ``normalize``
spells out numbers, dates, times, money, percentages, units and abbreviations (``"Dr. Smith
paid $12.50"`` -> ``"Doctor Smith paid twelve dollars and fifty cents"``), and ``split_text``
cuts the result into sentences, and sentences longer than ``max_chars`` at a clause (else word)
boundary, without dropping or repeating a word.

Each piece is then phonemized by piper (espeak-ng, bundled with the ``piper-tts`` wheel; no
system espeak): ``espeakbridge.get_phonemes`` returns one entry per clause with its terminator
and an end-of-sentence flag, and ``EspeakPhonemizer.phonemize`` groups clauses into sentences
(``,`` ``:`` ``;`` keep the sentence going; ``.`` ``?`` ``!`` and blank lines end it), so espeak
may still cut a piece where it sees a sentence end (``"U.S. Army"``). This module keeps one
``Sentence`` per piper sentence, so the card emits one AUDIO_CHUNK unit per sentence. A sentence
still longer than ``max_phonemes`` (a single very long word) is cut at a clause boundary, else a
word boundary, else at the limit, so that one unit stays bounded in time and memory; no phoneme
is dropped by the cut.

Behaviour inherited from espeak (no words are dropped, but note): symbols and emoji that the
normaliser leaves are read out (``"😀"`` -> "grinning face"); text between ``[[ ]]`` is taken as
raw phonemes. Phonemes missing from the voice's id map are skipped by ``phonemes_to_ids`` with a
logged warning (none occur for the ``en-us`` voice on Latin, Cyrillic, Greek or Arabic text).

Source: ``piper/voice.py`` (``PiperVoice.phonemize``, ``PiperVoice.phonemes_to_ids``),
``piper/phonemize_espeak.py``, ``piper/phoneme_ids.py`` (BOS ``^`` and PAD ``_``, then each
phoneme followed by PAD, then EOS ``$``), ``piper/config.py`` of piper-tts 1.8.0.

Imports: stdlib, piper-tts, ``omnistep.core`` and ``omnistep.text``.
"""

from __future__ import annotations

import json
from pathlib import Path

from piper.config import PiperConfig
from piper.voice import PiperVoice

from omnistep.core.errors import InvalidRequestError
from omnistep.models.sentence_voice import Sentence, split_long, strip_spaces
from omnistep.text import prepare

__all__ = ["PiperFrontend", "Sentence", "split_long"]

PUNCTUATION = frozenset(" \t\n.,;:!?¡¿-–—…'\"()[]")
"""Phonemes that carry no speech on their own: a sentence made only of these is dropped."""


class PiperFrontend:
    """Phonemizes text for one Piper voice config (espeak voice, id map, vowel clusters).

    Thread safety: piper serialises espeak calls behind its own module lock.

    Args:
        config: the voice's ``PiperConfig`` (``PiperConfig.from_dict(json)``).
        max_phonemes: a sentence longer than this many phonemes is cut into several units (at
            the last ``, ; :`` before the limit, else the last space, else at the limit).
            400 phonemes is about 20 s of speech.
        max_chars: the normalised text is cut into pieces of at most this many characters
            before phonemization (``omnistep.text.split_text``); 300 characters give about
            300-350 phonemes, so ``max_phonemes`` only cuts what has no space to cut at.
        normalize_text: spell out numbers, dates, money and abbreviations first (default);
            False phonemizes the text as given (espeak then reads digits itself).
        first_chunk_chars: a first sentence longer than this is cut into pieces of at most
            this many characters, at clause boundaries (else spaces), so the first unit, which
            sets the time to first audio, is a clause rather than a whole sentence, and the
            next unit is short too: it must be ready before the first clause has played.
            None keeps the sentence whole.

    Raises:
        ValueError: ``max_phonemes``, ``max_chars`` or ``first_chunk_chars`` < 1.
    """

    def __init__(
        self,
        config: PiperConfig,
        max_phonemes: int = 400,
        max_chars: int = 300,
        normalize_text: bool = True,
        first_chunk_chars: int | None = None,
    ):
        if max_phonemes < 1:
            raise ValueError(f"max_phonemes must be >= 1, got {max_phonemes}")
        if max_chars < 1:
            raise ValueError(f"max_chars must be >= 1, got {max_chars}")
        if first_chunk_chars is not None and first_chunk_chars < 1:
            raise ValueError(f"first_chunk_chars must be >= 1, got {first_chunk_chars}")
        self.first_chunk_chars = first_chunk_chars
        self.config = config
        self.max_phonemes = max_phonemes
        self.max_chars = max_chars
        self.normalize_text = normalize_text
        # PiperVoice.phonemize / phonemes_to_ids only read ``config`` (and espeak state): the
        # ONNX session is not needed for phonemization, so none is built here.
        self._phonemizer = PiperVoice(session=None, config=config)  # type: ignore[arg-type]

    @classmethod
    def from_config_path(cls, config_path: str | Path, **kwargs) -> PiperFrontend:
        """Build from a voice's ``*.onnx.json`` config file; ``kwargs`` go to the constructor."""
        with open(config_path, encoding="utf-8") as f:
            return cls(PiperConfig.from_dict(json.load(f)), **kwargs)

    def texts(self, text: str, normalize_text: bool | None = None) -> list[str]:
        """The pieces of text that are phonemized, in order: normalised, then split.

        ``normalize_text`` overrides the constructor's setting for this text (a request's
        ``Request.normalize_text``); None keeps it.

        Example: ``texts("Dr. Smith paid $12.50. Then he left.")`` is ``["Doctor Smith paid
        twelve dollars and fifty cents.", "Then he left."]``.
        """
        if normalize_text is None:
            normalize_text = self.normalize_text
        return prepare(text, self.max_chars, self.first_chunk_chars, normalize_text)

    def sentences(
        self, text: str, normalize_text: bool | None = None, voice: str | None = None
    ) -> list[Sentence]:
        """Split ``text`` into sentences of phoneme ids, in reading order (``normalize_text``:
        see ``texts``; ``voice`` is not read: the voice has one speaker).

        Raises:
            InvalidRequestError: (``param="input"``) nothing speakable: the text is empty after
                phonemization, e.g. only whitespace or punctuation.
        """
        groups: list[list[str]] = []
        for piece in self.texts(text, normalize_text):
            try:
                phonemized = self._phonemizer.phonemize(piece)
            except ValueError as exc:  # espeak rejects e.g. embedded NUL characters
                raise InvalidRequestError(
                    f"The input cannot be phonemized: {exc}", param="input", code="invalid_input"
                ) from None
            groups += [strip_spaces(p) for p in phonemized if _is_speakable(p)]
        pieces = [piece for p in groups for piece in split_long(p, self.max_phonemes)]
        if not pieces:
            raise InvalidRequestError(
                "The input has nothing to speak (empty after phonemization).",
                param="input",
                code="empty_input",
            )
        return [
            Sentence(i, "".join(p), tuple(self._phonemizer.phonemes_to_ids(p)))
            for i, p in enumerate(pieces)
        ]


def _is_speakable(phonemes: list[str]) -> bool:
    return any(p not in PUNCTUATION for p in phonemes)
