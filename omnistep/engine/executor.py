"""Executors run batches off the event loop so the server stays responsive while models compute.

The in-process executor runs batches on a small pool of worker threads (the engine decides
which batches may overlap). A batch that raises is
retried unit by unit so that only the request whose unit fails gets the exception.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from omnistep.core import Component, ModelInstance, StepResult, WorkUnitKind
from omnistep.engine.openmp import release_openmp_team, releasing

Outcome = StepResult | Exception


@dataclass(frozen=True)
class ComponentHealth:
    """The replicas of one component an executor runs elsewhere (the Ray executor's actors),
    for ``/health`` and the metrics.

    Attributes:
        model: the card id.
        component: the component's name in the card.
        replicas: replicas placed (the deploy file's ``replicas``).
        live: replicas serving now.
        recovering: dead replicas being replaced now.
        failed: dead replicas given up on (every attempt to replace them failed).
        deaths: actor deaths seen since start.
        restarts: replacement actors that came up and serve.
        last_recovery_s: seconds the last replacement took, from the death being seen to the
            new actor serving (its component loaded and at the served weight version); None
            before the first.
    """

    model: str
    component: str
    replicas: int
    live: int
    recovering: int = 0
    failed: int = 0
    deaths: int = 0
    restarts: int = 0
    last_recovery_s: float | None = None

    @property
    def state(self) -> str:
        """``ok`` (every replica live), ``degraded`` (some live), ``recovering`` (none live,
        a replacement is coming) or ``failed`` (none live, none coming)."""
        if self.live == self.replicas:
            return "ok"
        if self.live:
            return "degraded"
        return "recovering" if self.recovering else "failed"


def execute_isolated(
    component: Component, kind: WorkUnitKind, payloads: Sequence[Any]
) -> list[Outcome]:
    """Run ``component.execute`` on a batch; on failure, rerun unit by unit to isolate faults.

    Returns:
        One ``StepResult`` or ``Exception`` per payload, in order.
    """
    start = time.perf_counter()
    try:
        outputs = component.execute(kind, payloads)
        if len(outputs) != len(payloads):
            raise RuntimeError(
                f"component returned {len(outputs)} outputs for {len(payloads)} payloads"
            )
    except Exception as exc:  # noqa: BLE001 - isolated per unit below
        if len(payloads) == 1:
            return [exc]
        return [execute_isolated(component, kind, [p])[0] for p in payloads]
    seconds = time.perf_counter() - start
    return [StepResult(out, batch_size=len(payloads), seconds=seconds) for out in outputs]


execute_released = releasing(execute_isolated)
"""``execute_isolated`` that then frees its thread's OpenMP team (for executor threads)."""


class Executor(Protocol):
    """What the engine needs of an executor (``InProcessExecutor``, ``RayExecutor``)."""

    async def run(
        self,
        component: Component,
        kind: WorkUnitKind,
        payloads: Sequence[Any],
        *,
        model_id: str = "",
        name: str = "",
    ) -> list[Outcome]:
        """Execute one batch of ``component`` (``name`` of card ``model_id``); one outcome per
        payload, in order; a failing unit fails alone (see ``execute_isolated``)."""
        ...

    def capacity(self, model_id: str, name: str, per_instance: int) -> int:
        """Batches of component ``name`` that may run at once, given ``per_instance``, the
        component spec's ``max_concurrency`` (more than it when the executor has replicas)."""
        ...

    def attach(
        self, models: Iterable[ModelInstance], wake: Callable[[], None] | None = None
    ) -> None:
        """Called once by the engine with its models: an executor that runs components
        elsewhere puts stand-ins in ``model.components`` (the loops' sequence owners) where
        the models do not hold them already. ``wake``: wakes the engine's step loop (call it
        on the event loop's thread) when ``capacity`` went up (a replica came back)."""
        ...

    def check_available(self, model_id: str) -> None:
        """Raises ``ComponentUnavailableError`` when a component of ``model_id`` has no live
        replica (new requests for it are refused until one is back)."""
        ...

    def health(self) -> list[ComponentHealth]:
        """The replicas of every component run elsewhere; empty for an in-process executor."""
        ...

    def close(self) -> None:
        """Release the executor's workers."""
        ...


class InProcessExecutor:
    """Runs batches on ``num_workers`` worker threads of this process.

    A worker frees its OpenMP team after each batch, and the event loop's thread frees its own
    before handing a batch over (``omnistep.engine.openmp``): idle teams would cut every
    team's spin-wait and slow a lone batch's small parallel regions by up to ~1.8x on CPU.
    """

    def __init__(self, num_workers: int = 1) -> None:
        self._pool = ThreadPoolExecutor(max_workers=num_workers, thread_name_prefix="omnistep-exec")

    async def run(
        self,
        component: Component,
        kind: WorkUnitKind,
        payloads: Sequence[Any],
        *,
        model_id: str = "",
        name: str = "",
    ) -> list[Outcome]:
        """Execute one batch in a worker thread; see ``execute_isolated``. ``model_id`` and
        ``name`` (which component of which card) are not needed here: ``component`` is local."""
        loop = asyncio.get_running_loop()
        release_openmp_team()  # the loop's thread computes nothing while the batch runs
        return await loop.run_in_executor(self._pool, execute_released, component, kind, payloads)

    def capacity(self, model_id: str, name: str, per_instance: int) -> int:
        """One instance of each component: ``per_instance`` batches at once."""
        return per_instance

    def attach(
        self, models: Iterable[ModelInstance], wake: Callable[[], None] | None = None
    ) -> None:
        """Nothing to do: components run here, as built."""

    def check_available(self, model_id: str) -> None:
        """Nothing to check: components live in this process."""

    def health(self) -> list[ComponentHealth]:
        """None to report: no component runs elsewhere."""
        return []

    def close(self) -> None:
        """Stop the worker thread after the running batch."""
        self._pool.shutdown(wait=False, cancel_futures=True)
