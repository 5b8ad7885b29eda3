"""Reading a checkpoint's config dicts into frozen dataclasses: the field helpers that
several families' configs share (Qwen2.5-Omni's DiT and BigVGAN, the Qwen3-TTS codec). Stdlib
only."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import fields
from typing import Any


def as_tuple(value: Any) -> tuple:
    """A JSON list (nested lists too) as a tuple of tuples, so frozen configs stay hashable."""
    return tuple(as_tuple(v) if isinstance(v, list | tuple) else v for v in value)


def check_positive_ints(config: object, names: Sequence[str]) -> None:
    """Raise ``ValueError`` naming ``Config.field`` unless each named field is an int > 0."""
    for name in names:
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(
                f"{type(config).__name__}.{name} must be a positive int, got {value!r}"
            )


def known_fields(cls: type, raw: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of a config dict that are fields of dataclass ``cls`` (others are ignored:
    upstream configs carry keys this runtime does not use), lists turned into tuples."""
    names = {f.name for f in fields(cls)}
    return {k: as_tuple(v) if isinstance(v, list) else v for k, v in raw.items() if k in names}
