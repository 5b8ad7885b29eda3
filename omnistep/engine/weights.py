"""Weight updates of a running engine: version numbers, the pause and drain gates, and one
update of a model at a time.

``WeightUpdates`` is the ``AsyncEngine``'s collaborator for ``apply_weights`` (and the pause
that ``forget_voice`` shares): it owns every card's weight version and the gates that keep a
model's units from being dispatched (pause) or its new requests from starting (drain) while
its weights change. The engine asks it whether a model is paused before it dispatches a batch
and whether a new request is held by a drain. Imports ``omnistep.core`` and the engine's
stream and OpenMP helpers only.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from omnistep.core import InvalidRequestError, ModelInstance, WeightVersionError
from omnistep.engine.openmp import releasing
from omnistep.engine.stream import RequestRun

WEIGHT_UPDATE_POLL_S = 0.005
"""Seconds between checks while a weight update waits for batches or requests to finish."""
WEIGHT_UPDATE_MODES = ("pause", "drain")

MAX_WEIGHT_VERSION = 2**62
"""The largest weight version an update may ask for (``POST /v1/weights``'s bound too):
each step records its version in int64 (``LoopActions.weight_versions``), so a version
past 2**63 - 1 would make every later rollout fail; versions only go up, so it could never
be undone."""


def check_version_arg(version: Any) -> None:
    """An update's explicit ``version``: None, or an integer in [0, ``MAX_WEIGHT_VERSION``].

    Raises:
        InvalidRequestError: anything else (a bool, a string, a float, a negative or huge
            integer), param ``version``.
    """
    if version is not None and (
        not isinstance(version, int)
        or isinstance(version, bool)
        or not 0 <= version <= MAX_WEIGHT_VERSION
    ):
        raise InvalidRequestError(
            f"version must be an integer in [0, 2**62], got {version!r}", param="version"
        )


"""``apply_weights`` modes: pause the model's units, or drain its running requests."""

log = logging.getLogger("omnistep.engine")


@dataclass(frozen=True, slots=True)
class WeightUpdate:
    """What ``AsyncEngine.apply_weights`` did.

    Attributes:
        model: the card id.
        version: the weight version the model now runs.
        casts: one ``"name: from -> to"`` line per tensor cast to the model's dtype.
    """

    model: str
    version: int
    casts: tuple[str, ...] = ()


async def wait_until(condition: Callable[[], bool]) -> None:
    """Return once ``condition()`` holds, asking every ``WEIGHT_UPDATE_POLL_S`` seconds."""
    while not condition():
        await asyncio.sleep(WEIGHT_UPDATE_POLL_S)


class WeightUpdates:
    """Weight versions and the gates a weight update (or a voice's removal) closes.

    Args:
        card_ids: the engine's cards; each starts at version 0 (as loaded).
        resolve: the engine's ``resolve`` (a card id or alias -> its model).
        busy: whether a batch of the card is being executed.
        runs: the engine's unfinished requests.
        resume: starts a request a drain held (the engine's admission decides how).
        wake: wakes the engine's step loop (a gate opened).
    """

    def __init__(
        self,
        card_ids: Iterable[str],
        resolve: Callable[[str], ModelInstance],
        busy: Callable[[str], bool],
        runs: Callable[[], Iterable[RequestRun]],
        resume: Callable[[RequestRun], None],
        wake: Callable[[], None],
    ):
        self.versions: dict[str, int] = dict.fromkeys(card_ids, 0)
        """The weight version each card runs (0: as loaded), by card id."""
        self._resolve = resolve
        self._busy = busy
        self._runs = runs
        self._resume = resume
        self._wake = wake
        self._paused: set[str] = set()  # cards whose units wait (a weight update is applied)
        self._draining: dict[str, list[RequestRun]] = {}  # card -> requests held until resume
        self._locks: dict[str, asyncio.Lock] = {}

    def is_paused(self, card_id: str) -> bool:
        """Whether the card's units must not be dispatched now."""
        return card_id in self._paused

    def hold(self, run: RequestRun) -> bool:
        """Keep a new request back while a drain of its model runs (it starts, through
        ``resume``, once the weights changed); True when it was held."""
        drain = self._draining.get(run.card_id)
        if drain is None:
            return False
        drain.append(run)
        return True

    def lock(self, card_id: str) -> asyncio.Lock:
        """The lock that makes changes of one card (weight updates, forgetting a voice) run one
        at a time."""
        return self._locks.setdefault(card_id, asyncio.Lock())

    @asynccontextmanager
    async def pause(self, card_id: str, drain: bool = False) -> AsyncIterator[None]:
        """Within the block, the card runs nothing: with ``drain``, new requests of the card
        are held first and its running ones finish; then its units stop being dispatched and
        its running batches finish. On exit (also on an error) its units run again and the
        held requests start. Take ``lock(card_id)`` first."""
        try:
            if drain:
                self._draining[card_id] = []
                await wait_until(lambda: not self._drain_pending(card_id))
            self._paused.add(card_id)
            await wait_until(lambda: not self._busy(card_id))
            yield
        finally:
            self._paused.discard(card_id)
            self._release_drained(card_id)
            self._wake()

    async def apply(
        self,
        model_id: str,
        tensors: Mapping[str, Any],
        version: int | None = None,
        mode: str = "pause",
        check_finite: bool = True,
    ) -> WeightUpdate:
        """``AsyncEngine.apply_weights``: see there for the modes, what is checked and the
        errors raised."""
        if mode not in WEIGHT_UPDATE_MODES:
            raise InvalidRequestError(
                f"mode must be one of {', '.join(WEIGHT_UPDATE_MODES)}, got {mode!r}",
                param="mode",
            )
        check_version_arg(version)
        model = self._resolve(model_id)
        card_id = model.card.card_id
        self.check_version(card_id, version)
        prepared = await asyncio.to_thread(releasing(model.check_weights), tensors, check_finite)
        async with self.lock(card_id):
            self.check_version(card_id, version)  # another update may have run meanwhile
            new_version = self.versions[card_id] + 1 if version is None else version
            async with self.pause(card_id, drain=mode == "drain"):
                await asyncio.to_thread(releasing(model.update_weights), prepared, new_version)
                self.versions[card_id] = new_version
        casts = (
            f" ({len(prepared.casts)} tensors cast to the model's dtype)" if prepared.casts else ""
        )
        log.info("model %s now runs weight version %d%s", card_id, new_version, casts)
        return WeightUpdate(card_id, new_version, tuple(prepared.casts))

    def check_version(self, card_id: str, version: int | None) -> None:
        """Raises WeightVersionError when an explicit ``version`` is not above the current."""
        current = self.versions[card_id]
        if version is not None and version <= current:
            raise WeightVersionError(card_id, version, current)

    def _drain_pending(self, card_id: str) -> bool:
        """Whether requests of the model that a drain does not hold are still running."""
        held = {id(run) for run in self._draining.get(card_id, [])}
        return any(r.card_id == card_id and id(r) not in held for r in self._runs())

    def _release_drained(self, card_id: str) -> None:
        """Start the requests a drain held (those not aborted meanwhile)."""
        for run in self._draining.pop(card_id, []):
            if not run.finished:
                self._resume(run)
