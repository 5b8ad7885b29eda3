"""Optional API key check as a pure ASGI middleware: 401 with OpenAI's error JSON.

When a key is configured, every request but those to ``OPEN_PATHS`` (health, Prometheus
metrics, the API docs and the playground page) needs ``Authorization: Bearer KEY``; the
comparison takes constant time. Nothing of the body is read before the key is checked.

WebSockets need the key too, in the same header or, since browsers cannot set headers on a
WebSocket, as the query parameter ``?api_key=KEY``. Without it the socket is accepted, gets an
``{"type": "error", "error": {...}}`` event and is closed with 1008 (policy violation), so that
the client sees why; nothing it sends is read.
"""

from __future__ import annotations

import json
import secrets
from urllib.parse import parse_qs

from omnistep.server.errors import error_response
from omnistep.server.limits import ASGIApp, Scope

OPEN_PATHS = frozenset(
    {"/", "/health", "/metrics", "/docs", "/docs/oauth2-redirect", "/openapi.json", "/redoc"}
)
"""Paths served without a key: liveness probes, Prometheus metrics (as vLLM serves them: counts
and timings only, no request content), the OpenAPI page and the playground (``/``), which hold
no secrets."""


class ApiKeyAuth:
    """Reject HTTP requests without ``Authorization: Bearer <api_key>`` with a 401, and
    WebSockets without it (or ``?api_key=``) with close code 1008."""

    def __init__(self, app: ASGIApp, api_key: str):
        if not api_key:
            raise ValueError("api_key must not be empty")
        self.app = app
        self._expected = api_key.encode()

    async def __call__(self, scope: Scope, receive, send) -> None:  # noqa: ANN001
        if scope["type"] not in ("http", "websocket") or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        header = dict(scope.get("headers") or []).get(b"authorization")
        if scope["type"] == "websocket":
            await self._websocket(scope, receive, send, header)
            return
        if header is None:
            message = (
                "You didn't provide an API key. Send it in the Authorization header "
                "(Authorization: Bearer YOUR_KEY)."
            )
        elif self._matches(header):
            await self.app(scope, receive, send)
            return
        else:
            message = "Incorrect API key provided."
        response = error_response(
            401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}
        )
        await response(scope, receive, send)

    async def _websocket(self, scope: Scope, receive, send, header: bytes | None) -> None:  # noqa: ANN001
        """Pass a WebSocket with the key (header or ``?api_key=``); else accept it, send an
        error event and close it with 1008."""
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        keys = [k.encode("latin-1", "replace") for k in query.get("api_key", [])]
        if (header is not None and self._matches(header)) or any(
            secrets.compare_digest(k, self._expected) for k in keys
        ):
            await self.app(scope, receive, send)
            return
        if header is None and not keys:
            message = (
                "You didn't provide an API key. Send 'Authorization: Bearer YOUR_KEY' or add "
                "?api_key=YOUR_KEY to the URL."
            )
        else:
            message = "Incorrect API key provided."
        error = {"message": message, "type": "invalid_request_error", "param": None}
        event = json.dumps({"type": "error", "error": {**error, "code": "invalid_api_key"}})
        if (await receive())["type"] != "websocket.connect":
            return
        await send({"type": "websocket.accept"})
        await send({"type": "websocket.send", "text": event})
        await send({"type": "websocket.close", "code": 1008, "reason": "invalid_api_key"})

    def _matches(self, header: bytes) -> bool:
        scheme, _, token = header.strip().partition(b" ")
        return scheme.lower() == b"bearer" and secrets.compare_digest(token.strip(), self._expected)
