"""The family registry: ``--model family[=path]`` -> ``build_card(path) -> ModelCard``.

Families are looked up by name, never inferred from substrings of a model id. Family modules are
imported lazily so that serving one family does not import another's dependencies.
"""

from __future__ import annotations

import importlib
import inspect

from omnistep.core import InvalidRequestError, ModelCard

FAMILIES: dict[str, str] = {
    "toy": "omnistep.models.toy.card",
    "piper": "omnistep.models.piper.card",
    "chattts": "omnistep.models.chattts.card",
    "qwen2_5_omni": "omnistep.models.qwen2_5_omni.card",
}
"""Family name -> module that defines ``build_card(path: str | None) -> ModelCard``."""


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
        CardValidationError: the family built an inconsistent card.
    """
    family, path = parse_model_spec(spec)
    if family not in FAMILIES:
        raise InvalidRequestError(
            f"unknown model family '{family}'; known: {', '.join(sorted(FAMILIES))}", param="model"
        )
    module = importlib.import_module(FAMILIES[family])
    params = inspect.signature(module.build_card).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    accepted = {k: v for k, v in options.items() if v is not None and (takes_any or k in params)}
    return module.build_card(path, **accepted).validate()


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
