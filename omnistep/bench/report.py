"""Reports of a ``run_bench`` result: a text table and a PNG plot (matplotlib, imported lazily)."""

from __future__ import annotations

import math
from pathlib import Path


def _num(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def format_table(result: dict) -> str:
    """One row per concurrency level: requests, errors, TTFA/e2e/RTF p50/p90/p99, underruns and
    audio-seconds per wall-second. Times in seconds; percentiles over successful requests."""
    head = (
        f"{'C':>4} {'reqs':>5} {'err':>4} | {'TTFA p50':>8} {'p90':>7} {'p99':>7} | "
        f"{'e2e p50':>8} {'p90':>7} {'p99':>7} | {'RTF p50':>7} {'p90':>6} {'p99':>6} | "
        f"{'underruns':>9} {'(s)':>7} | {'audio-s/s':>9}"
    )
    lines = [head, "-" * len(head)]
    for lv in result["levels"]:
        t, e, r = lv["ttfa_s"], lv["e2e_s"], lv["rtf"]
        lines.append(
            f"{lv['concurrency']:>4} {lv['requests']:>5} {lv['errors']:>4} | "
            f"{_num(t['p50']):>8} {_num(t['p90']):>7} {_num(t['p99']):>7} | "
            f"{_num(e['p50']):>8} {_num(e['p90']):>7} {_num(e['p99']):>7} | "
            f"{_num(r['p50']):>7} {_num(r['p90']):>6} {_num(r['p99']):>6} | "
            f"{lv['underruns']:>9} {_num(lv['underrun_s'], '.2f'):>7} | "
            f"{_num(lv['audio_s_per_s'], '.2f'):>9}"
        )
    lines += [
        "seconds, over successful requests. TTFA: send to first audio bytes; e2e: send to last "
        "byte; RTF: e2e / audio seconds;",
        "underruns: stalls of a real-time player started at the first chunk (count, total "
        "seconds); audio-s/s: audio seconds / level wall time.",
    ]
    for lv in result["levels"]:
        for message, count in lv["error_messages"].items():
            lines.append(f"C={lv['concurrency']}: {count} x {message}")
    return "\n".join(lines)


def write_plot(result: dict, path: str | Path) -> Path:
    """Plot TTFA p50/p99 (seconds) and throughput (audio-s/s) against concurrency into a PNG.

    Levels without a successful request are left out of the TTFA lines; levels with failed
    requests are marked with their error count. Needs matplotlib
    (imported here only, so the server never needs it); raises ImportError without it.
    """
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global state

    levels = result["levels"]
    cs = [lv["concurrency"] for lv in levels]

    def series(key: str, q: str) -> list[float]:
        return [float("nan") if lv[key][q] is None else lv[key][q] for lv in levels]

    throughput = [float("nan") if v is None else v for v in (lv["audio_s_per_s"] for lv in levels)]
    fig = Figure(figsize=(10, 4), layout="constrained")
    ttfa_ax, rate_ax = fig.subplots(1, 2)
    ttfa_ax.plot(cs, series("ttfa_s", "p50"), "o-", label="p50")
    ttfa_ax.plot(cs, series("ttfa_s", "p99"), "s--", label="p99")
    ttfa_ax.set(xlabel="concurrency", ylabel="time to first audio (s)", title="TTFA")
    ttfa_ax.set_ylim(bottom=0)
    ttfa_ax.legend()
    rate_ax.plot(cs, throughput, "o-", color="tab:green")
    rate_ax.set(xlabel="concurrency", ylabel="audio seconds per second", title="Throughput")
    rate_ax.set_ylim(bottom=0)
    for c, rate, lv in zip(cs, throughput, levels, strict=True):
        if lv["errors"]:
            y = 0.0 if math.isnan(rate) else rate
            rate_ax.annotate(
                f"{lv['errors']} err",
                (c, y),
                textcoords="offset points",
                xytext=(0, 6),
                ha="center",
                color="tab:red",
            )
    for ax in (ttfa_ax, rate_ax):
        ax.set_xscale("log", base=2)
        ax.set_xlim(min(cs) / 1.3, max(cs) * 1.3)
        ax.set_xticks(cs, [str(c) for c in cs])
        ax.minorticks_off()
        ax.grid(True, alpha=0.3)
    fig.suptitle(f"{result['model']} at {result['url']}, {result['requests_per_level']} req/level")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return path
