"""OpenAI-style error bodies: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from omnistep.core import InvalidRequestError, ModelNotFoundError, RequestFailedError

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
    """Map an omnistep exception to its HTTP error (400/404 for input, 500 for failures)."""
    if isinstance(exc, ModelNotFoundError):
        return error_response(404, str(exc), param=exc.param, code=exc.code)
    if isinstance(exc, InvalidRequestError):
        return error_response(400, str(exc), param=exc.param, code=exc.code)
    if isinstance(exc, RequestFailedError):
        return error_response(500, str(exc), type_="server_error", code="generation_failed")
    log.exception("unhandled error", exc_info=exc)
    return error_response(500, "internal server error", type_="server_error")


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request body", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = loc[0] if loc else None
    where = ".".join(loc) or "body"
    return f"Invalid value for '{where}': {first.get('msg', 'invalid')}", param


def install_error_handlers(app: FastAPI) -> None:
    """Route every error the app can raise to OpenAI's error JSON."""

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(400, message, param=param, code="invalid_value")

    @app.exception_handler(HTTPException)
    async def _http(_: Request, exc: HTTPException) -> JSONResponse:
        type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return error_response(
            exc.status_code, str(exc.detail), type_=type_, headers=getattr(exc, "headers", None)
        )

    @app.exception_handler(InvalidRequestError)
    async def _invalid(_: Request, exc: InvalidRequestError) -> JSONResponse:
        return from_exception(exc)

    @app.exception_handler(Exception)
    async def _any(_: Request, exc: Exception) -> JSONResponse:
        return from_exception(exc)
