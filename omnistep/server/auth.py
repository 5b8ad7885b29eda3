"""Optional API key check as a pure ASGI middleware: 401 with OpenAI's error JSON.

When a key is configured, every request but those to ``OPEN_PATHS`` (health, Prometheus
metrics and the API docs) needs ``Authorization: Bearer KEY``; the comparison takes constant
time. Nothing of the body is read before the key is checked.
"""

from __future__ import annotations

import secrets

from omnistep.server.errors import error_response
from omnistep.server.limits import ASGIApp, Scope

OPEN_PATHS = frozenset(
    {"/health", "/metrics", "/docs", "/docs/oauth2-redirect", "/openapi.json", "/redoc"}
)
"""Paths served without a key: liveness probes, Prometheus metrics (as vLLM serves them: counts
and timings only, no request content) and the OpenAPI page (which holds no secrets)."""


class ApiKeyAuth:
    """Reject HTTP requests without ``Authorization: Bearer <api_key>`` with a 401."""

    def __init__(self, app: ASGIApp, api_key: str):
        if not api_key:
            raise ValueError("api_key must not be empty")
        self.app = app
        self._expected = api_key.encode()

    async def __call__(self, scope: Scope, receive, send) -> None:  # noqa: ANN001
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        header = dict(scope.get("headers") or []).get(b"authorization")
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

    def _matches(self, header: bytes) -> bool:
        scheme, _, token = header.strip().partition(b" ")
        return scheme.lower() == b"bearer" and secrets.compare_digest(token.strip(), self._expected)
