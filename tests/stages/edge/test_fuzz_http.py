"""The HTTP fuzzer: seeded bad bodies to the real edge's chat and completions routes (real
nats-server): JSON 65 to 10,000 deep in every parameter, oversized strings
and lists, wrong types and out-of-range integers; each is a 4xx whose `param` names the
parameter, and the edge still serves afterwards (/v1/models, /tokenize of a normal body)."""

from __future__ import annotations

import random

import httpx
import msgspec
import pytest

from schemas.events import VOCAB_CEILING
from stages.edge.openai_params import BY_ENDPOINT, CHAT, COMPLETIONS, PATHS
from stages.runtime.bus import BusConfig
from tests.schemas.submit_fuzz import names
from tests.stages.edge_harness import ACME_KEY, MODEL, keyring_for_tests, running_edge

pytestmark = pytest.mark.anyio
BIG = 2**70
BASE = {
    CHAT: {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
    COMPLETIONS: {"model": MODEL, "prompt": "Once"},
}
BAD = {  # beyond the schema tests' table: the hostile values of the issue
    "max_tokens": [BIG, 2**64, 0, 8193],
    "max_completion_tokens": [BIG, -1],
    "seed": [BIG, 2**64, -1, 1.5],
    "top_k": [BIG, VOCAB_CEILING + 1, -2],
    "stop_token_ids": [[BIG], [VOCAB_CEILING], [-1], [1] * 65],
    "min_tokens": [BIG, -1],
    "top_logprobs": [BIG, 21],
    "logprobs": {CHAT: ["x", 5], COMPLETIONS: [BIG, 6]},
    "temperature": [1e300, -1, "x"],
    "stop": ["x" * 257, ["x" * 257], ["a"] * 17, [5]],
    "model": [5, ["x"], "m" * 100_000],
    "messages": [[{"role": "user", "content": 5}], [{"role": "bot", "content": "x"}], "x"],
    "prompt": [5, [-5], {"a": 1}, [[BIG]]],
    "n": [BIG, 17],
    "logit_bias": [{str(BIG): 1}, {"1": BIG}, {"x": 1}],
    "tools": [[{"type": "function", "function": {"name": "f", "parameters": {"type": "x"}}}]],
    "tool_choice": [{"type": "function", "function": {"name": "nope"}}, "required"],
    "user": [5, ["x"]],
}


def _json(value: object) -> bytes:
    return msgspec.json.encode(value)


def _deep(depth: int, as_list: bool) -> bytes:
    if as_list:
        return b"[" * depth + b"]" * depth
    return b'{"a": ' * depth + b"1" + b"}" * depth


def cases(seed: int) -> list[tuple[str, str, bytes]]:
    """(endpoint, param, body), seeded order: every parameter of each route JSON-deep, then
    the table's values."""
    out = []
    for endpoint, table in BY_ENDPOINT.items():
        for name in table:
            for depth in (65, 1000, 10_000):
                for as_list in (True, False):
                    out.append((endpoint, name, _deep(depth, as_list)))
        for name, values in BAD.items():
            if isinstance(values, dict):
                values = values[endpoint]
            if name in table:
                out += [(endpoint, name, _json(v)) for v in values]
    bodies = []
    for endpoint, name, value in out:
        base = {k: v for k, v in BASE[endpoint].items() if k != name}
        bodies.append(
            (endpoint, name, _json(base)[:-1] + b", " + _json(name) + b": " + value + b"}")
        )
    random.Random(seed).shuffle(bodies)
    return bodies


async def test_every_bad_body_is_a_4xx_naming_its_param_and_the_edge_lives(
    bus_config: BusConfig, tmp_path
) -> None:
    bodies = cases(seed=5)
    assert len(bodies) >= 300
    wrong = []
    async with (
        running_edge(bus_config, keyring_for_tests(tmp_path)) as edge,
        httpx.AsyncClient(
            base_url=edge.url, headers={"Authorization": f"Bearer {ACME_KEY}"}, timeout=30
        ) as http,
    ):
        for endpoint, name, body in bodies:
            answer = await http.post(
                PATHS[endpoint], content=body, headers={"Content-Type": "application/json"}
            )
            param = answer.json().get("error", {}).get("param")
            if not 400 <= answer.status_code < 500 or not names(param, name):
                wrong.append((endpoint, name, body[:60], answer.status_code, answer.text[:200]))
        models = await http.get("/v1/models")
        tokens = await http.post("/tokenize", json=BASE[CHAT])
    assert not wrong, wrong[:10]
    assert models.status_code == 200 and models.json()["data"][0]["id"] == MODEL
    assert tokens.status_code == 200 and tokens.json()["count"] > 5
