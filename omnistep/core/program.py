"""A request's program: a DAG of kernel-free nodes and loop nodes connected by named slots.

A node runs once every slot it ``needs`` is bound. A ``KernelNode`` runs inline (tokenize, hand-off,
emit) and binds slots itself; a ``LoopNode`` drives one of the card's loops to completion and binds
the ``LoopResult.value`` to its slot. Stdlib only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from omnistep.core.contracts import StreamChunk
from omnistep.core.enums import ExecutionProfile
from omnistep.core.errors import CardValidationError

if TYPE_CHECKING:
    from omnistep.core.card import ModelInstance
    from omnistep.core.request import Request


class Channel:
    """An append-only hand-off between two loops of one request (token -> vocoder, thinker ->
    talker): the producer ``put``s items as it makes them and ``close``s at its end; consumers
    read by index and return ``Pending`` from ``next`` until what they need has arrived.

    Raises:
        RuntimeError: ``put`` after ``close``.
    """

    __slots__ = ("_items", "closed")

    def __init__(self) -> None:
        self._items: list[Any] = []
        self.closed = False

    def put(self, item: Any) -> None:
        """Append one item."""
        if self.closed:
            raise RuntimeError("put on a closed channel")
        self._items.append(item)

    def close(self) -> None:
        """No more items will come (idempotent)."""
        self.closed = True

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, index: int | slice) -> Any:
        return self._items[index]


TEXT_INPUT_SLOT = "text_input"
"""The slot holding a request's input text as a ``Channel`` of ``str`` pieces, bound at
submission for cards with ``Capability.STREAMING_TEXT_INPUT``: ``Request.text`` first (when not
empty), then what ``RequestStream.append_text`` adds; closed at once unless ``Request.text_input``,
else by ``RequestStream.end_text``. A card reads its text from here whether it streams in or not,
so a request whose text arrived in pieces runs exactly as one sent whole."""


@dataclass
class ProgramContext:
    """The per-request blackboard of a program run.

    Attributes:
        request: the request (its seed is always set by the time the program runs).
        model: the loaded card instance.
        profile: SERVE or ROLLOUT.
        slots: values bound so far, by slot name.
        outbox: chunks emitted by kernel nodes; the engine publishes them.
        trajectories: ROLLOUT records of finished loops, by program node name.
        rollout_info: ROLLOUT replay information of finished loops (``LoopResult.info``), by
            program node name.
        usage: token counts the card reports (``input_tokens``, ``output_tokens``), and
            ``cached_tokens``: prompt rows its AR loops took from the prefix cache (set by the
            engine when a loop finishes; absent when none).
    """

    request: Request
    model: ModelInstance
    profile: ExecutionProfile = ExecutionProfile.SERVE
    slots: dict[str, Any] = field(default_factory=dict)
    outbox: list[StreamChunk] = field(default_factory=list)
    trajectories: dict[str, list[Any]] = field(default_factory=dict)
    rollout_info: dict[str, dict[str, Any]] = field(default_factory=dict)
    usage: dict[str, int] = field(default_factory=lambda: {"input_tokens": 0, "output_tokens": 0})


@dataclass(frozen=True)
class KernelNode:
    """A node that computes no model step: ``fn(ctx)`` reads ``needs`` and writes ``binds``.

    ``fn`` may raise ``InvalidRequestError`` for input the card cannot serve; the first kernel
    nodes run when the request is submitted, so such errors reach the caller before streaming.
    """

    name: str
    fn: Callable[[ProgramContext], None]
    needs: tuple[str, ...] = ()
    binds: tuple[str, ...] = ()


@dataclass(frozen=True)
class LoopNode:
    """A node that drives the card's loop ``loop_id`` and binds its result to ``binds``.

    ``streams`` names slots the engine binds to fresh ``Channel``s when the loop starts and
    closes when it finishes: the loop puts items on them as it goes, and nodes that need them
    start at once (stage overlap).

    ``when(request)`` False skips the node: its slot binds to None and its streams to closed,
    empty Channels (e.g. a talker and vocoder when a chat asks for text only).
    """

    name: str
    loop_id: str
    needs: tuple[str, ...] = ()
    binds: str | None = None
    streams: tuple[str, ...] = ()
    when: Callable[[Request], bool] | None = None


Node = KernelNode | LoopNode


@dataclass(frozen=True)
class Program:
    """The DAG of a card's requests. ``inputs`` are slots bound before any node runs."""

    nodes: tuple[Node, ...]
    inputs: tuple[str, ...] = ()

    def validate(self, loop_ids: set[str]) -> None:
        """Check structure: unique names, known loops, every needed slot bound by someone earlier.

        Raises:
            CardValidationError: naming the node and the problem.
        """
        bound = set(self.inputs)
        names: set[str] = set()
        for node in self.nodes:
            if node.name in names:
                raise CardValidationError(f"duplicate program node name '{node.name}'")
            names.add(node.name)
            missing = [s for s in node.needs if s not in bound]
            if missing:
                raise CardValidationError(
                    f"node '{node.name}' needs slots {missing} that no earlier node binds"
                )
            if isinstance(node, LoopNode):
                if node.loop_id not in loop_ids:
                    raise CardValidationError(
                        f"node '{node.name}' drives unknown loop '{node.loop_id}'"
                    )
                bound.update(node.streams)
                if node.binds:
                    bound.add(node.binds)
            else:
                bound.update(node.binds)
