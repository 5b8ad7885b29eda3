"""What the scheduler asks of a component's paged KV pool before it forms a batch.

A component that keeps a paged KV cache (``omnistep.runners.paged_ar.PagedARModel``) implements
``KVPool``; the engine's scheduler finds it with ``kv_pool`` and, as nano-vllm's scheduler
does with its block manager (``can_allocate`` / ``allocate`` / ``can_append`` / ``preempt``),
admits a prefill only when its blocks (after its shared prefix) are free, and runs a decode
batch only when its next tokens fit, preempting the least urgent sequences of the batch
first. Payloads are the component's own unit payloads; the scheduler never looks inside.

Pure Python; imports nothing of omnistep.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class KVPool(Protocol):
    """A component's paged KV pool as the scheduler sees it.

    Called between steps only (no batch of the component running), from the engine's thread.
    """

    def admit(self, payload: Any) -> bool:
        """Admit one prefill unit if its blocks fit now, with its shared prefix (blocks an
        equal prompt or a kept prefix already holds are shared, not taken): its blocks are
        taken for it, and the unit must run in the batch being formed. False: nothing is
        taken; the unit waits in the queue. A unit that can never fit (longer than the whole
        pool) or whose payload is malformed is admitted: running it raises the error that
        fails its request."""
        ...

    def can_append(self, payloads: Sequence[Any]) -> bool:
        """Whether one decode step of each payload's sequence fits now (new blocks and
        private copies of shared blocks), with no preemption."""
        ...

    def preemption_frees(self, payload: Any) -> int:
        """Blocks preempting the payload's sequence would return to the pool (those it
        shares with another sequence stay)."""
        ...

    def preempt(self, payload: Any) -> int:
        """Free the payload's sequence (preemption by recompute): the unit, run anyway,
        answers preempted and its loop prefills again. Returns the blocks freed."""
        ...


def kv_pool(component: object) -> KVPool | None:
    """The component's ``KVPool``, or None when the scheduler cannot see one (no paged KV
    cache, or a stand-in for a component that runs in another process)."""
    return component if isinstance(component, KVPool) else None
