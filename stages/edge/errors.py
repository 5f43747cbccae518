"""The edge's errors in OpenAI's shape: a `RequestError` carries its code, field and retry hint;
its code picks the HTTP status and the error type. A failed run's error crosses as its code.
`as_request_error` turns anything else a route raises (Starlette's 404/405, a NATS error, a bug)
into one, so every answer is `{"error": {message, type, param, code}}`; 429 and 503 always carry
`Retry-After`.
"""

from __future__ import annotations

import logging
import math
import uuid
from typing import Any

import nats.errors
import nats.js.errors
from starlette.datastructures import MutableHeaders
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from schemas.events import RequestFailed

log = logging.getLogger("brigade.edge")
ErrorCode = str
BUS_RETRY_AFTER_S = 1.0  # a NATS leader election or reconnect usually settles within seconds
DEFAULT_RETRY_AFTER_S = 1.0

HTTP_STATUS: dict[ErrorCode, int] = {
    "invalid_request": 400,
    "unsupported_parameter": 400,
    "unknown_parameter": 400,
    "missing_parameter": 400,
    "context_length": 400,
    "unauthorized": 401,
    "forbidden": 403,
    "not_found": 404,
    "model_not_found": 404,
    "method_not_allowed": 405,
    "conflict": 409,
    "too_large": 413,
    "headers_too_large": 431,
    "rate_limited": 429,
    "internal": 500,
    "overloaded": 503,
    "unavailable": 503,
    "timeout": 504,
}
ERROR_TYPE = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    503: "overloaded_error",
}
CODE_TYPE = {"model_not_found": "invalid_request_error"}  # as OpenAI answers an unknown model
# JetStream answers that mean a request is wrong, not that the bus is away.
_NOT_TRANSIENT = (nats.js.errors.NotFoundError, nats.js.errors.BadRequestError)


class RequestError(Exception):
    """A client mistake or refusal with its error code, message and offending field."""

    def __init__(
        self,
        code: ErrorCode,
        message: str,
        field: str | None = None,
        retry_after_s: float | None = None,
    ):
        super().__init__(message)
        self.code = code
        self.message = message
        self.field = field
        self.retry_after_s = retry_after_s

    @property
    def status(self) -> int:
        return HTTP_STATUS.get(self.code, 500)


def error_body(err: RequestError) -> dict[str, Any]:
    status = err.status
    return {
        "error": {
            "message": err.message,
            "type": CODE_TYPE.get(err.code) or ERROR_TYPE.get(status, "server_error"),
            "param": err.field,
            "code": err.code,
        }
    }


def error_response(err: RequestError, request_id: str | None = None) -> JSONResponse:
    headers = {}
    retry_after_s = err.retry_after_s
    if retry_after_s is None and err.status in (429, 503):
        retry_after_s = DEFAULT_RETRY_AFTER_S
    if retry_after_s is not None:
        # whole seconds, as HTTP has it; and milliseconds, which the openai SDK reads first
        headers["Retry-After"] = str(max(1, round(retry_after_s + 0.499)))
        headers["Retry-After-Ms"] = str(max(1, math.ceil(retry_after_s * 1000)))
    if request_id is not None:
        headers["X-Request-Id"] = request_id
    return JSONResponse(error_body(err), status_code=err.status, headers=headers)


def failure_error(event: RequestFailed) -> RequestError:
    return RequestError(event.code, event.message, event.field, event.retry_after_s)


def bus_error(exc: BaseException) -> RequestError | None:
    """A NATS error as a 503 to retry (no responders, timeouts, a closed or reconnecting
    connection, JetStream unavailable during an election); None for anything else."""
    if not isinstance(exc, nats.errors.Error | nats.js.errors.Error) or isinstance(
        exc, _NOT_TRANSIENT
    ):
        return None
    detail = str(exc) or type(exc).__name__
    return RequestError(
        "unavailable",
        f"the message bus is not answering ({type(exc).__name__}: {detail[:200]}); retry shortly",
        retry_after_s=BUS_RETRY_AFTER_S,
    )


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in _leaves(inner)]
    return [exc]


def as_request_error(exc: BaseException) -> RequestError:
    """What to answer for an exception a route raised (task groups' exception groups unwrapped):
    its own RequestError, Starlette's HTTP errors by status, NATS errors as 503, else a 500."""
    leaves = _leaves(exc)
    for leaf in leaves:
        if isinstance(leaf, RequestError):
            return leaf
    for leaf in leaves:
        found = bus_error(leaf)
        if found is not None:
            return found
    for leaf in leaves:
        if isinstance(leaf, HTTPException):
            return http_error(leaf.status_code, leaf.detail)
    return RequestError(
        "internal", f"internal error ({type(leaves[0]).__name__}); the edge logged it"
    )


def http_error(status: int, detail: str | None = None) -> RequestError:
    if status == 404:
        return RequestError("not_found", "no such route; the routes are listed in docs/api.md")
    if status == 405:
        return RequestError("method_not_allowed", detail or "method not allowed")
    code = next((c for c, s in HTTP_STATUS.items() if s == status), "internal")
    return RequestError(code, detail or f"HTTP {status}")


async def http_exception(request: Request, exc: Exception) -> JSONResponse:
    """Starlette's own 404 (no route) and 405 (wrong method) in OpenAI's shape."""
    assert isinstance(exc, HTTPException)
    detail = exc.detail
    if exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow", "")
        detail = f"{request.method} is not allowed on {request.url.path}; allowed: {allowed}"
    response = error_response(http_error(exc.status_code, detail))
    response.headers.update(exc.headers or {})
    return response


class ErrorMiddleware:
    """Gives each HTTP request an id (`scope["state"]["request_id"]`: the id of the run it
    starts) and every answer an X-Request-Id; an exception raised before the answer started
    becomes its OpenAI error (a RequestError as itself, NATS errors 503, anything else a 500,
    logged with its traceback)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                headers = MutableHeaders(scope=message)
                if "x-request-id" not in headers:
                    headers.append("X-Request-Id", request_id)
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception as exc:
            if started:
                raise
            err = as_request_error(exc)
            if err.code == "internal":
                log.exception("request %s: %s %s failed", request_id, scope.get("method"),
                              scope.get("path"))  # fmt: skip
            await error_response(err)(scope, receive, send_with_id)
