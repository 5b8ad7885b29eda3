"""Split text into sentences, and long sentences into clauses, without losing or repeating a word.

Every cut is made at a run of whitespace, and a piece is the text between two cuts with its
outer whitespace stripped, so the pieces' whitespace-separated words, concatenated, are exactly
the input's words (``[w for p in pieces for w in p.split()] == text.split()``).

Sentences end at ``.``, ``!``, ``?`` or ``…`` (with any closing quotes or brackets after them)
followed by whitespace, and at blank lines. A period does not end a sentence when it belongs to
a title or a Latin abbreviation that is followed by more of the sentence (``Dr.``, ``Mr.``,
``St.``, ``e.g.``, ``i.e.``, ``vs.``, ``No.``, ...), to a single capital initial (``J. R. R.
Tolkien``), or when the next word starts with a lower-case letter (``"etc. and so on"``). A
period with no whitespace after it never ends one (``3.14``, ``example.com``). A single newline
is whitespace, not a boundary (hard-wrapped text), as in espeak-ng.

A sentence longer than ``max_chars`` is cut into pieces of at most ``max_chars`` characters at
the last clause boundary that fits (whitespace after ``, ; : – — …``, or after a spaced ``-`` or
``--``), else at the last space that fits; a single word longer than ``max_chars`` is kept
whole (nothing is cut inside a word).

pysbd (the sentence splitter Coqui TTS uses) was measured for this: it handles more
abbreviations, but it changes whitespace (leading spaces and blank lines vanish from its
pieces) and takes up to 1.2 s on a 4096-character input here (``"1. " * 1365``), where these
regular expressions take about a millisecond.

Imports: stdlib only.

Examples:
    >>> split_sentences("Dr. Smith earned 3.14 points, e.g. on Monday. It rained!\\n\\nThe end")
    ['Dr. Smith earned 3.14 points, e.g. on Monday.', 'It rained!', 'The end']
    >>> split_clauses("one two, three four, five six", max_chars=12)
    ['one two,', 'three four,', 'five six']
"""

from __future__ import annotations

import re

__all__ = ["NON_TERMINAL", "split_clauses", "split_sentences", "split_text"]

NON_TERMINAL = frozenset(
    {
        # titles, which precede a name
        "mr",
        "mrs",
        "ms",
        "dr",
        "prof",
        "st",
        "mt",
        "rev",
        "gen",
        "capt",
        "sgt",
        "lt",
        "col",
        # abbreviations followed by more of the sentence
        "e.g",
        "i.e",
        "eg",
        "ie",
        "vs",
        "cf",
        "approx",
        "ca",
        "no",
        "nos",
        "vol",
        "fig",
        "pp",
    }
)
"""Lower-cased words (without their final period) whose period never ends a sentence."""

# Possessive quantifiers and the look-behind keep every pattern linear in the text's length.
_SENTENCE_END = re.compile(r"(?<![.!?…])(?P<end>[.!?…]++)[\"'”’»)\]]*+(?P<space>\s+)")
_WORD_BEFORE = re.compile(r"[\w.]*+$")
_WORD_BEFORE_SPACE = re.compile(r"(?<!\S)\S++$")
_WINDOW = 24
"""Characters looked at before a period or a space: more than the longest abbreviation."""
_NEXT_START = re.compile(r"[\"'“‘«(\[]*(?P<c>.)", re.DOTALL)
_SPACE = re.compile(r"\s+")
_CLAUSE_PUNCTUATION = frozenset(",;:–—…")


def _ends_sentence(text: str, m: re.Match[str]) -> bool:
    end = m["end"]
    if "!" in end or "?" in end:
        return True
    word = _WORD_BEFORE.search(text, max(0, m.start() - _WINDOW), m.start())[0]
    if end == "." and (word.lower() in NON_TERMINAL or (len(word) == 1 and word.isupper())):
        return False
    following = _NEXT_START.match(text, m.end())
    return following is None or not following["c"].islower()


def _cut(text: str, cuts: list[tuple[int, int]]) -> list[str]:
    """The stripped, non-empty pieces of ``text`` between whitespace spans ``cuts``."""
    pieces, start = [], 0
    for a, b in [*sorted(set(cuts)), (len(text), len(text))]:
        piece = text[start:a].strip()
        if piece:
            pieces.append(piece)
        start = max(start, b)
    return pieces


def split_sentences(text: str) -> list[str]:
    """The sentences of ``text`` in order, stripped; whitespace-only text gives ``[]``.

    >>> split_sentences("Mr. and Mrs. Jones arrived at 5 p.m. Then they left. e.g. this")
    ['Mr. and Mrs. Jones arrived at 5 p.m.', 'Then they left. e.g. this']
    """
    cuts = [m.span("space") for m in _SENTENCE_END.finditer(text) if _ends_sentence(text, m)]
    cuts += [m.span() for m in _SPACE.finditer(text) if m[0].count("\n") >= 2]
    return _cut(text, cuts)


def _is_clause_cut(text: str, start: int) -> bool:
    before = text[start - 1]
    if before in _CLAUSE_PUNCTUATION:
        return True
    word_before = _WORD_BEFORE_SPACE.search(text, max(0, start - 3), start)
    return word_before is not None and word_before[0] in ("-", "--")


def split_clauses(sentence: str, max_chars: int) -> list[str]:
    """Cut ``sentence`` into pieces of at most ``max_chars`` characters (stripped).

    Cuts at the last clause boundary within the limit, else the last space; a word longer than
    ``max_chars`` becomes a piece of its own. A sentence that fits is returned whole.

    Raises:
        ValueError: ``max_chars`` < 1.

    >>> split_clauses("alpha beta gamma delta", max_chars=11)
    ['alpha beta', 'gamma delta']
    """
    if max_chars < 1:
        raise ValueError(f"max_chars must be >= 1, got {max_chars}")
    sentence = sentence.strip()
    spaces = [m.span() for m in _SPACE.finditer(sentence)]
    clauses = [s for s in spaces if _is_clause_cut(sentence, s[0])]
    cuts: list[tuple[int, int]] = []
    start = 0
    while len(sentence) - start > max_chars:
        limit = start + max_chars
        fitting = [s for s in clauses if start < s[0] <= limit]
        if not fitting:
            fitting = [s for s in spaces if start < s[0] <= limit]
        if not fitting:  # one word longer than max_chars: cut after it
            fitting = [s for s in spaces if s[0] > start][:1]
            if not fitting:
                break
        cut = fitting[-1]
        cuts.append(cut)
        start = cut[1]
    return _cut(sentence, cuts)


def split_text(text: str, max_chars: int = 300) -> list[str]:
    """Sentences of ``text``, each cut by ``split_clauses`` to at most ``max_chars`` characters
    where it has spaces; ``[]`` for whitespace-only text.

    300 characters is about 20 s of speech.

    >>> split_text("A short one. Word word word word", max_chars=10)
    ['A short', 'one.', 'Word word', 'word word']
    """
    return [piece for s in split_sentences(text) for piece in split_clauses(s, max_chars)]
