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

Words: each ``Sentence`` also says which ids spell each word of the text (``Sentence.words``, for
word timestamps). espeak separates words with a space phoneme but sometimes joins short words
(``"from the"`` -> ``fɹʌmðə``), so the text's words are matched to espeak's phoneme words by
``match_words``: one to one when the counts agree, else by the lengths of the words phonemized
alone, a joined group being shared among its words in proportion to those lengths (those
words' times are then estimates within the group's exact span).

Source: ``piper/voice.py`` (``PiperVoice.phonemize``, ``PiperVoice.phonemes_to_ids``),
``piper/phonemize_espeak.py``, ``piper/phoneme_ids.py`` (BOS ``^`` and PAD ``_``, then each
phoneme followed by PAD, then EOS ``$``), ``piper/config.py`` of piper-tts 1.8.0.

Imports: stdlib, piper-tts, ``omnistep.core`` and ``omnistep.text``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from piper.config import PiperConfig
from piper.voice import PiperVoice

from omnistep.core.errors import InvalidRequestError
from omnistep.runners.sentence_voice import Sentence, WordSpan, split_long, strip_spaces
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
        pieces: list[tuple[list[str], list[str | None]]] = []  # phonemes, word of each
        for piece in self.texts(text, normalize_text):
            phonemized = [strip_spaces(p) for p in self._phonemize(piece) if _is_speakable(p)]
            owners = self.match_words(piece, phonemized)
            for phonemes, owner in zip(phonemized, owners, strict=True):
                cursor = 0
                for part in split_long(phonemes, self.max_phonemes):
                    while phonemes[cursor : cursor + len(part)] != part:
                        cursor += 1  # a cut dropped spaces
                    pieces.append((part, owner[cursor : cursor + len(part)]))
                    cursor += len(part)
        if not pieces:
            raise InvalidRequestError(
                "The input has nothing to speak (empty after phonemization).",
                param="input",
                code="empty_input",
            )
        return [
            Sentence(i, "".join(p), tuple(self._phonemizer.phonemes_to_ids(p)), self._spans(p, o))
            for i, (p, o) in enumerate(pieces)
        ]

    def _phonemize(self, text: str) -> list[list[str]]:
        """piper's phonemes of ``text``, one list per espeak sentence.

        Raises:
            InvalidRequestError: (``param="input"``) espeak rejects the text.
        """
        try:
            return self._phonemizer.phonemize(text)
        except ValueError as exc:  # espeak rejects e.g. embedded NUL characters
            raise InvalidRequestError(
                f"The input cannot be phonemized: {exc}", param="input", code="invalid_input"
            ) from None

    def match_words(self, text: str, sentences: list[list[str]]) -> list[list[str | None]]:
        """For each phoneme of ``sentences`` (espeak's phonemes of ``text``), the word of
        ``text`` it belongs to, or None (spaces, punctuation, or no match found).

        espeak's words are the runs between space phonemes that hold a sound; the text's words
        are its whitespace-separated tokens with a letter or digit, outer punctuation stripped.
        Equal counts pair them in order; otherwise ``_align`` pairs runs of them by length.
        """
        words = [w.strip(_WORD_PUNCTUATION) for w in text.split()]
        words = [w for w in words if any(c.isalnum() for c in w)]
        groups = [(k, a, b) for k, s in enumerate(sentences) for a, b in _sound_runs(s)]
        owners: list[list[str | None]] = [[None] * len(s) for s in sentences]
        if not words or not groups:
            return owners
        if len(words) == len(groups):
            for w, (k, a, b) in zip(words, groups, strict=True):
                owners[k][a:b] = [w] * (b - a)
            return owners
        alone = [max(1, _sounds(sum(self._phonemize(w), []))) for w in words]
        lengths = [_sounds(sentences[k][a:b]) for k, a, b in groups]
        for (i, j), (m, n) in _align(alone, lengths):
            if j - i == 1:  # one word, one or more groups
                for k, a, b in groups[m:n]:
                    owners[k][a:b] = [words[i]] * (b - a)
                continue
            k, a, b = groups[m]  # several words joined in one group: share it by length
            shares = np.cumsum(alone[i:j])
            start = a
            for w, share in zip(words[i:j], shares, strict=True):
                end = a + round((b - a) * float(share) / float(shares[-1]))
                owners[k][start:end] = [w] * (end - start)
                start = end
        return owners

    def _spans(self, phonemes: list[str], owner: list[str | None]) -> tuple[WordSpan, ...]:
        """The ``WordSpan``s of a piece: each word's ids in ``phonemes_to_ids(phonemes)`` (BOS,
        PAD, then each phoneme's ids and a PAD), its last phoneme's PAD included."""
        id_map = self.config.phoneme_id_map
        spans: list[WordSpan] = []
        pos = 2  # after BOS and PAD
        for phoneme, word in zip(phonemes, owner, strict=True):
            if phoneme not in id_map:
                continue  # phonemes_to_ids skips it
            end = pos + len(id_map[phoneme]) + 1
            if word is not None:
                last = spans[-1] if spans else None
                if last is not None and last.word == word and last.end == pos:
                    spans[-1] = WordSpan(word, last.start, end)
                else:
                    spans.append(WordSpan(word, pos, end))
            pos = end
        return tuple(spans)


_WORD_PUNCTUATION = "\"'“”‘’()[]{}.,;:!?¡¿…-–—"
"""Stripped from the ends of a text word."""
_NOT_SOUNDS = frozenset({*PUNCTUATION, "ˈ", "ˌ", "ː"})
"""Phonemes that do not count in a word's length (punctuation, stress, length marks)."""


def _is_speakable(phonemes: list[str]) -> bool:
    return any(p not in PUNCTUATION for p in phonemes)


def _sounds(phonemes: list[str]) -> int:
    """How many phonemes of ``phonemes`` are sounds."""
    return sum(p not in _NOT_SOUNDS for p in phonemes)


def _sound_runs(phonemes: list[str]) -> list[tuple[int, int]]:
    """``[a, b)`` of each space-separated run holding a sound, outer punctuation excluded."""
    runs, start = [], 0
    for i in range(len(phonemes) + 1):
        if i == len(phonemes) or phonemes[i] == " ":
            a, b = start, i
            while a < b and phonemes[a] in PUNCTUATION:
                a += 1
            while b > a and phonemes[b - 1] in PUNCTUATION:
                b -= 1
            if _sounds(phonemes[a:b]):
                runs.append((a, b))
            start = i + 1
    return runs


MAX_JOINED = 3
"""Most text words espeak joins into one phoneme word (or phoneme words one text word makes)."""


def _align(words: list[int], groups: list[int]) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Pair runs of ``words`` (their lengths alone) with runs of ``groups`` (espeak's words'
    lengths), in order, every pair one-to-many or many-to-one (at most ``MAX_JOINED``), with the
    least total ``|sum(words) - sum(groups)|`` plus 1 per extra item (dynamic programming).
    Returns ``((i, j), (m, n))``: ``words[i:j]`` spoke ``groups[m:n]``."""
    inf = float("inf")
    cost = [[inf] * (len(groups) + 1) for _ in range(len(words) + 1)]
    back: list[list[tuple[int, int] | None]] = [[None] * (len(groups) + 1) for _ in cost]
    cost[0][0] = 0.0
    for i in range(len(words) + 1):
        for m in range(len(groups) + 1):
            if cost[i][m] == inf:
                continue
            for dw, dg in [(1, 1), *((k, 1) for k in range(2, MAX_JOINED + 1)),
                           *((1, k) for k in range(2, MAX_JOINED + 1))]:  # fmt: skip
                j, n = i + dw, m + dg
                if j > len(words) or n > len(groups):
                    continue
                c = cost[i][m] + abs(sum(words[i:j]) - sum(groups[m:n])) + (dw + dg - 2)
                if c < cost[j][n]:
                    cost[j][n], back[j][n] = c, (i, m)
    if cost[len(words)][len(groups)] == inf:
        return []
    pairs = []
    j, n = len(words), len(groups)
    while (j, n) != (0, 0):
        i, m = back[j][n]  # type: ignore[misc]
        pairs.append(((i, j), (m, n)))
        j, n = i, m
    return pairs[::-1]
