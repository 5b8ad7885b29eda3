"""Per-request sampling settings as the sampler sees them: one frozen, validated row per request.

Imports: stdlib and ``omnistep.core`` only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from omnistep.core.errors import InvalidRequestError

if TYPE_CHECKING:
    from omnistep.sampling.delay import DelayPattern


def _invalid(name: str, value: object, why: str) -> InvalidRequestError:
    return InvalidRequestError(
        f"Invalid value for '{name}': {value!r} ({why})", param=name, code="invalid_value"
    )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True, slots=True)
class SamplingRow:
    """One request's sampling settings for one step.

    Attributes:
        temperature: logits are divided by it; a scalar, or one per codebook; 0 means greedy
            (that codebook takes the argmax of the processed logits).
        top_p: nucleus mass kept, in (0, 1]; tokens outside the minimal set reaching it are cut.
        top_k: most-likely tokens kept; 0 disables.
        repetition_penalty: > 0; each of the last ``penalty_window`` tokens scales its logit
            again (upstream ChatTTS's compounding penalty); 1 disables.
        penalty_compounds: True (ChatTTS): an id seen ``n`` times is scaled ``n`` times; False
            (transformers' ``RepetitionPenaltyLogitsProcessor``): once, however often it
            occurs in the window.
        penalty_window: how many of the latest generated tokens the penalty looks at.
        min_new_tokens: EOS is masked while fewer tokens than this have been generated.
        eos_token_id: the EOS id (the same in every codebook), or None.
        min_keep: top-p and top-k never keep fewer tokens than this (upstream ChatTTS: 3).
        delay: the codebook delay pattern (``omnistep.sampling.delay``): forced BOS/EOS ids
            masked in before any other processing; None: no delay.
        min_p: tokens whose probability (after penalty and temperature) is below ``min_p``
            times the most likely one's are cut before top-p/top-k (transformers'
            ``MinPLogitsWarper``; upstream Chatterbox: 0.05); 0 disables.
    """

    temperature: float | tuple[float, ...] = 1.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    penalty_window: int = 16
    penalty_compounds: bool = True
    min_new_tokens: int = 0
    eos_token_id: int | None = None
    min_keep: int = 3
    delay: DelayPattern | None = None
    min_p: float = 0.0

    def __post_init__(self) -> None:
        temps = self.temperature if isinstance(self.temperature, tuple) else (self.temperature,)
        checks = [
            ("temperature", len(temps) > 0 and all(_is_finite(t) and t >= 0 for t in temps)),
            ("top_p", _is_finite(self.top_p) and 0 < self.top_p <= 1),
            ("top_k", _is_int(self.top_k) and self.top_k >= 0),
            (
                "repetition_penalty",
                _is_finite(self.repetition_penalty) and self.repetition_penalty > 0,
            ),
            ("penalty_window", _is_int(self.penalty_window) and self.penalty_window >= 0),
            ("min_new_tokens", _is_int(self.min_new_tokens) and self.min_new_tokens >= 0),
            (
                "eos_token_id",
                self.eos_token_id is None
                or (_is_int(self.eos_token_id) and self.eos_token_id >= 0),
            ),
            ("min_keep", _is_int(self.min_keep) and self.min_keep >= 1),
            ("min_p", _is_finite(self.min_p) and 0 <= self.min_p < 1),
        ]
        for name, ok in checks:
            if not ok:
                raise _invalid(name, getattr(self, name), "out of range or wrong type")

    def temperatures(self, num_vq: int) -> tuple[float, ...]:
        """The temperature of each of ``num_vq`` codebooks; a tuple must have one per codebook."""
        if not isinstance(self.temperature, tuple):
            return (float(self.temperature),) * num_vq
        if len(self.temperature) != num_vq:
            raise _invalid(
                "temperature", self.temperature, f"needs {num_vq} values, one a codebook"
            )
        return tuple(float(t) for t in self.temperature)

    def is_greedy(self) -> bool:
        """True when every codebook is greedy, so the row needs no random draws."""
        temps = self.temperature if isinstance(self.temperature, tuple) else (self.temperature,)
        return all(t == 0 for t in temps)
