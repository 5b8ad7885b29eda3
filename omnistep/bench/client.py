"""Load generator for a running speech server: streamed ``POST /v1/audio/speech`` requests.

For each concurrency level C the client sends N requests: C at once, then a new one each time one
finishes, so that C stay in flight until N are done. Every response body is read as it streams
(``response_format: pcm``: raw 24 kHz mono s16le, OpenAI's pcm) and each request records:

- TTFA: seconds from sending the request to the first body bytes carrying audio;
- e2e: seconds from sending to the end of the body;
- audio seconds: samples / 24000;
- RTF: e2e / audio seconds (below 1 is faster than real time);
- the gaps between chunk arrivals, seconds;
- underruns of a simulated real-time player (``simulate_playback``).

Errors (an HTTP status other than 200, a connection or protocol error, an empty body) are counted
per level with their messages; they never stop the run. A failed warm-up request does: it sends
the same request the levels send, so they would fail alike (no server, a wrong model or key).

The pure functions (``simulate_playback``, ``percentile``, ``summarize_level``) hold the arithmetic
and are unit-tested on hand-made timelines; ``run_bench`` does the HTTP. Only httpx, numpy and the
standard library are imported: the client benchmarks any OpenAI-compatible server and does not
import the engine.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import httpx
import numpy as np

PCM_RATE = 24_000
"""Sample rate of ``pcm`` responses in Hz (OpenAI's pcm: 24 kHz mono s16le)."""
PCM_SAMPLE_BYTES = 2
"""Bytes per ``pcm`` sample (16-bit mono)."""
RESPONSE_FORMATS = ("pcm",)
"""Formats the client can measure: it counts samples from raw bytes, so only headerless pcm."""
SPEECH_PATH = "/v1/audio/speech"

DEFAULT_TEXTS: tuple[str, ...] = (
    "Hello! Thanks for calling; how can I help you today?",
    "The quick brown fox jumps over the lazy dog.",
    "Your order number 4127 shipped on Tuesday and should arrive within three business days.",
    "Turn left at the second light, then keep right until you reach the old stone bridge.",
    "Wait, are you sure? I thought the meeting was moved to half past nine.",
    "The lighthouse keeper climbed the narrow stairs every evening to check the lamp, listening "
    "to the waves crash against the rocks far below.",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "Please remember to bring your passport, a pen, and a printed copy of the booking.",
    "It was a bright cold day in April, and the clocks were striking thirteen.",
    "Rain is expected this afternoon, with temperatures falling to around seven degrees tonight.",
)
"""Built-in texts: varied English sentences (short and long, questions, numbers, a list)."""

Progress = Callable[[str], None]


class WarmupFailedError(RuntimeError):
    """A warm-up request failed, so the run stopped before its levels (which would fail alike).

    Attributes:
        url: the server's base URL.
        error: why the first failed warm-up request failed (e.g. ``ConnectError: ...``,
            ``HTTP 404: ...``).
    """

    def __init__(self, url: str, error: str):
        hint = " (is a server running there?)" if error.startswith("ConnectError") else ""
        super().__init__(f"the warm-up request to {url} failed: {error}{hint}")
        self.url = url
        self.error = error


# --------------------------------------------------------------------------- pure functions
@dataclass(frozen=True, slots=True)
class Playback:
    """What a simulated real-time player experienced.

    Attributes:
        underruns: lengths in seconds of the stalls, in order (buffer empty, waiting for audio).
        played_until_s: when playback of the last chunk ends, seconds on the arrivals' clock.
    """

    underruns: tuple[float, ...]
    played_until_s: float

    @property
    def count(self) -> int:
        """Number of underruns."""
        return len(self.underruns)

    @property
    def total_s(self) -> float:
        """Total stall time in seconds."""
        return float(sum(self.underruns))


def simulate_playback(arrivals_s: Sequence[float], durations_s: Sequence[float]) -> Playback:
    """Play chunks in real time as they arrive and record each time the buffer runs dry.

    The player starts when the first chunk with audio arrives and plays without pause while it has
    audio. When its buffer runs dry before the next chunk arrives, that is one underrun, lasting
    until the arrival; playback resumes at once with the arrived chunk. A chunk arriving exactly
    when the buffer runs dry is no underrun. Chunks of zero duration carry no audio and are
    skipped.

    Args:
        arrivals_s: arrival time of each chunk, seconds, non-decreasing (any origin).
        durations_s: audio duration of each chunk, seconds, >= 0.

    Returns:
        The underrun lengths (seconds) and the time (seconds, same clock as ``arrivals_s``) when
        the last audio has played; no underruns and 0.0 when no chunk carries audio.

    Raises:
        ValueError: the sequences differ in length, a duration is negative or arrivals go back.
    """
    if len(arrivals_s) != len(durations_s):
        raise ValueError(f"{len(arrivals_s)} arrivals but {len(durations_s)} durations")
    underruns: list[float] = []
    played_until: float | None = None
    previous = -np.inf
    for arrival, duration in zip(arrivals_s, durations_s, strict=True):
        if duration < 0:
            raise ValueError(f"chunk durations must be >= 0, got {duration}")
        if arrival < previous:
            raise ValueError(f"arrivals must not decrease: {arrival} after {previous}")
        previous = arrival
        if duration == 0:
            continue
        if played_until is None:
            played_until = arrival + duration
        elif arrival > played_until:
            underruns.append(arrival - played_until)
            played_until = arrival + duration
        else:
            played_until += duration
    return Playback(tuple(underruns), 0.0 if played_until is None else played_until)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) with linear interpolation (numpy's default).

    Returns None for no values (so that JSON output never holds NaN).
    """
    if len(values) == 0:
        return None
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def quantiles(values: Sequence[float]) -> dict[str, float | None]:
    """p50, p90 and p99 of ``values`` (see ``percentile``), keyed "p50", "p90", "p99"."""
    return {f"p{q}": percentile(values, q) for q in (50, 90, 99)}


def gaps(arrivals_s: Sequence[float]) -> list[float]:
    """Seconds between consecutive chunk arrivals (one fewer than the arrivals)."""
    return [b - a for a, b in zip(arrivals_s, arrivals_s[1:], strict=False)]


@dataclass
class RequestResult:
    """One streamed request; times in seconds from sending it unless named otherwise.

    Attributes:
        index: position of the request in its level, from 0.
        text_index: which text was spoken (``index`` modulo the number of texts).
        seed: the seed sent, else the one the server reported (``x-omnistep-seed``), else None.
        ok: status 200, a complete body and at least one audio sample.
        status: HTTP status, None when no response came.
        error: why the request failed, None when ``ok``.
        start_s: when it was sent, seconds after its level started.
        ttfa_s: time to the first body bytes carrying audio; None when none came.
        e2e_s: time to the end of the body (or to the failure).
        samples: audio samples received (pcm, 24 kHz).
        audio_s: ``samples / 24000``, seconds.
        rtf: ``e2e_s / audio_s``; None without audio.
        chunks: non-empty body chunks received (as the client's reads returned them).
        gaps_s: seconds between consecutive chunk arrivals.
        underruns_s: lengths of the simulated player's underruns, seconds.
    """

    index: int
    text_index: int
    seed: int | None
    ok: bool = False
    status: int | None = None
    error: str | None = None
    start_s: float = 0.0
    ttfa_s: float | None = None
    e2e_s: float | None = None
    samples: int = 0
    audio_s: float = 0.0
    rtf: float | None = None
    chunks: int = 0
    gaps_s: list[float] = field(default_factory=list)
    underruns_s: list[float] = field(default_factory=list)

    @property
    def underrun_s(self) -> float:
        """Total underrun time, seconds."""
        return float(sum(self.underruns_s))

    def to_json(self) -> dict:
        """The fields as a JSON-ready dict, plus ``underruns`` (count) and ``underrun_s``."""
        return {**asdict(self), "underruns": len(self.underruns_s), "underrun_s": self.underrun_s}


def summarize_level(concurrency: int, results: Sequence[RequestResult], wall_s: float) -> dict:
    """Aggregate one level's requests.

    Percentiles (p50/p90/p99) of TTFA, e2e, RTF and chunk gaps are over successful requests;
    throughput is the audio seconds of successful requests per wall-clock second of the level
    (first send to last byte, ``wall_s``).

    Args:
        concurrency: requests kept in flight.
        results: every request of the level, failed ones included.
        wall_s: seconds from the level's first send to its last completion.

    Returns:
        A JSON-ready dict: ``concurrency``, ``requests``, ``ok``, ``errors``, ``error_messages``
        (message -> count), ``wall_s``, ``audio_s``, ``audio_s_per_s``, ``ttfa_s``, ``e2e_s``,
        ``rtf``, ``gap_s`` (dicts of p50/p90/p99; ``gap_s`` also has ``max``), ``underruns``,
        ``underrun_s`` and ``results`` (per request, see ``RequestResult``).
    """
    good = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    audio = float(sum(r.audio_s for r in good))
    all_gaps = [g for r in good for g in r.gaps_s]
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "ok": len(good),
        "errors": len(failed),
        "error_messages": dict(Counter(r.error or "unknown error" for r in failed)),
        "wall_s": wall_s,
        "audio_s": audio,
        "audio_s_per_s": audio / wall_s if wall_s > 0 else None,
        "ttfa_s": quantiles([r.ttfa_s for r in good if r.ttfa_s is not None]),
        "e2e_s": quantiles([r.e2e_s for r in good if r.e2e_s is not None]),
        "rtf": quantiles([r.rtf for r in good if r.rtf is not None]),
        "gap_s": {**quantiles(all_gaps), "max": max(all_gaps) if all_gaps else None},
        "underruns": sum(len(r.underruns_s) for r in good),
        "underrun_s": float(sum(r.underrun_s for r in good)),
        "results": [r.to_json() for r in results],
    }


def parse_levels(text: str) -> list[int]:
    """Concurrency levels from ``"1,4,8,16"``: sorted, unique, each >= 1.

    Raises:
        ValueError: not a comma-separated list of positive integers.
    """
    try:
        levels = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        levels = []
    if not levels or levels[0] < 1:
        raise ValueError(f"concurrency levels must be integers >= 1, e.g. 1,4,8; got {text!r}")
    return levels


def read_texts(path: str) -> list[str]:
    """One text per non-blank line of the UTF-8 file ``path`` (surrounding spaces stripped).

    Raises:
        OSError: the file cannot be read.
        ValueError: it has no non-blank line.
    """
    with open(path, encoding="utf-8") as f:
        texts = [line.strip() for line in f if line.strip()]
    if not texts:
        raise ValueError(f"{path} has no text (one text per line)")
    return texts


# --------------------------------------------------------------------------- HTTP
def _error_message(response: httpx.Response) -> str:
    """``HTTP <status>: <message>``, the message from OpenAI's error JSON when there is one."""
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.text.strip()[:200] or response.reason_phrase
    return f"HTTP {response.status_code}: {message}"


async def stream_one(
    client: httpx.AsyncClient, url: str, body: dict, result: RequestResult
) -> RequestResult:
    """Send one speech request, read its pcm body as it streams and fill ``result`` in.

    Never raises for a failed request (bad status, connection or protocol error, timeout, empty
    body): ``result.ok`` is False and ``result.error`` says why; e2e is then the time to the
    failure. Cancellation still propagates.
    """
    arrivals: list[float] = []
    durations: list[float] = []
    nbytes = 0
    start = time.perf_counter()
    try:
        async with client.stream("POST", url.rstrip("/") + SPEECH_PATH, json=body) as response:
            result.status = response.status_code
            if response.status_code != 200:
                await response.aread()
                result.error = _error_message(response)
                return result
            header_seed = response.headers.get("x-omnistep-seed")
            if result.seed is None and header_seed and header_seed.isdigit():
                result.seed = int(header_seed)
            async for data in response.aiter_bytes():
                if not data:
                    continue
                now = time.perf_counter() - start
                before = nbytes // PCM_SAMPLE_BYTES
                nbytes += len(data)
                new = nbytes // PCM_SAMPLE_BYTES - before
                if result.ttfa_s is None:
                    result.ttfa_s = now
                arrivals.append(now)
                durations.append(new / PCM_RATE)
        if nbytes < PCM_SAMPLE_BYTES:
            result.error = "the response carried no audio"
        elif nbytes % PCM_SAMPLE_BYTES:
            result.error = f"pcm body of {nbytes} bytes is not whole 16-bit samples"
        else:
            result.ok = True
    except Exception as exc:  # a failed request is data, never the end of the run
        result.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    finally:
        result.e2e_s = time.perf_counter() - start
        result.samples = nbytes // PCM_SAMPLE_BYTES
        result.audio_s = result.samples / PCM_RATE
        result.chunks = len(arrivals)
        result.gaps_s = gaps(arrivals)
        result.underruns_s = list(simulate_playback(arrivals, durations).underruns)
        if result.audio_s > 0:
            result.rtf = result.e2e_s / result.audio_s
    return result


def speech_body(
    model: str,
    text: str,
    voice: str | None = None,
    response_format: str = "pcm",
    seed: int | None = None,
) -> dict:
    """The JSON body of one request; ``voice`` and ``seed`` only when given.

    ``stream`` is not sent: omnistep (like Kokoro-FastAPI) streams by default and OpenAI's API
    has no such field. ``seed`` is an omnistep extra.
    """
    body: dict = {"model": model, "input": text, "response_format": response_format}
    if voice is not None:
        body["voice"] = voice
    if seed is not None:
        body["seed"] = seed
    return body


def _describe(level: int, done: int, total: int, r: RequestResult) -> str:
    head = f"[C={level}] {done}/{total}"
    if not r.ok:
        return f"{head} request {r.index} failed after {r.e2e_s:.3f} s: {r.error}"
    return (
        f"{head} request {r.index}: TTFA {r.ttfa_s:.3f} s, e2e {r.e2e_s:.3f} s, "
        f"audio {r.audio_s:.2f} s, RTF {r.rtf:.3f}, underruns {len(r.underruns_s)}"
    )


async def run_level(
    client: httpx.AsyncClient,
    url: str,
    concurrency: int,
    bodies: Sequence[tuple[int, dict]],
    progress: Progress | None = None,
) -> dict:
    """Send ``bodies`` keeping ``concurrency`` in flight; the level's summary (``summarize_level``).

    Args:
        client: the HTTP client (its connection limit must allow ``concurrency`` connections).
        url: server base URL, e.g. ``http://127.0.0.1:8000``.
        concurrency: requests in flight, >= 1: that many start at once, then one per completion.
        bodies: (text index, JSON body) per request, in sending order.
        progress: called with one line per completed request.
    """
    results = [
        RequestResult(index=k, text_index=t, seed=b.get("seed")) for k, (t, b) in enumerate(bodies)
    ]
    pending = iter(range(len(bodies)))
    done = 0
    level_start = time.perf_counter()

    async def worker() -> None:
        nonlocal done
        for k in pending:  # a shared iterator: each index is taken by exactly one worker
            results[k].start_s = time.perf_counter() - level_start
            await stream_one(client, url, bodies[k][1], results[k])
            done += 1
            if progress is not None:
                progress(_describe(concurrency, done, len(bodies), results[k]))

    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(bodies)))))
    return summarize_level(concurrency, results, time.perf_counter() - level_start)


async def run_bench_async(
    url: str,
    model: str,
    concurrency: Sequence[int],
    requests: int,
    texts: Sequence[str] = DEFAULT_TEXTS,
    voice: str | None = None,
    response_format: str = "pcm",
    seed: int | None = None,
    timeout_s: float = 300.0,
    warmup: int = 1,
    progress: Progress | None = None,
) -> dict:
    """Run every level in turn against the server at ``url``; see ``run_bench``."""
    if response_format not in RESPONSE_FORMATS:
        raise ValueError(f"response_format must be one of {RESPONSE_FORMATS}")
    if requests < 1 or not concurrency or min(concurrency) < 1 or not texts:
        raise ValueError("need requests >= 1, concurrency levels >= 1 and at least one text")
    plan = []
    for k in range(requests):
        t = k % len(texts)
        request_seed = None if seed is None else seed + k
        plan.append((t, speech_body(model, texts[t], voice, response_format, request_seed)))
    most = max(concurrency)
    limits = httpx.Limits(max_connections=most, max_keepalive_connections=most)
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout_s)) as client:
        warm = []
        for k in range(warmup):
            text_index, body = plan[k % len(plan)]
            r = await stream_one(client, url, body, RequestResult(k, text_index, None))
            if not r.ok:
                raise WarmupFailedError(url, r.error or "failed")
            warm.append(r)
            if progress is not None:
                progress("warm-up: ok")
        levels = [await run_level(client, url, c, plan, progress) for c in concurrency]
    return {
        "url": url,
        "model": model,
        "voice": voice,
        "response_format": response_format,
        "sample_rate": PCM_RATE,
        "requests_per_level": requests,
        "concurrency": list(concurrency),
        "seed": seed,
        "timeout_s": timeout_s,
        "texts": list(texts),
        "warmup": [{"ok": r.ok, "error": r.error, "e2e_s": r.e2e_s} for r in warm],
        "started": started,
        "levels": levels,
    }


def run_bench(
    url: str,
    model: str,
    concurrency: Sequence[int],
    requests: int,
    texts: Sequence[str] = DEFAULT_TEXTS,
    voice: str | None = None,
    response_format: str = "pcm",
    seed: int | None = None,
    timeout_s: float = 300.0,
    warmup: int = 1,
    progress: Progress | None = None,
) -> dict:
    """Benchmark a running server: ``requests`` streamed requests at each concurrency level.

    Request k of every level speaks ``texts[k % len(texts)]`` with seed ``seed + k`` (when a seed
    is given), so the levels send the same work. ``warmup`` unmeasured requests go first; if one
    fails, the run stops there. Failed measured requests are counted, never raised.

    Args:
        url: server base URL, e.g. ``http://127.0.0.1:8000``.
        model: the ``model`` field, e.g. ``tts-1``.
        concurrency: levels, each >= 1, run in the given order.
        requests: requests per level, >= 1.
        texts: the texts to speak, used round robin.
        voice: the ``voice`` field; omitted when None (the server's default).
        response_format: ``pcm`` (24 kHz mono s16le), the only measurable format.
        seed: base seed; None sends none (the server draws one per request).
        timeout_s: seconds to wait to connect, and for each read of the body.
        warmup: unmeasured requests before the first level.
        progress: called with one line per completed request.

    Returns:
        A JSON-ready dict: the settings, ``warmup`` and ``levels`` (one ``summarize_level`` dict
        per level).

    Raises:
        ValueError: bad arguments (not failed requests).
        WarmupFailedError: a warm-up request failed (no level was run).
    """
    return asyncio.run(
        run_bench_async(
            url,
            model,
            concurrency,
            requests,
            texts,
            voice,
            response_format,
            seed,
            timeout_s,
            warmup,
            progress,
        )
    )


def dumps(result: dict) -> str:
    """``result`` as indented JSON (NaN is never written: missing numbers are null)."""
    return json.dumps(result, indent=2, allow_nan=False) + "\n"
