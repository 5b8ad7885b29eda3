"""Sentences out of text that arrives in pieces (an LLM's tokens, words typed by a user).

``SentenceBuffer`` releases a sentence as soon as it is known to be complete, which is when the
next sentence has started: ``split_sentences`` of the buffered text then gives more than one
piece, and every piece but the last is complete (the last may still grow: ``"Dr."`` is followed
by a name, ``"etc."`` by more of the sentence, ``"3."`` by ``"14"``). ``flush`` releases the rest
at the end of the input. A pending sentence longer than ``max_chars`` is cut at clauses with
``split_clauses`` before its end arrives, so that text without sentence punctuation is still
spoken as it comes.

Fed in any pieces, the released sentences are those ``split_text`` gives for the whole text with
the same ``max_chars`` (checked in tests): a cut depends only on text that has already arrived.

Imports: stdlib and ``omnistep.text.split`` only.

>>> buffer = SentenceBuffer()
>>> [buffer.feed(word) for word in ["Hello", " there.", " How", " are", " you?"]]
[[], [], ['Hello there.'], [], []]
>>> buffer.flush()
['How are you?']
"""

from __future__ import annotations

from omnistep.text.split import split_clauses, split_sentences

__all__ = ["SentenceBuffer"]

_OPENING = "\"'“‘«(["
"""Opening quotes and brackets, which ``split_sentences`` looks past to see if a cut is one."""


class SentenceBuffer:
    """Accumulates streamed text and hands out complete sentences in order.

    Args:
        max_chars: a sentence longer than this is cut at clauses (else between words) into
            pieces of at most ``max_chars`` characters, as ``split_text`` does; the pieces are
            released as soon as the text after each cut has started.

    Raises:
        ValueError: ``max_chars`` < 1.
    """

    def __init__(self, max_chars: int = 300):
        if max_chars < 1:
            raise ValueError(f"max_chars must be >= 1, got {max_chars}")
        self.max_chars = max_chars
        self._text = ""

    @property
    def pending(self) -> str:
        """The text received but not released yet (the start of an incomplete sentence)."""
        return self._text

    def feed(self, text: str) -> list[str]:
        """Append ``text``; return the sentences (or clause pieces) it completed, stripped."""
        self._text += text
        sentences = split_sentences(self._text)
        if len(sentences) > 1 and not sentences[-1].lstrip(_OPENING):
            # Only opening quotes or brackets after the cut so far: whether it is a cut depends
            # on the letter that follows them ("(ok." continues a sentence, "(Ok." starts one).
            sentences.pop()  # it stays pending, after the sentence before it
        if not sentences:
            return []
        done = [p for s in sentences[:-1] for p in split_clauses(s, self.max_chars)]
        if len(sentences[-1]) > self.max_chars:
            done += split_clauses(sentences[-1], self.max_chars)[:-1]
        # The pieces are stripped substrings of the text, in order: drop the text up to the
        # end of the last one released (the whitespace after it goes with the pending text).
        end = 0
        for piece in done:
            end = self._text.index(piece, end) + len(piece)
        self._text = self._text[end:]
        return done

    def flush(self) -> list[str]:
        """End of input: return what is left as sentences (cut to ``max_chars``) and clear."""
        text, self._text = self._text, ""
        return [p for s in split_sentences(text) for p in split_clauses(s, self.max_chars)]

    def clear(self) -> str:
        """Drop the pending text and return it."""
        text, self._text = self._text, ""
        return text
