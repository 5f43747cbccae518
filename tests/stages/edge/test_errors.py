"""The edge's errors: each code's HTTP status and OpenAI error type, the Retry-After header, and
a failed run's error carried by its code and field (never parsed from its message)."""

import json

from schemas.events import RequestFailed
from stages.edge.errors import RequestError, error_body, error_response, failure_error


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


def test_error_response_rounds_retry_after_up_to_whole_seconds():
    for retry_after_s, header in ((0.2, "1"), (1.0, "1"), (1.01, "2"), (2.6, "3")):
        response = error_response(RequestError("rate_limited", "wait", retry_after_s=retry_after_s))
        assert (response.status_code, response.headers["retry-after"]) == (429, header)
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
