import pytest

from engine.params import SamplingParams


def test_defaults_are_valid_and_not_greedy():
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens, p.seed) == (1.0, 1.0, None, 16, None)
    assert not p.greedy
    assert SamplingParams(temperature=0.0).greedy


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [
        ("temperature", -0.5, "0 <= temperature <= 100"),
        ("temperature", float("nan"), "0 <= temperature <= 100"),
        ("top_p", 0.0, "0 < top_p <= 1"),
        ("top_p", 1.5, "0 < top_p <= 1"),
        ("top_k", 0, "None or an integer >= 1"),
        ("top_k", 2.5, "None or an integer >= 1"),
        ("min_p", 1.1, "0 <= min_p <= 1"),
        ("repetition_penalty", 0.0, "0 < x <= 10"),
        ("presence_penalty", 2.5, "-2 <= x <= 2"),
        ("frequency_penalty", -3.0, "-2 <= x <= 2"),
        ("seed", -1, "None or an integer in [0, 2**63)"),
        ("seed", 2**63, "None or an integer in [0, 2**63)"),
        ("max_tokens", 0, "an integer >= 1"),
        ("max_tokens", True, "an integer >= 1"),
        ("min_tokens", 17, "an integer in [0, max_tokens=16]"),
        ("stop_token_ids", (1, -2), "a tuple of integers >= 0"),
        ("logprobs", 21, "None or an integer in [0, 20]"),
        ("ignore_eos", 1, "True or False"),
    ],
)
def test_invalid_values_name_field_value_and_range(field, value, allowed):
    with pytest.raises(ValueError) as info:
        SamplingParams(**{field: value})
    message = str(info.value)
    assert f"SamplingParams.{field}={value!r}" in message
    assert allowed in message


def test_stop_token_ids_list_becomes_tuple_and_params_are_frozen():
    p = SamplingParams(stop_token_ids=[5, 7])
    assert p.stop_token_ids == (5, 7)
    with pytest.raises(AttributeError):
        p.temperature = 0.5  # type: ignore[misc]


def test_logit_bias_is_sorted_pairs_of_id_and_bounded_bias():
    assert SamplingParams(logit_bias={9: -100, 2: 0.5}).logit_bias == ((2, 0.5), (9, -100))
    allowed = "a dict of token id >= 0 -> bias in [-100, 100]"
    for bad in ({1: 100.5}, {1: -101}, {-1: 1.0}, {1: float("nan")}, {1.5: 1.0}, {1: "x"}, 5):
        with pytest.raises(ValueError, match=r"SamplingParams\.logit_bias=") as info:
            SamplingParams(logit_bias=bad)
        assert allowed in str(info.value)
