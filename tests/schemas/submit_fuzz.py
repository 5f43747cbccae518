"""Seeded bad submits for the llm.in and websocket fuzzers, each with the field its error must
name: wrong types, out-of-range integers and floats, oversized strings and lists, bad enums and
JSON nested past every bound. Values are JSON text, since 100,000 levels cannot be encoded."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

import msgspec

from schemas.events import VOCAB_CEILING

BIG = 2**70
DEPTHS = (65, 1000, 10_000)  # and 100,000 in a few fields
DEEPEST = {"messages": 100_000, "guided_json": 100_000, "zzz_unknown": 100_000}


def _json(value: object) -> bytes:
    return msgspec.json.encode(value)


def _schema(depth: int) -> object:
    schema: dict = {"type": "array", "items": {}}
    inner = schema
    for _ in range(depth):
        inner["items"] = {"type": "array", "items": {}}
        inner = inner["items"]
    return schema


MESSAGE = {"role": "user", "content": "hi"}
BAD: dict[str, list[object]] = {
    "request_id": [5, "a.b", "x" * 65, "", [], {"a": 1}],
    "api_key": [5, [], True],
    "model": [5, [], {"a": 1}, False],
    "messages": [
        "x", 5, {}, [], [5], ["x"], [{"role": "bot", "content": "x"}], [{"role": "user"}],
        [{"content": "x"}], [{"role": "user", "content": 5}],
        [{"role": "user", "content": "x", "name": "n"}], [MESSAGE] * 1025,
        [{"role": "user", "content": "x" * 1_000_001}],
    ],
    "prompt": [5, "", [], ["a"], {"a": 1}, True, "x" * 1_000_001],
    "system": [5, [], {"a": 1}, "x" * 1_000_001],
    "documents": [5, "x", [5], [{}], [{"content": 5}], [{"content": "x", "id": 5}],
                  [{"content": "x"}] * 65],
    "truncation": ["x", 5, None, "DROP_OLDEST"],
    "priority": ["urgent", 5, []],
    "idempotency_key": ["", "k" * 257, 5, []],
    "temperature": [-0.1, 2.01, "x", [], 1e300, True],
    "top_p": [0, -1, 1.01, "x", None],
    "top_k": [0, -1, VOCAB_CEILING + 1, BIG, 1.5, "x"],
    "min_p": [-0.1, 1.1, "x"],
    "max_tokens": [0, -1, 8193, 2**63, 2**64, BIG, 1.5, "9", [], True],
    "min_tokens": [-1, 8193, BIG, "x", 300],  # 300 > max_tokens' default 256
    "seed": [-1, 2**63, 2**64, BIG, 1.5, "x", [1]],
    "stop": ["x", 5, [5], [""], ["x" * 257], ["a"] * 17, [[]]],
    "stop_token_ids": [5, "x", [BIG], [-1], [VOCAB_CEILING], ["a"], [1] * 65, [1.5]],
    "repetition_penalty": [0, -1, 2.01, "x"],
    "presence_penalty": [-2.01, 2.01, "x", BIG],
    "frequency_penalty": [-2.01, 2.01, "x"],
    "ignore_eos": ["yes", 1, [], None],
    "logprobs": [-1, 21, BIG, "x", 1.5],
    "response_format": ["json", 5, {"type": "xml"}, {"type": "json_schema"},
                        {"type": "json_schema", "json_schema": {"name": ""}},
                        {"type": "json_schema", "json_schema": {"schema": _schema(40)}}],
    "guided_json": [5, [1], True, _schema(40), "{nope"],
    "guided_regex": ["", 5, "x" * 100_001, "(("],
    "guided_choice": [[], [""], "x", ["a"] * 257, [5]],
    "guided_grammar": ["", 5, []],
    "logit_bias": [5, "x", [1], {"x": 1}, {"-1": 1}, {"1": 101}, {"1": -100.5}, {"1": "x"},
                   {str(VOCAB_CEILING): 1}, {str(i): 1 for i in range(1025)}],
    "prompt_logprobs": [-1, 21, BIG, "x", 1.5],
    "prompt_token_ids": [5, "x", [], [-1], [VOCAB_CEILING], [BIG], ["a"], [1.5], {"a": 1}],
    "fork_of": [5, "a.b", "x" * 65, "", [], {"a": 1}],
}  # fmt: skip


@dataclass(frozen=True)
class Case:
    field: str
    value: bytes  # JSON text
    base: dict

    def submit(self) -> bytes:
        """The whole submit: a valid base with `field` set to the bad value."""
        head = _json(self.base)[:-1]
        sep = b", " if self.base else b""
        return head + sep + _json(self.field) + b": " + self.value + b"}"


def names(field: str | None, expected: str) -> bool:
    """Does an error's field name `expected` (itself, or a path inside it)?"""
    return field is not None and (
        field == expected or field.startswith((f"{expected}.", f"{expected}["))
    )


def _base(field: str, rng: random.Random) -> dict:
    base: dict = {} if field in ("messages", "prompt") else {"messages": [MESSAGE]}
    for name, value in (("temperature", 0.5), ("max_tokens", 16), ("seed", 7)):
        if name != field and rng.random() < 0.5:
            base[name] = value
    return base


def _deep(depth: int, as_list: bool) -> bytes:
    if as_list:
        return b"[" * depth + b"]" * depth
    return b'{"a": ' * depth + b"1" + b"}" * depth


def bad_cases(seed: int, *, exclude: frozenset[str] = frozenset()) -> Iterator[Case]:
    """Every table value of every field, then JSON too deep in every field (and an unknown one),
    in a seeded order on seeded valid bases."""
    rng = random.Random(seed)
    cases = [
        Case(field, _json(value), _base(field, rng))
        for field, values in BAD.items()
        if field not in exclude
        for value in values
    ]
    for field in [*BAD, "zzz_unknown"]:
        if field in exclude:
            continue
        for depth in (*DEPTHS, *([DEEPEST[field]] if field in DEEPEST else [])):
            for as_list in (True, False):
                cases.append(Case(field, _deep(depth, as_list), _base(field, rng)))
    rng.shuffle(cases)
    yield from cases
