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


def test_a_model_is_named_by_its_id_or_an_alias_of_a_served_one(tmp_path):
    """Two served models: no name is the default, an id itself, `alias` the default's and
    `alias=id` that id's; an alias of a model not served, or any other name, is a 404; a
    tenant limited to one model gets a 403 for the other."""
    from stages.edge.core import Edge
    from stages.edge.keys import Caller

    config = EdgeConfig(
        model="smollm2-135m,tiny=/models/tiny", model_aliases=("gpt-4o", "mini=tiny", "ghost=nope")
    )
    edge = Edge(bus=None, config=config, keys=None)  # resolving names touches neither
    anyone = Caller(tenant="acme", api_key="k")
    assert [edge.served_model(anyone, n) for n in (None, "tiny", "gpt-4o", "mini")] == [
        "smollm2-135m", "tiny", "smollm2-135m", "tiny"]  # fmt: skip
    for name in ("ghost", "/models/tiny", "gpt-5"):
        with pytest.raises(RequestError) as info:
            edge.served_model(anyone, name)
        assert (info.value.code, info.value.status, info.value.field) == (
            "model_not_found", 404, "model")  # fmt: skip
    assert "served: smollm2-135m, tiny, gpt-4o, mini (GET" in info.value.message
    only_tiny = Caller(tenant="t", api_key="k", allowed_models=("tiny",))
    assert edge.served_model(only_tiny, "mini") == "tiny"
    with pytest.raises(RequestError) as info:
        edge.served_model(only_tiny, None)
    assert (info.value.code, info.value.status) == ("forbidden", 403)


def test_each_model_is_admitted_on_its_own_engines_load():
    """One model's engines full (KV past the watermark, requests queued) refuse that model's
    requests only: the other model's engines have room."""
    from schemas.events import RunStarted
    from stages.edge.core import Edge

    edge = Edge(bus=None, config=EdgeConfig(model="smollm2-135m,tiny=/models/tiny"), keys=None)
    full = RunStarted(request_id="r", kv_usage=0.99, num_waiting=3, model="tiny")
    edge._observe(full, 0)
    with pytest.raises(RequestError) as info:
        edge.gate_of("tiny").admit("a", 10)
    assert info.value.code == "overloaded" and "KV cache at 99%" in info.value.message
    edge.gate_of("smollm2-135m").admit("b", 10)  # not refused
    edge.gate_of(None).release("b")  # None: the default model's gate
    assert not edge.gate_of("smollm2-135m").waiting
