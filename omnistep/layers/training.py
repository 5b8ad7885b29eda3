"""Trainer copies of serving components: what an RL trainer optimizes is never what serves.

A component that takes weight updates (``weight_specs`` / ``update_weights``) and can be scored
(``score_logprobs``, ``score_steps``) offers ``training_copy()``: a deep copy holding its own
weights (every tensor copied) and none of the serving state (KV cache, sequence tables), marked
``serving = False``. Only a copy hands out tensors that require grad
(``trainable_weights``); the serving component refuses, so an optimizer step can change what
serves only through the engine's ``update_weights`` (which records a new version). This is
what makes asynchronous (off-policy) RL safe: a step taken while a rollout runs changes none of
its frames.

Imports torch only.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import TypeVar

C = TypeVar("C")


class ServingWeightsError(RuntimeError):
    """``trainable_weights`` was asked of a serving component: its weights change only through
    the engine's ``update_weights``. Train a copy (``AsyncOmniEngine.trainer``)."""


def training_copy(component: C, drop: Iterable[str] = ()) -> C:
    """A deep copy of ``component`` for a trainer: every tensor copied (the trainer's own
    weights, equal in value), the attributes named in ``drop`` (serving state such as the KV
    cache and sequence tables, which a copy never uses) set to None in the copy, and
    ``serving`` False. The original is untouched.

    Costs one more copy of the component's weights in memory.
    """
    memo: dict[int, object] = {}
    for name in drop:
        value = getattr(component, name, None)
        if value is not None:
            memo[id(value)] = None
    twin = copy.deepcopy(component, memo)
    twin.serving = False  # type: ignore[attr-defined]
    return twin


def require_training_copy(component: object) -> None:
    """Raises ServingWeightsError when ``component`` serves (``serving`` is not False)."""
    if getattr(component, "serving", True):
        raise ServingWeightsError(
            f"{type(component).__name__} serves: its weights change only through the engine's "
            "update_weights. Train a copy: omni.trainer() (or component.training_copy()), "
            "optimize trainer.weights(), then omni.update_weights(trainer)"
        )
