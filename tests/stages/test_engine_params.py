"""The engine stage's pure parts: admission numbers, seeds, and the wire -> engine mapping."""

from __future__ import annotations

import pytest

from schemas.events import Sampling
from stages.engine_params import (
    AdmissionConfig,
    admission_room,
    derived_seed,
    engine_config_from_env,
    sampling_params,
)
from stages.runtime.failures import StageError


def test_admission_room_counts_reserved_blocks_and_bounds():
    config = AdmissionConfig(max_active=8, kv_watermark=0.9, max_fetch=4)
    room = dict(num_total_blocks=100, config=config)
    assert admission_room(num_free_blocks=100, reserved_blocks=0, num_active=0, **room) == 4
    assert admission_room(num_free_blocks=100, reserved_blocks=0, num_active=6, **room) == 2
    assert admission_room(num_free_blocks=100, reserved_blocks=0, num_active=8, **room) == 0
    assert admission_room(num_free_blocks=40, reserved_blocks=30, num_active=1, **room) == 0
    assert admission_room(num_free_blocks=40, reserved_blocks=29, num_active=1, **room) == 4
    assert admission_room(num_free_blocks=5, reserved_blocks=6, num_active=1, **room) == 0


def test_admission_room_pulls_only_the_requests_that_fit():
    """At 3 blocks a request, 10 free blocks hold 3 more (not max_fetch), 2 hold none; an
    idle worker takes one even when a request is bigger than its whole cache."""
    config = AdmissionConfig(max_active=8, kv_watermark=0.95, max_fetch=4)
    room = dict(num_total_blocks=16, config=config, blocks_per_request=3)
    assert admission_room(num_free_blocks=16, reserved_blocks=0, num_active=0, **room) == 4
    assert admission_room(num_free_blocks=13, reserved_blocks=3, num_active=1, **room) == 3
    assert admission_room(num_free_blocks=10, reserved_blocks=8, num_active=2, **room) == 0
    assert admission_room(num_free_blocks=9, reserved_blocks=0, num_active=2, **room) == 3
    big = dict(room, blocks_per_request=40)
    assert admission_room(num_free_blocks=16, reserved_blocks=0, num_active=0, **big) == 1
    assert admission_room(num_free_blocks=16, reserved_blocks=0, num_active=1, **big) == 0


def test_seeds_are_fixed_by_the_request_id():
    assert derived_seed("r1") == derived_seed("r1") != derived_seed("r2")
    assert 0 <= derived_seed("r1") < 2**63
    assert sampling_params(Sampling(), "r1").seed == derived_seed("r1")
    assert sampling_params(Sampling(seed=7), "r1").seed == 7


def test_wire_sampling_maps_field_by_field():
    wire = Sampling(
        temperature=0.5, top_p=0.9, top_k=40, min_p=0.05, max_tokens=12, min_tokens=2,
        stop_token_ids=[5, 6], repetition_penalty=1.1, presence_penalty=0.5,
        frequency_penalty=-0.5, ignore_eos=True, logprobs=3, stop=["x"],
        logit_bias={9: -100.0, 3: 2.5},
    )  # fmt: skip
    p = sampling_params(wire, "r")
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (0.5, 0.9, 40, 0.05)
    assert (p.max_tokens, p.min_tokens, p.stop_token_ids) == (12, 2, (5, 6))
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.1, 0.5, -0.5)
    assert (p.ignore_eos, p.logprobs) == (True, 3)
    assert p.logit_bias == ((3, 2.5), (9, -100.0))


def test_a_value_the_engine_refuses_names_its_field():
    with pytest.raises(StageError) as info:
        sampling_params(Sampling(max_tokens=4, min_tokens=9), "r")
    assert (info.value.code, info.value.field) == ("invalid_request", "min_tokens")
    assert "max_tokens=4" in info.value.message


def test_engine_config_from_the_environment(monkeypatch):
    monkeypatch.setenv("BRIGADE_NUM_KV_BLOCKS", "128")
    monkeypatch.setenv("BRIGADE_MAX_NUM_SEQS", "4")
    config = engine_config_from_env()
    assert (config.num_kv_blocks, config.max_num_seqs, config.model) == (128, 4, "smollm2-135m")
    assert config.batch_invariant is False
    monkeypatch.setenv("BRIGADE_BATCH_INVARIANT", "true")
    assert engine_config_from_env().batch_invariant is True
    monkeypatch.setenv("BRIGADE_BATCH_INVARIANT", "maybe")
    with pytest.raises(ValueError, match="BRIGADE_BATCH_INVARIANT='maybe': 'maybe' is not a flag"):
        engine_config_from_env()
    monkeypatch.delenv("BRIGADE_BATCH_INVARIANT")
    assert engine_config_from_env().enable_prefix_caching is True  # on when served
    monkeypatch.setenv("BRIGADE_PREFIX_CACHING", "0")
    assert engine_config_from_env().enable_prefix_caching is False
    monkeypatch.delenv("BRIGADE_PREFIX_CACHING")
    monkeypatch.setenv("BRIGADE_NUM_SPECULATIVE_TOKENS", "4")
    assert engine_config_from_env().num_speculative_tokens == 4
    monkeypatch.delenv("BRIGADE_NUM_SPECULATIVE_TOKENS")
    assert engine_config_from_env().quantized_gemv is True
    monkeypatch.setenv("BRIGADE_QUANTIZED_GEMV", "0")
    assert engine_config_from_env().quantized_gemv is False
    monkeypatch.delenv("BRIGADE_QUANTIZED_GEMV")
    assert engine_config_from_env().fused_decode is True
    monkeypatch.setenv("BRIGADE_FUSED_DECODE", "0")
    assert engine_config_from_env().fused_decode is False
    monkeypatch.delenv("BRIGADE_FUSED_DECODE")
    assert engine_config_from_env().screened_head is True
    monkeypatch.setenv("BRIGADE_SCREENED_HEAD", "0")
    assert engine_config_from_env().screened_head is False
    monkeypatch.delenv("BRIGADE_SCREENED_HEAD")
    assert engine_config_from_env().amx_prefill is True
    monkeypatch.setenv("BRIGADE_AMX_PREFILL", "0")
    assert engine_config_from_env().amx_prefill is False
    monkeypatch.delenv("BRIGADE_AMX_PREFILL")
    assert engine_config_from_env().kv_cache_dtype == "auto"
    monkeypatch.setenv("BRIGADE_KV_CACHE_DTYPE", "float16")
    assert engine_config_from_env().kv_cache_dtype == "float16"
    monkeypatch.setenv("BRIGADE_DTYPE", "bfloat16")  # a pair the engine refuses, and says why
    with pytest.raises(ValueError, match="float16 under float32, on the CPU"):
        engine_config_from_env()
    monkeypatch.delenv("BRIGADE_DTYPE")
    monkeypatch.delenv("BRIGADE_KV_CACHE_DTYPE")
    monkeypatch.setenv("BRIGADE_MAX_NUM_SEQS", "four")
    with pytest.raises(ValueError, match="BRIGADE_MAX_NUM_SEQS='four'"):
        engine_config_from_env()


def test_structured_output_fields_map_to_one_constraint():
    from engine.params import Constraint
    from schemas.events import JsonSchemaFormat, ResponseFormat

    schema = {"type": "object", "properties": {"b": {}, "a": {}}}
    cases = [
        (Sampling(), None),
        (Sampling(response_format=ResponseFormat(type="text")), None),
        (Sampling(response_format=ResponseFormat(type="json_object")), Constraint("json_object")),
        (
            Sampling(
                response_format=ResponseFormat(
                    type="json_schema", json_schema=JsonSchemaFormat(schema=schema, strict=True)
                )
            ),
            Constraint.json_schema(schema),
        ),
        (Sampling(guided_json=schema), Constraint.json_schema(schema)),
        (
            Sampling(guided_json='{"type": "integer"}'),
            Constraint("json_schema", '{"type":"integer"}'),
        ),
        (Sampling(guided_regex="[0-9]+"), Constraint("regex", "[0-9]+")),
        (Sampling(guided_choice=["a", "b"]), Constraint.choice(["a", "b"])),
        (Sampling(guided_grammar='root ::= "x"'), Constraint("grammar", 'root ::= "x"')),
    ]
    for wire, expected in cases:
        assert sampling_params(wire, "r").constraint == expected, wire
    with pytest.raises(StageError) as info:
        sampling_params(Sampling(guided_regex="a", min_tokens=2), "r")
    assert info.value.field == "min_tokens"
