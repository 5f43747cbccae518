"""RequestRejected: every refusal of a request carries its code and field (and is a ValueError),
with the numbers and what to change in its message."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import Engine, EngineConfig, SamplingParams
from engine.errors import RequestRejected
from tests.engine.tiny_llama import write_tiny_llama


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Engine:
    model: Path = write_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama")
    config = EngineConfig(
        model=str(model), dtype="float32", block_size=4, num_kv_blocks=8, max_model_len=64
    )
    return Engine(config)


@pytest.mark.parametrize(
    ("prompt", "params", "code", "field", "words"),
    [
        ([5] * 60, SamplingParams(max_tokens=10), "context_length", "prompt_token_ids",
         ["= 70 > max_model_len 64", "shorten the prompt or lower max_tokens"]),
        ([5] * 30, SamplingParams(max_tokens=10), "context_length", "prompt_token_ids",
         ["needs 10 KV blocks but the cache has 8", "raise kv_cache_memory_bytes"]),
        ([5, 300], SamplingParams(), "invalid_request", "prompt_token_ids",
         ["outside [0, 259): [300]"]),
        ([], SamplingParams(), "invalid_request", "prompt_token_ids", ["the prompt has no tokens"]),
    ],
)  # fmt: skip
def test_add_request_rejects_with_code_and_field(engine, prompt, params, code, field, words):
    with pytest.raises(RequestRejected) as info:
        engine.add_request("r", prompt, params)
    err = info.value
    assert isinstance(err, ValueError)
    assert (err.code, err.field) == (code, field)
    assert all(w in err.message for w in words) and str(err) == err.message
    assert not engine.has_unfinished_requests()  # nothing was queued


def test_priority_and_a_request_in_flight_are_rejected_by_field(engine):
    with pytest.raises(RequestRejected) as info:
        engine.add_request("p", [5], SamplingParams(), priority=3)
    assert (info.value.code, info.value.field) == ("invalid_request", "priority")
    engine.add_request("dup", [5], SamplingParams())
    try:
        with pytest.raises(RequestRejected) as info:
            engine.add_request("dup", [5], SamplingParams())
        assert (info.value.code, info.value.field) == ("invalid_request", "request_id")
    finally:
        engine.abort_request("dup")
        engine.step()


def test_sampling_params_reject_with_the_field_they_name():
    with pytest.raises(RequestRejected) as info:
        SamplingParams(max_tokens=4, min_tokens=9)
    err = info.value
    assert (err.code, err.field) == ("invalid_request", "min_tokens")
    assert err.message == (
        "SamplingParams.min_tokens=9 is invalid; allowed: an integer in [0, max_tokens=4]"
    )
