"""N rollout replicas on Ray, for RL scale-out: Ray actors each running one whole engine
(``AsyncOmniEngine``), groups dispatched across them, and a trainer-side weight broadcast over
``torch.distributed``.

``RolloutReplicas.start(models, n=2)`` starts ``n`` actors, each building its engine from the
same ``FAMILY[=PATH]`` specs and options as ``AsyncOmniEngine.from_specs``. Then, from the
trainer's (driver's) process:

- ``rollout(inputs, n=, seed=)``: each input's group of ``n`` samples runs on one replica (a
  group is never split, so its prompt is prefilled once there); groups are spread so that
  replicas get about equal work (longest first onto the least loaded replica, text length as
  the cost). Sample ``k`` of every input runs with seed ``seed + k`` as in process, so the
  samples equal one in-process engine's for the same seeds (bit for bit under
  ``batch_invariant``); each sample records its ``replica``.
- ``score(samples)``: the serving weights' log-probs (or, with ``reference=True``, those of a
  frozen copy of the starting weights each replica keeps when started with ``reference=True``),
  the samples spread across replicas. Nothing of a graph crosses processes: a trainer scores
  in its own process, on its ``Trainer`` copy (``OmniEngine.score(samples, trainer=)``).
- ``update_weights(tensors | Trainer, version=)``: the trainer is rank 0 and the replicas
  ranks 1..N of a process group (gloo; NCCL when the replicas run on CUDA), formed on first
  use through a TCP store on a free port. An update is two-phase: (1) the tensors' names,
  shapes and dtypes and the version are announced by a Ray call and every replica checks them
  (versions only go up: ``WeightVersionError``; unknown names, bad shapes:
  ``WeightUpdateError``) before any byte moves; (2) the tensors are broadcast (in chunks of
  ``BROADCAST_CHUNK_BYTES``, all in flight at once) into fresh buffers while the replicas keep
  serving, each replica checks them (NaN/Inf) and holds them; (3) only once every replica
  holds them does any apply them (``AsyncEngine.apply_weights``, pause mode). So no replica
  runs a step at the new version before every replica has it, and a refused update changes
  nothing anywhere. ``update_weights`` returns once every replica runs the new version.

Failures: a replica that dies (its process or node gone) fails only the groups dispatched to
it, with a ``ReplicaDiedError`` naming it and them (``rollout(..., return_exceptions=True)``
returns it in their places and the other groups' results beside it); later calls run on the
live replicas (``alive``). The process group is torn down and formed again, with the live
replicas, at the next update; an update during which a replica dies is retried with the
others (nothing was applied before every live replica held the tensors).

A product-plane module (offline API): imports offline, launch (through offline), core;
ray and torch (``torch.distributed``) lazily.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from omnistep.core import (
    InvalidRequestError,
    OmnistepError,
    RequestFailedError,
    SamplingParams,
    WeightUpdateError,
    WeightVersionError,
)
from omnistep.core.card import count_nonfinite
from omnistep.engine.openmp import releasing
from omnistep.engine.weights import WEIGHT_UPDATE_MODES, check_version_arg
from omnistep.models.registry import DEFAULT_MODEL
from omnistep.offline import (
    AsyncOmniEngine,
    LoopScore,
    RolloutGroup,
    RolloutSample,
    Trainer,
    check_rollout_args,
    flatten_samples,
    read_weights,
    score_samples,
)

BROADCAST_CHUNK_BYTES = 16 * 2**20
"""Bytes per ``broadcast`` call: larger tensors go in slices of this size, every slice in
flight at once (one 400 MB call took 4-10x longer than 16 MB slices on gloo over loopback)."""
BACKENDS = ("gloo", "nccl")


class ReplicaDiedError(RequestFailedError):
    """A rollout replica died (its actor process or node is gone) while it ran groups of a
    call; only those groups failed.

    Attributes:
        replica: the replica's id.
        groups: the indices (in the call's inputs) of the groups that ran there.
    """

    def __init__(self, replica: int, groups: Sequence[int], cause: str):
        shown = ", ".join(str(g) for g in groups) or "none"
        first = cause.strip().splitlines()[0] if cause.strip() else "no reason given"
        super().__init__(
            f"rollout replica {replica} died; its groups failed (inputs {shown}), the other "
            f"replicas' groups are unaffected and later calls run on the live replicas "
            f"({first[:200]})"
        )
        self.replica = replica
        self.groups = tuple(groups)


@dataclass(frozen=True)
class BroadcastReport:
    """What ``RolloutReplicas.apply_weights`` did.

    Attributes:
        model: the card id updated.
        version: the version every replica now runs.
        replicas: the replicas updated (the live ones).
        num_bytes: bytes broadcast (each replica received them all).
        casts: tensors cast to the model's dtype (``AsyncEngine.apply_weights``).
        announce_s: seconds of the announcement and checks before any byte moved (and of
            forming the process group, when one was formed).
        transfer_s: seconds from the first byte sent to every replica holding and having
            checked every tensor.
        commit_s: seconds of every replica's ``apply_weights``.
        total_s: seconds of the whole call.
        received_at: per replica, ``time.monotonic()`` there once it held and had checked
            every tensor.
        committing_at: per replica, ``time.monotonic()`` there when it began applying them
            (no step at the new version can start before). On one host,
            ``max(received_at) <= min(committing_at)``: every replica had the weights before
            any began to use them.
    """

    model: str
    version: int
    replicas: tuple[int, ...]
    num_bytes: int
    casts: tuple[str, ...]
    announce_s: float
    transfer_s: float
    commit_s: float
    total_s: float
    received_at: dict[int, float]
    committing_at: dict[int, float]


def assign_groups(costs: Sequence[float], num_replicas: int) -> list[list[int]]:
    """Spread groups over replicas: each group (by decreasing cost, then index) goes to the
    replica with the least cost so far (the longest-processing-time rule, within 4/3 of the
    best makespan). Returns each replica's group indices, ascending.

    Raises:
        ValueError: ``num_replicas`` < 1.
    """
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be at least 1, got {num_replicas}")
    loads = [0.0] * num_replicas
    plan: list[list[int]] = [[] for _ in range(num_replicas)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(num_replicas), key=lambda r: (loads[r], r))
        plan[r].append(i)
        loads[r] += costs[i]
    return [sorted(p) for p in plan]


def chunk_views(tensor: Any, chunk_bytes: int = BROADCAST_CHUNK_BYTES) -> list[Any]:
    """Flat views of a contiguous ``tensor`` in slices of at most ``chunk_bytes``: sender and
    receivers slice alike, so their ``broadcast`` calls pair up."""
    flat = tensor.view(-1)
    step = max(1, chunk_bytes // max(1, tensor.element_size()))
    return [flat[i : i + step] for i in range(0, flat.numel(), step)]


def broadcast_each(group: Any, tensors: Sequence[Any], timeout_s: float) -> Iterator[int]:
    """``group.broadcast`` of every tensor from rank 0 (the trainer), in place: all slices
    (``chunk_views``) issued at once, then each tensor's index yielded as soon as its slices
    arrived, so a receiver checks a tensor while the next ones are in flight.

    Raises:
        RuntimeError: a peer went away or ``timeout_s`` passed (torch.distributed's error).
    """
    pending = [[group.broadcast(view, 0) for view in chunk_views(t)] for t in tensors]
    for i, works in enumerate(pending):
        for work in works:
            work.wait(timedelta(seconds=timeout_s))
        yield i


def broadcast(group: Any, tensors: Sequence[Any], timeout_s: float) -> None:
    """``broadcast_each`` to the end (the sender's side)."""
    for _ in broadcast_each(group, tensors, timeout_s):
        pass


def process_group(
    store: Any, rank: int, size: int, backend: str, host: str, timeout_s: float
) -> Any:
    """A process group of its own (not torch.distributed's default one, so a trainer's DDP
    group is untouched) over ``store``: ``ProcessGroupGloo`` bound to ``host`` (this rank's
    address the others reach), or ``ProcessGroupNCCL``. Blocks until every rank joined."""
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    options._timeout = timeout
    return dist.ProcessGroupGloo(store, rank, size, options)


def _node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


def _dtype(name: str) -> Any:
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise InvalidRequestError(f"unknown dtype '{name}'", param="weights")
    return dtype


def _to_host(value: Any) -> Any:
    """A score result with no graph, on the CPU (what crosses processes)."""
    if isinstance(value, LoopScore):
        return LoopScore(_to_host(value.logprobs), _to_host(value.entropy), _to_host(value.flow))
    if hasattr(value, "detach"):
        return value.detach().cpu()
    return value


class ReplicaWorker:
    """The body of one replica actor: one ``AsyncOmniEngine`` and its side of the weight
    broadcast (see the module docstring). Its methods are coroutines (a Ray async actor):
    rollouts, scoring and a broadcast's receiving run concurrently; blocking work runs on
    worker threads.

    Args:
        index: the replica's id.
        models, device, options: as ``AsyncOmniEngine.from_specs``.
        reference: keep a frozen copy of the starting weights of each model, for
            ``score(reference=True)``.
    """

    def __init__(self, index: int, models: list[str], device: str, options: dict, reference: bool):
        self.index = index
        self._build = (models, device, options)
        self._keep_reference = reference
        self.omni: AsyncOmniEngine | None = None
        self._reference: dict[str, Trainer] = {}
        self._group: Any = None
        self._staged: tuple[str, int, dict[str, Any], tuple[str, ...]] | None = None

    async def start(self) -> dict[str, Any]:
        """Build the engine (and the reference copies); returns the process id, node address,
        model ids and weight versions."""
        models, device, options = self._build
        self.omni = await asyncio.to_thread(
            releasing(AsyncOmniEngine.from_specs), models, device, **options
        )
        if self._keep_reference:
            for card_id in self.omni.engine.models:
                # a Trainer's policy copy is the served weights as now; nothing trains it
                self._reference[card_id] = await self.omni.trainer(card_id)
        return {
            "pid": os.getpid(),
            "node": _node_ip(),
            "models": list(self.omni.model_ids),
            "versions": dict(self.omni.engine.weight_versions),
        }

    async def rollout(self, inputs: list[str], options: dict) -> list[RolloutGroup]:
        """``AsyncOmniEngine.rollout`` of ``inputs``, each sample marked with this replica."""
        groups = await self.omni.rollout(inputs, progress=False, **options)
        return [
            RolloutGroup(
                g.input, g.group, [dataclasses.replace(s, replica=self.index) for s in g.samples]
            )
            for g in groups
        ]

    async def score(
        self, samples: list[RolloutSample], options: dict, reference: bool
    ) -> list[dict[str, Any]]:
        """``score_samples`` on the serving weights (or the reference copy), no graph, on the
        CPU."""
        return await asyncio.to_thread(releasing(self._score), samples, options, reference)

    def _score(self, samples: list[RolloutSample], options: dict, reference: bool) -> list:
        import torch

        engine = self.omni.engine
        with torch.no_grad():
            if not reference:
                scores = score_samples(engine, samples, **options)
            else:
                scores = [{} for _ in samples]
                by_card: dict[str, list[int]] = {}
                for i, s in enumerate(samples):
                    by_card.setdefault(s.model or next(iter(engine.models)), []).append(i)
                for card_id, idx in by_card.items():
                    trainer = self._reference.get(card_id)
                    if trainer is None:
                        raise InvalidRequestError(
                            "reference=True scores on each replica's frozen copy of the "
                            "starting weights: start the replicas with reference=True",
                            param="reference",
                        )
                    part = score_samples(
                        engine, [samples[i] for i in idx], trainer=trainer, **options
                    )
                    for i, got in zip(idx, part, strict=True):
                        scores[i] = got
        return [{k: _to_host(v) for k, v in d.items()} for d in scores]

    async def weight_version(self, model: str | None) -> int:
        """``model``'s weight version (the first served model's for None)."""
        return self.omni.engine.weight_versions[self.omni.card_id(model)]

    async def stats(self) -> dict[str, int]:
        """``AsyncEngine.stats()``."""
        return self.omni.engine.stats()

    async def announce(
        self, model: str | None, specs: list[tuple[str, tuple[int, ...], str]], version: int | None
    ) -> tuple[str, int]:
        """Check an update before any tensor moves: ``version`` above the current one, and
        every name, shape and dtype against the model's (``ModelInstance.check_weights`` on
        meta tensors). Returns the card id and its current version.

        Raises:
            WeightVersionError, WeightUpdateError, ModelNotFoundError.
        """
        import torch

        card_id = self.omni.card_id(model)
        current = self.omni.engine.weight_versions[card_id]
        if version is not None and version <= current:
            raise WeightVersionError(card_id, version, current)
        meta = {n: torch.empty(s, dtype=_dtype(d), device="meta") for n, s, d in specs}
        self.omni.engine.models[card_id].check_weights(meta, check_finite=False)
        return card_id, current

    async def join_group(
        self, host: str, port: int, rank: int, size: int, backend: str, timeout_s: float
    ) -> None:
        """Join the trainer's process group as ``rank`` (blocks until all joined)."""
        import torch.distributed as dist

        def join() -> Any:
            store = dist.TCPStore(
                host, port, size, is_master=False, timeout=timedelta(seconds=timeout_s)
            )
            return process_group(store, rank, size, backend, _node_ip(), timeout_s)

        self._group = None
        self._group = await asyncio.to_thread(join)

    async def leave_group(self) -> None:
        """Drop the process group (the trainer forms another)."""
        self._group = None
        self._staged = None

    async def receive(
        self,
        card_id: str,
        specs: list[tuple[str, tuple[int, ...], str]],
        version: int,
        check_finite: bool,
        device: str,
        timeout_s: float,
    ) -> float:
        """Receive the broadcast tensors into fresh buffers on ``device`` while the engine
        keeps serving, check them (NaN/Inf, each as soon as it arrived; then
        ``check_weights``) and hold them for ``commit``; returns ``time.monotonic()`` then.

        Raises:
            WeightUpdateError: a NaN/Inf value with ``check_finite`` (nothing held).
        """
        import torch

        def work() -> tuple[dict[str, Any], tuple[str, ...]]:
            tensors = {n: torch.empty(s, dtype=_dtype(d), device=device) for n, s, d in specs}
            names, problems = list(tensors), []
            for i in broadcast_each(self._group, list(tensors.values()), timeout_s):
                bad = count_nonfinite(tensors[names[i]]) if check_finite else 0
                if bad:  # check_weights' own words
                    problems.append(
                        f"'{names[i]}' holds {bad} NaN/Inf value(s) (pass check_finite=False "
                        "to allow)"
                    )
            if problems:
                raise WeightUpdateError(card_id, problems)
            prepared = self.omni.engine.models[card_id].check_weights(tensors, False)
            return prepared.flat(), tuple(prepared.casts)

        self._staged = None
        tensors, casts = await asyncio.to_thread(releasing(work))
        self._staged = (card_id, version, tensors, casts)
        return time.monotonic()

    async def commit(self, card_id: str, version: int, mode: str) -> tuple[float, tuple[str, ...]]:
        """Apply the held tensors (``AsyncEngine.apply_weights`` in ``mode``); returns when it
        began (``time.monotonic()``) and what was cast.

        Raises:
            RuntimeError: nothing held for this model and version.
        """
        staged, self._staged = self._staged, None
        if staged is None or staged[:2] != (card_id, version):
            raise RuntimeError(f"replica {self.index} holds no update {card_id} v{version}")
        began = time.monotonic()
        await self.omni.engine.apply_weights(card_id, staged[2], version, mode, False)
        return began, staged[3]

    async def discard(self) -> None:
        """Drop held tensors (an update refused elsewhere)."""
        self._staged = None

    async def close(self) -> None:
        """Stop the engine."""
        self._group = None
        if self.omni is not None:
            await self.omni.close()


class RolloutReplicas:
    """N rollout replicas on Ray and the trainer's end of their weight broadcast (see the
    module docstring). Build with ``start``; use as a context manager or call ``close``.
    Methods are synchronous and thread-safe (a rollout may run on one thread while
    ``update_weights`` runs on another; updates run one at a time)."""

    def __init__(
        self,
        ray: Any,
        actors: dict[int, Any],
        infos: dict[int, dict],
        device: str,
        backend: str,
        timeout_s: float,
        owns_ray: bool,
    ):
        self._ray = ray
        self._actors = actors
        self.infos = infos
        self.device = device
        self.backend = backend
        self.timeout_s = timeout_s
        self._owns_ray = owns_ray
        self._alive = set(actors)
        self._state = threading.Lock()  # guards _alive and the group
        self._updating = threading.Lock()  # one update at a time
        self._group: Any = None
        self._store: Any = None
        self._members: tuple[int, ...] = ()

    @classmethod
    def start(
        cls,
        models: str | Sequence[str] = DEFAULT_MODEL,
        n: int = 2,
        device: str = "cpu",
        *,
        num_cpus: float = 1.0,
        num_gpus: float | None = None,
        reference: bool = False,
        backend: str | None = None,
        ray_address: str | None = None,
        ready_timeout: float = 600.0,
        broadcast_timeout: float = 600.0,
        **engine_options: Any,
    ) -> RolloutReplicas:
        """Start ``n`` replica actors, each building an engine from ``models`` on ``device``
        with ``engine_options`` (``AsyncOmniEngine.from_specs``: ``kv_cache_gb``,
        ``batch_invariant``, ``max_batch_size``...), and wait until all are built.

        Args:
            num_cpus, num_gpus: what each actor reserves (``num_gpus`` default: 1 on
                ``cuda``, else 0; Ray gives each actor its own GPU).
            reference: each replica keeps a frozen copy of the starting weights
                (``score(reference=True)``; one more copy of the trained components).
            backend: ``"gloo"`` or ``"nccl"`` for the weight broadcast (default: nccl on
                ``cuda``, else gloo). NCCL needs the trainer and every replica on distinct
                GPUs; gloo works anywhere (CUDA tensors are staged through host memory).
            ray_address: the cluster to join when Ray is not initialized yet (None: a
                running local cluster or a new one; a new one is shut down by ``close``).
            ready_timeout: seconds to wait for every engine to be built.
            broadcast_timeout: seconds a broadcast (or forming its group) may take.

        Raises:
            OmnistepError: ray missing, ``n`` < 1, an unknown backend, an actor that could
                not be placed or failed to build its engine (its error in the message).
        """
        try:
            import ray
        except ImportError:
            raise OmnistepError("rollout replicas need ray: pip install 'omnistep[ray]'") from None
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise OmnistepError(f"n must be a positive integer, got {n!r}")
        backend = backend or ("nccl" if device.startswith("cuda") else "gloo")
        if backend not in BACKENDS:
            raise OmnistepError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        owns_ray = not ray.is_initialized()
        if owns_ray:
            ray.init(address=ray_address)
        specs = [models] if isinstance(models, str) else list(models)
        gpus = (1.0 if device.startswith("cuda") else 0.0) if num_gpus is None else num_gpus
        remote = ray.remote(ReplicaWorker).options(num_cpus=num_cpus, num_gpus=gpus)
        actors = {
            i: remote.remote(i, specs, device, dict(engine_options), reference) for i in range(n)
        }
        replicas = cls(ray, actors, {}, device, backend, broadcast_timeout, owns_ray)
        try:
            refs = {i: a.start.remote() for i, a in actors.items()}
            ready, waiting = ray.wait(list(refs.values()), num_returns=n, timeout=ready_timeout)
            if waiting:
                raise OmnistepError(
                    f"{len(waiting)} of {n} rollout replicas were not built within "
                    f"{ready_timeout:g} s ({ray.available_resources()} available)"
                )
            for i, ref in refs.items():
                try:
                    replicas.infos[i] = ray.get(ref)
                except Exception as exc:  # noqa: BLE001 - the actor's error, reported whole
                    cause = _cause(exc)
                    raise OmnistepError(
                        f"rollout replica {i} failed to start: {type(cause).__name__}: {cause}"
                    ) from cause
        except BaseException:
            replicas.close()
            raise
        return replicas

    @property
    def alive(self) -> tuple[int, ...]:
        """The ids of the replicas still running, ascending."""
        with self._state:
            return tuple(sorted(self._alive))

    @property
    def handles(self) -> dict[int, Any]:
        """Each live replica's Ray actor handle, by id (to watch or kill it)."""
        return {i: self._actors[i] for i in self.alive}

    def weight_versions(self, model: str | None = None) -> dict[int, int]:
        """Each live replica's weight version of ``model`` (default: the first served)."""
        return self._call_each("weight_version", model)

    def stats(self) -> dict[int, dict[str, int]]:
        """Each live replica's ``AsyncEngine.stats()``."""
        return self._call_each("stats")

    def rollout(
        self,
        inputs: str | Sequence[str],
        *,
        n: int = 1,
        seed: int | None = 0,
        model: str | None = None,
        voice: str | None = None,
        sampling: SamplingParams | None = None,
        logprobs: str = "processed",
        audio: bool = False,
        return_exceptions: bool = False,
    ) -> list[RolloutGroup | BaseException]:
        """``AsyncOmniEngine.rollout`` with each input's group on one replica (see the module
        docstring); groups in input order, ids ``rollout-<hex>/<i>``.

        ``return_exceptions``: False: the first failure is raised once every replica
        answered (a ``ReplicaDiedError`` for a replica that died); True: each failed group's
        place holds its error and the others their ``RolloutGroup``.

        Raises:
            InvalidRequestError: as ``AsyncOmniEngine.rollout``, before anything runs.
            ReplicaDiedError: see ``return_exceptions``.
            RequestFailedError: a request failed in a replica (the groups of that replica's
                call failed with it), or no replica is alive.
        """
        inputs, seed = check_rollout_args(inputs, n, seed, logprobs)
        live = self._live_or_raise()
        options = {
            "n": n,
            "seed": seed,
            "model": model,
            "voice": voice,
            "sampling": sampling,
            "logprobs": logprobs,
            "audio": audio,
        }
        plan = assign_groups([1.0 + len(text) for text in inputs], len(live))
        calls = {
            self._actors[r].rollout.remote([inputs[i] for i in idx], options): (r, idx)
            for r, idx in zip(live, plan, strict=True)
            if idx
        }
        results: list[Any] = [None] * len(inputs)
        try:
            for ref, (replica, idx) in calls.items():
                for i, value in zip(idx, self._groups_of(ref, replica, idx), strict=True):
                    results[i] = value
        except BaseException:  # Ctrl-C or the like: the replicas abort this call's requests
            for ref in calls:
                self._ray.cancel(ref)
            raise
        base = f"rollout-{uuid.uuid4().hex[:12]}"
        results = [
            dataclasses.replace(g, group=f"{base}/{i}") if isinstance(g, RolloutGroup) else g
            for i, g in enumerate(results)
        ]
        failed = next((r for r in results if isinstance(r, BaseException)), None)
        if failed is not None and not return_exceptions:
            raise failed
        return results

    def _groups_of(self, ref: Any, replica: int, idx: list[int]) -> list[Any]:
        """A replica's answer to ``rollout``: its groups, or one error per group."""
        try:
            return self._ray.get(ref)
        except self._ray.exceptions.RayActorError as exc:
            self._died(replica)
            return [ReplicaDiedError(replica, idx, str(exc))] * len(idx)
        except self._ray.exceptions.RayTaskError as exc:
            return [_cause(exc)] * len(idx)

    def score(
        self,
        samples: RolloutSample | RolloutGroup | Sequence[RolloutSample | RolloutGroup],
        *,
        reference: bool = False,
        trainer: Trainer | None = None,
        **options: Any,
    ) -> list[dict[str, Any]]:
        """``score_samples`` on the replicas' serving weights (``reference=True``: their
        frozen copies of the starting weights), the samples split evenly over the live
        replicas (a replica that dies meanwhile: its part runs on another). ``options``:
        ``mode``, ``loops``, ``match_serving``, ``entropy``, ``masked``, ``batch_size``,
        ``routing_replay`` (MoE cards: replay the recorded routing).

        Returns:
            As ``score_samples``, with no graph: CPU ``torch.Tensor``s (``LoopScore``s with
            ``entropy``), in sample order.

        Raises:
            InvalidRequestError: a ``trainer`` (its copy is in this process: score there with
                ``OmniEngine.score(samples, trainer=)``), or what ``score_samples`` raises.
            RequestFailedError: no replica is alive.
        """
        if trainer is not None:
            raise InvalidRequestError(
                "a Trainer's copy lives in the trainer's process: score on it there "
                "(OmniEngine.score(samples, trainer=trainer)); RolloutReplicas.score scores "
                "the serving weights (or reference=True)",
                param="trainer",
            )
        flat = flatten_samples(samples)
        out: list[Any] = [None] * len(flat)
        todo = [list(range(len(flat)))]
        while todo:
            live = self._live_or_raise()
            parts = [p for idx in todo for p in _split(idx, len(live))]
            todo = []
            calls = {}
            for j, idx in enumerate(parts):
                r = live[j % len(live)]
                calls[self._actors[r].score.remote([flat[i] for i in idx], options, reference)] = (
                    r,
                    idx,
                )
            for ref, (replica, idx) in calls.items():
                try:
                    got = self._ray.get(ref)
                except self._ray.exceptions.RayActorError:
                    self._died(replica)
                    todo.append(idx)
                    continue
                except self._ray.exceptions.RayTaskError as exc:
                    raise _cause(exc) from None
                for i, value in zip(idx, got, strict=True):
                    out[i] = value
        return out

    def update_weights(
        self,
        weights: Mapping[str, Any] | str | Path | Trainer,
        *,
        model: str | None = None,
        version: int | None = None,
        mode: str = "pause",
        check_finite: bool = True,
    ) -> int:
        """Broadcast new weights to every live replica (see the module docstring); returns
        the version they all run. ``weights``: tensors by checkpoint name, a safetensors
        file, or a ``Trainer`` (the tensors it handed out; its model unless ``model`` says
        otherwise; its ``version`` becomes the new one). ``version``: above the current one
        (default: the current + 1).

        Raises:
            WeightVersionError: ``version`` not above a replica's current one (nothing moved).
            WeightUpdateError: an unknown name, a wrong shape or dtype (nothing moved), or a
                NaN/Inf value with ``check_finite`` (nothing applied anywhere).
            RequestFailedError: no replica left alive.
        """
        return self.apply_weights(
            weights, model=model, version=version, mode=mode, check_finite=check_finite
        ).version

    def apply_weights(
        self,
        weights: Mapping[str, Any] | str | Path | Trainer,
        *,
        model: str | None = None,
        version: int | None = None,
        mode: str = "pause",
        check_finite: bool = True,
    ) -> BroadcastReport:
        """``update_weights``, answering a ``BroadcastReport`` (timings and ordering)."""
        if mode not in WEIGHT_UPDATE_MODES:
            raise InvalidRequestError(
                f"mode must be one of {', '.join(WEIGHT_UPDATE_MODES)}, got {mode!r}",
                param="mode",
            )
        check_version_arg(version)  # before anything moves (a replica would refuse it last)
        trainer = weights if isinstance(weights, Trainer) else None
        if trainer is not None:
            model = model or trainer.card_id
            tensors = trainer.state()
        else:
            tensors = read_weights(weights)
        with self._updating:
            started = time.perf_counter()
            named = self._wire_tensors(tensors)
            while True:
                try:
                    report = self._update_once(named, model, version, mode, check_finite, started)
                    break
                except _ReplicasLost:
                    continue  # the group is re-formed with the live replicas
        if trainer is not None and report.model == trainer.card_id:
            trainer.version = report.version
        return report

    def close(self) -> None:
        """Stop every replica (and Ray, when ``start`` started it). Idempotent."""
        with self._state:
            self._group = self._store = None
            actors, self._actors = dict(self._actors), {}
            self._alive.clear()
        if actors:  # a clean stop where the actor answers; a dead or stuck one is killed
            refs = [actor.close.remote() for actor in actors.values()]
            self._ray.wait(refs, num_returns=len(refs), timeout=30)
        for actor in actors.values():
            self._ray.kill(actor)
        if self._owns_ray and self._ray.is_initialized():
            self._ray.shutdown()
            self._owns_ray = False

    def __enter__(self) -> RolloutReplicas:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- the broadcast ---------------------------------------------------------------

    def _wire_tensors(self, tensors: Mapping[str, Any]) -> dict[str, Any]:
        """The tensors as contiguous torch tensors where the backend sends from."""
        import numpy as np
        import torch

        if not isinstance(tensors, Mapping) or not tensors:
            raise InvalidRequestError("weights must be a non-empty mapping", param="weights")
        out = {}
        for name, value in tensors.items():
            if isinstance(value, np.ndarray):
                value = torch.from_numpy(value)
            if not isinstance(value, torch.Tensor):
                raise InvalidRequestError(
                    f"'{name}' is a {type(value).__name__}, not a tensor", param="weights"
                )
            value = value.detach()
            if self.backend == "nccl" and not value.is_cuda:
                value = value.cuda()
            out[name] = value.contiguous()
        return out

    def _update_once(
        self,
        tensors: dict[str, Any],
        model: str | None,
        version: int | None,
        mode: str,
        check_finite: bool,
        started: float,
    ) -> BroadcastReport:
        """One attempt of an update on the live replicas: announce, broadcast, commit.
        Raises ``_ReplicasLost`` when a replica died before the commit (the others hold
        nothing then), for a retry with the others."""
        specs = [
            (n, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in tensors.items()
        ]
        live = self._live_or_raise()
        t_announce = time.perf_counter()
        announced = self._all(
            {r: self._actors[r].announce.remote(model, specs, version) for r in live}
        )
        card_id = announced[live[0]][0]
        new_version = max(c for _, c in announced.values()) + 1 if version is None else version
        group = self._ensure_group(live)
        t0 = time.perf_counter()
        device = "cpu" if self.backend == "gloo" else self.device
        receiving = {
            r: self._actors[r].receive.remote(
                card_id, specs, new_version, check_finite, device, self.timeout_s
            )
            for r in live
        }
        failure = None
        try:
            broadcast(group, list(tensors.values()), self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - a peer went away or failed: its answer says
            failure = exc
        received = self._all(receiving, holding=True, keep_group=failure is None)
        if failure is not None:  # every replica answered, yet sending failed here
            self._drop_group()
            for r in live:
                self._actors[r].discard.remote()
            raise failure
        t1 = time.perf_counter()
        # every live replica holds the checked tensors: now (and only now) they apply them
        refs = {r: self._actors[r].commit.remote(card_id, new_version, mode) for r in live}
        committed, _, error = self._gather(refs)
        if error is not None:
            raise error
        t2 = time.perf_counter()
        return BroadcastReport(
            model=card_id,
            version=new_version,
            replicas=tuple(committed),
            num_bytes=sum(t.numel() * t.element_size() for t in tensors.values()),
            casts=next(iter(committed.values()))[1] if committed else (),
            announce_s=t0 - t_announce,
            transfer_s=t1 - t0,
            commit_s=t2 - t1,
            total_s=time.perf_counter() - started,
            received_at=received,
            committing_at={r: c[0] for r, c in committed.items()},
        )

    def _all(
        self, refs: dict[int, Any], holding: bool = False, keep_group: bool = True
    ) -> dict[int, Any]:
        """Every replica's answer to a step of an update. A replica that died: the group is
        dropped, the others drop what they hold (``holding``), ``_ReplicasLost`` is raised.
        A replica's own error is raised likewise (the group kept when ``keep_group``)."""
        answers, died, error = self._gather(refs)
        if not died and error is None:
            return answers
        if died or not keep_group:
            self._drop_group()
        if holding:
            for r in self.alive:
                self._actors[r].discard.remote()
        if error is not None:
            raise error
        raise _ReplicasLost()

    def _gather(self, refs: dict[int, Any]) -> tuple[dict[int, Any], list[int], Any]:
        """Wait for every ref: the answers by replica, the replicas that died (marked
        dead), and the first error a replica raised (or None)."""
        answers, died, error = {}, [], None
        for replica, ref in refs.items():
            try:
                answers[replica] = self._ray.get(ref)
            except self._ray.exceptions.RayActorError:
                self._died(replica)
                died.append(replica)
            except self._ray.exceptions.RayTaskError as exc:
                error = error or _cause(exc)
        return answers, died, error

    def _ensure_group(self, live: tuple[int, ...]) -> Any:
        """The process group of the trainer (rank 0) and ``live`` (ranks 1..N), formed
        when none is or its members changed (a replica died)."""
        with self._state:
            if self._group is not None and self._members == live:
                return self._group
        self._drop_group()
        import torch.distributed as dist

        host, size = _node_ip(), len(live) + 1
        store = dist.TCPStore(
            host, 0, size, is_master=True, timeout=timedelta(seconds=self.timeout_s),
            wait_for_workers=False,
        )  # fmt: skip
        joins = {
            r: self._actors[r].join_group.remote(
                host, store.port, rank, size, self.backend, self.timeout_s
            )
            for rank, r in enumerate(live, 1)
        }
        group = process_group(store, 0, size, self.backend, host, self.timeout_s)
        self._all(joins, keep_group=False)
        with self._state:
            self._group, self._store, self._members = group, store, live
        return group

    def _drop_group(self) -> None:
        with self._state:
            had, self._group, self._store, members = self._group, None, None, self._members
            self._members = ()
        if had is not None:
            for r in members:
                if r in self._alive:
                    self._actors[r].leave_group.remote()

    def _discard_all(self) -> None:
        for r in self.alive:
            self._actors[r].discard.remote()

    # --- bookkeeping -------------------------------------------------------------------

    def _died(self, replica: int) -> None:
        with self._state:
            self._alive.discard(replica)
            if replica in self._members:
                self._group, self._store, self._members = None, None, ()

    def _live_or_raise(self) -> tuple[int, ...]:
        live = self.alive
        if not live:
            raise RequestFailedError("no rollout replica is alive (every one died)")
        return live

    def _call_each(self, method: str, *args: Any) -> dict[int, Any]:
        """``method(*args)`` on every live replica: the answers of those that gave one (a
        dead one is dropped).

        Raises:
            the first replica's own error.
        """
        refs = {r: getattr(self._actors[r], method).remote(*args) for r in self.alive}
        answers, _, error = self._gather(refs)
        if error is not None:
            raise error
        return answers


class _ReplicasLost(Exception):
    """A replica died during an update attempt (internal: the update is retried)."""


def _cause(exc: BaseException) -> BaseException:
    """The exception a Ray task raised (``RayTaskError.cause``), else ``exc``."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else exc


def _split(items: list[int], parts: int) -> list[list[int]]:
    """``items`` in ``parts`` contiguous runs of near-equal length (no empty ones)."""
    size, extra = divmod(len(items), parts)
    out, start = [], 0
    for p in range(parts):
        end = start + size + (1 if p < extra else 0)
        if end > start:
            out.append(items[start:end])
        start = end
    return out


__all__ = [
    "BROADCAST_CHUNK_BYTES",
    "BroadcastReport",
    "ReplicaDiedError",
    "ReplicaWorker",
    "RolloutReplicas",
    "assign_groups",
]
