"""Where media named by a request may come from, and reading it: the one fetcher behind
``ref_audio`` (speech, rollouts) and the chat content parts (``input_audio``, ``image_url``,
``audio_url``, ``video_url``).

A reference is a ``data:`` URL with base64, an http(s) URL (only with ``--allow-remote-media``;
fetched with httpx, bounded by ``MediaPolicy.max_bytes`` and ``timeout_s``), a file path or
``file://`` URL (only under ``--allowed-local-media-path``; a relative path is taken under it,
symlinks are resolved and nothing outside it is read), or, where the caller allows it, bare
base64. Anything else is a 400 (``InvalidRequestError``) whose ``param`` is the caller's name for
the field (``ref_audio``, ``messages[1].content[2]``) and whose message names the flag to turn on.

Imports FastAPI (its thread pool), httpx and ``omnistep.core``.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

import httpx
from fastapi.concurrency import run_in_threadpool

from omnistep.core import InvalidRequestError

_BASE64 = re.compile(r"[A-Za-z0-9+/]+={0,2}")
_URL_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")
_MIN_BASE64_CHARS = 64
"""Shorter strings are taken as paths: no media file is this small, and a path of 64 base64
characters without a dot is unlikely."""


@dataclass(frozen=True, slots=True)
class MediaPolicy:
    """Where media may come from besides the request body.

    Attributes:
        allowed_local_media_path: the directory whose files a request may name (symlinks
            resolved; nothing outside it); None: no file paths.
        allow_remote_media: fetch http(s) URLs (any host the server reaches: turn it on only
            for trusted clients); False: refused.
        max_bytes: the largest file read from a path or a URL.
        timeout_s: the whole fetch of a URL, seconds.
    """

    allowed_local_media_path: Path | None = None
    allow_remote_media: bool = False
    max_bytes: int = 32 << 20
    timeout_s: float = 15.0

    def __post_init__(self) -> None:
        if self.max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {self.max_bytes}")
        if not 0 < self.timeout_s < float("inf"):
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")


def _bad(message: str, param: str, code: str = "invalid_value") -> InvalidRequestError:
    return InvalidRequestError(message, param=param, code=code)


def b64decode(text: str, param: str) -> bytes:
    """Strict base64 (whitespace ignored); InvalidRequestError (``invalid_base64``) otherwise."""
    try:
        return base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError):
        raise _bad(f"{param} is not valid base64", param, "invalid_base64") from None


def _data_url(ref: str, param: str) -> bytes:
    header, comma, payload = ref.partition(",")
    if not comma or not header.lower().endswith(";base64"):
        raise _bad(f"{param} data URLs must be base64: data:<type>;base64,...", param)
    return b64decode(payload, param)


def _looks_base64(ref: str) -> bool:
    text = "".join(ref.split())
    return len(text) >= _MIN_BASE64_CHARS and len(text) % 4 == 0 and bool(_BASE64.fullmatch(text))


def local_path(ref: str, policy: MediaPolicy, param: str) -> Path:
    """The file a path (or ``file://`` URL) names, if it lies in the allowed directory.

    Raises:
        InvalidRequestError: no allowed directory (``local_media_disabled``), a path outside
            it (``local_media_forbidden``), an unusable path.
    """
    root = policy.allowed_local_media_path
    if root is None:
        raise _bad(
            f"{param} names a file path, and this server reads no local files: send the media "
            "as base64 or a data: URL, or start the server with --allowed-local-media-path DIR",
            param,
            "local_media_disabled",
        )
    raw = unquote(urlparse(ref).path) if ref[:7].lower() == "file://" else ref
    base = root.resolve()
    try:
        path = (base / raw).resolve()  # an absolute raw replaces base
    except (OSError, ValueError) as exc:  # a NUL byte, a symlink loop
        raise _bad(f"{param} is not a usable path: {exc}", param) from None
    if not path.is_relative_to(base):
        raise _bad(
            f"{param} path {raw[:200]!r} is outside the allowed media directory",
            param,
            "local_media_forbidden",
        )
    return path


def _read_file(path: Path, policy: MediaPolicy, param: str, too_large: str) -> bytes:
    if not path.is_file():
        if path.exists():  # a folder, a FIFO, a device: not opened (a FIFO would block)
            raise _bad(f"{param} path {path.name!r} is not a regular file", param)
        raise _bad(f"{param} file {path.name!r} does not exist", param, "file_not_found")
    with path.open("rb") as f:
        data = f.read(policy.max_bytes + 1)
    if len(data) > policy.max_bytes:
        raise _bad(f"{param} file is over {policy.max_bytes} bytes", param, too_large)
    return data


async def _fetch(url: str, policy: MediaPolicy, param: str, too_large: str) -> bytes:
    if not policy.allow_remote_media:
        raise _bad(
            f"{param} is a URL, and this server fetches no remote media: send the media as "
            "base64 or a data: URL, or start the server with --allow-remote-media",
            param,
            "remote_media_disabled",
        )
    try:
        download = _download(url, policy.max_bytes, param, too_large)
        return await asyncio.wait_for(download, policy.timeout_s)
    except TimeoutError:
        raise _bad(
            f"fetching {param} took over {policy.timeout_s:g} s", param, "fetch_failed"
        ) from None
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        raise _bad(f"fetching {param} failed: {exc}", param, "fetch_failed") from None


async def _download(url: str, max_bytes: int, param: str, too_large: str) -> bytes:
    data = bytearray()
    async with (
        httpx.AsyncClient(follow_redirects=True, max_redirects=5) as client,
        client.stream("GET", url) as reply,
    ):
        if reply.status_code != 200:
            raise _bad(f"fetching {param} answered HTTP {reply.status_code}", param, "fetch_failed")
        async for piece in reply.aiter_bytes():
            data += piece
            if len(data) > max_bytes:
                raise _bad(f"{param} at the URL is over {max_bytes} bytes", param, too_large)
    return bytes(data)


async def read_media(
    ref: str,
    policy: MediaPolicy,
    param: str,
    bare_base64: bool = False,
    too_large: str = "file_too_large",
) -> bytes:
    """The bytes of the file ``ref`` gives (see the module docstring for the forms).

    Args:
        ref: a data URL, an http(s) URL, a path or ``file://`` URL, or (``bare_base64``) base64.
        param: the request field, named in errors.
        bare_base64: take a long base64-looking string as the file's base64 (``ref_audio``).
        too_large: the error code for a file over ``policy.max_bytes``.

    Raises:
        InvalidRequestError: param ``param``: bad base64 (``invalid_base64``), a URL of
            another scheme (``unsupported_url_scheme``: ``ftp://``, ``s3://``), a path or URL
            the policy refuses (``local_media_disabled``, ``local_media_forbidden``,
            ``remote_media_disabled``), a missing file (``file_not_found``), too many bytes
            (``too_large``), a failed fetch (``fetch_failed``).
    """
    lower = ref[:8].lower()
    if lower.startswith("data:"):
        return _data_url(ref, param)
    if lower.startswith(("http://", "https://")):
        return await _fetch(ref, policy, param, too_large)
    scheme = _URL_SCHEME.match(ref)
    if scheme and scheme[1].lower() != "file":  # ftp://, s3://, ...: not a relative path
        raise _bad(
            f"{param} is a {scheme[1]}:// URL; media may be a data: URL, an http(s) URL or a "
            "local file path",
            param,
            "unsupported_url_scheme",
        )
    if bare_base64 and not lower.startswith("file://") and _looks_base64(ref):
        return b64decode(ref, param)
    path = local_path(ref, policy, param)
    return await run_in_threadpool(_read_file, path, policy, param, too_large)
