"""The deploy file of the Ray executor: where each component's actors go, how many, and how a
dead actor is replaced.

``omnistep serve --executor ray --deploy deploy.yaml`` (YAML, or JSON, which is YAML)::

    models:
      toy:                       # card id (or family name) of a served model
        components:
          lm: {num_cpus: 1, replicas: 1}
          vocoder: {num_cpus: 0.5, replicas: 2, resources: {vocoder_node: 1}}
    recovery:                    # optional; these are the defaults
      attempts: 5                # tries to replace one dead actor before giving up on it
      backoff_s: 1.0             # wait before the 2nd try; doubles for each later one
      max_backoff_s: 30.0        # the longest wait between tries
      ready_timeout_s: 300.0     # a new actor must be built and caught up within this

``omnistep.engine.ray_executor`` places the actors as parsed here; imports neither ray nor
torch. PyYAML is needed only to read a file (``load_deploy``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from omnistep.core import Component, OmnistepError

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
    if not isinstance(data, Mapping) or set(data) - {"models", "recovery"}:
        raise DeployConfigError(
            "a deploy file is a mapping with the keys 'models' and (optional) 'recovery'"
        )
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


RECOVERY_KEYS = ("attempts", "backoff_s", "max_backoff_s", "ready_timeout_s")
"""The keys of a deploy file's ``recovery`` section."""


@dataclass(frozen=True)
class RecoveryPolicy:
    """How the Ray executor replaces a component actor that died (the deploy file's
    ``recovery`` section).

    A dead actor is replaced by a new one (same component, same Ray options, placed wherever
    the cluster has room), which loads its component from the model folder and is then
    brought to the weight version the engine serves before it takes work. Tries after the
    first wait ``backoff_s``, then twice as long each time, at most ``max_backoff_s``.

    Attributes:
        attempts: tries to replace one dead actor; after the last one fails the replica is
            reported ``failed`` (``/health``, the metrics) and the component's other replicas
            keep serving.
        backoff_s: seconds before the second try (the first starts at once).
        max_backoff_s: the longest wait between two tries.
        ready_timeout_s: seconds a new actor has to be placed, build its component and replay
            the weight updates; longer counts as a failed try (its actor is killed).
    """

    attempts: int = 5
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    ready_timeout_s: float = 300.0

    def delay(self, attempt: int) -> float:
        """Seconds to wait before try ``attempt`` (1-based): 0, then ``backoff_s`` doubling,
        capped at ``max_backoff_s``."""
        if attempt <= 1:
            return 0.0
        return min(self.backoff_s * 2.0 ** (attempt - 2), self.max_backoff_s)


def parse_recovery(data: object) -> RecoveryPolicy:
    """The ``recovery`` section of a loaded deploy file (defaults where it is absent).

    Raises:
        DeployConfigError: a section that is not a mapping, an unknown key, a bad value.
    """
    entry = data.get("recovery") if isinstance(data, Mapping) else None
    if entry is None:
        return RecoveryPolicy()
    if not isinstance(entry, Mapping):
        raise DeployConfigError(f"recovery must be a mapping of {', '.join(RECOVERY_KEYS)}")
    unknown = sorted(set(entry) - set(RECOVERY_KEYS))
    if unknown:
        raise DeployConfigError(
            f"recovery: unknown keys {unknown}; allowed: {', '.join(RECOVERY_KEYS)}"
        )
    default = RecoveryPolicy()
    return RecoveryPolicy(
        attempts=_number(entry.get("attempts", default.attempts), "recovery.attempts", 1, True),
        backoff_s=_number(entry.get("backoff_s", default.backoff_s), "recovery.backoff_s", 0),
        max_backoff_s=_number(
            entry.get("max_backoff_s", default.max_backoff_s), "recovery.max_backoff_s", 0
        ),
        ready_timeout_s=_number(
            entry.get("ready_timeout_s", default.ready_timeout_s), "recovery.ready_timeout_s", 1
        ),
    )
