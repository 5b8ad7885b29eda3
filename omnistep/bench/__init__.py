"""``omnistep bench``: load-test a running speech server (TTFA, e2e, RTF, underruns, throughput).

``client`` sends the requests and holds the statistics; ``report`` prints the table and draws the
plot. Neither imports the engine: the client measures any OpenAI-compatible speech endpoint.
"""

from omnistep.bench.client import (
    DEFAULT_TEXTS,
    Playback,
    RequestResult,
    WarmupFailedError,
    percentile,
    quantiles,
    run_bench,
    simulate_playback,
    summarize_level,
)
from omnistep.bench.report import format_table, write_plot

__all__ = [
    "DEFAULT_TEXTS",
    "Playback",
    "RequestResult",
    "WarmupFailedError",
    "format_table",
    "percentile",
    "quantiles",
    "run_bench",
    "simulate_playback",
    "summarize_level",
    "write_plot",
]
