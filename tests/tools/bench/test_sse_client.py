"""The benchmarks' lean SSE client against a real HTTP server (uvicorn, chunked responses): each
event keeps the arrival time of its last byte, however the server cuts its writes, and a 503 is
waited out for its retry-after-ms and sent again."""

from __future__ import annotations

import json
import socket

import anyio
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from tools.bench.loadgen import SseTarget
from tools.bench.sse_client import post_stream
from tools.bench.workload import WorkItem

pytestmark = pytest.mark.anyio
GAP_S = 0.05


def chunk(content: str | None, finish: str | None = None) -> bytes:
    body = {"choices": [{"index": 0, "delta": {"content": content}, "finish_reason": finish}]}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


async def stream(request: Request):
    body = await request.json()
    assert body["stream"] is True

    async def pieces():
        one, two = chunk("Hel"), chunk("lo")
        yield one[:10]  # an event cut in two writes ...
        await anyio.sleep(GAP_S)
        yield one[10:]  # ... arrives with its second half
        await anyio.sleep(GAP_S)
        yield two + chunk(" world")  # two events in one write
        await anyio.sleep(GAP_S)
        yield chunk(None, "length") + b"data: [DONE]\n\n"

    return StreamingResponse(pieces(), media_type="text/event-stream")


def refusing(times: int):
    """A route that answers 503 (retry after 80 ms) `times` times, then streams."""
    left = [times]

    async def route(request: Request):
        if left[0]:
            left[0] -= 1
            return JSONResponse(
                {"error": {"message": "busy"}}, status_code=503, headers={"retry-after-ms": "80"}
            )
        return await stream(request)

    return route


@pytest.fixture
async def server():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = Starlette(
        routes=[
            Route("/v1/chat/completions", stream, methods=["POST"]),
            Route("/refuse/v1/chat/completions", refusing(1), methods=["POST"]),
        ]
    )
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    async with anyio.create_task_group() as tg:
        tg.start_soon(srv.serve)
        while not srv.started:
            await anyio.sleep(0.01)
        yield f"http://127.0.0.1:{port}"
        srv.should_exit = True


async def test_events_carry_the_arrival_of_their_last_byte(server):
    resp = await post_stream(server + "/v1/chat/completions", {"stream": True}, {}, 10.0)
    assert resp.status == 200 and resp.complete
    assert resp.headers["content-type"].startswith("text/event-stream")
    events = resp.events()
    texts = [json.loads(d)["choices"][0]["delta"]["content"] for _, d in events[:-1]]
    assert texts == ["Hel", "lo", " world", None] and events[-1][1] == "[DONE]"
    stamps = [t for t, _ in events]
    # "Hel" came with the second write, a gap after the first; "lo" and " world" together
    assert resp.pieces[0][0] < stamps[0] == resp.pieces[1][0]
    assert stamps[1] == stamps[2] and (stamps[1] - stamps[0]) / 1e9 >= GAP_S * 0.8


async def test_the_target_measures_a_streamed_answer(server):
    item = WorkItem(index=0, prompt="hi", num_prompt_words=1, max_tokens=3, seed=1)
    sample = await SseTarget(server, None, 10.0, "m").run_one(item, "r0")
    assert sample.ok and sample.error is None and sample.retries == 0
    assert sample.num_tokens == 3 and len(sample.gaps_ms) == 2
    assert sample.gaps_ms[0] >= GAP_S * 1e3 * 0.8 and sample.gaps_ms[1] < GAP_S * 1e3 * 0.5
    assert sample.ttft_ms is not None and sample.ttft_ms >= GAP_S * 1e3 * 0.8  # "Hel" whole


async def test_a_503_is_waited_out_and_sent_again(server):
    item = WorkItem(index=0, prompt="hi", num_prompt_words=1, max_tokens=3, seed=1)
    target = SseTarget(server + "/refuse", None, 10.0, "m", retries_on_503=2)
    sample = await target.run_one(item, "r0")
    assert sample.ok and sample.retries == 1
    assert sample.ttft_ms is not None and sample.ttft_ms >= 80  # the wait counts from the send


async def test_a_refusal_past_the_retries_is_the_samples_error(server):
    item = WorkItem(index=0, prompt="hi", num_prompt_words=1, max_tokens=3, seed=1)
    sample = await SseTarget(server + "/refuse", None, 10.0, "m").run_one(item, "r0")
    assert not sample.ok and sample.error.startswith('HTTP 503: b\'{"error"')


async def test_a_dead_port_is_an_error_not_a_crash():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    item = WorkItem(index=0, prompt="hi", num_prompt_words=1, max_tokens=3, seed=1)
    sample = await SseTarget(f"http://127.0.0.1:{port}", None, 5.0, "m").run_one(item, "r0")
    assert not sample.ok and "ConnectionRefusedError" in sample.error
