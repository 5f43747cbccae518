"""Admission through the real edge (uvicorn on a real nats-server, no engine behind it, so a
submitted run waits for its first token): a request that can never fit the model's window is a
400 naming the limit on an idle server; past the time bound a request is refused at once with
a Retry-After from the queue, and the same request sent again then keeps its place."""

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


async def test_the_same_request_sent_again_at_its_retry_time_keeps_its_place(bus_config, tmp_path):
    """Steady bound 0.05 s, the burst's 5 s for places only (never quiet): a second request is
    refused past the steady bound; sent again (the same body, the same key) after its
    retry-after-ms it is held to the burst's bound and submitted. Another body sent at that
    moment is still refused."""
    admission = AdmissionConfig(max_wait_s=0.05, burst_wait_s=5.0, quiet_s=0.0, prefill_tok_s=100.0)
    keys = keyring_for_tests(tmp_path)
    async with running_edge(bus_config, keys, admission=admission) as edge:
        bus = await Bus.connect(bus_config)
        prompt = "x" * 400  # ~108 tokens: ~1.1 s at 100 tokens/s
        replies = []

        async def send(body: str) -> None:
            replies.append(await http.post("/v1/chat/completions", json=chat(body)))

        async with httpx.AsyncClient(base_url=edge.url, headers=AUTH, timeout=30) as http:
            async with anyio.create_task_group() as tg:
                tg.start_soon(send, prompt)  # admitted alone; waits (no engine)
                with anyio.fail_after(10):
                    while await num_submitted(bus) < 1:
                        await anyio.sleep(0.01)
                refused = await http.post("/v1/chat/completions", json=chat("z" * 400))
                assert refused.status_code == 503, refused.text
                assert "BRIGADE_EDGE_MAX_WAIT_S" in refused.json()["error"]["message"]
                retry_ms = int(refused.headers["retry-after-ms"])
                assert 1080 <= retry_ms <= 1100  # the run ahead's prefill
                await anyio.sleep(retry_ms / 1000)
                other = await http.post("/v1/chat/completions", json=chat("w" * 400))
                assert other.status_code == 503, other.text
                tg.start_soon(send, "z" * 400)
                with anyio.fail_after(10):
                    while await num_submitted(bus) < 2 and not replies:
                        await anyio.sleep(0.01)
                assert not replies, replies[0].text  # submitted, waiting for a first token
                tg.cancel_scope.cancel()
        await bus.close()


async def num_submitted(bus: Bus) -> int:
    return (await bus.js.stream_info(subjects.SUBMIT_STREAM)).state.messages
