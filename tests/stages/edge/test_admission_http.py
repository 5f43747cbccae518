"""Admission through the real edge (uvicorn on a real nats-server, no engine behind it, so a
submitted run waits for its first token): a request that can never fit the model's window is a
400 naming the limit on an idle server; past the time bound a request is refused at once with
a Retry-After from the queue."""

from __future__ import annotations

import time

import anyio
import httpx
import pytest

from schemas import subjects
from stages.edge.admission import AdmissionConfig
from stages.runtime.bus import Bus
from tests.stages.edge_harness import ACME_KEY, MODEL, keyring_for_tests, running_edge

pytestmark = pytest.mark.anyio
AUTH = {"Authorization": f"Bearer {ACME_KEY}"}


def chat(content: str, max_tokens: int = 16) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens}  # fmt: skip


@pytest.fixture
async def edge(bus_config, tmp_path):
    admission = AdmissionConfig(max_wait_s=0.05, burst_wait_s=0.05, prefill_tok_s=100.0)
    async with running_edge(bus_config, keyring_for_tests(tmp_path), admission=admission) as e:
        yield e


@pytest.mark.parametrize("size", [260_000, 1_000_000])
async def test_a_prompt_over_the_window_is_a_400_naming_the_limit_on_an_idle_server(edge, size):
    async with httpx.AsyncClient(base_url=edge.url, headers=AUTH, timeout=30) as http:
        reply = await http.post("/v1/chat/completions", json=chat("word " * (size // 5)))
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert (error["code"], error["param"]) == ("context_length", "messages")
    assert "8192-token context window (BRIGADE_MAX_MODEL_LEN)" in error["message"]
    assert reply.headers["x-request-id"]


async def test_max_tokens_that_fill_the_window_are_a_400(edge):
    async with httpx.AsyncClient(base_url=edge.url, headers=AUTH, timeout=30) as http:
        reply = await http.post("/v1/chat/completions", json=chat("Hi", max_tokens=8192))
    assert reply.status_code == 400
    assert (reply.json()["error"]["code"], reply.json()["error"]["param"]) == (
        "context_length",
        "max_tokens",
    )


async def test_past_the_time_bound_a_request_is_refused_with_retry_after_from_the_queue(
    edge, bus_config
):
    bus = await Bus.connect(bus_config)
    prompt = "x" * 400  # ~108 tokens: ~1.1 s at the configured 100 tokens/s
    async with httpx.AsyncClient(base_url=edge.url, headers=AUTH, timeout=30) as http:
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: http.post("/v1/chat/completions", json=chat(prompt)))  # waits
            with anyio.fail_after(10):
                while not await submitted(bus):  # admitted first, then queued on llm.in
                    await anyio.sleep(0.01)
            began = time.monotonic()
            refused = await http.post("/v1/chat/completions", json=chat(prompt))
            elapsed = time.monotonic() - began
            tg.cancel_scope.cancel()
    await bus.close()
    assert refused.status_code == 503, refused.text
    assert refused.json()["error"]["code"] == "overloaded"
    assert "BRIGADE_EDGE_MAX_WAIT_S" in refused.json()["error"]["message"]
    assert refused.headers["retry-after"] == "2"  # the one run ahead: 108 tokens at 100/s
    assert elapsed < 0.5, elapsed


async def submitted(bus: Bus) -> bool:
    return (await bus.js.stream_info(subjects.SUBMIT_STREAM)).state.messages > 0
