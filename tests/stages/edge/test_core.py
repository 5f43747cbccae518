"""The edge's core without a server: the header budget and the tokens a submit reserves at the
admission gate. (Keys, ownership and runs through a real nats-server: test_app.py.)"""

import pytest
from starlette.requests import Request

from schemas.events import Message, Submit
from stages.edge.core import EdgeConfig, check_headers, prompt_tokens
from stages.edge.errors import RequestError


def _request(headers: list[tuple[bytes, bytes]]) -> Request:
    return Request({"type": "http", "method": "GET", "path": "/", "headers": headers})


def test_headers_over_the_budget_are_refused_with_the_numbers():
    config = EdgeConfig(max_header_bytes=64)
    check_headers(_request([(b"x-a", b"v" * 57)]), config)  # 3 + 57 + 4 = 64 bytes
    with pytest.raises(RequestError) as info:
        check_headers(_request([(b"x-a", b"v" * 58)]), config)
    assert (info.value.code, info.value.status) == ("headers_too_large", 431)
    assert info.value.message == (
        "request headers are 65 bytes; at most 64 (BRIGADE_EDGE_MAX_HEADERS) are accepted"
    )


def test_admission_counts_a_submits_prompt_estimate():
    chat = Submit(
        messages=[Message(role="user", content="x" * 40), Message(role="assistant", content="y")],
        system="z" * 8,
        max_tokens=100,
    )
    assert prompt_tokens(chat) == (40 // 4 + 8) + (1 // 4 + 8) + (8 // 4 + 8)
    assert prompt_tokens(Submit(prompt="p" * 12, max_tokens=5)) == 12 // 4 + 8
