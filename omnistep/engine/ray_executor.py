"""The Ray executor: each component of a card runs in one or more Ray actors.

``omnistep serve --executor ray [--deploy deploy.yaml]`` places every component of every served
card as Ray actors (``replicas`` of them), with the Ray resources the deploy file asks for
(``num_cpus``, ``num_gpus``, custom resources such as ``{"vocoder_node": 1}`` that pin a
component to the nodes started with that resource). The engine, scheduler and loops stay in
the driver process; only ``component.execute`` runs in the actors, with ``execute_isolated``:
a batch that raises is rerun unit by unit there, so only the failing request fails, exactly as
in process. Every card runs on it (``toy``, ``piper``, ``chattts``, ``qwen2_5_omni``) with
outputs identical to the in-process executor (tested).

Components are built inside their actor, and only there: the actor receives a picklable
``factory`` (the CLI passes ``functools.partial(omnistep.models.registry.build_component, spec,
name, device, options)``, which rebuilds the card from its spec string and builds that one
component), because a card's ``ComponentSpec.build`` closure need not pickle.

The serving process (the Ray driver) builds no component: no weights, no KV cache, no ONNX
session. It builds each card (``build_card`` reads configs, tokenizers and speaker tables;
weights load only inside ``ComponentSpec.build``) and ``RayExecutor.instance(card)`` makes the
card's ``ModelInstance`` with a ``RemoteComponent`` for every component
(``ModelInstance.assemble``). The design rests on one rule for cards: loops and program nodes
take everything they need from the card, never from a built component. Then all the serving
process needs of a component is generic, and is what ``RemoteComponent`` has:

- ``free_sequence(seq_id)``: the AR loops' ``SequenceOwner``, called on finish and abort (and
  the stateful audio loops', which free a vocoder's per-request decoder state the same way);
- KV usage for ``engine.stats()`` and the metrics (``kv_blocks()``);
- nothing else. ``execute`` and any other attribute raise, naming the component, so a card
  that reads a component from a loop fails at its first request, not silently.

Measured with ``bench/driver_memory.py`` (resident memory of the serving process once loaded):
piper 497 -> 326 MiB, chattts on its tiny test checkpoint with the default 2 GiB KV cache
2459 -> 334 MiB, where the process held 316 MiB before loading (torch and Ray started).

What each card's driver-side code reads, and where it comes from: ``toy``: prompt and sampling
settings (the card's loop and audio config); ``piper``: the voice's sample rate, hop length,
noise and length scales, batching and ``make_unit`` (``VoiceSettings``, read from the voice's
``.onnx.json`` and given to the sentence loop by the card) and the espeak frontend; ``chattts``:
the GPT config and EOS id (from ``config.json`` and the header of ``Embed.safetensors``), the
tokenizer and speaker statistics; ``qwen2_5_omni``: config, EOS ids, tokenizer (chat template,
detokenizing), speakers (``spk_dict.pt``). The GPT, thinker and talker are reached through
``free_sequence`` and KV usage only; vocoders, DiT and BigVGAN not at all (the talker's actor
reads the one thinker tensor it needs, the embedding, not the thinker's weights). The alternative, a
proxy that fetches attributes from an actor or forwards method calls (``make_unit``) to it, was
not taken: a loop's ``init`` runs on the event loop, which would then wait on an actor that may
be busy with a batch, and a component's attributes would become a second, implicit interface.

Start-up cost: every actor builds the whole card (the light parts above: tokenizer, configs)
and then its one component; the serving process builds each card once. So each actor pays its
own component's load (a thinker actor reads the thinker's weights, a piper actor opens the ONNX
session) plus the card's light parts, once per replica.

Per-request state of AR components (the ChatTTS GPT, the Qwen thinker and talker) and of
stateful vocoders (the Qwen3-TTS codec):

- KV blocks live in the actor that ran the sequence's prefill. A payload with a ``seq_id``
  attribute is routed by it: every unit of a sequence goes to the replica holding its blocks,
  a new sequence to the replica holding the fewest sequences (then the fewest batches in
  flight), so a batch whose sequences live on different replicas is split and its parts run
  at once. Payloads without ``seq_id`` (stateless vocoder chunks, ODE steps) go as one batch
  to the least busy replica. A stateful vocoder's chunks (``AudioChunkInput.seq_id``, e.g.
  qwen3_tts's codec, which keeps each request's KV cache and conv inputs) are routed like a
  sequence: to the replica holding the request's decoder state. A preempted sequence (the
  actor freed it to make room) stays routed to its replica and recomputes there.
- The ``RemoteComponent`` in the driver's ``ModelInstance.components`` is the loops'
  ``SequenceOwner``: its ``free_sequence`` (called by the loop on finish and abort) reaches the
  replica holding the sequence, and ``kv_blocks()`` reports the actors' KV usage to
  ``engine.stats()`` and the metrics (``refresh_kv_blocks`` queries them). ``attach`` puts
  stand-ins in models made with ``ModelInstance.load`` too (dropping their built components).
- Random generators: payloads carry the request's own ``torch.Generator``, which sampling
  advances in place. It pickles (torch 2.13: device, seed, offset and state), so the actor
  samples with a copy; after the batch the actor returns the state of every payload field that
  has ``get_state``/``set_state`` (top-level dataclass fields) and the driver copies it into
  its own object with ``set_state``. The driver's generator thus ends every step where it
  would in process, whichever replica runs the next step and across preemptions, and the
  actor keeps no per-request random state. Nothing here is card-specific.

Transport: payloads and outputs cross as cloudpickle bytes (``ray_worker.dumps``: a tensor
that views a larger storage is sent as a copy of its own elements). Tensors cross as they are
(a CUDA tensor arrives on the same CUDA device index), so the driver and the actors of AR cards
must use the same kind of device (``--device`` and the deploy file's ``device``): the
per-request generator is made on the driver's device and must match the device the component
samples on. A batch whose payloads do not pickle fails its requests with a ``TypeError`` that
says so.

Files: ``deploy.py`` reads the deploy file (per component ``num_cpus``, ``num_gpus``,
``resources``, ``replicas``, ``device``; the ``recovery`` section); ``ray_worker.py`` is the
actor's side (``ComponentWorker``, the transport); this module is the serving process's side:
placement, routing, the ``RemoteComponent`` stand-ins and healing. Replicas of an AR component
each hold their own KV pool (``kv_cache_gb`` each); replicas give the same outputs as one actor
where the card's batches do not change results (``batch_invariant``), since they split batches.

Healing. A component actor that dies (a crash, the OOM killer, SIGKILL, its node lost) is
replaced, and nothing else is touched:

- Seen at once: each actor runs ``ComponentWorker.watch`` (which never returns) in a
  concurrency group of its own, beside its batches; the driver's call fails the moment the
  process dies, idle or busy (~10 ms here). A batch that fails with Ray's ``ActorDiedError``
  says the same. An actor Ray reports unreachable (``ActorUnavailableError``) fails the batch
  it was sent (its outcome is unknown) and is watched again; still unreachable after
  ``UNREACHABLE_GRACE_S`` it counts as dead. A weight update it may have missed counts it
  dead at once (its replacement replays the update).
- The dead replica gets no more work; the component's units wait while it has no live replica
  (``capacity`` 0), and ``check_available`` refuses new requests for its model with
  ``ComponentUnavailableError`` (503 + ``Retry-After``); other models are not looked at.
- The units of the batch it was running, and every later unit of a sequence routed to it (its
  KV blocks or decoder state died with it; a rollout group's samples all live on one replica,
  so the group fails as a whole), fail with ``ComponentUnavailableError``. Their routes are
  forgotten when the loops free them (no call reaches the dead actor); its KV report is
  dropped.
- Replacement: our own re-creation, not Ray's ``max_restarts``. A restarted Ray actor takes
  calls as soon as its constructor returns, before it could be brought to the served weight
  version, and Ray would retry or fail its calls on its own terms; here a new actor (same
  options, placed wherever the cluster has room) builds its component from the model folder,
  then replays the recorded weight updates (``REPLAYED_CALLS``: the current value of every
  tensor updated since load, kept in the Ray object store) and the weight version, and only
  then takes its predecessor's place (under a lock that ``call_all`` also takes, so an update
  sent meanwhile is either replayed or reaches it). ``RecoveryPolicy``: tries with back-off
  and a time limit; a replica that cannot come back is reported ``failed`` and its
  component's other replicas serve on. The engine's step loop is woken when a replica is back.
- ``health()`` (``/health``, ``omnistep_actor_deaths_total`` and the other metrics) reports
  live, recovering and failed replicas, deaths and restarts.

This module imports ``ray`` only when a ``RayExecutor`` is made (``pip install omnistep[ray]``),
and ``torch`` never (tensors are recognised once torch is loaded).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import pickle
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from omnistep.core import (
    Component,
    ComponentUnavailableError,
    ModelCard,
    ModelInstance,
    OmnistepError,
    WorkUnitKind,
)
from omnistep.engine.deploy import ComponentDeployment, RecoveryPolicy
from omnistep.engine.executor import ComponentHealth, Outcome
from omnistep.engine.ray_worker import WATCH_GROUP, BatchReply, ComponentWorker, KVSnapshot, dumps

__all__ = ["REPLAYED_CALLS", "RayExecutor", "RemoteComponent"]

log = logging.getLogger("omnistep.engine.ray")


REPLAYED_CALLS = frozenset({"update_weights", "refresh_text_embeds"})
"""``call_all`` methods that change what a replica holds (its weights, and the copies derived
from them such as the Qwen2.5-Omni talker's rows of the thinker's embeddings): the executor
records them (their arguments in the Ray object store) and replays them, in order, on an actor
that replaces a dead one. An update whose every tensor a later one sets again, or an earlier
call of another of these methods, is dropped from the record: it holds the current tensors,
at most one copy of the updated weights. ``weight_version`` is recorded as its last value."""

UNREACHABLE_GRACE_S = 5.0
"""Seconds an actor Ray reports unreachable (``ActorUnavailableError``, e.g. a network blip
to its node) may stay so before it counts as dead and is replaced."""


@dataclass(eq=False)
class _Call:
    """A recorded ``REPLAYED_CALLS`` call: its order, method, arguments (a ref to the pickled
    tuple in the object store) and, for ``update_weights``, the tensor names it still sets."""

    serial: int
    method: str
    ref: Any
    names: frozenset[str] | None = None


@dataclass(eq=False)
class _Replica:
    actor: Any
    index: int = 0  # its place among its component's replicas
    pid: int | None = None  # the actor's process id
    live: bool = True  # False once its actor died (it is replaced by a new _Replica)
    cause: str = ""  # why it died
    in_flight: int = 0
    batches: int = 0
    num_sequences: int = 0  # sequences routed here and not freed yet
    kv: KVSnapshot | None = None  # the newest KV usage the actor reported
    pending: list[Any] = field(default_factory=list)  # refs of free_sequence calls
    unreachable_since: float | None = None  # when its watch first found it unreachable

    def note_kv(self, kv: KVSnapshot | None) -> None:
        if kv is not None and (self.kv is None or kv[0] > self.kv[0]):
            self.kv = kv


@dataclass(eq=False)
class _Placed:
    """One placed component: how to start its actors, its replicas and their history."""

    deployment: ComponentDeployment
    options: dict[str, Any]
    replicas: list[_Replica]
    turn: itertools.count = field(default_factory=itertools.count)
    recovering: set[int] = field(default_factory=set)  # replica indices being replaced
    failed: set[int] = field(default_factory=set)  # replica indices given up on
    deaths: int = 0
    restarts: int = 0
    last_recovery_s: float | None = None
    calls: list[_Call] = field(default_factory=list)  # REPLAYED_CALLS, in order
    version: int | None = None  # the last weight_version set (None: as loaded)

    def live(self) -> list[_Replica]:
        return [r for r in self.replicas if r.live]


class RemoteComponent:
    """The serving process's stand-in for a component placed in Ray actors; nothing of the
    component (weights, KV cache) is built or held here.

    It is all the serving process needs of a component: ``free_sequence`` (the loops'
    ``SequenceOwner``) reaches the replica holding the sequence, and ``kv_blocks`` reports the
    actors' KV usage. ``execute`` raises (batches go through ``RayExecutor.run``), and so does
    reading any other attribute: loops and program nodes take their settings from the card,
    never from a built component (see the module docstring).

    Args:
        executor: the executor that placed the component.
        model_id: the card id.
        name: the component's name in the card.
    """

    def __init__(self, executor: RayExecutor, model_id: str, name: str):
        self._executor = executor
        self._model_id = model_id
        self._name = name

    def execute(self, kind: WorkUnitKind, payloads: Sequence[Any]) -> list[Any]:
        """Not here: batches run in the actors. Raises RuntimeError."""
        raise RuntimeError(
            f"{self._model_id}/{self._name} runs in Ray actors; batches go through the executor"
        )

    def free_sequence(self, seq_id: str) -> None:
        """Free ``seq_id`` in the actor holding it (asynchronously; idempotent)."""
        self._executor.free_sequence(self._model_id, self._name, seq_id)

    def kv_blocks(self) -> tuple[int, int] | None:
        """(used, free) KV blocks summed over the actors, as last reported; None without a
        paged cache."""
        return self._executor.kv_blocks(self._model_id, self._name)

    def weight_specs(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """The component's ``weight_specs``, asked of one of its actors (once)."""
        return self._executor.weight_specs(self._model_id, self._name)

    def weight_problems(self, tensors: Mapping[str, Any]) -> list[str]:
        """The component's ``weight_problems`` (``ModelInstance.check_weights`` asks it before
        any component changes), asked of one of its actors; [] when it has none."""
        return self._executor.weight_problems(self._model_id, self._name, tensors)

    def update_weights(self, tensors: Mapping[str, Any]) -> None:
        """Copy ``tensors`` into the component in every replica; returns once all have them
        (the engine calls it between steps, with no batch of this model running)."""
        self.call_all("update_weights", tensors)

    @property
    def weight_version(self) -> int:
        """The weight version the actors run (as last set through this stand-in)."""
        return self.__dict__.get("_weight_version", 0)

    @weight_version.setter
    def weight_version(self, version: int) -> None:
        self.call_all("weight_version", version)
        self.__dict__["_weight_version"] = version

    def call_all(self, method: str, *args: Any) -> Any:
        """``<method>(*args)`` on the component in every live replica, waiting for all;
        returns the first one's result (None for a recorded call no replica was live for:
        the replacements replay it; see ``RayExecutor.call_all``)."""
        results = self._executor.call_all(self._model_id, self._name, method, args)
        return results[0] if results else None

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("_"):  # pickling and copying probe dunders; the fields are set
            raise AttributeError(attr)
        raise AttributeError(
            f"{self._model_id}/{self._name} runs in Ray actors and is not built in the serving "
            f"process, which has no '{attr}' of it: a card's loops and program nodes must take "
            "their settings from the card"
        )

    def __repr__(self) -> str:
        return f"RemoteComponent({self._model_id}/{self._name})"


class RayExecutor:
    """Runs each component's batches in its Ray actors (see the module docstring), and
    replaces an actor that dies (see "Healing" there).

    Args:
        deployments: the components to place; every component the engine will run.
        init_options: ``ray.init`` keyword arguments, used when Ray is not initialized yet
            (e.g. ``{"address": "auto"}``); Ray started here is shut down by ``close``.
        ready_timeout: seconds to wait for all actors to be placed and their components
            built (a component that asks for resources no node has never starts).
        recovery: how a dead actor is replaced (tries, back-off, time limit).

    Raises:
        OmnistepError: ray is not installed, an actor failed to build its component, or the
            actors were not placed within ``ready_timeout``.
    """

    def __init__(
        self,
        deployments: Sequence[ComponentDeployment],
        init_options: Mapping[str, Any] | None = None,
        ready_timeout: float = 300.0,
        recovery: RecoveryPolicy | None = None,
    ):
        try:
            import ray
        except ImportError:
            raise OmnistepError("the ray executor needs ray: pip install 'omnistep[ray]'") from None
        self._ray = ray
        self._owns_ray = False
        self._ray_keeper: threading.Event | None = None
        if not ray.is_initialized():
            self._ray_keeper = _init_ray(ray, dict(init_options or {}))
            self._owns_ray = True
        self.recovery = recovery or RecoveryPolicy()
        self._lock = threading.RLock()  # deaths, replacements and recorded calls
        self._closing = threading.Event()
        self._starting: set[Any] = set()  # actors of replacements not installed yet
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: Callable[[], None] | None = None
        self._placed: dict[tuple[str, str], _Placed] = {}
        self._replicas: dict[tuple[str, str], list[_Replica]] = {}  # the _Placed's lists
        self._routes: dict[tuple[str, str, str], _Replica] = {}  # (model, component, seq_id)
        self._weight_specs: dict[tuple[str, str], dict] = {}
        self._checks_values: dict[tuple[str, str], bool] = {}  # offers weight_problems
        # sample groups (Request.group) live on one replica of a component while any of
        # their sequences does: (model, component, group) -> replica, and its member count
        self._groups: dict[tuple[str, str, str], _Replica] = {}
        self._group_size: dict[tuple[str, str, str], int] = {}
        self._group_of: dict[tuple[str, str, str], str] = {}  # (model, component, seq) -> group
        self._serial = itertools.count(1)  # of recorded calls
        self._remote = ray.remote(concurrency_groups={WATCH_GROUP: 1})(ComponentWorker)
        pending: list[tuple[tuple[str, str], _Replica, Any]] = []
        for dep in deployments:
            p = dep.placement
            options: dict[str, Any] = {
                "num_cpus": p.num_cpus,
                "num_gpus": p.num_gpus,
                "max_concurrency": dep.max_concurrency,
            }
            if p.resources:
                options["resources"] = dict(p.resources)
            key = (dep.model_id, dep.name)
            placed = _Placed(dep, options, [])
            self._placed[key] = placed
            self._replicas[key] = placed.replicas
            for index in range(p.replicas):
                replica = _Replica(self._remote.options(**options).remote(dep.factory), index)
                placed.replicas.append(replica)
                pending.append((key, replica, replica.actor.ready.remote()))
        try:
            refs = [ref for _, _, ref in pending]
            ready, waiting = ray.wait(refs, num_returns=len(refs), timeout=ready_timeout)
            if waiting:
                raise OmnistepError(
                    f"{len(waiting)} of {len(refs)} component actors were not placed within "
                    f"{ready_timeout:g} s: does the cluster have the resources the deploy file "
                    f"asks for? ({ray.available_resources()} available)"
                )
            for (key, replica, _), (pid, kv) in zip(pending, ray.get(refs), strict=True):
                replica.pid = pid
                replica.note_kv(kv)
                self._watch(key, replica)
        except Exception as exc:
            self.close()
            if isinstance(exc, OmnistepError):
                raise
            raise OmnistepError(f"a component actor failed to start: {exc}") from exc

    def instance(self, card: ModelCard, device: str = "cpu") -> ModelInstance:
        """``card`` as the serving process runs it: its loops, with a ``RemoteComponent`` for
        each component and none built here. ``device``: where loops make per-request state
        (the random generators; see the module docstring).

        Raises:
            KeyError: a component of ``card`` that this executor placed no actor for.
            CardValidationError: see ``ModelCard.validate``.
        """
        components = {}
        for spec in card.components:
            key = (card.card_id, spec.name)
            if key not in self._replicas:
                raise KeyError(f"the ray executor placed no actor for component {key[0]}/{key[1]}")
            components[spec.name] = RemoteComponent(self, *key)
        return ModelInstance.assemble(card, components, device)

    def attach(
        self, models: Iterable[ModelInstance], wake: Callable[[], None] | None = None
    ) -> None:
        """Put a ``RemoteComponent`` in ``models``' ``components`` for every placed component
        (the engine calls this), so that loops free sequences in the actors; a component built
        here (a model made with ``ModelInstance.load``) is dropped. Models made with
        ``instance`` have their stand-ins already. Idempotent. ``wake`` (the engine's) is
        called on the event loop when a replacement actor starts serving."""
        if wake is not None:
            self._wake = wake
        with contextlib.suppress(RuntimeError):  # no running loop: the first batch sets it
            self._loop = asyncio.get_running_loop()
        for model in models:
            for name, component in list(model.components.items()):
                key = (model.card.card_id, name)
                if key in self._replicas and not isinstance(component, RemoteComponent):
                    model.components[name] = RemoteComponent(self, *key)

    def replica_batches(self, model_id: str, name: str) -> list[int]:
        """Batches each replica of component ``name`` of ``model_id`` has received (a
        replacement counts from 0)."""
        return [r.batches for r in self._replicas[(model_id, name)]]

    def replica_sequences(self, model_id: str, name: str) -> list[int]:
        """Sequences routed to each replica of component ``name`` of ``model_id`` and not
        freed yet."""
        return [r.num_sequences for r in self._replicas[(model_id, name)]]

    def replica_pids(self, model_id: str, name: str) -> list[int | None]:
        """The process id of each replica's actor (None for one being replaced)."""
        return [r.pid if r.live else None for r in self._replicas[(model_id, name)]]

    def replica_versions(self, model_id: str, name: str) -> list[int]:
        """The weight version each live replica's component runs, asked of the actors."""
        live = self._placed[(model_id, name)].live()
        return self._ray.get([r.actor.weight_version.remote() for r in live])

    def capacity(self, model_id: str, name: str, per_instance: int) -> int:
        """``per_instance`` batches on each live replica; 0 while none is live and one is
        being replaced (the component's units wait for it); ``per_instance`` when none will
        come back (its units run and fail with ``ComponentUnavailableError``)."""
        placed = self._placed.get((model_id, name))
        if placed is None:
            return per_instance
        live = len(placed.live())
        if live:
            return per_instance * live
        return 0 if placed.recovering else per_instance

    def check_available(self, model_id: str) -> None:
        """Raises ``ComponentUnavailableError`` (the server's 503 with ``Retry-After``) when a
        component of ``model_id`` has no live replica; other models are not looked at."""
        for (card_id, name), placed in self._placed.items():
            if card_id != model_id or placed.live():
                continue
            coming = "is being replaced" if placed.recovering else "could not be replaced"
            retry = self._retry_after(placed)
            raise ComponentUnavailableError(
                f"model '{card_id}' is unavailable: every Ray actor of its component '{name}' "
                f"died and {coming}; retry in {retry} s",
                card_id,
                name,
                retry,
            )

    def _retry_after(self, placed: _Placed) -> int:
        """Seconds a client should wait: the last replacement's time (5 s before any), or
        ``max_backoff_s`` once the component could not be replaced."""
        if not placed.recovering:
            return max(1, math.ceil(self.recovery.max_backoff_s))
        last = placed.last_recovery_s
        return max(1, math.ceil(last if last is not None else 5.0))

    def health(self) -> list[ComponentHealth]:
        """Replicas of every placed component: live, being replaced, given up on, deaths and
        replacements so far."""
        with self._lock:
            return [
                ComponentHealth(
                    model_id,
                    name,
                    len(placed.replicas),
                    len(placed.live()),
                    len(placed.recovering),
                    len(placed.failed),
                    placed.deaths,
                    placed.restarts,
                    placed.last_recovery_s,
                )
                for (model_id, name), placed in self._placed.items()
            ]

    def _rotated(self, key: tuple[str, str]) -> list[_Replica]:
        """The live replicas, starting at the next in turn (so ties rotate)."""
        placed = self._placed[key]
        replicas = placed.live()
        if not replicas:
            return []
        start = next(placed.turn) % len(replicas)
        return replicas[start:] + replicas[:start]

    def _pick(self, key: tuple[str, str]) -> _Replica | None:
        return min(self._rotated(key), key=lambda r: r.in_flight, default=None)

    def _route(
        self, key: tuple[str, str], payloads: Sequence[Any]
    ) -> dict[_Replica | None, list[int]]:
        """Payload indices by the replica that runs them: a sequence's units where its KV
        blocks are (a new sequence: where its sample group's other sequences are, so they can
        share their prompt's blocks, else the live replica with the fewest), the rest on the
        least busy live replica. A sequence whose replica died stays routed to it (its units
        fail: its state is gone); None: no live replica for a unit."""
        parts: dict[_Replica | None, list[int]] = {}
        shared: _Replica | None = None
        for index, payload in enumerate(payloads):
            seq_id = getattr(payload, "seq_id", None)
            if seq_id is None:
                shared = shared or self._pick(key)
                replica = shared
            else:
                replica = self._routes.get((*key, seq_id))  # type: ignore[arg-type]
                if replica is None:
                    replica = self._place(key, seq_id, getattr(payload, "share_group", None))
            parts.setdefault(replica, []).append(index)
        return parts

    def _place(self, key: tuple[str, str], seq_id: str, group: str | None) -> _Replica | None:
        """The replica a new sequence lives on (see ``_route``); recorded until it is freed.
        A sequence of a group whose replica died goes there too: the group fails as a whole.
        None when no replica is live."""
        replica = None if group is None else self._groups.get((*key, group))
        if replica is None:
            replica = min(
                self._rotated(key), key=lambda r: (r.num_sequences, r.in_flight), default=None
            )
            if replica is None:
                return None
        replica.num_sequences += 1
        self._routes[(*key, seq_id)] = replica
        if group is not None:
            self._groups[(*key, group)] = replica
            self._group_of[(*key, seq_id)] = group
            self._group_size[(*key, group)] = self._group_size.get((*key, group), 0) + 1
        return replica

    async def run(
        self,
        component: Component | None,
        kind: WorkUnitKind,
        payloads: Sequence[Any],
        *,
        model_id: str = "",
        name: str = "",
    ) -> list[Outcome]:
        """Execute one batch in the actors of component ``name`` of ``model_id`` (the local
        ``component`` is not used), split by replica when its sequences live on several (see
        the module docstring). Returns one outcome per payload; when a part cannot reach its
        actor (payloads that do not pickle), each of its units gets the error; the units of a
        part whose actor died (or whose sequence's replica died before) get a
        ``ComponentUnavailableError``. Stateful payload fields (generators) end in the state
        the actor left them in.

        Raises:
            KeyError: no actor was placed for (``model_id``, ``name``).
        """
        key = (model_id, name)
        if key not in self._replicas:
            raise KeyError(f"the ray executor placed no actor for component {model_id}/{name}")
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        parts = self._route(key, payloads)
        outcomes: list[Outcome | None] = [None] * len(payloads)
        results = await asyncio.gather(
            *(
                self._send(key, replica, kind, [payloads[i] for i in indices])
                for replica, indices in parts.items()
            )
        )
        for indices, part in zip(parts.values(), results, strict=True):
            for index, outcome in zip(indices, part, strict=True):
                outcomes[index] = outcome
        return outcomes  # type: ignore[return-value]

    def _unavailable(
        self, key: tuple[str, str], replica: _Replica | None, unreachable: str = ""
    ) -> Exception:
        """The error of a unit whose replica died (or that found no live replica, or whose
        actor could not be reached: ``unreachable`` says why)."""
        model_id, name = key
        placed = self._placed[key]
        if replica is None:
            message = f"no Ray actor of {model_id}/{name} is live"
        elif unreachable:
            message = (
                f"the Ray actor of {model_id}/{name} (replica {replica.index}) could not be "
                f"reached ({unreachable}); whether the step ran is unknown"
            )
        else:
            message = (
                f"the Ray actor of {model_id}/{name} (replica {replica.index}) died "
                f"({replica.cause}); the request's state there (KV cache blocks, decoder "
                "state; a rollout group's samples all live on one replica) is lost"
            )
        coming = "it is being replaced" if placed.recovering else "retry later"
        return ComponentUnavailableError(
            f"{message}: retry the request ({coming})", model_id, name, self._retry_after(placed)
        )

    async def _send(
        self,
        key: tuple[str, str],
        replica: _Replica | None,
        kind: WorkUnitKind,
        payloads: list[Any],
    ) -> list[Outcome]:
        """Run ``payloads`` on ``replica``; copy the generator states it returns back."""
        model_id, name = key
        if replica is None or not replica.live:
            return [self._unavailable(key, replica)] * len(payloads)
        try:
            blob = dumps((kind, payloads))
        except Exception as exc:  # noqa: BLE001 - payloads that do not pickle
            err: Exception = TypeError(
                f"the ray executor could not send a batch of {model_id}/{name} to its "
                f"actor ({type(exc).__name__}: {exc}); it runs cards whose payloads pickle"
            )
            return [err] * len(payloads)
        replica.in_flight += 1
        replica.batches += 1
        try:
            ref = replica.actor.run.remote(blob)
            try:
                reply: BatchReply = pickle.loads(await ref)
            except asyncio.CancelledError:
                with contextlib.suppress(Exception):  # a running task may not be cancellable
                    self._ray.cancel(ref)
                raise
            except self._ray.exceptions.ActorUnavailableError as exc:
                # unreachable, maybe for a moment: the step's units fail (its outcome and the
                # generators' states are unknown); the watch tells whether the actor died
                return [self._unavailable(key, replica, _death(exc))] * len(payloads)
            except self._ray.exceptions.RayActorError as exc:  # the actor died
                self._lost(key, replica, exc)
                return [self._unavailable(key, replica)] * len(payloads)
            except Exception as exc:  # noqa: BLE001 - the call failed otherwise
                err = RuntimeError(
                    f"ray actor of {model_id}/{name} failed the batch: {type(exc).__name__}: {exc}"
                )
                return [err] * len(payloads)
        finally:
            replica.in_flight -= 1
        replica.unreachable_since = None  # it answered
        replica.note_kv(reply.kv)
        for payload, states in zip(payloads, reply.states, strict=True):
            for field_name, state in states:
                getattr(payload, field_name).set_state(state)
        return reply.outcomes

    def free_sequence(self, model_id: str, name: str, seq_id: str) -> None:
        """Free ``seq_id`` in the replica of component ``name`` holding it and forget its
        route; a sequence never sent there is a no-op, and so is one whose replica died (its
        blocks died with it). Does not wait for the actor (its reply updates ``kv_blocks``);
        the engine frees a sequence only after its last batch returned, so nothing of it runs
        later."""
        replica = self._routes.pop((model_id, name, seq_id), None)
        if replica is None:
            return
        replica.num_sequences -= 1
        group = self._group_of.pop((model_id, name, seq_id), None)
        if group is not None:
            left = self._group_size[(model_id, name, group)] - 1
            self._group_size[(model_id, name, group)] = left
            if not left:  # the group's last sequence: forget where it lived
                del self._group_size[(model_id, name, group)]
                del self._groups[(model_id, name, group)]
        if replica.live:
            replica.pending.append(replica.actor.free_sequence.remote(seq_id))

    def _settle(self, replica: _Replica, timeout: float | None = 0) -> None:
        """Take the KV usage of the replica's finished ``free_sequence`` calls (all of them,
        waiting up to ``timeout`` seconds; 0: only those already done)."""
        if not replica.pending:
            return
        done, replica.pending = self._ray.wait(
            replica.pending, num_returns=len(replica.pending), timeout=timeout
        )
        for ref in done:
            with contextlib.suppress(Exception):  # a dead actor holds nothing any more
                replica.note_kv(self._ray.get(ref))

    def kv_blocks(self, model_id: str, name: str) -> tuple[int, int] | None:
        """(used, free) KV blocks of component ``name`` of ``model_id``, summed over its live
        replicas as they last reported them (after each batch and each freed sequence);
        None when the component keeps no paged KV cache, has no live replica or was not
        placed here."""
        reports = []
        for replica in self._replicas.get((model_id, name), []):
            if not replica.live:
                continue
            self._settle(replica)
            if replica.kv is not None:
                reports.append(replica.kv)
        if not reports:
            return None
        return sum(kv[1] for kv in reports), sum(kv[2] for kv in reports)

    def weight_specs(self, model_id: str, name: str) -> dict[str, tuple[tuple[int, ...], str]]:
        """``weight_specs()`` of component ``name`` of ``model_id`` (its replicas are built
        alike: a live one is asked, once).

        Raises:
            ComponentUnavailableError: no replica is live and none was asked before.
        """
        key = (model_id, name)
        if key not in self._weight_specs:
            live = self._placed[key].live()
            if not live:
                raise self._unavailable(key, None)
            self._weight_specs[key] = self._ray.get(live[0].actor.weight_specs.remote())
        return self._weight_specs[key]

    def weight_problems(self, model_id: str, name: str, tensors: Mapping[str, Any]) -> list[str]:
        """``weight_problems(tensors)`` of component ``name`` of ``model_id``, asked of one live
        replica (they are built alike); the tensors travel only to a component that has the
        check (asked once). With no live replica to ask (all being replaced), or one that dies
        while asked, it answers []: the update is then recorded and replayed on the
        replacements, whose own ``update_weights`` still refuses bad values."""
        key = (model_id, name)
        if self._checks_values.get(key) is False:
            return []
        live = self._placed[key].live()
        if not live:
            return []
        try:
            if key not in self._checks_values:
                offers = live[0].actor.offers.remote("weight_problems")
                self._checks_values[key] = self._ray.get(offers)
            if not self._checks_values[key]:
                return []
            return self._ray.get(live[0].actor.weight_problems.remote(dict(tensors)))
        except self._ray.exceptions.RayActorError:
            return []

    def call_all(self, model_id: str, name: str, method: str, args: tuple) -> list[Any]:
        """Call ``method(*args)`` on the component in every live replica of (``model_id``,
        ``name``) and wait for all of them; returns their results, replica by replica.

        ``REPLAYED_CALLS`` and ``weight_version`` are recorded first, so that a replica that
        dies meanwhile, or is being replaced, gets them too (its replacement replays them
        before it serves); such a call succeeds with no live replica at all (returns []).
        A replica that dies during the call is replaced; an actor's own error is raised here
        (a recorded call is then forgotten).

        Raises:
            ComponentUnavailableError: another method, and no replica answered.
        """
        key = (model_id, name)
        placed = self._placed[key]
        blob = dumps(args)
        recorded = None
        stored = self._ray.put(blob) if method in REPLAYED_CALLS else None  # not under the lock
        with self._lock:
            if method in REPLAYED_CALLS:
                recorded = self._record(placed, method, stored, args)
            elif method == "weight_version":
                placed.version = args[0]
            live = placed.live()
        sent = recorded.ref if recorded is not None else blob
        refs = [r.actor.call.remote(method, sent) for r in live]
        results, error = [], None
        for replica, ref in zip(live, refs, strict=True):
            try:
                results.append(self._ray.get(ref))
            except self._ray.exceptions.RayActorError as exc:
                self._lost(key, replica, exc)
            except Exception as exc:  # noqa: BLE001 - raised below, after the others answered
                error = error or exc
        if error is not None:
            if recorded is not None:
                with self._lock:
                    placed.calls = [c for c in placed.calls if c is not recorded]
            raise error
        if not results and recorded is None and method != "weight_version":
            raise self._unavailable(key, None)
        return results

    def _record(self, placed: _Placed, method: str, ref: Any, args: tuple) -> _Call:
        """Record a ``REPLAYED_CALLS`` call (``ref``: its pickled arguments in the object
        store) and drop what it supersedes: earlier updates' tensors it sets again, an earlier
        call of another recorded method. Call with the lock held."""
        names = None
        if method == "update_weights" and args and isinstance(args[0], Mapping):
            names = frozenset(args[0])
        kept = []
        for call in placed.calls:
            if call.method != method:
                kept.append(call)
            elif names is not None and call.names is not None:
                call.names = call.names - names
                if call.names:
                    kept.append(call)
            elif method == "update_weights":  # an update without names: keep it
                kept.append(call)
        recorded = _Call(next(self._serial), method, ref, names)
        placed.calls = [*kept, recorded]
        return recorded

    async def refresh_kv_blocks(self, model_id: str, name: str) -> tuple[int, int] | None:
        """Like ``kv_blocks``, but asks each live replica now, after the sequences freed so
        far (waits for a running batch to end). Raises KeyError for a component not placed."""
        replicas = [r for r in self._replicas[(model_id, name)] if r.live]
        for replica in replicas:
            for ref in replica.pending:
                with contextlib.suppress(Exception):
                    await ref
            self._settle(replica, timeout=None)
        kvs = await asyncio.gather(
            *(r.actor.kv_usage.remote() for r in replicas), return_exceptions=True
        )
        for replica, kv in zip(replicas, kvs, strict=True):
            if not isinstance(kv, BaseException):
                replica.note_kv(kv)
        return self.kv_blocks(model_id, name)

    # ------------------------------------------------------------- healing

    def _watch(self, key: tuple[str, str], replica: _Replica) -> None:
        """Call the replica's ``watch``, which never returns: when it fails, the actor died."""
        ref = replica.actor.watch.options(concurrency_group=WATCH_GROUP).remote()
        ref.future().add_done_callback(lambda future: self._watch_ended(key, replica, future))

    def _watch_ended(self, key: tuple[str, str], replica: _Replica, future: Any) -> None:
        """Runs on a thread of Ray's own, where calling Ray deadlocks: hands over to a thread."""
        try:
            cause: BaseException | None = future.exception()
        except BaseException as exc:  # noqa: BLE001 - a cancelled future
            cause = exc
        threading.Thread(target=self._watch_failed, args=(key, replica, cause), daemon=True).start()

    def _watch_failed(
        self, key: tuple[str, str], replica: _Replica, cause: BaseException | None
    ) -> None:
        """The actor died, or could not be reached (Ray's ``ActorUnavailableError``: maybe for
        a moment): watch again, up to ``UNREACHABLE_GRACE_S`` after it was first unreachable
        (a dead actor's new watch fails at once with ``ActorDiedError``); then it is lost."""
        unreachable = isinstance(cause, self._ray.exceptions.ActorUnavailableError)
        if unreachable and replica.live and not self._closing.is_set():
            now = time.monotonic()
            replica.unreachable_since = replica.unreachable_since or now
            within = now - replica.unreachable_since < UNREACHABLE_GRACE_S
            if within and not self._closing.wait(UNREACHABLE_GRACE_S / 10):
                with contextlib.suppress(Exception):
                    self._watch(key, replica)
                    return
        self._lost(key, replica, cause)

    def _lost(self, key: tuple[str, str], replica: _Replica, cause: BaseException | None) -> None:
        """``replica``'s actor died: stop routing to it, forget its KV usage, and start its
        replacement. Idempotent; ignored once the executor closes. Thread-safe."""
        with self._lock:
            placed = self._placed[key]
            if self._closing.is_set() or not replica.live:
                return
            if placed.replicas[replica.index] is not replica:
                return
            replica.live = False
            replica.cause = _death(cause)
            replica.kv = None
            replica.pending = []
            placed.deaths += 1
            placed.recovering.add(replica.index)
        died = time.monotonic()
        log.warning(
            "ray actor of %s/%s (replica %d, pid %s) died: %s; replacing it",
            *key,
            replica.index,
            replica.pid,
            replica.cause,
        )
        threading.Thread(
            target=self._recover,
            args=(key, replica.index, died),
            name=f"omnistep-heal-{key[0]}-{key[1]}-{replica.index}",
            daemon=True,
        ).start()

    def _recover(self, key: tuple[str, str], index: int, died: float) -> None:
        """Replace the dead replica ``index`` of ``key``: a new actor, its component loaded
        from the model folder, the recorded calls replayed and the weight version set, then
        installed; up to ``recovery.attempts`` tries with back-off, then reported failed."""
        policy = self.recovery
        placed = self._placed[key]
        with contextlib.suppress(Exception):  # an unreachable actor must not come back
            self._ray.kill(placed.replicas[index].actor)
        for attempt in range(1, policy.attempts + 1):
            if self._closing.wait(policy.delay(attempt)):
                return
            actor = None
            try:
                with self._lock:
                    if self._closing.is_set():
                        return
                    actor = self._remote.options(**placed.options).remote(placed.deployment.factory)
                    self._starting.add(actor)
                deadline = time.monotonic() + policy.ready_timeout_s
                pid, kv = self._ray.get(actor.ready.remote(), timeout=policy.ready_timeout_s)
                replica = _Replica(actor, index, pid)
                replica.note_kv(kv)
                if self._catch_up(key, replica, deadline):
                    seconds = time.monotonic() - died
                    with self._lock:
                        placed.last_recovery_s = seconds
                    log.warning(
                        "ray actor of %s/%s (replica %d) replaced in %.2f s (pid %d)",
                        *key,
                        index,
                        seconds,
                        pid,
                    )
                    self._notify()
                return
            except Exception as exc:  # noqa: BLE001 - this try failed; the next may not
                log.warning(
                    "replacing ray actor of %s/%s (replica %d): try %d of %d failed: %s",
                    *key,
                    index,
                    attempt,
                    policy.attempts,
                    exc,
                )
                if actor is not None:
                    with contextlib.suppress(Exception):
                        self._ray.kill(actor)
            finally:
                with self._lock:
                    self._starting.discard(actor)
        with self._lock:
            placed.recovering.discard(index)
            placed.failed.add(index)
        log.error(
            "ray actor of %s/%s (replica %d) could not be replaced in %d tries; %d of its "
            "replicas serve",
            *key,
            index,
            policy.attempts,
            len(placed.live()),
        )
        self._notify()

    def _catch_up(self, key: tuple[str, str], replica: _Replica, deadline: float) -> bool:
        """Replay the recorded calls and the weight version on a new replica until none is
        left, then install it (under the lock, so no update can slip in between); False when
        the executor closed meanwhile. Raises what a replayed call raises, or GetTimeoutError
        past ``deadline``."""
        placed = self._placed[key]
        replayed, version = 0, None
        while True:
            with self._lock:
                if self._closing.is_set():
                    with contextlib.suppress(Exception):
                        self._ray.kill(replica.actor)
                    return False
                todo = [c for c in placed.calls if c.serial > replayed]
                want = placed.version
                if not todo and want == version:
                    placed.replicas[replica.index] = replica
                    placed.recovering.discard(replica.index)
                    placed.restarts += 1
                    self._watch(key, replica)
                    return True
            for call in todo:
                left = max(0.0, deadline - time.monotonic())
                self._ray.get(replica.actor.call.remote(call.method, call.ref), timeout=left)
                replayed = call.serial
            if want != version:
                left = max(0.0, deadline - time.monotonic())
                ref = replica.actor.call.remote("weight_version", dumps((want,)))
                self._ray.get(ref, timeout=left)
                version = want

    def _notify(self) -> None:
        """Wake the engine's step loop (from any thread): capacity changed."""
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed
                loop.call_soon_threadsafe(wake)

    def close(self) -> None:
        """Kill the component actors (and shut Ray down if this executor started it); no
        actor is replaced any more."""
        with self._lock:
            self._closing.set()
            actors = [r.actor for rs in self._replicas.values() for r in rs] + list(self._starting)
        for actor in actors:
            with contextlib.suppress(Exception):  # already gone
                self._ray.kill(actor)
        self._replicas.clear()
        self._routes.clear()
        if self._owns_ray and self._ray.is_initialized():
            self._ray.shutdown()
            self._owns_ray = False
        if self._ray_keeper is not None:
            self._ray_keeper.set()


def _init_ray(ray: Any, options: dict[str, Any]) -> threading.Event:
    """``ray.init(**options)`` on a thread that lives until the returned event is set (by
    ``close``). Ray ties the processes it starts (GCS, raylet, workers) to the thread that
    started them (Linux ``PR_SET_PDEATHSIG``): started from a thread that then ends, such as
    ``omnistep serve``'s loader thread, the whole local cluster died with it and the first
    request failed. Raises what ``ray.init`` raises."""
    started, keep = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def keeper() -> None:
        try:
            ray.init(**options)
        except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread
            errors.append(exc)
        finally:
            started.set()
        keep.wait()

    threading.Thread(target=keeper, name="omnistep-ray", daemon=True).start()
    started.wait()
    if errors:
        raise errors[0]
    return keep


def _death(cause: BaseException | None) -> str:
    """A one-line reason for an actor's death (Ray's messages run to many lines)."""
    if cause is None:
        return "its actor ended"
    text = str(cause).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(cause).__name__}: {first[:200]}" if first else type(cause).__name__
