"""Command line: ``omnistep serve`` (the HTTP server), ``omnistep say`` (text to a file) and
``omnistep bench`` (load-test a running server).

A product-plane module: imports engine, audio, core and the model registry (to build cards).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import secrets
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from omnistep.audio import FORMATS, make_encoder
from omnistep.core import ModelCard, ModelInstance, OmnistepError, Request
from omnistep.core.request import MAX_SEED
from omnistep.engine import AsyncEngine, EngineConfig
from omnistep.engine.config import SCHEDULING_POLICIES
from omnistep.models.registry import FAMILIES, build_card, distinct_names

if TYPE_CHECKING:
    from omnistep.server import ServerConfig

log = logging.getLogger("omnistep")

API_KEY_ENV = "OMNISTEP_API_KEY"
"""Environment variable read for the API key when ``--api-key`` is not given."""


def load_engine(
    specs: list[str],
    device: str,
    max_batch_size: int,
    max_queued: int | None = None,
    scheduling: str | None = None,
    request_timeout: float | None = None,
    executor: str = "inprocess",
    deploy: str | None = None,
    ray_address: str | None = None,
    served_names: list[str] | None = None,
    **options: object,
) -> AsyncEngine:
    """Build, validate and load each ``family[=path]`` card and wrap them in an engine.

    ``served_names``: the public name of each model (``--served-model-name``), one per spec in
    the same order (see ``registry.public_names``); None: card ids, with the family names as
    aliases.

    ``max_queued`` bounds the unfinished requests (more get HTTP 429; None: the engine's
    default); ``scheduling`` is ``"edf"`` or ``"fcfs"`` (None: the engine's default, EDF);
    ``request_timeout`` aborts requests running longer (seconds; None: no limit).
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
    settings: dict[str, object] = {"max_queued": max_queued, "scheduling": scheduling}
    runner = None
    names = served_names or [None] * len(specs)
    cards = [
        build_card(spec, served_name=name, **options)
        for spec, name in zip(specs, names, strict=True)
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


def server_config(args: argparse.Namespace) -> ServerConfig:
    """The ServerConfig of ``omnistep serve ARGS``.

    The API key is ``--api-key``, else ``$OMNISTEP_API_KEY`` (an empty variable means no key).

    Raises:
        OmnistepError: the key is empty, or not printable ASCII without spaces.
    """
    from omnistep.server import ServerConfig

    key = args.api_key if args.api_key is not None else (os.environ.get(API_KEY_ENV) or None)
    try:
        return ServerConfig(
            host=args.host,
            port=args.port,
            api_key=key.strip() if key is not None else None,
            cors_origins=tuple(args.cors_origin or ()),
            shutdown_grace=args.shutdown_grace,
            voices_db=args.voices_db,
        )
    except ValueError as exc:
        raise OmnistepError(f"bad server settings: {exc}") from None


def _usage_banner(host: str, port: int, engine: AsyncEngine, api_key: bool = False) -> str:
    model = next(iter(engine.models.values())).card.card_id
    base = f"http://{host}:{port}"
    auth = f'-H "Authorization: Bearer ${API_KEY_ENV}" ' if api_key else ""
    return (
        f"omnistep is serving {', '.join(engine.models)} on {base}\n"
        f"  curl {base}/v1/audio/speech {auth}-H 'Content-Type: application/json' \\\n"
        f'    -d \'{{"model": "{model}", "input": "Hello from omnistep.", '
        f'"voice": "alloy"}}\' -o hello.mp3\n'
        f"  models: {base}/v1/models   health: {base}/health   docs: {base}/docs"
    )


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT; a SIGTERM drains in-flight requests, then exits 0."""
    from omnistep.server import build_app
    from omnistep.server.lifecycle import serve

    config = server_config(args)
    engine = load_engine(
        args.model or ["piper"],
        args.device,
        args.max_batch_size,
        max_queued=args.max_queued,
        scheduling=args.scheduling,
        request_timeout=args.request_timeout,
        kv_cache_gb=args.kv_cache_gb,
        batch_invariant=args.batch_invariant or None,
        first_chunk_chars=args.first_chunk_chars,
        executor=args.executor,
        deploy=args.deploy,
        ray_address=args.ray_address,
        served_names=args.served_model_name,
    )
    print(_usage_banner(config.host, config.port, engine, config.api_key is not None), flush=True)
    app = build_app(engine, config)
    serve(
        app,
        app.state.drain,
        shutdown_grace=config.shutdown_grace,
        host=config.host,
        port=config.port,
        log_level=args.log_level,
    )
    return 0


async def synthesize_to_bytes(engine: AsyncEngine, request: Request, fmt: str) -> bytes:
    """Run ``request`` and encode all of its audio as one ``fmt`` file."""
    model = engine.resolve(request.model)
    encoder = make_encoder(fmt, model.card.sample_rate)
    parts = []
    try:
        async for chunk in engine.generate(request):
            if chunk.audio is not None:
                parts.append(encoder.encode(chunk.audio))
        parts.append(encoder.flush())
    finally:
        await engine.shutdown()
    return encoder.with_lengths(b"".join(parts))


def cmd_say(args: argparse.Namespace) -> int:
    """Synthesize TEXT, or the whole ``--file``, into one audio file."""
    out = Path(args.output)
    fmt = args.format or out.suffix.lstrip(".").lower() or "wav"
    if fmt not in FORMATS:
        raise OmnistepError(f"unknown format '{fmt}'; choose one of {', '.join(FORMATS)}")
    if (args.text is None) == (args.file is None):
        raise OmnistepError("give either TEXT or --file FILE")
    spec = args.model or "piper"
    if args.file is not None:
        return _say_file(args, out, fmt, spec)
    engine = load_engine([spec], args.device, 1)
    model_id = next(iter(engine.models))
    request = Request(model_id, text=args.text, voice=args.voice, speed=args.speed, seed=args.seed)
    data = asyncio.run(synthesize_to_bytes(engine, request, fmt))
    out.write_bytes(data)
    print(f"wrote {out} ({len(data)} bytes, {fmt}, seed {request.seed})")
    return 0


def _say_file(args: argparse.Namespace, out: Path, fmt: str, spec: str) -> int:
    """``say --file``: every sentence of the file, in order, into one ``fmt`` file."""
    from omnistep import longform

    pieces = longform.text_pieces(longform.read_text(args.file))
    if not pieces:
        raise OmnistepError(f"{args.file} has nothing to speak (no letter or digit)")
    if not out.parent.is_dir():
        raise OmnistepError(f"cannot write {out}: no such directory {out.parent}")
    seed = args.seed if args.seed is not None else secrets.randbelow(MAX_SEED + 1)
    Request("check", speed=args.speed, seed=seed)  # bad speed or seed: fail before loading
    engine = load_engine([spec], args.device, longform.WINDOW)
    model_id = next(iter(engine.models))
    progress = longform.ProgressBar(len(pieces), enabled=False if args.no_progress else None)
    try:
        samples = asyncio.run(
            longform.synthesize_file(
                engine,
                model_id,
                pieces,
                out,
                fmt,
                voice=args.voice,
                speed=args.speed,
                seed=seed,
                progress=progress,
            )
        )
    except KeyboardInterrupt:
        print("omnistep: interrupted; nothing written", file=sys.stderr)
        return 130
    size = out.stat().st_size
    print(
        f"wrote {out} ({size} bytes, {fmt}, {len(pieces)} sentences, "
        f"{longform.seconds(samples)} of audio, seed {seed})"
    )
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    """Run the benchmark, print the table, write the JSON and the plot.

    Exit status 1 when any measured request failed, 0 otherwise.
    """
    try:
        from omnistep.bench import client, report
    except ImportError as exc:
        raise OmnistepError(
            f"omnistep bench could not import its client ({exc}): reinstall omnistep"
        ) from None
    if not args.url.startswith(("http://", "https://")):
        raise OmnistepError(f"--url must start with http:// or https://, got {args.url!r}")
    try:
        levels = client.parse_levels(args.concurrency)
    except ValueError as exc:
        raise OmnistepError(f"--concurrency: {exc}") from None
    if args.requests < 1 or args.warmup < 0 or args.timeout <= 0:
        raise OmnistepError("--requests must be >= 1, --warmup >= 0 and --timeout > 0")
    try:
        texts = client.read_texts(args.text_file) if args.text_file else client.DEFAULT_TEXTS
    except (OSError, ValueError) as exc:
        raise OmnistepError(f"--text-file: {exc}") from None
    out = Path(args.out)
    plot = Path(args.plot) if args.plot else out.with_suffix(".png")

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one progress line per request is enough

    print(
        f"benchmarking {args.url} model {args.model}: concurrency {levels}, "
        f"{args.requests} requests per level, {len(texts)} texts",
        file=sys.stderr,
        flush=True,
    )
    result = client.run_bench(
        args.url,
        args.model,
        levels,
        args.requests,
        texts=texts,
        voice=args.voice,
        response_format=args.format,
        seed=args.seed,
        timeout_s=args.timeout,
        warmup=args.warmup,
        progress=progress,
    )
    print(report.format_table(result))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(client.dumps(result))
    print(f"wrote {out}")
    try:
        print(f"wrote {report.write_plot(result, plot)}")
    except ImportError:
        print("no plot: matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
    return 1 if any(level["errors"] for level in result["levels"]) else 0


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _seconds(text: str, allow_zero: bool = False) -> float:
    value = float(text)
    low_ok = value >= 0 if allow_zero else value > 0
    if not low_ok or value == float("inf"):
        bound = ">= 0" if allow_zero else "> 0"
        raise argparse.ArgumentTypeError(f"must be finite seconds {bound}, got {text}")
    return value


def _seconds_or_zero(text: str) -> float:
    return _seconds(text, allow_zero=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omnistep", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    families = ", ".join(sorted(FAMILIES))

    serve = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    serve.add_argument("--host", default="127.0.0.1", help="interface to bind (default loopback)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument(
        "--model",
        action="append",
        help=f"family[=weights dir], repeatable; families: {families} "
        "(default: piper, the embedded voice)",
    )
    serve.add_argument(
        "--served-model-name",
        action="append",
        metavar="NAME",
        help="the public name of a model (vLLM's flag): requests, /v1/models, saved voices and "
        "metrics use NAME instead of the card id and family name (the card's OpenAI aliases, "
        "like tts-1, stay); repeatable: one per --model, in the same order",
    )
    serve.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N")
    serve.add_argument("--max-batch-size", type=_positive_int, default=64)
    serve.add_argument(
        "--scheduling",
        choices=SCHEDULING_POLICIES,
        default=EngineConfig().scheduling,
        help="edf: earliest playback deadline first, new requests' first audio ahead of "
        "buffered streams, admission held while streams run low; fcfs: in arrival order "
        "(default edf)",
    )
    serve.add_argument(
        "--max-queued",
        type=_positive_int,
        default=EngineConfig().max_queued,
        help="unfinished requests the engine admits; more get HTTP 429 with Retry-After "
        f"(default {EngineConfig().max_queued})",
    )
    serve.add_argument(
        "--request-timeout",
        type=_seconds,
        metavar="SECONDS",
        help="abort requests still running after SECONDS: 504 (or an error event / a cut "
        "stream once audio has been sent); default: no limit",
    )
    serve.add_argument(
        "--shutdown-grace",
        type=_seconds_or_zero,
        default=30.0,
        metavar="SECONDS",
        help="on SIGTERM, refuse new requests (503) and give in-flight ones SECONDS to finish "
        "before exiting (default 30)",
    )
    serve.add_argument(
        "--api-key",
        help=f"require 'Authorization: Bearer KEY' on every route but /health and the docs "
        f"(default: ${API_KEY_ENV}; unset: no key)",
    )
    serve.add_argument(
        "--cors-origin",
        action="append",
        metavar="ORIGIN",
        help="allow browser requests from ORIGIN (repeatable; '*' for any); default: CORS off",
    )
    serve.add_argument(
        "--voices-db",
        metavar="PATH",
        help="SQLite file of saved voices (/v1/audio/voices), created on the first save "
        "(default: $XDG_DATA_HOME/omnistep/voices.db, else ~/.local/share/omnistep/voices.db)",
    )
    serve.add_argument(
        "--first-chunk-chars",
        type=int,
        help="piper: cut the first sentence at a clause within this many characters, so audio "
        "starts sooner (default 80; 0 keeps it whole)",
    )
    serve.add_argument(
        "--kv-cache-gb",
        type=float,
        help="memory for each AR model's paged KV cache, GiB (chattts: 2)",
    )
    serve.add_argument(
        "--batch-invariant",
        action="store_true",
        help="bit-identical outputs whatever the batch (slower; AR models)",
    )
    serve.add_argument(
        "--executor",
        choices=EXECUTORS,
        default="inprocess",
        help="inprocess: worker threads (default); ray: each component of each card in Ray "
        "actors (every family; outputs identical to inprocess)",
    )
    serve.add_argument(
        "--deploy",
        metavar="FILE",
        help="with --executor ray: YAML placing components (num_cpus, num_gpus, resources, "
        "replicas, device per component); default 1 replica, 1 CPU each",
    )
    serve.add_argument(
        "--ray-address",
        metavar="ADDR",
        help="with --executor ray: the Ray cluster to join (default: a running local cluster, "
        "else a new one)",
    )
    serve.add_argument("--log-level", default="info")
    serve.set_defaults(func=cmd_serve)

    say = sub.add_parser("say", help="synthesize TEXT, or a text file, into one audio file")
    say.add_argument("text", nargs="?", help="the text (or use --file)")
    say.add_argument(
        "--file",
        metavar="FILE",
        help="speak this UTF-8 text file ('-': stdin) sentence by sentence into one file",
    )
    say.add_argument("-o", "--output", required=True, help="output file; format from extension")
    say.add_argument("--model", help=f"family[=weights dir] (default piper); families: {families}")
    say.add_argument("--voice")
    say.add_argument("--format", choices=FORMATS)
    say.add_argument("--speed", type=float, default=1.0)
    say.add_argument("--seed", type=int, help="with --file, sentence k gets SEED+k")
    say.add_argument("--device", default="cpu")
    say.add_argument(
        "--no-progress",
        action="store_true",
        help="--file: no progress bar (it is shown only when stderr is a terminal)",
    )
    say.set_defaults(func=cmd_say)

    bench = sub.add_parser(
        "bench",
        help="load-test a running server: TTFA, e2e, RTF, underruns, throughput per concurrency",
    )
    bench.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    bench.add_argument("--model", default="tts-1", help="the request's model field")
    bench.add_argument(
        "--concurrency",
        default="1,4,8,16",
        help="comma-separated levels: requests kept in flight (default 1,4,8,16)",
    )
    bench.add_argument("--requests", type=int, default=16, help="requests per level (default 16)")
    bench.add_argument(
        "--text-file", help="texts to speak, one per line (default: built-in sentences)"
    )
    bench.add_argument("--voice", help="the request's voice field (default: the server's)")
    bench.add_argument("--format", default="pcm", choices=["pcm"], help="response_format")
    bench.add_argument(
        "--seed", type=int, help="request k of each level gets seed SEED+k (default: none sent)"
    )
    bench.add_argument(
        "--out", default="bench-results.json", help="JSON results (default bench-results.json)"
    )
    bench.add_argument("--plot", help="PNG plot (default: the --out path with .png)")
    bench.add_argument(
        "--timeout", type=float, default=300.0, help="seconds to connect and per body read"
    )
    bench.add_argument(
        "--warmup", type=int, default=1, help="unmeasured requests first (default 1)"
    )
    bench.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``omnistep`` command. Exit status 2 on bad input."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except OmnistepError as exc:
        print(f"omnistep: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
