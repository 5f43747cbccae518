"""The edge's other settings on the real pipeline (every stage, the real model, a real
nats-server), driven by the `openai` SDK: on h11 (BRIGADE_EDGE_HTTP; every other edge test runs
on the default, httptools) with an SSE answer's ready chunks written together
(BRIGADE_EDGE_BATCH_SSE), streamed answers are the whole answers, and n = 3 choices (three runs
into one answer: chunks do queue) add up to each choice's text."""

from __future__ import annotations

import anyio
import httpx
import openai
import pytest
from anyio.streams.memory import MemoryObjectReceiveStream

from stages.edge.openai_routes import _with_ready
from tests.stages.edge_harness import ACME_KEY, MODEL
from tests.stages.pipeline_harness import acme_pipeline

pytestmark = pytest.mark.anyio
ASK = [{"role": "user", "content": "Name three rivers."}]


@pytest.fixture(scope="module")
def anyio_backend():
    return "asyncio", {"use_uvloop": True}


@pytest.fixture(scope="module")
async def pipeline(tmp_path_factory):
    data = tmp_path_factory.mktemp("levers")
    async with acme_pipeline(data, http="h11", batch_sse=True) as running:
        yield running


async def test_ready_chunks_leave_as_one_write_in_order():
    send, receive = anyio.create_memory_object_stream[bytes](max_buffer_size=8)
    for piece in (b"a", b"b", b"c"):
        send.send_nowait(piece)
    first = receive.receive_nowait()
    assert _with_ready(first, receive) == b"abc"
    assert _with_ready(b"x", receive) == b"x"  # nothing waiting: the piece alone
    send.close()
    assert _with_ready(b"y", receive) == b"y"  # closed and empty
    assert isinstance(receive, MemoryObjectReceiveStream)


async def test_streamed_answers_on_h11_with_batched_writes_are_the_whole_answers(pipeline):
    edge, _ = pipeline
    client = openai.AsyncOpenAI(base_url=f"{edge.url}/v1", api_key=ACME_KEY, max_retries=0)
    args = {"model": MODEL, "messages": ASK, "max_tokens": 12, "temperature": 0}
    whole = await client.chat.completions.create(**args)
    streamed = ""
    async for chunk in await client.chat.completions.create(**args, stream=True):
        streamed += chunk.choices[0].delta.content or "" if chunk.choices else ""
    assert streamed == whole.choices[0].message.content and streamed

    sampled = {**args, "temperature": 1.0, "seed": 3}
    three = await client.chat.completions.create(**sampled, n=3)
    texts = [c.message.content for c in three.choices]
    got = {0: "", 1: "", 2: ""}
    async for chunk in await client.chat.completions.create(**sampled, n=3, stream=True):
        for c in chunk.choices:
            got[c.index] += c.delta.content or ""
    assert [got[i] for i in range(3)] == texts


async def test_h11_keeps_the_edges_errors_and_keep_alive(pipeline):
    edge, _ = pipeline
    async with httpx.AsyncClient(base_url=edge.url, timeout=30) as http:
        bad = await http.post(
            "/v1/chat/completions",
            headers={"Authorization": f"Bearer {ACME_KEY}"},
            json={"model": MODEL, "messages": ASK, "max_tokens": -1},
        )
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
        ok = await http.get("/v1/models", headers={"Authorization": f"Bearer {ACME_KEY}"})
        assert ok.status_code == 200 and ok.json()["data"][0]["id"] == MODEL
