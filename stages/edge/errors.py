"""The edge's errors in OpenAI's shape: a `RequestError` carries its code, field and retry hint;
its code picks the HTTP status and the error type. A failed run's error crosses as its code."""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

from schemas.events import RequestFailed

ErrorCode = str

HTTP_STATUS: dict[ErrorCode, int] = {
    "invalid_request": 400,
    "context_length": 400,
    "unauthorized": 401,
    "forbidden": 403,
    "not_found": 404,
    "conflict": 409,
    "too_large": 413,
    "headers_too_large": 431,
    "rate_limited": 429,
    "internal": 500,
    "overloaded": 503,
    "timeout": 504,
}
ERROR_TYPE = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    503: "overloaded_error",
}


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
            "type": ERROR_TYPE.get(status, "server_error"),
            "param": err.field,
            "code": err.code,
        }
    }


def error_response(err: RequestError) -> JSONResponse:
    headers = {}
    if err.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, round(err.retry_after_s + 0.499)))
    return JSONResponse(error_body(err), status_code=err.status, headers=headers)


def failure_error(event: RequestFailed) -> RequestError:
    return RequestError(event.code, event.message, event.field, event.retry_after_s)
