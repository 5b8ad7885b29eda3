"""Resident memory (RSS) of the serving process after it loads a card, in process or with the
Ray executor (where the components run in actors and the serving process is the Ray driver).

    .venv/bin/python bench/driver_memory.py --model piper --executor ray
    .venv/bin/python bench/driver_memory.py --model chattts=tiny --executor inprocess

``chattts=tiny`` writes the tiny test checkpoint (``tests/chattts_ref``) to a temporary folder
first. The script imports torch, the card's family and (for ``ray``) starts a local Ray before
its first reading, so the readings differ by what loading the card adds: ``base`` (before
``load_engine``), ``loaded`` (after it), ``served`` (after one short request) and ``peak`` (the
process's high-water mark, ``VmHWM``), in MiB from ``/proc/self/status`` (Linux only). Prints
one JSON line. Measure one configuration per process: freed memory is not always returned to
the system, so a second load in the same process would read low.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import sys
import tempfile
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # for tests.chattts_ref


def status_mib(field: str) -> float:
    """A ``kB`` line of ``/proc/self/status`` (``VmRSS``, ``VmHWM``) in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


def model_spec(spec: str, tmp: Path) -> str:
    """``spec``, with ``chattts=tiny`` replaced by a freshly written tiny checkpoint."""
    if spec != "chattts=tiny":
        return spec
    from omnistep.models.chattts.tiny import write_tiny_chattts

    return f"chattts={write_tiny_chattts(tmp / 'chattts')}"


def one_request(card_id: str):
    """A short speech request for ``card_id`` (seeded)."""
    from omnistep.core import Request, SamplingParams

    return Request(card_id, text="Hello there.", seed=1, sampling=SamplingParams(max_new_tokens=24))


async def measure(spec: str, executor: str, options: dict[str, object]) -> dict[str, object]:
    """Load ``spec`` with ``executor``, run one request; the RSS readings (see module doc)."""
    import torch  # noqa: F401 - counted in the base reading

    from omnistep.cli import load_engine
    from omnistep.models.registry import FAMILIES, parse_model_spec
    from omnistep.parity import collect

    importlib.import_module(FAMILIES[parse_model_spec(spec)[0]])
    if executor == "ray":
        import ray

        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    readings: dict[str, object] = {"model": spec.split("=")[0], "executor": executor}
    readings["base"] = status_mib("VmRSS")
    engine = load_engine([spec], "cpu", 8, executor=executor, **options)
    try:
        readings["loaded"] = status_mib("VmRSS")
        card_id = next(iter(engine.models))
        result = await collect(engine, one_request(card_id))
        readings["served"] = status_mib("VmRSS")
        readings["audio_samples"] = int(result.audio.size)
    finally:
        await engine.shutdown()
    readings["peak"] = status_mib("VmHWM")
    return {k: round(v, 1) if isinstance(v, float) else v for k, v in readings.items()}


def main(argv: list[str] | None = None) -> None:
    """Parse the arguments, measure, print one JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="family[=path], or chattts=tiny")
    parser.add_argument("--executor", choices=("inprocess", "ray"), default="ray")
    parser.add_argument("--kv-cache-gb", type=float, default=None, help="card option")
    args = parser.parse_args(argv)
    options = {"kv_cache_gb": args.kv_cache_gb}
    with tempfile.TemporaryDirectory() as tmp:
        spec = model_spec(args.model, Path(tmp))
        print(json.dumps(asyncio.run(measure(spec, args.executor, options))))


if __name__ == "__main__":
    main()
