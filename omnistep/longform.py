"""Long text (an article, a book) to one audio file: ``omnistep say --file book.txt -o book.mp3``.

The text is cut into sentences (``split_text`` with the 4096-character input limit, so a very
long sentence is cut at clauses); pieces with nothing to speak (``* * *``) are skipped. Each
sentence is one engine request, the k-th with seed ``(S + k) mod 2**63`` as on the WebSocket
stream, so sentence k of a book sounds as ``omnistep say SENTENCE --seed S+k``. Up to ``WINDOW``
sentences synthesise at once; their audio goes in order through ONE streaming encoder into a
``.part`` file beside the output, so an mp3/opus/aac file is one continuous stream (not files
glued together) and memory stays flat; wav and flac get their exact lengths written into the
header at the end, and the file is then renamed to the output path (an interrupted run leaves
no half-written output).

A product-plane module: imports engine, audio, core and text.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TextIO

from omnistep.audio import OUTPUT_SAMPLE_RATE, StreamEncoder, make_encoder
from omnistep.core import Modality, OmnistepError, Request, SamplingParams
from omnistep.core.request import MAX_SEED
from omnistep.engine import AsyncEngine, RequestStream
from omnistep.text import split_text

WINDOW = 4
"""Sentences submitted to the engine at once."""
MAX_PIECE_CHARS = 4096
"""Longest piece sent as one request (``/v1/audio/speech``'s input limit)."""


def read_text(path: str) -> str:
    """The UTF-8 text of ``path`` (``-`` reads stdin); a byte-order mark is dropped.

    Raises:
        OmnistepError: the file cannot be read or is not UTF-8.
    """
    try:
        if path == "-":
            return sys.stdin.read()
        return Path(path).read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as exc:
        raise OmnistepError(
            f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start})"
        ) from None
    except OSError as exc:
        raise OmnistepError(f"cannot read {path}: {exc.strerror or exc}") from None


def text_pieces(text: str) -> list[str]:
    """The sentences of ``text`` to speak, in order: ``split_text(text, MAX_PIECE_CHARS)``
    without the pieces that have no letter or digit."""
    return [p for p in split_text(text, MAX_PIECE_CHARS) if any(c.isalnum() for c in p)]


def piece_seed(seed: int, index: int) -> int:
    """The seed of the ``index``-th piece: ``(seed + index) mod 2**63``."""
    return (seed + index) % (MAX_SEED + 1)


def format_progress(done: int, total: int, elapsed: float, width: int = 30) -> str:
    """``[#####.....] 12/40 sentences 00:31``: a bar, the count and the elapsed time.

    >>> format_progress(1, 4, 75.2, width=8)
    '[##......] 1/4 sentences 01:15'
    """
    filled = width * done // total if total else width
    minutes, seconds = divmod(int(elapsed), 60)
    hours, minutes = divmod(minutes, 60)
    clock = f"{hours}:{minutes:02d}:{seconds:02d}" if hours else f"{minutes:02d}:{seconds:02d}"
    noun = "sentence" if total == 1 else "sentences"
    return f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {noun} {clock}"


class ProgressBar:
    """A one-line progress bar redrawn in place on ``stream`` (a terminal); silent when
    ``enabled`` is False.

    Args:
        total: sentences to do.
        stream: where to draw; stderr by default.
        enabled: draw at all; by default only when ``stream`` is a terminal.
    """

    def __init__(self, total: int, stream: TextIO | None = None, enabled: bool | None = None):
        self.total = total
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.start = time.monotonic()
        self.done = 0

    def update(self, done: int) -> None:
        """Show ``done`` sentences finished."""
        self.done = done
        if self.enabled:
            line = format_progress(done, self.total, time.monotonic() - self.start)
            self.stream.write("\r" + line)
            self.stream.flush()

    def close(self) -> None:
        """End the line."""
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()


async def synthesize_pieces(
    engine: AsyncEngine,
    requests: Sequence[Request],
    encoder: StreamEncoder,
    write: Callable[[bytes], object],
    progress: Callable[[int], None] | None = None,
) -> None:
    """Run ``requests`` (up to ``WINDOW`` at once) and pass their audio, in order, through
    ``encoder`` (flushed at the end) to ``write``: one stream. ``progress(k)`` is called after
    the k-th request finishes.

    Raises:
        OmnistepError: a request was refused or failed; those in flight are aborted.
    """
    pending = deque(requests)
    in_flight: deque[RequestStream] = deque()
    try:
        for done in range(1, len(requests) + 1):
            while pending and len(in_flight) < WINDOW:
                in_flight.append(engine.add_request(pending.popleft()))
            async for chunk in in_flight[0]:
                if chunk.modality is Modality.AUDIO and chunk.audio is not None:
                    write(encoder.encode(chunk.audio))
            in_flight.popleft()
            if progress is not None:
                progress(done)
        write(encoder.flush())
    finally:
        for stream in in_flight:
            stream.cancel()


async def synthesize_file(
    engine: AsyncEngine,
    model_id: str,
    pieces: Sequence[str],
    out: Path,
    fmt: str,
    *,
    voice: str | None = None,
    speed: float = 1.0,
    seed: int = 0,
    progress: ProgressBar | None = None,
    sampling: SamplingParams | None = None,
) -> int:
    """Speak ``pieces`` into the single file ``out`` (see the module docstring); the engine
    is shut down at the end. ``sampling``: every piece's settings (default: the card's).

    Returns:
        samples written at 24 kHz.
    """
    requests = [
        Request(
            model_id,
            text=text,
            voice=voice,
            speed=speed,
            seed=piece_seed(seed, k),
            sampling=sampling or SamplingParams(),
        )
        for k, text in enumerate(pieces)
    ]
    part = out.with_name(out.name + ".part")
    encoder = make_encoder(fmt, engine.resolve(model_id).card.sample_rate)
    try:
        if progress is not None:
            progress.update(0)
        with part.open("wb") as file:
            update = progress.update if progress is not None else None
            await synthesize_pieces(engine, requests, encoder, file.write, update)
        data = part.read_bytes()
        fixed = encoder.with_lengths(data)  # exact lengths in wav and flac headers
        if fixed != data:
            part.write_bytes(fixed)
        os.replace(part, out)
    finally:
        if progress is not None:
            progress.close()
        with contextlib.suppress(FileNotFoundError):
            part.unlink()
        await engine.shutdown()
    return encoder.num_samples


def seconds(samples: int) -> str:
    """``samples`` at 24 kHz as ``m:ss``."""
    minutes, secs = divmod(round(samples / OUTPUT_SAMPLE_RATE), 60)
    return f"{minutes}:{secs:02d}"
