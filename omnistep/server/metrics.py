"""``GET /metrics``: the engine's counters, histograms and gauges in Prometheus text format.

Every app gets its own ``CollectorRegistry`` (``metrics_registry``), never prometheus_client's
global one, so several engines or apps in one process do not clash. Nothing is updated on the
request path here: ``EngineCollector`` reads, at scrape time, the counts the engine keeps
(``AsyncEngine.metrics``, plain integers updated where events happen) and what it holds
(``AsyncEngine.occupancy()``), on the event loop thread that also runs the engine.

Like vLLM, the endpoint needs no API key (see ``auth.OPEN_PATHS``): the numbers carry no
request content, and Prometheus scrapers are commonly configured without credentials. Keep the
port off the public internet, or put a proxy with auth in front of it, if the counts of
requests by model must not be seen.

Metrics (labels in braces; ``model`` is the card id, e.g. ``piper``, never an alias):

- ``omnistep_requests_total{model, status}`` counter; status ``ok``, ``error``, ``aborted``,
  ``timeout``, ``rejected`` (429: the engine was full). Input errors (400, 404) are not counted.
- ``omnistep_time_to_first_audio_seconds{model}`` histogram: from the engine receiving the
  request (the wait for admission included) to its first audio chunk.
- ``omnistep_real_time_factor{model}`` histogram: wall seconds / audio seconds of requests that
  finished ok with audio (below 1: faster than real time).
- ``omnistep_live_requests{model}``, ``omnistep_waiting_requests{model}`` (of those, waiting
  for admission), ``omnistep_queued_units``, ``omnistep_running_batches{model, component}``,
  ``omnistep_live_loops{model, kind}`` gauges.
- ``omnistep_work_units_total{model, component, kind}`` counter (use ``rate()`` for units/s).
- ``omnistep_batch_size{model, component}`` histogram: WorkUnits per executed batch.
- ``omnistep_kv_blocks_used{model, component}``, ``omnistep_kv_blocks_free{model, component}``
  gauges, for components with a paged KV cache.
- With the Ray executor: ``omnistep_actor_deaths_total{model, component}`` and
  ``omnistep_actor_restarts_total{model, component}`` counters (actors that died; replacements
  that came up and serve), ``omnistep_replicas_live{model, component}`` gauge.
- prometheus_client's ``process_*``, ``python_info`` and ``python_gc_*`` metrics.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

from fastapi import APIRouter
from fastapi import Request as HttpRequest
from fastapi.responses import Response
from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from omnistep.engine import AsyncEngine
from omnistep.engine.metrics import REQUEST_STATUSES, Histogram, batch_histogram

router = APIRouter()


def _histogram(family: HistogramMetricFamily, labels: list[str], hist: Histogram) -> None:
    buckets = [(floatToGoString(bound), count) for bound, count in hist.cumulative()]
    family.add_metric(labels, buckets, hist.sum)


class EngineCollector(Collector):
    """The engine's metrics (see module docstring), computed when the registry is scraped."""

    def __init__(self, engine: AsyncEngine):
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        """Yield every metric family of the engine; gauges list every label with 0 when idle."""
        metrics = self.engine.metrics
        models = list(self.engine.models)

        requests = CounterMetricFamily(
            "omnistep_requests", "Requests by how they ended.", labels=["model", "status"]
        )
        for model in models:
            for status in REQUEST_STATUSES:
                requests.add_metric([model, status], metrics.requests[(model, status)])
        yield requests

        ttfa = HistogramMetricFamily(
            "omnistep_time_to_first_audio_seconds",
            "Seconds from receiving a request to its first audio chunk.",
            labels=["model"],
        )
        rtf = HistogramMetricFamily(
            "omnistep_real_time_factor",
            "Wall seconds per audio second of requests that finished ok with audio.",
            labels=["model"],
        )
        for model in models:
            _histogram(ttfa, [model], metrics.ttfa[model])
            _histogram(rtf, [model], metrics.rtf[model])
        yield ttfa
        yield rtf

        yield from self._gauges()

        units = CounterMetricFamily(
            "omnistep_work_units",
            "WorkUnits executed.",
            labels=["model", "component", "kind"],
        )
        for (model, component, kind), count in sorted(metrics.work_units().items()):
            units.add_metric([model, component, str(kind)], count)
        yield units

        batches = HistogramMetricFamily(
            "omnistep_batch_size",
            "WorkUnits per executed batch.",
            labels=["model", "component"],
        )
        sizes = metrics.batch_sizes()
        for model, instance in self.engine.models.items():
            for component in instance.components:
                _histogram(
                    batches,
                    [model, component],
                    batch_histogram(sizes.get((model, component), Counter())),
                )
        yield batches
        yield from self._replicas()

    def _replicas(self) -> Iterator[Metric]:
        health = self.engine.component_health()
        if not health:
            return
        deaths = CounterMetricFamily(
            "omnistep_actor_deaths", "Component actors that died.", labels=["model", "component"]
        )
        restarts = CounterMetricFamily(
            "omnistep_actor_restarts",
            "Actors that replaced a dead one and serve.",
            labels=["model", "component"],
        )
        live = GaugeMetricFamily(
            "omnistep_replicas_live", "Component replicas serving.", labels=["model", "component"]
        )
        for h in health:
            deaths.add_metric([h.model, h.component], h.deaths)
            restarts.add_metric([h.model, h.component], h.restarts)
            live.add_metric([h.model, h.component], h.live)
        yield deaths
        yield restarts
        yield live

    def _gauges(self) -> Iterator[Metric]:
        now = self.engine.occupancy()
        live = GaugeMetricFamily("omnistep_live_requests", "Unfinished requests.", labels=["model"])
        waiting = GaugeMetricFamily(
            "omnistep_waiting_requests",
            "Unfinished requests waiting for admission.",
            labels=["model"],
        )
        for model, count in now.live_requests.items():
            live.add_metric([model], count)
            waiting.add_metric([model], now.waiting_requests[model])
        yield live
        yield waiting
        yield GaugeMetricFamily(
            "omnistep_queued_units",
            "WorkUnits ready and queued in the scheduler.",
            now.queued_units,
        )
        running = GaugeMetricFamily(
            "omnistep_running_batches", "Batches being executed.", labels=["model", "component"]
        )
        for (model, component), count in now.running_batches.items():
            running.add_metric([model, component], count)
        yield running
        loops = GaugeMetricFamily(
            "omnistep_live_loops", "Live loops of unfinished requests.", labels=["model", "kind"]
        )
        for (model, kind), count in now.live_loops.items():
            loops.add_metric([model, kind], count)
        yield loops
        used = GaugeMetricFamily(
            "omnistep_kv_blocks_used", "KV cache blocks in use.", labels=["model", "component"]
        )
        free = GaugeMetricFamily(
            "omnistep_kv_blocks_free", "Free KV cache blocks.", labels=["model", "component"]
        )
        for (model, component), (num_used, num_free) in now.kv_blocks.items():
            used.add_metric([model, component], num_used)
            free.add_metric([model, component], num_free)
        yield used
        yield free


def metrics_registry(engine: AsyncEngine) -> CollectorRegistry:
    """A new registry with ``engine``'s metrics and the process, platform and GC metrics."""
    registry = CollectorRegistry()
    registry.register(EngineCollector(engine))
    for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
        registry.register(collector)
    return registry


@router.get("/metrics", include_in_schema=False)
async def prometheus_metrics(http: HttpRequest) -> Response:
    """The app's registry (``app.state.metrics``) in the format the scraper accepts (Prometheus
    text, or OpenMetrics when asked for). ``async``: it reads engine state on the event loop."""
    registry: CollectorRegistry = http.app.state.metrics
    encoder, content_type = choose_encoder(http.headers.get("accept", ""))
    return Response(encoder(registry), media_type=content_type)
