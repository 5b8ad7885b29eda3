"""What every loop shares: a fresh per-request state (``new_state``) and, for the generic loops
built from a config, the config and the loop id it names (``ConfiguredLoop``).

Imports ``omnistep.core`` only.
"""

from __future__ import annotations

from typing import Any, Generic, Protocol, TypeVar

from omnistep.core import LoopState, Request

S = TypeVar("S", bound=LoopState)


class _NamesLoop(Protocol):
    @property
    def loop_id(self) -> str: ...


C = TypeVar("C", bound=_NamesLoop)


def new_state(state_cls: type[S], req: Request, loop_id: str, **fields: Any) -> S:
    """A loop's state for ``req`` at its start: the request's id and execution profile, the
    loop's id (``LoopState``'s own fields), then the loop's ``fields``."""
    return state_cls(request_id=req.request_id, loop_id=loop_id, profile=req.profile, **fields)


class ConfiguredLoop(Generic[C]):
    """Base of a loop built from a frozen config: keeps it as ``config``; ``loop_id`` is the
    config's ``loop_id`` (the loop's id in the card)."""

    def __init__(self, config: C):
        self.config = config
        self.loop_id = config.loop_id

    def new_state(self, state_cls: type[S], req: Request, **fields: Any) -> S:
        """``new_state`` with this loop's id."""
        return new_state(state_cls, req, self.loop_id, **fields)
