import pytest

from schemas.events import RequestFailed, TokensGenerated
from stages.edge.admission import AdmissionConfig, AdmissionGate
from stages.edge.errors import RequestError


def test_waiting_tokens_are_bounded_and_released_on_first_token():
    gate = AdmissionGate(AdmissionConfig(max_waiting_tokens=100))
    gate.admit("a", 60)
    with pytest.raises(
        RequestError,
        match="60 tokens already wait .* reserves 50; the bound for interactive work is 100",
    ) as info:
        gate.admit("b", 50)
    assert (info.value.code, info.value.status, info.value.retry_after_s) == (
        "overloaded",
        503,
        1.0,
    )
    gate.observe(TokensGenerated(request_id="a", seq=0, token_ids=[1]))
    assert gate.num_waiting_tokens == 0
    gate.admit("b", 50)
    gate.observe(RequestFailed(request_id="b", stage="auth", code="unauthorized", message="x"))
    assert gate.waiting == {}


def test_batch_gets_only_its_share():
    gate = AdmissionGate(AdmissionConfig(max_waiting_tokens=100, batch_share=0.5))
    gate.admit("i", 40)
    with pytest.raises(RequestError, match="bound for batch work is 50"):
        gate.admit("b", 20, "batch")
    gate.admit("i2", 60, "interactive")
    assert gate.num_waiting_tokens == 100


def test_kv_watermark_with_a_queue_refuses():
    gate = AdmissionGate(AdmissionConfig(kv_watermark=0.9))
    gate.observe(
        TokensGenerated(request_id="x", seq=3, token_ids=[1], kv_usage=0.95, num_waiting=0)
    )
    gate.admit("a", 1)  # nothing queued: the engine takes it when blocks free up
    gate.observe(
        TokensGenerated(request_id="x", seq=4, token_ids=[1], kv_usage=0.95, num_waiting=2)
    )
    with pytest.raises(RequestError, match="KV cache at 95% .* with 2 requests queued"):
        gate.admit("b", 1)


def test_config_is_validated():
    with pytest.raises(ValueError, match="kv_watermark=1.5"):
        AdmissionConfig(kv_watermark=1.5)
