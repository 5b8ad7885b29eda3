"""English text -> misaki/Kokoro phonemes -> model ids, with hibari's G2P (no espeak, no GPL).

Kokoro-82M and the voices distilled from it (hibari) read phonemes in misaki's alphabet
(``vocab.json`` of either package: one id per character). hibari-tts ships a complete English
G2P without espeak-ng or spaCy (a port of misaki 0.9.4's ``en.py``: tokenizer, perceptron
tagger, gold/silver lexicons with part-of-speech rules, an ONNX net for unknown words, stress
resolution); ``english_g2p`` loads it once per process (about 0.5 s and 60 MB; each sentence
then takes about 1-4 ms on the 2-core CI machine).

``MisakiFrontend`` is the ``SentenceFrontend`` of such voices: the model-independent
``omnistep.text`` normalisation (numbers, dates, money, abbreviations to words), sentence
splitting (``split_text``; the first sentence also cut at clauses to ``first_chunk_chars``, for
the time to first audio), then G2P per piece, and pieces still over ``max_phonemes`` cut at
clause punctuation, else spaces (``split_long``). Characters missing from the vocab are dropped,
as upstream does (hibari ``Hibari.ids``, kokoro-onnx ``Tokenizer.tokenize``); ids get the 0 pad
at both ends.

Words: ``sentences`` also records which ids spell each word (``Sentence.words``), from the
G2P's own tokens (the phoneme string is built from them exactly as hibari's ``G2P.__call__``
joins them), so the voices can time every word (word timestamps). A word is a token whose text
has a letter or a digit; punctuation and the spaces between words belong to no word.

Source: hibari-tts 0.2.1 ``hibari/g2p/__init__.py`` (``G2P``), ``hibari/tts.py``
(``MAX_PHONEMES`` 400, ``ids``).

Imports: stdlib, hibari-tts (lazily), ``omnistep.core``, ``omnistep.text``.
"""

from __future__ import annotations

import functools
import logging
import re
import threading
import unicodedata
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from omnistep.core import InvalidRequestError
from omnistep.runners.sentence_voice import (
    FIRST_CHUNK_CHARS,
    Sentence,
    WordSpan,
    split_long,
)
from omnistep.text import prepare

if TYPE_CHECKING:
    from hibari.g2p import G2P

__all__ = ["PUNCTUATION", "MisakiFrontend", "english_g2p"]

PUNCTUATION = frozenset(" \t\n.,;:!?¡¿-–—…'\"()[]“”")
"""Phonemes that carry no speech on their own: a piece made only of these is dropped."""

_QUOTES = "\"'“”‘’()[]{}«»"
"""Stripped from the ends of a word's text (a token may keep its quotes: ``"Quoted"``)."""

_G2P_LOCK = threading.Lock()

log = logging.getLogger(__name__)

MAX_NUMBER_DIGITS = 36
"""Digits of the longest number hibari's G2P reads as a number: its largest scale word is
"decillion" (10**33, ``hibari/g2p/numbers.py`` ``SCALES``), so a longer number raises
IndexError in ``cardinal``."""

_NUMBER_RUN = re.compile(r"[0-9][0-9,]*")

MAX_WORD_CHARS = 32
"""Longest run of non-space characters the G2P gets whole; longer runs are cut into pieces of
this many characters. hibari's G2P takes time that grows about as the cube of a token's length
when it splits the token into parts (camelCase, hyphens): measured on the 2-core CI machine,
64 characters of ``aB`` 0.23 s, 800 of them 58 s, all on the server's event loop; 32
characters take 0.01-0.15 s. English words are shorter than this but for a few."""

_LONG_RUN = re.compile(rf"\S{{{MAX_WORD_CHARS + 1},}}")


def _cut_long_run(match: re.Match[str]) -> str:
    run = match.group()
    return " ".join(run[i : i + MAX_WORD_CHARS] for i in range(0, len(run), MAX_WORD_CHARS))


def _ascii_digit(char: str) -> str:
    """A character ``str.isdigit`` takes for a digit, as its ASCII digit (``"１"``, ``"٣"``,
    ``"²"``, ``"①"``); other characters unchanged."""
    if char.isascii() or not char.isdigit():
        return char
    return str(unicodedata.digit(char))


def _spaced_long_number(match: re.Match[str]) -> str:
    digits = match.group().replace(",", "")
    return " ".join(digits) if len(digits) > MAX_NUMBER_DIGITS else match.group()


def g2p_safe(text: str) -> str:
    """``text`` as hibari's G2P can read it: digits of other scripts and forms (fullwidth,
    Arabic-Indic, superscript, circled) as ASCII digits, since its tokenizer takes them for
    numbers and ``int()`` fails on some (``"①"``); and numbers of more than
    ``MAX_NUMBER_DIGITS`` digits spaced out, read digit by digit (they raised IndexError).
    The text front-end spells long numbers out already; this covers
    ``normalization_options.normalize: false`` and digits it does not know.

    Also drops invisible format characters (Unicode category Cf: zero-width spaces, bidi
    controls, soft hyphens), which joined a whole input into one token, and cuts runs of
    non-space characters longer than ``MAX_WORD_CHARS`` (the G2P's time grows with the cube of
    a token's length: 4,000 zero-width spaces took 39 s)."""
    if not text.isascii():
        text = "".join(_ascii_digit(c) for c in text if unicodedata.category(c) != "Cf")
    text = _NUMBER_RUN.sub(_spaced_long_number, text)
    return _LONG_RUN.sub(_cut_long_run, text)


@functools.cache
def english_g2p(british: bool = False) -> G2P:
    """hibari's English G2P (American, or British with ``british``), loaded once per process.

    Raises:
        MissingDependencyError: hibari-tts is not installed (via the registry's extras check).
    """
    from hibari.g2p import G2P

    return G2P(british=british)


class MisakiFrontend:
    """Text -> sentences of misaki phoneme ids for Kokoro-family voices.

    Args:
        vocab: phoneme character -> id (the voice's ``vocab.json``); 0 is the pad.
        max_phonemes: a piece with more phonemes than this is cut (hibari: 400; Kokoro's
            context holds 512 ids, so 510 phonemes plus the two pads).
        british: misaki's British lexicon and rules (en-gb voices): a bool for every request,
            or a function of the request's voice (Kokoro: voices named ``b*``).
        max_chars: the normalised text is cut into pieces of at most this many characters
            before G2P (``split_text``).
        first_chunk_chars: a first sentence longer than this is cut at clauses (else spaces)
            into pieces of at most this many characters; None keeps it whole.
        normalize_text: spell out numbers, dates, money and abbreviations first (default).

    Raises:
        ValueError: ``max_phonemes``, ``max_chars`` or ``first_chunk_chars`` < 1, or a vocab
            without characters.
    """

    def __init__(
        self,
        vocab: Mapping[str, int],
        *,
        max_phonemes: int,
        british: bool | Callable[[str | None], bool] = False,
        max_chars: int = 300,
        first_chunk_chars: int | None = FIRST_CHUNK_CHARS,
        normalize_text: bool = True,
    ):
        for name, value in (("max_phonemes", max_phonemes), ("max_chars", max_chars)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if first_chunk_chars is not None and first_chunk_chars < 1:
            raise ValueError(f"first_chunk_chars must be >= 1, got {first_chunk_chars}")
        if not vocab:
            raise ValueError("the phoneme vocab is empty")
        self.vocab = dict(vocab)
        self.max_phonemes = max_phonemes
        self.british = british
        self.max_chars = max_chars
        self.first_chunk_chars = first_chunk_chars
        self.normalize_text = normalize_text
        # Load the G2P (and its lazily built OOV net and caches) now, not on the first
        # request: loading took ~0.5 s, the first call another ~0.3 s.
        accents = {british} if isinstance(british, bool) else {False, True}
        for accent in accents:
            self.phonemes("Hello there, Zyxtrelle.", accent)

    def texts(self, text: str, normalize_text: bool | None = None) -> list[str]:
        """The pieces of text that go through G2P, in order: normalised, then split.

        Example: ``texts("Dr. Smith paid $12.50. Then he left.")`` is ``["Doctor Smith paid
        twelve dollars and fifty cents.", "Then he left."]``.
        """
        if normalize_text is None:
            normalize_text = self.normalize_text
        return prepare(text, self.max_chars, self.first_chunk_chars, normalize_text)

    def is_british(self, voice: str | None) -> bool:
        """Whether ``voice`` is read with the British G2P (see ``british``)."""
        return self.british if isinstance(self.british, bool) else bool(self.british(voice))

    def phonemes(self, text: str, british: bool = False) -> str:
        """hibari's G2P (British with ``british``) of one piece of text: a misaki phoneme
        string, e.g. ``"həlˈO."`` (of ``g2p_safe(text)``)."""
        g2p = english_g2p(british)
        with _G2P_LOCK:  # the tagger and lexicon caches are not meant for concurrent calls
            return g2p(g2p_safe(text))

    def read(self, text: str, british: bool = False) -> tuple[str, list[tuple[str, int, int]]]:
        """``phonemes(text, british)`` and its words: ``(phonemes, [(word, start, end)])``
        where ``phonemes[start:end]`` are the word's phoneme characters.

        The string is joined from the G2P's tokens as hibari's ``G2P.__call__`` joins them (a
        token's phonemes, then a space where the text had one; stripped), so it is the same.
        The G2P reads ``g2p_safe(text)``.

        Raises:
            InvalidRequestError: (``param="input"``, ``code="unreadable_input"``) the G2P
                raised on this text (a 400 naming the piece, not a 500).
        """
        from hibari.g2p import normalize

        g2p = english_g2p(british)
        try:
            with _G2P_LOCK:  # the tagger and lexicon caches are not meant for concurrent calls
                tokens = g2p.phonemize_tokens(g2p.tokenize(normalize(g2p_safe(text))))
        except Exception as exc:  # noqa: BLE001 - third-party code over a client's text
            log.warning("hibari's G2P failed on %r", text[:80], exc_info=exc)
            raise InvalidRequestError(
                f"The input could not be read by the English G2P near {text[:40]!r} "
                f"({type(exc).__name__}); rephrase that part.",
                param="input",
                code="unreadable_input",
            ) from exc
        parts: list[str] = []
        words: list[tuple[str, int, int]] = []
        pos = 0
        for tk in tokens:
            ps = g2p.unk if tk.phonemes is None else tk.phonemes
            if ps.strip() and any(c.isalnum() for c in tk.text):
                words.append((tk.text.strip(_QUOTES), pos, pos + len(ps)))
            parts.append(ps + (" " if tk.whitespace else ""))
            pos += len(parts[-1])
        joined = "".join(parts)
        lead = len(joined) - len(joined.lstrip())
        phonemes = joined.strip()
        spans = [(w, a - lead, min(b - lead, len(phonemes))) for w, a, b in words]
        return phonemes, [(w, a, b) for w, a, b in spans if a < b]

    def ids(self, phonemes: str) -> tuple[int, ...]:
        """``(0, *ids, 0)``: each character's vocab id, characters outside the vocab dropped."""
        vocab = self.vocab
        return (0, *(vocab[c] for c in phonemes if c in vocab), 0)

    def sentences(
        self, text: str, normalize_text: bool | None = None, voice: str | None = None
    ) -> list[Sentence]:
        """Split ``text`` into sentences of phoneme ids, in reading order; ``voice`` picks the
        G2P's accent (``is_british``).

        Raises:
            InvalidRequestError: (``param="input"``, ``code="empty_input"``) nothing
                speakable: no phoneme outside punctuation after G2P.
        """
        pieces: list[tuple[str, tuple[WordSpan, ...]]] = []
        british = self.is_british(voice)
        for piece in self.texts(text, normalize_text):
            phonemes, words = self.read(piece, british)
            if not any(c not in PUNCTUATION and c in self.vocab for c in phonemes):
                continue
            cursor = 0
            for part in split_long(phonemes, self.max_phonemes):
                start = phonemes.index(part, cursor)  # parts are in order; cuts drop spaces
                cursor = start + len(part)
                pieces.append((part, self._word_spans(part, start, words)))
        if not pieces:
            raise InvalidRequestError(
                "The input has nothing to speak (empty after phonemization).",
                param="input",
                code="empty_input",
            )
        return [Sentence(i, p, self.ids(p), w) for i, (p, w) in enumerate(pieces)]

    def _word_spans(
        self, part: str, offset: int, words: list[tuple[str, int, int]]
    ) -> tuple[WordSpan, ...]:
        """The words of ``part`` (which starts at ``offset`` in the phoneme string whose
        ``words`` these are) as spans of ``ids(part)``: position ``k`` of the ids is the
        ``k``-th character of ``part`` in the vocab, after the leading pad."""
        id_index: list[int | None] = []
        k = 1  # ids[0] is the pad
        for c in part:
            id_index.append(k if c in self.vocab else None)
            k += c in self.vocab
        spans = []
        for word, a, b in words:
            inside = [
                id_index[j - offset] for j in range(max(a, offset), min(b, offset + len(part)))
            ]
            inside = [i for i in inside if i is not None]
            if inside:
                spans.append(WordSpan(word, inside[0], inside[-1] + 1))
        return tuple(spans)
