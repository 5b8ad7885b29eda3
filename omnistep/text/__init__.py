"""Model-independent text front-end for speech: normalisation to words, then splitting.

``prepare(text)`` is what a card runs on a request's input: ``normalize`` (numbers, dates,
times, money, abbreviations to words) then ``split_text`` (sentences; long sentences cut at
clauses, else between words); ``SentenceBuffer`` does the splitting for text that arrives in
pieces. Imports stdlib and ``num2words`` only (no torch, no phonemizer).

>>> prepare("Dr. Smith paid $12.50. He left at 3 pm.")
['Doctor Smith paid twelve dollars and fifty cents.', 'He left at three p.m.']
"""

from omnistep.text.normalize import normalize
from omnistep.text.split import split_clauses, split_sentences, split_text
from omnistep.text.stream import SentenceBuffer

__all__ = [
    "SentenceBuffer",
    "normalize",
    "prepare",
    "split_clauses",
    "split_sentences",
    "split_text",
]


def prepare(
    text: str,
    max_chars: int = 300,
    first_chunk_chars: int | None = None,
    normalize_text: bool = True,
) -> list[str]:
    """``split_text(normalize(text), max_chars)``: the pieces a card synthesises in order.

    ``first_chunk_chars``: a first piece longer than this is cut at clauses (else spaces)
    into pieces of at most this many characters (``split_clauses``), so that the first unit,
    which sets the time to first audio, is short; None keeps it. ``normalize_text=False``
    splits the text as given.
    """
    pieces = split_text(normalize(text) if normalize_text else text, max_chars)
    if pieces and first_chunk_chars is not None and len(pieces[0]) > first_chunk_chars:
        pieces[:1] = split_clauses(pieces[0], first_chunk_chars)
    return pieces
