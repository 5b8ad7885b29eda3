"""Token ids of text that arrives in pieces, equal to tokenizing the whole text at once.

A byte-level BPE (GPT-2, Qwen2/Qwen3) never merges across pre-tokens: its pre-tokenizer cuts the
(normalized) text into pieces with a regex, and each piece is encoded on its own. Text that is
still arriving can only change its LAST pre-token (a word may go on, whitespace may become a
space before the next word, ``'`` may become ``'s``) and, through normalization (NFC), its last
characters, which that pre-token holds. So the tokens of every pre-token but the last are final:
``feed`` returns them as soon as a later pre-token begins, and ``finish`` the rest. Special
(added) tokens spelled in the text are matched as the whole-text encoding matches them only
when they arrive in one piece.

Uses a ``tokenizers.Tokenizer`` (a transformers tokenizer's ``backend_tokenizer``); no torch.
"""

from __future__ import annotations

from typing import Any


class IncrementalTokenizer:
    """Feed text pieces, get token ids as they become final.

    Args:
        backend: a ``tokenizers.Tokenizer`` with a pre-tokenizer (e.g.
            ``Qwen2Tokenizer.from_pretrained(dir).backend_tokenizer``).

    Invariant: the concatenation of everything ``feed`` and ``finish`` return equals
    ``backend.encode(whole_text, add_special_tokens=False).ids`` for any way of cutting the text
    (tests/test_text_frontend.py checks random cuts).

    Raises:
        ValueError: a backend without a pre-tokenizer (its tokens may span any text).
    """

    def __init__(self, backend: Any):
        if backend.pre_tokenizer is None:
            raise ValueError("IncrementalTokenizer needs a tokenizer with a pre-tokenizer")
        self.backend = backend
        self.text = ""  # everything fed, as given
        self.ids: list[int] = []  # ids returned so far
        self._done = 0  # characters of the normalized text whose ids were returned
        self.finished = False

    def _normalized(self) -> str:
        normalizer = self.backend.normalizer
        return normalizer.normalize_str(self.text) if normalizer is not None else self.text

    def _encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids if text else []

    def feed(self, piece: str) -> list[int]:
        """Add ``piece``; returns the ids that became final (possibly none).

        Raises:
            RuntimeError: after ``finish``.
        """
        if self.finished:
            raise RuntimeError("feed after finish")
        self.text += piece
        normalized = self._normalized()
        pieces = self.backend.pre_tokenizer.pre_tokenize_str(normalized)
        if len(pieces) < 2:
            return []
        boundary = pieces[-1][1][0]  # the last pre-token's start (normalized characters)
        if boundary <= self._done:
            return []
        new = self._encode(normalized[self._done : boundary])
        self._done = boundary
        self.ids.extend(new)
        return new

    def finish(self) -> list[int]:
        """The text is complete: returns the remaining ids (idempotent: [] the second time)."""
        if self.finished:
            return []
        self.finished = True
        new = self._encode(self._normalized()[self._done :])
        self._done = len(self._normalized())
        self.ids.extend(new)
        return new
