"""Build an engine from ``FAMILY[=PATH]`` specs: what ``omnistep serve`` and the offline Python
API (``omnistep.offline``) both start from.

A product-plane module: imports engine, core and the model registry (to build cards).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable

from omnistep.core import ModelCard, ModelInstance, OmnistepError
from omnistep.engine import AsyncEngine, EngineConfig
from omnistep.models.registry import (
    build_card,
    distinct_names,
    parse_model_spec,
    resolve_model_spec,
)
from omnistep.runners.locate import is_hub_id

log = logging.getLogger("omnistep.launch")

LOAD_HEARTBEAT_S = 10.0
"""Seconds between the "still loading" lines of a long load."""


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
    progress: Callable[[str], None] | None = None,
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

    Loading is logged (``loading FAMILY from PATH``, then one line per component and a
    ``still loading`` line every ``LOAD_HEARTBEAT_S`` seconds); ``progress`` also gets each
    line (what a server's ``/health`` shows while it loads).

    Raises:
        OmnistepError: ``deploy`` without the ray executor, a bad deploy file, ray missing,
            not one served name per spec, or two models answering to one name.
    """
    check_executor(executor, deploy)
    settings: dict[str, object] = {
        "max_queued": max_queued,
        "scheduling": scheduling,
        "admission_max_wait_s": admission_max_wait,
    }
    runner = None
    with LoadProgress(progress) as report:
        given, specs = specs, [resolve_model_spec(spec) for spec in specs]
        cards = build_cards(specs, served_names, given=given, **options)
        if executor == "ray":
            for spec in specs:
                report.show(f"loading {describe_spec(spec)} (in Ray actors)")
            runner = ray_executor(specs, cards, device, deploy, ray_address, options)
            models = [runner.instance(card, device) for card in cards]
        else:
            models = [
                load_instance(card, device, describe_spec(spec), report)
                for spec, card in zip(specs, cards, strict=True)
            ]
    if executor == "ray":
        slots = sum(
            runner.capacity(m.card.card_id, c.name, c.max_concurrency)
            for m in models
            for c in m.card.components
        )
        settings["num_workers"] = max(slots, EngineConfig().num_workers)
    settings = {k: v for k, v in settings.items() if v is not None}
    config = EngineConfig(
        max_batch_size=max_batch_size, request_timeout=request_timeout, **settings
    )
    return AsyncEngine(models, config, executor=runner)


def check_executor(executor: str, deploy: str | None) -> None:
    """Raises ``OmnistepError`` for an unknown executor or ``deploy`` without ray."""
    if executor not in EXECUTORS:
        raise OmnistepError(f"unknown executor '{executor}'; choose one of {', '.join(EXECUTORS)}")
    if deploy is not None and executor != "ray":
        raise OmnistepError("--deploy needs --executor ray")


def build_cards(
    specs: list[str],
    served_names: list[str] | None = None,
    given: list[str] | None = None,
    **options: object,
) -> list[ModelCard]:
    """Build and validate the card of each spec (quick: files are checked, no weights are
    read), under its served name (see ``load_engine``). ``given``: the specs as the user gave
    them (before ``resolve_model_spec``), so a model given by a hub id answers to it.

    Raises:
        OmnistepError: not one served name per spec, two models answering to one name, or
            what ``build_card`` raises (unknown family, missing files).
    """
    if served_names and len(served_names) != len(specs):
        raise OmnistepError(
            f"--served-model-name was given {len(served_names)} time(s) for {len(specs)} "
            "--model; give one name per --model, in the same order"
        )
    names = served_names or [None] * len(specs)
    cards = [
        _hub_alias(build_card(spec, served_name=name, **options), model, name)
        for spec, model, name in zip(specs, given or specs, names, strict=True)
    ]
    return distinct_names(specs, cards)


def _hub_alias(card: ModelCard, model: str, served_name: str | None) -> ModelCard:
    """``card``, answering also to ``model`` when that is the Hugging Face id it was loaded by
    (vLLM serves a model under the name given to ``--model``); ``--served-model-name``
    replaces every such name."""
    if served_name is not None or not is_hub_id(model) or model in card.model_ids:
        return card
    return dataclasses.replace(card, aliases=(*card.aliases, model))


def describe_spec(spec: str) -> str:
    """``FAMILY from PATH`` (``FAMILY`` for a spec without a path), for the log."""
    family, path = parse_model_spec(spec)
    return f"{family} from {path}" if path else family


def load_instance(
    card: ModelCard, device: str, what: str, report: LoadProgress | None = None
) -> ModelInstance:
    """``ModelInstance.load``, reported as ``loading WHAT``, then component by component as
    ``loading WHAT: COMPONENT (i/n)``.

    Raises:
        CardValidationError: see ``ModelCard.validate``; whatever a component's builder raises.
    """
    card.validate()
    if report is not None:
        report.show(f"loading {what}")
    components = {}
    total = len(card.components)
    for i, spec in enumerate(card.components, 1):
        if report is not None:
            report.show(f"loading {what}: {spec.name} ({i}/{total})")
        components[spec.name] = spec.build(device)
    return ModelInstance.assemble(card, components, device=device)


class LoadProgress:
    """Reports a load: ``show(line)`` logs the line (INFO) and passes it to ``sink``; while
    the context is open, a ``still loading`` line (the last one shown and the seconds since
    the load began) is logged every ``interval`` seconds, so a long load never looks like a
    hang.

    Args:
        sink: gets every line (e.g. a server's loading status); None: the log only.
        interval: seconds between heartbeat lines (default ``LOAD_HEARTBEAT_S``).
    """

    def __init__(
        self, sink: Callable[[str], None] | None = None, interval: float | None = None
    ) -> None:
        self.sink = sink
        self.interval = LOAD_HEARTBEAT_S if interval is None else interval
        self.line = ""
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="omnistep-load", daemon=True)

    def __enter__(self) -> LoadProgress:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def show(self, line: str) -> None:
        """Log ``line`` and pass it to the sink."""
        self.line = line
        log.info("%s", line)
        if self.sink is not None:
            self.sink(line)

    def _beat(self) -> None:
        while not self._stop.wait(self.interval):
            if self.line:
                elapsed = time.monotonic() - self.started
                log.info("still %s (%.0f s)", self.line, elapsed)


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

    from omnistep.engine.deploy import (
        ComponentDeployment,
        load_deploy,
        parse_deploy,
        parse_recovery,
    )
    from omnistep.engine.ray_executor import RayExecutor
    from omnistep.models.registry import build_component

    served = {c.card_id: (c.family, [comp.name for comp in c.components]) for c in cards}
    data = load_deploy(deploy) if deploy else None
    placements = parse_deploy(data, served)
    recovery = parse_recovery(data)
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
    return RayExecutor(deployments, init_options=init, recovery=recovery)
