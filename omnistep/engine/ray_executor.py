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

Transport: payloads and outputs are pickled here with cloudpickle, and a tensor that views a
larger storage (a row of a batch's hidden states, a frame of a mel spectrogram) is copied to
its own storage first, since pickling a view sends its whole storage; values are unchanged.
Tensors cross as they are (a CUDA tensor arrives on the same CUDA device index), so the driver
and the actors of AR cards must use the same kind of device (``--device`` and the deploy
file's ``device``): the per-request generator is made on the driver's device and must match
the device the component samples on. A batch whose payloads do not pickle fails its requests
with a ``TypeError`` that says so.

Deploy file (YAML, or JSON, which is YAML)::

    models:
      toy:                       # card id (or family name) of a served model
        components:
          lm: {num_cpus: 1, replicas: 1}
          vocoder: {num_cpus: 0.5, replicas: 2, resources: {vocoder_node: 1}}

Per component: ``num_cpus`` (default 1), ``num_gpus`` (default 0), ``resources`` (custom Ray
resources, default none), ``replicas`` (default 1), ``device`` (default: ``--device``; set
``cuda`` for a component given GPUs). Components the file does not name get the defaults.
Replicas of an AR component each hold their own KV pool (``kv_cache_gb`` each); replicas give
the same outputs as one actor where the card's batches do not change results
(``batch_invariant``), since they split batches.

This module imports ``ray`` only when a ``RayExecutor`` is made (``pip install omnistep[ray]``),
and ``torch`` never (tensors are recognised once torch is loaded).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import io
import itertools
import pickle
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omnistep.core import Component, ModelCard, ModelInstance, OmnistepError, WorkUnitKind
from omnistep.engine.executor import Outcome, execute_released
from omnistep.kv import kv_usage

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

    def call(self, method: str, blob: bytes) -> Any:
        """``component.<method>(*args)`` with pickled ``args`` (a weight update, the version
        that follows it, a refresh of derived copies, a voice enrollment); runs between
        batches; returns the method's result."""
        args = pickle.loads(blob)
        if method == "weight_version":
            self.component.weight_version = args[0]  # type: ignore[attr-defined]
            return None
        return getattr(self.component, method)(*args)


@dataclass(eq=False)
class _Replica:
    actor: Any
    in_flight: int = 0
    batches: int = 0
    num_sequences: int = 0  # sequences routed here and not freed yet
    kv: KVSnapshot | None = None  # the newest KV usage the actor reported
    pending: list[Any] = field(default_factory=list)  # refs of free_sequence calls

    def note_kv(self, kv: KVSnapshot | None) -> None:
        if kv is not None and (self.kv is None or kv[0] > self.kv[0]):
            self.kv = kv


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
        """``<method>(*args)`` on the component in every replica, waiting for all; returns the
        first replica's result."""
        return self._executor.call_all(self._model_id, self._name, method, args)[0]

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
        self._routes: dict[tuple[str, str, str], _Replica] = {}  # (model, component, seq_id)
        self._weight_specs: dict[tuple[str, str], dict] = {}
        # sample groups (Request.group) live on one replica of a component while any of
        # their sequences does: (model, component, group) -> replica, and its member count
        self._groups: dict[tuple[str, str, str], _Replica] = {}
        self._group_size: dict[tuple[str, str, str], int] = {}
        self._group_of: dict[tuple[str, str, str], str] = {}  # (model, component, seq) -> group
        remote = ray.remote(ComponentWorker)
        pending: list[tuple[_Replica, Any]] = []
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
                replica = _Replica(remote.options(**options).remote(dep.factory))
                replicas.append(replica)
                pending.append((replica, replica.actor.ready.remote()))
            self._replicas[(dep.model_id, dep.name)] = replicas
            self._turn[(dep.model_id, dep.name)] = itertools.count()
        try:
            refs = [ref for _, ref in pending]
            ready, waiting = ray.wait(refs, num_returns=len(refs), timeout=ready_timeout)
            if waiting:
                raise OmnistepError(
                    f"{len(waiting)} of {len(refs)} component actors were not placed within "
                    f"{ready_timeout:g} s: does the cluster have the resources the deploy file "
                    f"asks for? ({ray.available_resources()} available)"
                )
            for (replica, _), (_, kv) in zip(pending, ray.get(refs), strict=True):
                replica.note_kv(kv)
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

    def attach(self, models: Iterable[ModelInstance]) -> None:
        """Put a ``RemoteComponent`` in ``models``' ``components`` for every placed component
        (the engine calls this), so that loops free sequences in the actors; a component built
        here (a model made with ``ModelInstance.load``) is dropped. Models made with
        ``instance`` have their stand-ins already. Idempotent."""
        for model in models:
            for name, component in list(model.components.items()):
                key = (model.card.card_id, name)
                if key in self._replicas and not isinstance(component, RemoteComponent):
                    model.components[name] = RemoteComponent(self, *key)

    def replica_batches(self, model_id: str, name: str) -> list[int]:
        """Batches each replica of component ``name`` of ``model_id`` has received."""
        return [r.batches for r in self._replicas[(model_id, name)]]

    def replica_sequences(self, model_id: str, name: str) -> list[int]:
        """Sequences routed to each replica of component ``name`` of ``model_id`` and not
        freed yet."""
        return [r.num_sequences for r in self._replicas[(model_id, name)]]

    def capacity(self, model_id: str, name: str, per_instance: int) -> int:
        """``per_instance`` batches on each replica."""
        return per_instance * len(self._replicas.get((model_id, name), [None]))

    def _rotated(self, key: tuple[str, str]) -> list[_Replica]:
        """The replicas, starting at the next in turn (so ties rotate)."""
        replicas = self._replicas[key]
        start = next(self._turn[key]) % len(replicas)
        return replicas[start:] + replicas[:start]

    def _pick(self, key: tuple[str, str]) -> _Replica:
        return min(self._rotated(key), key=lambda r: r.in_flight)

    def _route(self, key: tuple[str, str], payloads: Sequence[Any]) -> dict[_Replica, list[int]]:
        """Payload indices by the replica that runs them: a sequence's units where its KV
        blocks are (a new sequence: where its sample group's other sequences are, so they can
        share their prompt's blocks, else the replica with the fewest), the rest on the least
        busy."""
        parts: dict[_Replica, list[int]] = {}
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

    def _place(self, key: tuple[str, str], seq_id: str, group: str | None) -> _Replica:
        """The replica a new sequence lives on (see ``_route``); recorded until it is freed."""
        replica = None if group is None else self._groups.get((*key, group))
        if replica is None:
            replica = min(self._rotated(key), key=lambda r: (r.num_sequences, r.in_flight))
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
        actor (payloads that do not pickle, a dead actor), each of its units gets the error.
        Stateful payload fields (generators) end in the state the actor left them in.

        Raises:
            KeyError: no actor was placed for (``model_id``, ``name``).
        """
        key = (model_id, name)
        if key not in self._replicas:
            raise KeyError(f"the ray executor placed no actor for component {model_id}/{name}")
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

    async def _send(
        self, key: tuple[str, str], replica: _Replica, kind: WorkUnitKind, payloads: list[Any]
    ) -> list[Outcome]:
        """Run ``payloads`` on ``replica``; copy the generator states it returns back."""
        model_id, name = key
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
            except Exception as exc:  # noqa: BLE001 - the actor died
                err = RuntimeError(
                    f"ray actor of {model_id}/{name} failed the batch: {type(exc).__name__}: {exc}"
                )
                return [err] * len(payloads)
        finally:
            replica.in_flight -= 1
        replica.note_kv(reply.kv)
        for payload, states in zip(payloads, reply.states, strict=True):
            for field_name, state in states:
                getattr(payload, field_name).set_state(state)
        return reply.outcomes

    def free_sequence(self, model_id: str, name: str, seq_id: str) -> None:
        """Free ``seq_id`` in the replica of component ``name`` holding it and forget its
        route; a sequence never sent there is a no-op. Does not wait for the actor (its reply
        updates ``kv_blocks``); the engine frees a sequence only after its last batch returned,
        so nothing of it runs later."""
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
        """(used, free) KV blocks of component ``name`` of ``model_id``, summed over its
        replicas as they last reported them (after each batch and each freed sequence);
        None when the component keeps no paged KV cache or was not placed here."""
        reports = []
        for replica in self._replicas.get((model_id, name), []):
            self._settle(replica)
            if replica.kv is not None:
                reports.append(replica.kv)
        if not reports:
            return None
        return sum(kv[1] for kv in reports), sum(kv[2] for kv in reports)

    def weight_specs(self, model_id: str, name: str) -> dict[str, tuple[tuple[int, ...], str]]:
        """``weight_specs()`` of component ``name`` of ``model_id`` (its replicas are built
        alike: the first is asked, once)."""
        key = (model_id, name)
        if key not in self._weight_specs:
            actor = self._replicas[key][0].actor
            self._weight_specs[key] = self._ray.get(actor.weight_specs.remote())
        return self._weight_specs[key]

    def call_all(self, model_id: str, name: str, method: str, args: tuple) -> list[Any]:
        """Call ``method(*args)`` on the component in every replica of (``model_id``,
        ``name``) and wait for all of them (an actor's error is raised here); returns their
        results, replica by replica."""
        blob = dumps(args)
        replicas = self._replicas[(model_id, name)]
        return self._ray.get([r.actor.call.remote(method, blob) for r in replicas])

    async def refresh_kv_blocks(self, model_id: str, name: str) -> tuple[int, int] | None:
        """Like ``kv_blocks``, but asks each replica now, after the sequences freed so far
        (waits for a running batch to end). Raises KeyError for a component not placed."""
        replicas = self._replicas[(model_id, name)]
        for replica in replicas:
            for ref in replica.pending:
                with contextlib.suppress(Exception):
                    await ref
            self._settle(replica, timeout=None)
        for replica, kv in zip(
            replicas,
            await asyncio.gather(*(r.actor.kv_usage.remote() for r in replicas)),
            strict=True,
        ):
            replica.note_kv(kv)
        return self.kv_blocks(model_id, name)

    def close(self) -> None:
        """Kill the component actors (and shut Ray down if this executor started it)."""
        for replicas in self._replicas.values():
            for replica in replicas:
                with contextlib.suppress(Exception):  # already gone
                    self._ray.kill(replica.actor)
        self._replicas.clear()
        self._routes.clear()
        if self._owns_ray and self._ray.is_initialized():
            self._ray.shutdown()
            self._owns_ray = False
