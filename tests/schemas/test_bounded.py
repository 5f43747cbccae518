"""Bounded JSON decoding: depth and size refused by path before msgspec recurses."""

from __future__ import annotations

import json
import random

import msgspec
import pytest

from schemas.bounded import (
    MAX_JSON_DEPTH,
    JsonBoundsError,
    check_bounds,
    decode_bounded,
    json_depth,
    value_depth,
    without_deep_values,
)
from schemas.events import Submit
from stages.runtime.failures import error_field

SUBMIT = msgspec.json.Decoder(Submit)


def nested(depth: int, open_: str = "[", close: str = "]") -> str:
    return open_ * depth + close * depth


def test_msgspec_alone_overflows_the_stack_on_deep_input():
    """Why the bound exists: msgspec raises RecursionError (no DecodeError), a 500 upstream."""
    with pytest.raises(RecursionError):
        SUBMIT.decode(b'{"prompt": "x", "zzz": ' + nested(5000).encode() + b"}")


@pytest.mark.parametrize("depth", [1000, 100_000])
def test_deep_input_is_refused_by_path(depth):
    data = '{"prompt": "x", "guided_json": ' + '{"a": ' * depth + "1" + "}" * depth + "}"
    with pytest.raises(JsonBoundsError) as info:
        decode_bounded(SUBMIT, data)
    assert info.value.field == "guided_json.a.a.a.a.a"
    assert error_field(info.value) == "guided_json.a.a.a.a.a"  # the runtime's reader agrees
    assert isinstance(info.value, msgspec.ValidationError)  # every bad-input handler serves it
    assert f"deeper than {MAX_JSON_DEPTH} levels" in str(info.value)


def test_the_limit_is_exact_and_lists_name_their_index():
    ok = '{"stop": [' + nested(MAX_JSON_DEPTH - 2) + "]}"
    check_bounds(ok.encode())
    deep = '{"prompt": "x", "stop": ["a", [0, [1], ' + nested(MAX_JSON_DEPTH - 2) + "]]}"
    with pytest.raises(JsonBoundsError) as info:
        decode_bounded(SUBMIT, deep)
    assert info.value.field == "stop[1][2][0][0][0]"  # the path to 6 levels
    with pytest.raises(JsonBoundsError) as info:
        decode_bounded(None, nested(MAX_JSON_DEPTH + 1))
    assert info.value.field == "[0][0][0][0][0][0]" and "- at `$[0]" in str(info.value)


def test_truncated_deep_input_is_refused_not_overflowed():
    with pytest.raises(JsonBoundsError) as info:
        decode_bounded(SUBMIT, b'{"messages": [' + b"[" * 10_000)
    assert info.value.field == "messages[0][0][0][0][0]"


def test_brackets_inside_strings_do_not_count():
    text = '[\\"{' * 5000  # escaped quotes too
    data = json.dumps({"prompt": text, "system": '"]]]' * 300})
    assert json_depth(data.encode()) == 1
    assert decode_bounded(SUBMIT, data).prompt == text


def test_size_is_bounded():
    with pytest.raises(JsonBoundsError, match="is 101 bytes; at most 100"):
        decode_bounded(SUBMIT, b" " * 101, max_bytes=100)


def python_depth(value) -> int:
    if isinstance(value, dict):
        return 1 + max(map(python_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(python_depth, value), default=0)
    return 0


def test_json_depth_equals_a_recursive_count_on_random_values():
    rng = random.Random(3)

    def value(depth):
        kind = rng.random()
        if depth > 12 or kind < 0.3:
            return rng.choice([1, "x[{", 'q"]}', None, 2.5, "\\"])
        if kind < 0.65:
            return [value(depth + 1) for _ in range(rng.randrange(0, 4))]
        return {f"k{i}]": value(depth + 1) for i in range(rng.randrange(0, 4))}

    for _ in range(300):
        v = value(0)
        assert json_depth(json.dumps(v).encode()) == python_depth(v) == value_depth(v)


def test_without_deep_values_keeps_the_envelope_before_the_deep_value():
    data = (
        b'{"request_id": "abc", "tenant": "t", "x": [1, {"y": ' + nested(100_000).encode()
        + b'}], "after": 1}'
    )  # fmt: skip
    small = without_deep_values(data, 3)  # the first container at depth 4 becomes null
    assert json.loads(small) == {"request_id": "abc", "tenant": "t", "x": [1, {"y": None}]}
    truncated = b'{"request_id": "abc", "x": ' + b"[" * 1000
    assert json.loads(without_deep_values(truncated, 3)) == {"request_id": "abc", "x": [[None]]}
    assert without_deep_values(b'{"a": 1}') == b'{"a": 1}'
