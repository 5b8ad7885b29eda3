"""The Ray executor: each component of a card runs in one or more Ray actors.

``omnistep serve --executor ray [--deploy deploy.yaml]`` places every component of every served
card as Ray actors (``replicas`` of them), with the Ray resources the deploy file asks for
(``num_cpus``, ``num_gpus``, custom resources such as ``{"vocoder_node": 1}`` that pin a
component to the nodes started with that resource). The engine, scheduler and loops stay in
the driver process; only ``component.execute`` runs in the actors. A batch goes to the least
busy replica (ties in turn), which runs it with ``execute_isolated``: a batch that raises is
rerun unit by unit there, so only the failing request fails, exactly as in process.

Components are built inside their actor: the actor receives a picklable ``factory`` (the CLI
passes ``functools.partial(omnistep.models.registry.build_component, spec, name, device,
options)``, which rebuilds the card from its spec string), because a card's
``ComponentSpec.build`` closure need not pickle.

Limits of this version: payloads and outputs cross process boundaries, so they must pickle
(numpy arrays, dataclasses). The ``toy`` and ``piper`` cards qualify. AR cards whose
components keep per-request state (paged KV caches, per-request ``torch.Generator``s in
payloads: ``chattts``, ``qwen2_5_omni``) need that state placed in the actor: future work; a
batch whose payloads do not pickle fails its requests with a ``TypeError`` that says so.

Deploy file (YAML, or JSON, which is YAML)::

    models:
      toy:                       # card id (or family name) of a served model
        components:
          lm: {num_cpus: 1, replicas: 1}
          vocoder: {num_cpus: 0.5, replicas: 2, resources: {vocoder_node: 1}}

Per component: ``num_cpus`` (default 1), ``num_gpus`` (default 0), ``resources`` (custom Ray
resources, default none), ``replicas`` (default 1), ``device`` (default: ``--device``; set
``cuda`` for a component given GPUs). Components the file does not name get the defaults.

This module imports ``ray`` only when a ``RayExecutor`` is made (``pip install omnistep[ray]``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import pickle
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omnistep.core import Component, OmnistepError, WorkUnitKind
from omnistep.engine.executor import Outcome, execute_isolated

PLACEMENT_KEYS = ("num_cpus", "num_gpus", "resources", "replicas", "device")
"""The keys a component may set in a deploy file."""


class DeployConfigError(OmnistepError):
    """A deploy file that cannot be read or does not fit the served cards."""


@dataclass(frozen=True)
class ComponentPlacement:
    """Where and how many: the Ray options of one component's actors.

    Attributes:
        num_cpus: CPUs each actor reserves (fractions allowed; 0 lets actors share cores).
        num_gpus: GPUs each actor reserves (Ray sets ``CUDA_VISIBLE_DEVICES`` in the actor).
        resources: custom Ray resources each actor needs, e.g. ``{"vocoder_node": 1}``.
        replicas: actors running this component; batches go to the least busy one.
        device: the device the component is built on in its actor; None: the serve default.
    """

    num_cpus: float = 1.0
    num_gpus: float = 0.0
    resources: Mapping[str, float] = field(default_factory=dict)
    replicas: int = 1
    device: str | None = None


@dataclass(frozen=True)
class ComponentDeployment:
    """One component to place: which card and component, how to build it, and where.

    Attributes:
        model_id: the card id the engine knows the model by (``Batch.model_id``).
        name: the component's name in the card.
        factory: ``factory() -> Component``, called inside each actor; must pickle.
        placement: Ray options and replica count.
        max_concurrency: batches one actor runs at once (the spec's ``max_concurrency``).
    """

    model_id: str
    name: str
    factory: Callable[[], Component]
    placement: ComponentPlacement = field(default_factory=ComponentPlacement)
    max_concurrency: int = 1


def _number(value: object, where: str, low: float, integer: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise DeployConfigError(f"{where} must be a number, got {value!r}")
    if integer and value != int(value):
        raise DeployConfigError(f"{where} must be a whole number, got {value!r}")
    if not low <= value < float("inf"):
        raise DeployConfigError(f"{where} must be >= {low:g}, got {value!r}")
    return int(value) if integer else float(value)


def _placement(entry: object, where: str) -> ComponentPlacement:
    if entry is None:
        return ComponentPlacement()
    if not isinstance(entry, Mapping):
        raise DeployConfigError(f"{where} must be a mapping of {', '.join(PLACEMENT_KEYS)}")
    unknown = sorted(set(entry) - set(PLACEMENT_KEYS))
    if unknown:
        raise DeployConfigError(
            f"{where}: unknown keys {unknown}; allowed: {', '.join(PLACEMENT_KEYS)}"
        )
    resources = entry.get("resources") or {}
    if not isinstance(resources, Mapping):
        raise DeployConfigError(f"{where}.resources must be a mapping of name to amount")
    device = entry.get("device")
    if device is not None and not isinstance(device, str):
        raise DeployConfigError(f"{where}.device must be a string such as cpu or cuda")
    return ComponentPlacement(
        num_cpus=_number(entry.get("num_cpus", 1), f"{where}.num_cpus", 0),
        num_gpus=_number(entry.get("num_gpus", 0), f"{where}.num_gpus", 0),
        resources={str(k): _number(v, f"{where}.resources.{k}", 0) for k, v in resources.items()},
        replicas=_number(entry.get("replicas", 1), f"{where}.replicas", 1, integer=True),
        device=device,
    )


def parse_deploy(
    data: object, cards: Mapping[str, tuple[str, Sequence[str]]]
) -> dict[tuple[str, str], ComponentPlacement]:
    """Check a deploy mapping against the served cards and return every component's placement.

    Args:
        data: the loaded deploy file (``{"models": {model: {"components": {name: {...}}}}}``),
            or None for all defaults.
        cards: card id -> (family, component names) of each served card; a deploy entry may
            name a card by its id or its family.

    Returns:
        ``(card id, component name) -> ComponentPlacement`` for every component of every card.

    Raises:
        DeployConfigError: bad structure or values, a model that is not served, or a component
            the card does not have (the message lists what is known).
    """
    placements = {
        (card_id, name): ComponentPlacement()
        for card_id, (_, names) in cards.items()
        for name in names
    }
    if data is None:
        return placements
    if not isinstance(data, Mapping) or set(data) - {"models"}:
        raise DeployConfigError("a deploy file is a mapping with one key, 'models'")
    models = data.get("models") or {}
    if not isinstance(models, Mapping):
        raise DeployConfigError("'models' must map model names to {components: {...}}")
    by_name = {card_id: card_id for card_id in cards}
    by_name.update({family: card_id for card_id, (family, _) in cards.items()})
    for model, entry in models.items():
        if model not in by_name:
            raise DeployConfigError(
                f"deploy file names model '{model}', which is not served; "
                f"served: {', '.join(sorted(cards))}"
            )
        card_id = by_name[model]
        names = cards[card_id][1]
        if entry is None:
            continue
        if not isinstance(entry, Mapping) or set(entry) - {"components"}:
            raise DeployConfigError(f"models.{model} must be a mapping with one key, 'components'")
        components = entry.get("components") or {}
        if not isinstance(components, Mapping):
            raise DeployConfigError(f"models.{model}.components must map component names")
        for name, spec in components.items():
            if name not in names:
                raise DeployConfigError(
                    f"models.{model}.components: card '{card_id}' has no component '{name}'; "
                    f"its components: {', '.join(names)}"
                )
            placements[(card_id, name)] = _placement(spec, f"models.{model}.components.{name}")
    return placements


def load_deploy(path: str | Path) -> object:
    """Read a deploy file (YAML; JSON is valid YAML). Raises DeployConfigError."""
    try:
        import yaml
    except ImportError:  # pragma: no cover - PyYAML comes with ray
        raise DeployConfigError("reading a deploy file needs PyYAML: pip install pyyaml") from None
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise DeployConfigError(f"cannot read deploy file {path}: {exc}") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise DeployConfigError(f"deploy file {path} is not valid YAML: {exc}") from None


def _picklable(exc: Exception) -> Exception:
    """``exc`` itself if it pickles, else a RuntimeError carrying its type and message."""
    try:
        pickle.dumps(exc)
    except Exception:  # noqa: BLE001 - any pickling failure
        return RuntimeError(f"{type(exc).__name__}: {exc}")
    return exc


class ComponentWorker:
    """The body of a component actor: builds the component, runs batches on it."""

    def __init__(self, factory: Callable[[], Component]):
        self.component = factory()

    def ready(self) -> int:
        """The actor's process id, once the component is built."""
        import os

        return os.getpid()

    def run(self, kind: WorkUnitKind, payloads: list[Any]) -> list[Outcome]:
        """``execute_isolated`` on this actor's component, with exceptions made picklable."""
        outcomes = execute_isolated(self.component, kind, payloads)
        return [_picklable(o) if isinstance(o, Exception) else o for o in outcomes]


@dataclass
class _Replica:
    actor: Any
    in_flight: int = 0
    batches: int = 0


class RayExecutor:
    """Runs each component's batches in its Ray actors (see the module docstring).

    Args:
        deployments: the components to place; every component the engine will run.
        init_options: ``ray.init`` keyword arguments, used when Ray is not initialized yet
            (e.g. ``{"address": "auto"}``); Ray started here is shut down by ``close``.
        ready_timeout: seconds to wait for all actors to be placed and their components
            built (a component that asks for resources no node has never starts).

    Raises:
        OmnistepError: ray is not installed, an actor failed to build its component, or the
            actors were not placed within ``ready_timeout``.
    """

    def __init__(
        self,
        deployments: Sequence[ComponentDeployment],
        init_options: Mapping[str, Any] | None = None,
        ready_timeout: float = 300.0,
    ):
        try:
            import ray
        except ImportError:
            raise OmnistepError("the ray executor needs ray: pip install 'omnistep[ray]'") from None
        self._ray = ray
        self._owns_ray = False
        if not ray.is_initialized():
            ray.init(**dict(init_options or {}))
            self._owns_ray = True
        self._replicas: dict[tuple[str, str], list[_Replica]] = {}
        self._turn: dict[tuple[str, str], itertools.count] = {}
        remote = ray.remote(ComponentWorker)
        pending = []
        for dep in deployments:
            p = dep.placement
            options: dict[str, Any] = {
                "num_cpus": p.num_cpus,
                "num_gpus": p.num_gpus,
                "max_concurrency": dep.max_concurrency,
            }
            if p.resources:
                options["resources"] = dict(p.resources)
            replicas = []
            for _ in range(p.replicas):
                actor = remote.options(**options).remote(dep.factory)
                replicas.append(_Replica(actor))
                pending.append(actor.ready.remote())
            self._replicas[(dep.model_id, dep.name)] = replicas
            self._turn[(dep.model_id, dep.name)] = itertools.count()
        try:
            ready, waiting = ray.wait(pending, num_returns=len(pending), timeout=ready_timeout)
            if waiting:
                raise OmnistepError(
                    f"{len(waiting)} of {len(pending)} component actors were not placed within "
                    f"{ready_timeout:g} s: does the cluster have the resources the deploy file "
                    f"asks for? ({ray.available_resources()} available)"
                )
            ray.get(ready)
        except Exception as exc:
            self.close()
            if isinstance(exc, OmnistepError):
                raise
            raise OmnistepError(f"a component actor failed to start: {exc}") from exc

    def replica_batches(self, model_id: str, name: str) -> list[int]:
        """Batches each replica of component ``name`` of ``model_id`` has received."""
        return [r.batches for r in self._replicas[(model_id, name)]]

    def capacity(self, model_id: str, name: str, per_instance: int) -> int:
        """``per_instance`` batches on each replica."""
        return per_instance * len(self._replicas.get((model_id, name), [None]))

    def _pick(self, key: tuple[str, str]) -> _Replica:
        replicas = self._replicas[key]
        start = next(self._turn[key]) % len(replicas)
        order = replicas[start:] + replicas[:start]
        return min(order, key=lambda r: r.in_flight)

    async def run(
        self,
        component: Component | None,
        kind: WorkUnitKind,
        payloads: Sequence[Any],
        *,
        model_id: str = "",
        name: str = "",
    ) -> list[Outcome]:
        """Execute one batch in an actor of component ``name`` of ``model_id`` (the local
        ``component`` is not used). Returns one outcome per payload; when the batch cannot
        reach its actor (payloads that do not pickle, a dead actor), every unit gets the error.

        Raises:
            KeyError: no actor was placed for (``model_id``, ``name``).
        """
        key = (model_id, name)
        if key not in self._replicas:
            raise KeyError(f"the ray executor placed no actor for component {model_id}/{name}")
        replica = self._pick(key)
        replica.in_flight += 1
        replica.batches += 1
        try:
            try:
                ref = replica.actor.run.remote(kind, list(payloads))
            except Exception as exc:  # noqa: BLE001 - serialization of the arguments
                err: Exception = TypeError(
                    f"the ray executor could not send a batch of {model_id}/{name} to its "
                    f"actor ({type(exc).__name__}: {exc}); it runs cards whose payloads "
                    "pickle (toy, piper)"
                )
                return [err] * len(payloads)
            try:
                return await ref
            except asyncio.CancelledError:
                with contextlib.suppress(Exception):  # a running task may not be cancellable
                    self._ray.cancel(ref)
                raise
            except Exception as exc:  # noqa: BLE001 - actor died or outputs did not pickle
                err = RuntimeError(
                    f"ray actor of {model_id}/{name} failed the batch: {type(exc).__name__}: {exc}"
                )
                return [err] * len(payloads)
        finally:
            replica.in_flight -= 1

    def close(self) -> None:
        """Kill the component actors (and shut Ray down if this executor started it)."""
        for replicas in self._replicas.values():
            for replica in replicas:
                with contextlib.suppress(Exception):  # already gone
                    self._ray.kill(replica.actor)
        self._replicas.clear()
        if self._owns_ray and self._ray.is_initialized():
            self._ray.shutdown()
            self._owns_ray = False
