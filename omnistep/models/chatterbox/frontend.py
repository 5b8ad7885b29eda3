"""Chatterbox's text front end and the ``frontend`` node of its card.

Text: upstream ``tts.py: punc_norm`` (an empty text, a lower-case first letter, runs of
whitespace, uncommon or LLM punctuation, a missing sentence end) then ``EnTokenizer`` over
``tokenizer.json`` (spaces written ``[SPACE]``, then the ``tokenizers`` vocabulary; T3 adds the
start/stop text ids). The node builds the request's ``T3Prompt`` and its S3Gen voice prompt and
binds them to the program slots ``prompt`` and ``voice``; the per-stage seeds go to ``flow_seed``
and ``hift_seed``.

Imports ``tokenizers``, torch, ``omnistep.core`` and this family's modules.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from omnistep.core import OPENAI_VOICES, InvalidRequestError, ProgramContext, derived_seed
from omnistep.models.chatterbox.t3 import T3Prompt

SPACE = "[SPACE]"
_PUNCTUATION = (
    ("...", ", "),
    ("\u2026", ", "),
    (":", ","),
    (" - ", ", "),
    (";", ", "),
    ("\u2014", "-"),
    ("\u2013", "-"),
    (" ,", ","),
    ("\u201c", '"'),
    ("\u201d", '"'),
    ("\u2018", "'"),
    ("\u2019", "'"),
)
"""Upstream ``punc_norm``'s replacements, applied in this order."""
_SENTENCE_ENDS = (".", "!", "?", "-", ",")

SPEC_PREFIX = "chatterbox-voice:"
"""How a cloned voice's spec starts (``clone.voice_to_spec``)."""

FLOW_SEED_KEY, HIFT_SEED_KEY = 1, 2
"""``derived_seed`` keys of a request's S3Gen initial noise and HiFT source noise."""


def punc_norm(text: str) -> str:
    """Upstream ``punc_norm``: the empty text becomes upstream's stock sentence; the first
    letter is capitalised, whitespace runs collapse to one space, uncommon punctuation is
    replaced (``_PUNCTUATION``), and a full stop is added when no sentence end closes it."""
    if not text:
        return "You need to add some text for me to talk."
    if text[0].islower():
        text = text[0].upper() + text[1:]
    text = " ".join(text.split())
    for old, new in _PUNCTUATION:
        text = text.replace(old, new)
    text = text.rstrip(" ")
    if not text.endswith(_SENTENCE_ENDS):
        text += "."
    return text


class TextTokenizer:
    """``tokenizer.json`` as upstream's ``EnTokenizer`` uses it.

    Raises (constructor):
        ValueError: the vocabulary lacks ``[START]``, ``[STOP]`` or ``[SPACE]``.
    """

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(path))
        vocab = self.tokenizer.get_vocab()
        missing = [t for t in ("[START]", "[STOP]", SPACE) if t not in vocab]
        if missing:
            raise ValueError(f"{path} lacks the special tokens {missing}")

    def encode(self, text: str) -> list[int]:
        """Ids of ``text`` (already ``punc_norm``-ed), spaces as ``[SPACE]``."""
        return self.tokenizer.encode(text.replace(" ", SPACE)).ids


@dataclass(frozen=True, eq=False)
class Voice:
    """A Chatterbox voice: T3's and S3Gen's conditioning (``conds.pt``'s two halves).

    Attributes:
        speaker: ``[256]`` voice-encoder embedding (T3).
        prompt_tokens: T3's prompt speech tokens.
        exaggeration: the voice's stored emotion scalar (used when a request gives none).
        gen_tokens: ``[p]`` int64 S3Gen's prompt speech tokens.
        gen_mel: ``[2p, 80]`` S3Gen's prompt mel.
        gen_embedding: ``[192]`` S3Gen's speaker x-vector.
    """

    speaker: torch.Tensor
    prompt_tokens: tuple[int, ...]
    exaggeration: float
    gen_tokens: torch.Tensor
    gen_mel: torch.Tensor
    gen_embedding: torch.Tensor


DEFAULT_EXAGGERATION = 0.5
DEFAULT_CFG_WEIGHT = 0.5
"""``ChatterboxTTS.generate``'s defaults."""


class ChatterboxFrontend:
    """The ``frontend`` node and the card's ``voice_validator``.

    Args:
        tokenizer: the text tokenizer.
        default_voice: ``conds.pt``'s voice (None: the folder has none, so no voice speaks).
        cfg_weight: classifier-free guidance weight of T3 (0 turns it off) when a request's
            ``SamplingParams.cfg_weight`` is unset.
        exaggeration: emotion exaggeration when a request's ``SamplingParams.exaggeration`` is
            unset; None keeps the voice's stored value.
        cloned: ``spec -> Voice`` for cloned voices' specs (``clone.voice_from_spec``); None:
            the folder cannot clone, so no spec is accepted.
    """

    def __init__(
        self,
        tokenizer: TextTokenizer,
        default_voice: Voice | None,
        cfg_weight: float = DEFAULT_CFG_WEIGHT,
        exaggeration: float | None = DEFAULT_EXAGGERATION,
        cloned: Callable[[str], Voice] | None = None,
    ):
        self.tokenizer = tokenizer
        self.default_voice = default_voice
        self.cfg_weight = cfg_weight
        self.exaggeration = exaggeration
        self.cloned = cloned

    def voice(self, name: str | None) -> Voice:
        """The voice a request names: the default for None, ``default`` and OpenAI's names; a
        cloned voice's spec (``SPEC_PREFIX``) when the folder can clone.

        Raises:
            InvalidRequestError: another name, a damaged spec, or no default voice in the
                folder (``voice``).
        """
        if name is not None and name.startswith(SPEC_PREFIX) and self.cloned is not None:
            return self.cloned(name)
        if name is not None and name != "default" and name not in OPENAI_VOICES:
            clone = (
                ", or a cloned voice (POST /v1/audio/voices, or ref_audio)" if self.cloned else ""
            )
            raise InvalidRequestError(
                f"unknown voice {name[:40]!r}: chatterbox speaks its default voice "
                f"('default' or an OpenAI voice name){clone}",
                param="voice",
                code="invalid_voice",
            )
        if self.default_voice is None:
            raise InvalidRequestError(
                "this chatterbox folder has no conds.pt, so it has no default voice",
                param="voice",
                code="invalid_voice",
            )
        return self.default_voice

    def check_voice(self, name: str) -> None:
        """Raise InvalidRequestError (param ``voice``) for a voice the card cannot use."""
        self.voice(name)

    def __call__(self, ctx: ProgramContext) -> None:
        req = ctx.request
        if not req.text.strip():
            raise InvalidRequestError("input text is empty", param="input")
        voice = self.voice(req.voice)
        ids = tuple(self.tokenizer.encode(punc_norm(req.text)))
        default = voice.exaggeration if self.exaggeration is None else self.exaggeration
        exaggeration = float(req.sampling.or_default("exaggeration", default))
        weight = float(req.sampling.or_default("cfg_weight", self.cfg_weight))
        cfg = weight if weight > 0 else None
        ctx.slots["prompt"] = T3Prompt(ids, voice.speaker, voice.prompt_tokens, exaggeration, cfg)
        ctx.slots["voice"] = voice
        ctx.slots["hift_seed"] = derived_seed(req.seed, HIFT_SEED_KEY)
        ctx.usage["input_tokens"] = len(ids)
