"""The edge's errors: each code's HTTP status and OpenAI error type, the Retry-After header, and
a failed run's error carried by its code and field (never parsed from its message), NATS errors
as 503 to retry, anything else a 500."""

import json

import nats.errors
import nats.js.errors

from schemas.events import RequestFailed
from stages.edge.errors import (
    RequestError,
    as_request_error,
    bus_error,
    error_body,
    error_response,
    failure_error,
)


def test_error_body_types():
    err = RequestError("rate_limited", "slow down", None, retry_after_s=2.0)
    assert err.status == 429
    assert error_body(err) == {
        "error": {
            "message": "slow down",
            "type": "rate_limit_error",
            "param": None,
            "code": "rate_limited",
        }
    }
    assert RequestError("timeout", "late").status == 504
    assert error_body(RequestError("timeout", "late"))["error"]["type"] == "server_error"
    assert RequestError("no_such_code", "?").status == 500


def test_error_response_rounds_retry_after_up_to_whole_seconds_and_milliseconds():
    cases = ((0.2, "1", "200"), (1.0, "1", "1000"), (1.01, "2", "1010"), (2.6, "3", "2600"),
             (0.0001, "1", "1"), (0.0123, "1", "13"))  # fmt: skip
    for retry_after_s, seconds, ms in cases:
        response = error_response(RequestError("rate_limited", "wait", retry_after_s=retry_after_s))
        headers = response.headers
        assert response.status_code == 429
        assert (headers["retry-after"], headers["retry-after-ms"]) == (seconds, ms)
    response = error_response(RequestError("headers_too_large", "big", "headers"))
    assert response.status_code == 431 and "retry-after" not in response.headers
    assert json.loads(response.body)["error"]["param"] == "headers"


def test_a_failed_run_keeps_its_code_field_and_retry_hint():
    event = RequestFailed(
        request_id="r1", stage="auth", code="rate_limited", message="42 tokens over the minute",
        field="max_tokens", retry_after_s=3.5,
    )  # fmt: skip
    err = failure_error(event)
    assert (err.code, err.message, err.field, err.retry_after_s) == (
        "rate_limited",
        "42 tokens over the minute",
        "max_tokens",
        3.5,
    )
    assert err.status == 429


def test_nats_errors_are_503_to_retry_and_bugs_are_500():
    for exc in (
        nats.errors.NoRespondersError(),
        nats.errors.TimeoutError(),
        nats.errors.ConnectionClosedError(),
        nats.errors.ConnectionReconnectingError(),
        nats.js.errors.ServiceUnavailableError(code=503, description="JetStream unavailable"),
        nats.js.errors.APIError(code=500, err_code=10008, description="leader election"),
    ):
        err = bus_error(exc)
        assert err is not None and (err.status, err.code) == (503, "unavailable"), exc
        assert type(exc).__name__ in err.message
        response = error_response(err)
        assert response.headers["retry-after"] == "1"
        nested = ExceptionGroup("task group", [ExceptionGroup("inner", [exc])])
        assert as_request_error(nested).status == 503  # unwrapped from anyio's task groups
    assert bus_error(nats.js.errors.NotFoundError()) is None
    assert bus_error(ValueError("x")) is None
    bug = as_request_error(ZeroDivisionError("boom"))
    assert (bug.status, bug.code) == (500, "internal")
    assert "boom" not in bug.message  # the traceback goes to the log, not to the client
    refusal = RequestError("forbidden", "no", "model")
    assert as_request_error(ExceptionGroup("g", [refusal])) is refusal


def test_429_and_503_always_carry_retry_after():
    for code in ("rate_limited", "overloaded", "unavailable"):
        response = error_response(RequestError(code, "later"))
        assert response.headers["retry-after"] == "1", code
    assert "retry-after" not in error_response(RequestError("invalid_request", "no")).headers
    body = json.loads(error_response(RequestError("model_not_found", "no", "model")).body)
    assert body["error"] == {
        "message": "no",
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }
    assert error_response(RequestError("not_found", "no"), "rid1").headers["x-request-id"] == "rid1"
