"""Request body size limit as a pure ASGI middleware: 413 with OpenAI's error JSON.

The limit is checked against ``Content-Length`` before reading, and counted while reading a
body without one (chunked transfer), so an oversized body is never buffered whole.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
ASGIApp = Callable[
    [Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]
]


class BodySizeLimit:
    """Reject HTTP request bodies over ``max_bytes`` with a 413; ``path_limits`` gives other
    limits to exact paths (a weights upload)."""

    def __init__(self, app: ASGIApp, max_bytes: int, path_limits: dict[str, int] | None = None):
        self.app = app
        self.max_bytes = max_bytes
        self.path_limits = path_limits or {}

    async def __call__(self, scope: Scope, receive, send) -> None:  # noqa: ANN001
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.path_limits.get(scope.get("path", ""), self.max_bytes)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            await self._reject(send, limit)
            return
        seen = 0
        exceeded = False

        async def limited_receive() -> Message:
            # Past the limit the body is cut short (the app sees an invalid body and answers
            # an error, which ``guarded_send`` replaces by the 413): nothing more is buffered.
            nonlocal seen, exceeded
            if exceeded:
                return {"type": "http.request", "body": b"", "more_body": False}
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    exceeded = True
                    return {"type": "http.request", "body": b"", "more_body": False}
            return message

        async def guarded_send(message: Message) -> None:
            if not exceeded:
                await send(message)
            elif message["type"] == "http.response.start":
                await self._reject(send, limit)

        await self.app(scope, limited_receive, guarded_send)

    async def _reject(self, send, limit: int) -> None:  # noqa: ANN001
        body = json.dumps(
            {
                "error": {
                    "message": f"Request body exceeds the {limit} byte limit.",
                    "type": "invalid_request_error",
                    "param": None,
                    "code": "request_too_large",
                }
            }
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
