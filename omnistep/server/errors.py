"""OpenAI-style error bodies: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from omnistep.core import (
    EngineOverloadedError,
    InvalidRequestError,
    ModelNotFoundError,
    OmnistepError,
    RequestFailedError,
)

log = logging.getLogger("omnistep.server")


def error_response(
    status: int,
    message: str,
    type_: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """A JSONResponse with OpenAI's error shape."""
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def from_exception(exc: Exception) -> JSONResponse:
    """Map an omnistep exception to its HTTP error.

    400/404 for bad input, 429 with ``Retry-After`` when the engine is full (OpenAI's
    request-rate error: type ``requests``, code ``rate_limit_exceeded``), 500 for failures.
    """
    if isinstance(exc, EngineOverloadedError):
        return error_response(
            429,
            str(exc),
            type_="requests",
            code="rate_limit_exceeded",
            headers={"Retry-After": str(exc.retry_after)},
        )
    if isinstance(exc, ModelNotFoundError):
        return error_response(404, str(exc), param=exc.param, code=exc.code)
    if isinstance(exc, InvalidRequestError):
        return error_response(400, str(exc), param=exc.param, code=exc.code)
    if isinstance(exc, RequestFailedError):
        return error_response(500, str(exc), type_="server_error", code="generation_failed")
    log.exception("unhandled error", exc_info=exc)
    return error_response(500, "internal server error", type_="server_error")


_FIELD_NAMES = frozenset(
    {
        "model",
        "input",
        "voice",
        "id",
        "instructions",
        "response_format",
        "speed",
        "stream_format",
        "stream",
        "seed",
        "temperature",
        "top_p",
        "top_k",
        "repetition_penalty",
        "max_new_tokens",
        # chat completions
        "messages",
        "role",
        "content",
        "text",
        "type",
        "modalities",
        "audio",
        "format",
        "stream_options",
        "include_usage",
        "max_tokens",
        "max_completion_tokens",
        "n",
    }
)


def _is_json(content_type: str | None) -> bool:
    media = (content_type or "").split(";", 1)[0].strip().lower()
    return media == "application/json" or media.endswith("+json")


def _validation_message(
    exc: RequestValidationError, content_type: str | None = None
) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request body", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"The request body is not valid JSON: {first.get('msg', 'decode error')}", None
    if tuple(first.get("loc", ())) == ("body",):  # the body as a whole is wrong
        if not _is_json(content_type):
            return "The body must be JSON, sent with 'Content-Type: application/json'.", None
        if first.get("type") == "missing":
            return "The request body is empty; expected a JSON object.", None
        return "The request body must be a JSON object.", None
    loc = [p for p in first.get("loc", ()) if p != "body"]
    param = str(loc[0]) if loc else None
    # keep field names and list indices; drop pydantic's union-member labels ("constrained-str")
    where = ".".join(str(p) for p in loc if isinstance(p, int) or p in _FIELD_NAMES) or "body"
    return f"Invalid value for '{where}': {first.get('msg', 'invalid')}", param


def install_error_handlers(app: FastAPI) -> None:
    """Route every error the app can raise to OpenAI's error JSON."""

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc, request.headers.get("content-type"))
        return error_response(400, message, param=param, code="invalid_value")

    @app.exception_handler(HTTPException)
    async def _http(_: Request, exc: HTTPException) -> JSONResponse:
        type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return error_response(
            exc.status_code, str(exc.detail), type_=type_, headers=getattr(exc, "headers", None)
        )

    @app.exception_handler(OmnistepError)
    async def _omnistep(_: Request, exc: OmnistepError) -> JSONResponse:
        return from_exception(exc)

    @app.middleware("http")
    async def _unhandled(request: Request, call_next):  # noqa: ANN001, ANN202
        # An exception handler for Exception answers but lets the error reach the ASGI server,
        # which then drops the keep-alive connection; answering here keeps it open.
        try:
            return await call_next(request)
        except Exception as exc:  # noqa: BLE001 - every error becomes OpenAI's error JSON
            return from_exception(exc)
