"""Build an engine from ``FAMILY[=PATH]`` specs: what ``omnistep serve`` and the offline Python
API (``omnistep.offline``) both start from.

A product-plane module: imports engine, core and the model registry (to build cards).
"""

from __future__ import annotations

import dataclasses

from omnistep.core import ModelCard, ModelInstance, OmnistepError
from omnistep.engine import AsyncEngine, EngineConfig
from omnistep.models.locate import is_hub_id
from omnistep.models.registry import build_card, distinct_names, resolve_model_spec


def load_engine(
    specs: list[str],
    device: str,
    max_batch_size: int,
    max_queued: int | None = None,
    scheduling: str | None = None,
    request_timeout: float | None = None,
    admission_max_wait: float | None = None,
    executor: str = "inprocess",
    deploy: str | None = None,
    ray_address: str | None = None,
    served_names: list[str] | None = None,
    **options: object,
) -> AsyncEngine:
    """Build, validate and load each ``family[=path]`` card and wrap them in an engine. A spec
    may also be a weights folder or a Hugging Face id (``registry.resolve_model_spec``); a
    model given by its hub id also answers to that id.

    ``served_names``: the public name of each model (``--served-model-name``), one per spec in
    the same order (see ``registry.public_names``); None: card ids, with the family names as
    aliases.

    ``max_queued`` bounds the unfinished requests (more get HTTP 429; None: the engine's
    default); ``scheduling`` is ``"edf"`` or ``"fcfs"`` (None: the engine's default, EDF);
    ``request_timeout`` aborts requests running longer (seconds; None: no limit);
    ``admission_max_wait``: the longest a request waits for admission under EDF (seconds;
    None: the engine's default).
    ``options`` are card options (``kv_cache_gb``, ``batch_invariant``) for families that
    take them.

    ``executor``: ``"inprocess"`` (worker threads) or ``"ray"``: every component runs in Ray
    actors placed as the ``deploy`` file says (see ``omnistep.engine.ray_executor``), on the
    Ray cluster at ``ray_address`` (None: a running local cluster, else a new one). This
    process then builds the cards only, none of their components (no weights, no KV cache):
    each model's ``components`` are ``RemoteComponent`` stand-ins (``RayExecutor.instance``).

    Raises:
        OmnistepError: ``deploy`` without the ray executor, a bad deploy file, ray missing,
            not one served name per spec, or two models answering to one name.
    """
    if served_names and len(served_names) != len(specs):
        raise OmnistepError(
            f"--served-model-name was given {len(served_names)} time(s) for {len(specs)} "
            "--model; give one name per --model, in the same order"
        )
    if executor not in EXECUTORS:
        raise OmnistepError(f"unknown executor '{executor}'; choose one of {', '.join(EXECUTORS)}")
    if deploy is not None and executor != "ray":
        raise OmnistepError("--deploy needs --executor ray")
    settings: dict[str, object] = {
        "max_queued": max_queued,
        "scheduling": scheduling,
        "admission_max_wait_s": admission_max_wait,
    }
    runner = None
    names = served_names or [None] * len(specs)
    given, specs = specs, [resolve_model_spec(spec) for spec in specs]
    cards = [
        _hub_alias(build_card(spec, served_name=name, **options), model, name)
        for spec, model, name in zip(specs, given, names, strict=True)
    ]
    cards = distinct_names(specs, cards)
    if executor == "ray":
        runner = ray_executor(specs, cards, device, deploy, ray_address, options)
        models = [runner.instance(card, device) for card in cards]
        slots = sum(
            runner.capacity(m.card.card_id, c.name, c.max_concurrency)
            for m in models
            for c in m.card.components
        )
        settings["num_workers"] = max(slots, EngineConfig().num_workers)
    else:
        models = [ModelInstance.load(card, device=device) for card in cards]
    settings = {k: v for k, v in settings.items() if v is not None}
    config = EngineConfig(
        max_batch_size=max_batch_size, request_timeout=request_timeout, **settings
    )
    return AsyncEngine(models, config, executor=runner)


def _hub_alias(card: ModelCard, model: str, served_name: str | None) -> ModelCard:
    """``card``, answering also to ``model`` when that is the Hugging Face id it was loaded by
    (vLLM serves a model under the name given to ``--model``); ``--served-model-name``
    replaces every such name."""
    if served_name is not None or not is_hub_id(model) or model in card.model_ids:
        return card
    return dataclasses.replace(card, aliases=(*card.aliases, model))


EXECUTORS = ("inprocess", "ray")
"""Values of ``--executor``."""


def ray_executor(
    specs: list[str],
    cards: list[ModelCard],
    device: str,
    deploy: str | None,
    ray_address: str | None,
    options: dict[str, object],
):
    """A RayExecutor placing every component of ``cards`` (built from ``specs``) as the
    ``deploy`` file says; each actor rebuilds its card from the spec string and builds its one
    component.

    Raises:
        OmnistepError: bad deploy file, ray missing, actors that cannot be placed.
    """
    from functools import partial

    from omnistep.engine.ray_executor import (
        ComponentDeployment,
        RayExecutor,
        load_deploy,
        parse_deploy,
    )
    from omnistep.models.registry import build_component

    served = {c.card_id: (c.family, [comp.name for comp in c.components]) for c in cards}
    placements = parse_deploy(load_deploy(deploy) if deploy else None, served)
    card_options = {k: v for k, v in options.items() if v is not None}
    deployments = [
        ComponentDeployment(
            card.card_id,
            comp.name,
            partial(
                build_component,
                spec,
                comp.name,
                placements[(card.card_id, comp.name)].device or device,
                card_options,
            ),
            placements[(card.card_id, comp.name)],
            max_concurrency=comp.max_concurrency,
        )
        for spec, card in zip(specs, cards, strict=True)
        for comp in card.components
    ]
    init = {"address": ray_address} if ray_address else {}
    return RayExecutor(deployments, init_options=init)
