"""The actor side of the Ray executor: what runs inside each component actor, and how batches
and their outputs cross between the serving process and the actors.

``ComponentWorker`` is the body of a component actor (``RayExecutor`` makes it a Ray actor
class): it builds its component from a picklable factory, runs batches with
``execute_isolated`` (a batch that raises is rerun unit by unit, so only the failing request
fails), frees sequences, reports KV usage and takes weight updates between batches. It keeps no
per-request random state: after a batch it returns the state of every payload's generator
(``stateful_fields``) for the serving process to copy back.

Transport: payloads and outputs are pickled with cloudpickle (``dumps``), and a tensor that
views a larger storage (a row of a batch's hidden states, a frame of a mel spectrogram) is
copied to its own storage first, since pickling a view sends its whole storage; values are
unchanged.

Imports ``omnistep.core``, the engine's executor helpers and ``omnistep.kv``; ``ray`` only in
``dumps`` (its cloudpickle), ``torch`` never (tensors are recognised once torch is loaded).
"""

from __future__ import annotations

import dataclasses
import functools
import io
import itertools
import pickle
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from omnistep.core import Component
from omnistep.engine.executor import Outcome, execute_released
from omnistep.kv import kv_usage

WATCH_GROUP = "omnistep_watch"
"""The Ray concurrency group of ``ComponentWorker.watch`` (one thread, beside the batches)."""


def _picklable(exc: Exception) -> Exception:
    """``exc`` itself if it pickles, else a RuntimeError carrying its type and message."""
    try:
        pickle.dumps(exc)
    except Exception:  # noqa: BLE001 - any pickling failure
        return RuntimeError(f"{type(exc).__name__}: {exc}")
    return exc


def _is_partial_view(obj: object) -> bool:
    """True for a plain strided ``torch.Tensor`` whose storage holds more than its elements
    (pickling it would send the whole storage). Never imports torch."""
    torch = sys.modules.get("torch")
    if torch is None or type(obj) is not torch.Tensor:
        return False
    try:
        if obj.layout is not torch.strided or obj.device.type == "meta":
            return False
        return obj.untyped_storage().nbytes() > obj.numel() * obj.element_size()
    except Exception:  # noqa: BLE001 - tensors without a plain storage pickle as they are
        return False


@functools.cache
def _compact_pickler() -> type:
    """A cloudpickle Pickler that pickles a partial view as a copy of its own elements."""
    from ray import cloudpickle

    class CompactPickler(cloudpickle.CloudPickler):
        def reducer_override(self, obj: object) -> Any:
            if _is_partial_view(obj):
                return obj.clone().__reduce_ex__(self.proto)  # type: ignore[attr-defined]
            return super().reducer_override(obj)

    return CompactPickler


def dumps(obj: object) -> bytes:
    """Pickle ``obj`` with cloudpickle, each tensor that views part of a larger storage copied
    to its own first (same values; see the module docstring). ``pickle.loads`` reads it.

    Raises:
        Whatever pickling raises for an object that does not pickle.
    """
    buffer = io.BytesIO()
    _compact_pickler()(buffer, protocol=5).dump(obj)
    return buffer.getvalue()


def stateful_fields(payload: object) -> list[tuple[str, Any]]:
    """(name, value) of the payload's top-level dataclass fields whose value has callable
    ``get_state`` and ``set_state`` (a ``torch.Generator``); empty for other payloads."""
    if not dataclasses.is_dataclass(payload) or isinstance(payload, type):
        return []
    found = []
    for f in dataclasses.fields(payload):
        value = getattr(payload, f.name, None)
        if callable(getattr(value, "get_state", None)) and callable(
            getattr(value, "set_state", None)
        ):
            found.append((f.name, value))
    return found


KVSnapshot = tuple[int, int, int]
"""(serial, used blocks, free blocks) of an actor's paged KV cache; a later serial is newer."""


@dataclass(frozen=True)
class BatchReply:
    """What an actor returns for a batch.

    Attributes:
        outcomes: one ``StepResult`` or exception per payload, in order.
        states: per payload, ``(field name, get_state())`` of its stateful fields after the
            batch (see ``stateful_fields``).
        kv: the actor's KV usage after the batch; None for a component without a paged cache.
    """

    outcomes: list[Outcome]
    states: list[list[tuple[str, Any]]]
    kv: KVSnapshot | None


class ComponentWorker:
    """The body of a component actor: builds the component, runs batches on it, frees
    sequences and reports KV usage."""

    def __init__(self, factory: Callable[[], Component]):
        self.component = factory()
        self._serial = itertools.count(1)
        self._ended = threading.Event()  # never set: the actor ends by being killed

    def watch(self) -> None:
        """Block for as long as the actor lives. Called once, in its own concurrency group
        (``WATCH_GROUP``), so it runs beside batches: the driver's call fails the moment the
        actor's process dies, busy or idle, which is how the executor learns of a death."""
        self._ended.wait()

    def weight_version(self) -> int:
        """The weight version the component runs (0: as loaded)."""
        return int(getattr(self.component, "weight_version", 0))

    def kv_usage(self) -> KVSnapshot | None:
        """The component's KV blocks now, if it keeps a paged cache (``kv_usage``)."""
        usage = kv_usage(self.component)
        return None if usage is None else (next(self._serial), *usage)

    def ready(self) -> tuple[int, KVSnapshot | None]:
        """The actor's process id and KV usage, once the component is built."""
        import os

        return os.getpid(), self.kv_usage()

    def run(self, blob: bytes) -> bytes:
        """Run a pickled ``(kind, payloads)`` batch with ``execute_isolated``; returns a pickled
        ``BatchReply`` (exceptions made picklable; outputs that do not pickle become errors).
        The calling thread's OpenMP team is freed after the batch, as in-process: an actor
        with ``max_concurrency`` > 1 runs batches on several threads."""
        kind, payloads = pickle.loads(blob)
        outcomes = execute_released(self.component, kind, payloads)
        outcomes = [_picklable(o) if isinstance(o, Exception) else o for o in outcomes]
        states = [[(n, v.get_state()) for n, v in stateful_fields(p)] for p in payloads]
        try:
            return dumps(BatchReply(outcomes, states, self.kv_usage()))
        except Exception as exc:  # noqa: BLE001 - outputs that do not pickle fail their units
            err = RuntimeError(f"outputs that do not pickle ({type(exc).__name__}: {exc})")
            return dumps(BatchReply([err] * len(payloads), states, self.kv_usage()))

    def free_sequence(self, seq_id: str) -> KVSnapshot | None:
        """Free what the component holds for ``seq_id``; returns the KV usage after."""
        free = getattr(self.component, "free_sequence", None)
        if free is not None:
            free(seq_id)
        return self.kv_usage()

    def weight_specs(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """The component's ``weight_specs()``; empty when it takes no weight updates."""
        report = getattr(self.component, "weight_specs", None)
        return report() if callable(report) else {}

    def offers(self, method: str) -> bool:
        """Whether the component has a callable ``method`` (e.g. ``weight_problems``)."""
        return callable(getattr(self.component, method, None))

    def weight_problems(self, tensors: dict[str, Any]) -> list[str]:
        """The component's ``weight_problems(tensors)`` (what a weight update's values must not
        be beyond shape and dtype; ``ModelInstance.check_weights``); [] when it has none."""
        ask = getattr(self.component, "weight_problems", None)
        return list(ask(tensors)) if callable(ask) else []

    def call(self, method: str, blob: bytes) -> Any:
        """``component.<method>(*args)`` with pickled ``args`` (a weight update, the version
        that follows it, a refresh of derived copies, a voice enrollment); runs between
        batches; returns the method's result."""
        args = pickle.loads(blob)
        if method == "weight_version":
            self.component.weight_version = args[0]  # type: ignore[attr-defined]
            return None
        return getattr(self.component, method)(*args)
