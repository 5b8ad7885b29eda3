"""Kokoro voices: packs by name, Kokoro-FastAPI's blend syntax, OpenAI names, the style row.

A voice pack is float32 ``[510, 256]``: row ``n - 1`` is the style vector for an input of ``n``
phonemes. A request's ``voice`` is one pack's name or a blend of packs, in Kokoro-FastAPI's
syntax (``api/src/routers/openai_compatible.py`` ``process_and_validate_voices`` and
``api/src/services/tts_service.py`` ``_get_voices_path`` of Kokoro-FastAPI v0.8.0):

- ``af_bella+af_sky``: equal weights; ``af_bella(2)+af_sky(1)``: weighted; ``a(2)-b(1)``
  subtracts. Spaces are ignored. Weights are positive finite numbers (default 1) and are
  normalised by their sum (Kokoro-FastAPI's default ``voice_weight_normalization=True``):
  ``a(2)+b(1)`` is ``2/3 a + 1/3 b``, ``a(2)-b(1)`` is ``2/3 a - 1/3 b``, and a lone
  ``af_bella(3)`` is ``af_bella``.
- Each item may be an OpenAI voice name (``alloy``, ``nova``...), mapped as below.
- An empty voice, a leading, trailing or doubled ``+``/``-``, an item that is not ``name`` or
  ``name(weight)``, or a weight that is not a positive number: ``InvalidRequestError(param=
  "voice", code="invalid_voice")``. An unknown name: ``code="unknown_voice"``, the message
  listing the folder's voices (Kokoro-FastAPI answers both with 400 ``validation_error``).

OpenAI voice names map as Kokoro-FastAPI's ``api/src/core/openai_mappings.json`` (``alloy`` ->
``am_adam``, ``ash`` -> ``af_nicole``, ``coral`` -> ``bf_emma``, ``echo`` -> ``af_bella``,
``fable`` -> ``af_sarah``, ``onyx`` -> ``bm_george``, ``nova`` -> ``bf_isabella``, ``sage`` ->
``am_michael``, ``shimmer`` -> ``af_sky``) when the folder has that pack; an OpenAI name it does
not map (``ballad``, ``verse``, ``marin``, ``cedar``) or whose pack the folder lacks maps to the
folder's default voice. A pack whose own name is an OpenAI name is that pack.

Default voice: ``af_heart`` (Kokoro-FastAPI's ``default_voice``) when the folder has it, else
the folder's first pack.

The style row follows hexgrad/kokoro (``kokoro/pipeline.py`` ``KPipeline.infer``:
``pack[len(ps) - 1]``, ``ps`` the phoneme string without the pads), the model Kokoro-FastAPI
runs: for ``n`` phoneme ids (pads excluded) the row is ``n - 1``. kokoro-onnx indexes one row
further (``voice[len(tokens)]``, ``src/kokoro_onnx/__init__.py`` ``_create_audio``).

Imports: stdlib, numpy, ``omnistep.core``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from omnistep.core import OPENAI_VOICES, InvalidRequestError

OPENAI_VOICE_MAP: dict[str, str] = {
    "alloy": "am_adam",
    "ash": "af_nicole",
    "coral": "bf_emma",
    "echo": "af_bella",
    "fable": "af_sarah",
    "onyx": "bm_george",
    "nova": "bf_isabella",
    "sage": "am_michael",
    "shimmer": "af_sky",
}
"""OpenAI voice -> Kokoro pack (Kokoro-FastAPI's ``openai_mappings.json``)."""

PREFERRED_DEFAULT = "af_heart"
"""The default voice when the folder has it (Kokoro-FastAPI's ``default_voice``)."""

_ITEM = re.compile(r"(?P<name>[^()]+)(?:\((?P<weight>[^()]*)\))?")
_NUMBER = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
"""A weight as written: a sign, digits, a decimal point and an exponent (no hex, no ``_``)."""
_SEPARATOR = re.compile(r"([+-])(?![^()]*\))")
"""A ``+`` or ``-`` between items, not one inside a weight's brackets (``a(1e-3)``)."""


@dataclass(frozen=True, slots=True)
class BlendTerm:
    """One item of a voice blend.

    Attributes:
        name: the item's name as written (a pack's or an OpenAI voice's).
        weight: > 0, before normalisation (1 when not written).
        sign: +1 (added) or -1 (subtracted).
    """

    name: str
    weight: float
    sign: int


def parse_blend(spec: str) -> tuple[BlendTerm, ...]:
    """Parse Kokoro-FastAPI's voice syntax (``a``, ``a+b``, ``a(2)+b(1)``, ``a(2)-b``); spaces
    are ignored. Names are not checked here.

    Raises:
        InvalidRequestError: (param ``voice``, code ``invalid_voice``) empty; a leading,
            trailing or doubled ``+``/``-``; an item not ``name`` or ``name(weight)``; a weight
            that is not a positive finite number.
    """
    text = spec.replace(" ", "").strip()
    if not text:
        raise _invalid("the voice is empty")
    if text[0] in "+-" or text[-1] in "+-" or re.search(r"[+-]{2,}", text):
        raise _invalid(f"voice '{spec}' has an empty item in its blend")
    parts = _SEPARATOR.split(text)
    terms: list[BlendTerm] = []
    for k in range(0, len(parts), 2):
        item = parts[k]
        match = _ITEM.fullmatch(item)
        if match is None:
            raise _invalid(f"voice item '{item}' is not a voice name or name(weight)")
        weight = 1.0
        if match.group("weight") is not None:
            if not _NUMBER.fullmatch(match.group("weight")):
                raise _invalid(f"voice item '{item}': the weight is not a number")
            weight = float(match.group("weight"))
            if not math.isfinite(weight) or weight <= 0:
                raise _invalid(f"voice item '{item}' must have a positive finite weight")
        sign = -1 if k > 0 and parts[k - 1] == "-" else 1
        terms.append(BlendTerm(match.group("name"), weight, sign))
    return tuple(terms)


def style_row(num_phonemes: int) -> int:
    """The pack row for ``num_phonemes`` phoneme ids (pads excluded): ``n - 1``, clamped to
    ``[0, 509]`` (hexgrad/kokoro ``KPipeline.infer``: ``pack[len(ps) - 1]``)."""
    return min(max(num_phonemes - 1, 0), 509)


class VoiceBank:
    """The voice packs of a folder, looked up by name, blend or OpenAI name.

    Args:
        packs: name -> float32 ``[510, 256]`` (``loader.load_voice_packs``), non-empty; the
            order is the folder's.

    Attributes:
        names: the packs' names, in the folder's order.
        default_voice: ``af_heart`` if present, else the first pack.
        openai_map: each OpenAI voice name -> the pack it means here (see the module doc).
    """

    def __init__(self, packs: Mapping[str, np.ndarray]):
        if not packs:
            raise ValueError("a VoiceBank needs at least one voice pack")
        self._packs = dict(packs)
        self.names: tuple[str, ...] = tuple(self._packs)
        self.default_voice = PREFERRED_DEFAULT if PREFERRED_DEFAULT in packs else self.names[0]
        self.openai_map: dict[str, str] = {}
        for name in OPENAI_VOICES:
            if name in self._packs:
                continue
            target = OPENAI_VOICE_MAP.get(name)
            self.openai_map[name] = target if target in self._packs else self.default_voice

    @property
    def voices(self) -> tuple[str, ...]:
        """Every single name a request may give: the packs, then the OpenAI names they lack."""
        return (*self.names, *self.openai_map)

    def pack_name(self, name: str) -> str:
        """The pack ``name`` means (itself, or what an OpenAI name maps to).

        Raises:
            InvalidRequestError: (param ``voice``, code ``unknown_voice``) no such pack or
                OpenAI name; the message lists the folder's voices.
        """
        if name in self._packs:
            return name
        if name in self.openai_map:
            return self.openai_map[name]
        raise InvalidRequestError(
            f"unknown voice '{name}'; this Kokoro folder has {', '.join(self.names)} (or an "
            f"OpenAI voice name: {', '.join(self.openai_map)}; blends as 'a+b' or "
            "'a(2)+b(1)')",
            param="voice",
            code="unknown_voice",
        )

    def is_british(self, spec: str | None) -> bool:
        """Whether voice ``spec`` speaks British English: its (first) pack's name starts with
        ``b`` (``bf_emma``, ``bm_george``), as Kokoro-FastAPI picks the G2P's language from the
        voice name's first letter (American ``a``; for a blend, the first voice's). A bad
        ``spec`` is not British (``check`` reports it)."""
        if spec is None:
            return self.default_voice.startswith("b")
        try:
            return self.pack_name(parse_blend(spec)[0].name).startswith("b")
        except InvalidRequestError:
            return False

    def check(self, spec: str | None) -> None:
        """Raise ``InvalidRequestError`` (param ``voice``) unless ``spec`` is None or a valid
        name or blend (see ``parse_blend`` and ``pack_name``)."""
        if spec is not None:
            for term in parse_blend(spec):
                self.pack_name(term.name)

    def style(self, spec: str | None, num_phonemes: int) -> np.ndarray:
        """The style vector, float32 ``[256]``, of voice ``spec`` (None: the default voice)
        for ``num_phonemes`` phoneme ids (pads excluded): row ``style_row(num_phonemes)`` of
        the pack, or of the blend ``sum(sign * weight / sum(weights) * pack)`` accumulated in
        the blend's order (Kokoro-FastAPI ``_get_voices_path`` blends whole packs; the row of
        the blend is the blend of the rows).

        Raises:
            InvalidRequestError: a bad ``spec`` (see ``check``).
        """
        row = style_row(num_phonemes)
        if spec is None:
            return self._packs[self.default_voice][row].copy()
        terms = parse_blend(spec)
        if len(terms) == 1:
            return self._packs[self.pack_name(terms[0].name)][row].copy()
        largest = max(t.weight for t in terms)  # scaled first: 1e308 + 1e308 is inf
        total = sum(t.weight / largest for t in terms)
        out = np.zeros(self._packs[self.names[0]].shape[1], np.float32)
        for term in terms:
            share = term.weight / largest / total
            vector = self._packs[self.pack_name(term.name)][row] * np.float32(share)
            out = out + vector if term.sign > 0 else out - vector
        return out


def _invalid(message: str) -> InvalidRequestError:
    hint = "; a voice is a name, or a blend such as 'af_bella+af_sky' or 'af_bella(2)+af_sky(1)'"
    return InvalidRequestError(message + hint, param="voice", code="invalid_voice")
