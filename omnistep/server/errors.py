"""OpenAI-style error bodies: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from omnistep.core import (
    ComponentUnavailableError,
    EngineOverloadedError,
    InvalidRequestError,
    ModelNotFoundError,
    OmnistepError,
    RequestAbortedError,
    RequestFailedError,
    RequestTimeoutError,
    WeightVersionError,
)

log = logging.getLogger("omnistep.server")


@dataclass(frozen=True, slots=True)
class ApiError:
    """An error as the API reports it: HTTP status, OpenAI's error object, extra headers."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] | None = None

    def to_dict(self) -> dict:
        """OpenAI's error object: ``{"message", "type", "param", "code"}``."""
        return {"message": self.message, "type": self.type, "param": self.param, "code": self.code}

    def response(self) -> JSONResponse:
        """The error as a JSON response: ``{"error": {...}}`` with its status."""
        return JSONResponse({"error": self.to_dict()}, self.status, headers=self.headers)


class StreamCut(Exception):
    """A started response ends early for an expected reason: its request timed out, failed or
    was aborted (``cause``). Raised to the ASGI server, which then closes the connection
    without the body's final chunk, so the client sees a truncated body; the reason has been
    logged in one line already (the engine logs timeouts and failures), so
    ``QuietStreamCuts`` keeps the server from logging it again with a traceback."""

    def __init__(self, request_id: str, cause: OmnistepError):
        super().__init__(f"response of {request_id} cut short: {cause}")
        self.request_id = request_id
        self.cause = cause


class QuietStreamCuts(logging.Filter):
    """Drops the ASGI server's "Exception in ASGI application" record (and its traceback) when
    the exception is a ``StreamCut``, anywhere in its cause/context chain; every other record
    passes. Installed on uvicorn's error logger by ``install_log_filter``."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        seen = 0
        while exc is not None and seen < 16:  # bounded: chains can loop
            if isinstance(exc, StreamCut):
                return False
            exc = exc.__cause__ or exc.__context__
            seen += 1
        return True


SERVER_LOGGER = "uvicorn.error"
"""The logger uvicorn reports exceptions of the ASGI app to."""


def install_log_filter(logger_name: str = SERVER_LOGGER) -> None:
    """Add ``QuietStreamCuts`` to ``logger_name``'s filters (once)."""
    logger = logging.getLogger(logger_name)
    if not any(isinstance(f, QuietStreamCuts) for f in logger.filters):
        logger.addFilter(QuietStreamCuts())


def error_response(
    status: int,
    message: str,
    type_: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """A JSONResponse with OpenAI's error shape."""
    return ApiError(status, message, type_, param, code, headers).response()


def api_error(exc: BaseException) -> ApiError:
    """Map an exception to its API error; unexpected ones are logged with their traceback.

    400/404 for bad input (409 for a weight version that does not go up); 429 with
    ``Retry-After`` when the engine is full (OpenAI's request-rate error: type ``requests``,
    code ``rate_limit_exceeded``); 504 (type
    ``timeout_error``, code ``request_timeout``) past the server's request timeout; 503 (code
    ``request_aborted``) for a request aborted by the server (shutdown); 503 with
    ``Retry-After`` (code ``component_unavailable``) when a component of the model has no live
    replica, or when the replica running the request died (a failure caused by a
    ``ComponentUnavailableError``); 500 for other failures.
    """
    unavailable = exc if isinstance(exc, ComponentUnavailableError) else None
    if isinstance(exc, RequestFailedError) and isinstance(exc.__cause__, ComponentUnavailableError):
        unavailable = exc.__cause__
    if unavailable is not None:
        headers = {"Retry-After": str(unavailable.retry_after)}
        return ApiError(
            503, str(exc), "server_error", code="component_unavailable", headers=headers
        )
    if isinstance(exc, EngineOverloadedError):
        headers = {"Retry-After": str(exc.retry_after)}
        return ApiError(429, str(exc), "requests", code="rate_limit_exceeded", headers=headers)
    if isinstance(exc, InvalidRequestError):  # ModelNotFoundError included
        status = 404 if isinstance(exc, ModelNotFoundError) else 400
        status = 409 if isinstance(exc, WeightVersionError) else status
        return ApiError(status, str(exc), param=exc.param, code=exc.code)
    if isinstance(exc, RequestTimeoutError):
        return ApiError(504, str(exc), "timeout_error", code="request_timeout")
    if isinstance(exc, RequestAbortedError):
        return ApiError(503, str(exc), "server_error", code="request_aborted")
    if isinstance(exc, RequestFailedError):
        return ApiError(500, str(exc), "server_error", code="generation_failed")
    log.error("unhandled error", exc_info=exc)
    return ApiError(500, "internal server error", "server_error")


def from_exception(exc: BaseException) -> JSONResponse:
    """The JSON error response of ``exc`` (see ``api_error``)."""
    return api_error(exc).response()


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
        "flow_noise_level",
        "normalization_options",
        "normalize",
        "unit_normalization",
        "url_normalization",
        "email_normalization",
        "optional_pluralization_normalization",
        "phone_normalization",
        "replace_remaining_symbols",
        "return_timestamps",
        "caption_format",
        "language",
        "non_streaming_mode",
        # peers' voice fields (vllm-omni, SGLang-Omni)
        "ref_audio",
        "ref_text",
        "task_type",
        "x_vector_only_mode",
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
        # chat media parts
        "input_audio",
        "image_url",
        "audio_url",
        "video_url",
        "url",
        "data",
        "detail",
        "use_audio_in_video",
        "mm_processor_kwargs",
        "max_tokens",
        "max_completion_tokens",
        "n",
        # rollouts and weights
        "inputs",
        "logprobs",
        "audio_format",
        "path",
        "version",
        "mode",
        "check_finite",
        "min_new_tokens",
        "subtalker_temperature",
        "subtalker_top_p",
        "subtalker_top_k",
        "exaggeration",
        "cfg_weight",
    }
)


UNREADABLE_BODY = "There was an error parsing the body"
"""FastAPI's ``HTTPException`` detail for a body it could not decode (invalid UTF-8)."""


def _is_json(content_type: str | None) -> bool:
    media = (content_type or "").split(";", 1)[0].strip().lower()
    return media == "application/json" or media.endswith("+json")


def _union_member(first: dict, errors: list) -> dict:
    """For a value of a ``str | list[...]`` union (a chat message's ``content``) whose list
    failed deeper, the deeper error: "should be a valid string" says less."""
    loc = tuple(first.get("loc", ()))
    if first.get("type") != "string_type" or not loc or loc[-1] != "str":
        return first
    deeper = [e for e in errors if tuple(e.get("loc", ()))[: len(loc) - 1] == loc[:-1]]
    return max(deeper, key=lambda e: len(e.get("loc", ())))


def _content_part(loc: list) -> str | None:
    """``messages[1].content[2]`` for an error inside a chat message's content part."""
    if len(loc) >= 5 and loc[0] == "messages" and loc[2] == "content" and isinstance(loc[4], int):
        return f"messages[{loc[1]}].content[{loc[4]}]"
    return None


def _json_invalid_message(error: dict) -> str:
    """What is wrong with a body that is not JSON, and where: FastAPI's ``json_invalid``
    error says only "JSON decode error"; its ``ctx.error`` holds the decoder's reason and its
    ``loc`` the character offset."""
    reason = (error.get("ctx") or {}).get("error") or error.get("msg") or "decode error"
    loc = tuple(error.get("loc", ()))
    where = f" (at character {loc[1]})" if len(loc) == 2 and isinstance(loc[1], int) else ""
    return f"The request body is not valid JSON: {reason}{where}."


def unreadable_body_message(cause: BaseException | None) -> str:
    """The message for a body FastAPI could not parse (its 400 "There was an error parsing
    the body"), by the exception it caught (``cause``): invalid UTF-8, or JSON nested deeper
    than the decoder recurses (``RecursionError``)."""
    if isinstance(cause, UnicodeError):
        return "The request body could not be read as JSON text: it is not valid UTF-8."
    if isinstance(cause, RecursionError):
        return "The request body is nested too deeply to be read as JSON."
    return "The request body could not be read as JSON."


def validation_message(
    exc: RequestValidationError, content_type: str | None = None
) -> tuple[str, str | None]:
    """An OpenAI-style message and ``param`` for a validation error (the first error found;
    a specific message for a non-JSON content type, an empty or non-object body)."""
    errors = exc.errors()
    if not errors:
        return "invalid request body", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return _json_invalid_message(first), None
    if tuple(first.get("loc", ())) == ("body",):  # the body as a whole is wrong
        if not _is_json(content_type):
            return "The body must be JSON, sent with 'Content-Type: application/json'.", None
        if first.get("type") == "missing":
            return "The request body is empty; expected a JSON object.", None
        return "The request body must be a JSON object.", None
    unknown = [e for e in errors if e.get("type") == "extra_forbidden" and e.get("loc")]
    if unknown:  # bodies that forbid extras (rollouts, weights): name every unknown field
        names = sorted({str(e["loc"][-1])[:64] for e in unknown})
        shown = ", ".join(f"'{n}'" for n in names[:10])
        return f"Unknown field(s) {shown}: this endpoint does not take them.", names[0]
    first = _union_member(first, errors)
    loc = [p for p in first.get("loc", ()) if p != "body"]
    param = _content_part(loc) or (str(loc[0]) if loc else None)
    # keep field names and list indices; drop pydantic's union-member labels ("constrained-str")
    kept = [str(p) for p in loc if isinstance(p, int) or p in _FIELD_NAMES]
    kept = [p for i, p in enumerate(kept) if i == 0 or p != kept[i - 1]]  # a union's tag label
    where = ".".join(kept) or "body"
    return f"Invalid value for '{where}': {first.get('msg', 'invalid')}", param


def install_error_handlers(app: FastAPI) -> None:
    """Route every error the app can raise to OpenAI's error JSON."""

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc, request.headers.get("content-type"))
        return error_response(400, message, param=param, code="invalid_value")

    @app.exception_handler(HTTPException)
    async def _http(_: Request, exc: HTTPException) -> JSONResponse:
        if exc.status_code == 400 and exc.detail == UNREADABLE_BODY:  # e.g. not UTF-8
            message = unreadable_body_message(exc.__cause__)
            return error_response(400, message, code="invalid_value")
        type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return error_response(
            exc.status_code, str(exc.detail), type_=type_, headers=getattr(exc, "headers", None)
        )

    @app.exception_handler(OmnistepError)
    async def _omnistep(_: Request, exc: OmnistepError) -> JSONResponse:
        return from_exception(exc)

    app.add_middleware(UnhandledErrors)


class UnhandledErrors:
    """Pure ASGI middleware: an unexpected exception becomes a 500 with OpenAI's error JSON.

    An exception handler for ``Exception`` would answer but let the error reach the ASGI
    server, which then drops the keep-alive connection; answering here keeps it open. Once a
    response has started the exception propagates, so that the server closes the connection
    without ending the body: the client sees a truncated stream, not a complete short one.
    (Starlette's ``BaseHTTPMiddleware`` ends the body cleanly there, and it delays noticing
    client disconnects; hence a pure ASGI middleware.)
    """

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:  # noqa: BLE001 - every error becomes OpenAI's error JSON
            if started:
                raise
            await from_exception(exc)(scope, receive, send)
