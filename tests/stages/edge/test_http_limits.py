"""The edge's connection bounds on the real server (uvicorn, a real nats-server), with raw
sockets: oversized headers get 431 (not a reset), slow or silent headers and a body shorter than
its Content-Length get 408 within the bound, and ordinary requests and websockets are untouched."""

from __future__ import annotations

import asyncio
import json
import time

import anyio
import pytest
import websockets

from stages.edge.http_limits import PROTOCOLS, HttpLimits, bounded_protocol
from tests.stages.edge_harness import ACME_KEY, keyring_for_tests, running_edge

pytestmark = pytest.mark.anyio
TIMEOUT_S = 0.5


@pytest.fixture(params=PROTOCOLS)
async def edge(request, bus_config, tmp_path):
    """The edge on each of uvicorn's protocols (BRIGADE_EDGE_HTTP): the bounds hold on both."""
    async with running_edge(
        bus_config,
        keyring_for_tests(tmp_path),
        header_timeout_s=TIMEOUT_S,
        body_timeout_s=TIMEOUT_S,
        http=request.param,
    ) as running:
        yield running


async def _open(edge) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", edge.config.port)


async def _read_all(reader: asyncio.StreamReader, timeout_s: float = 5.0) -> bytes:
    """Everything until the server closes (a reset raises)."""
    with anyio.fail_after(timeout_s):
        return await reader.read(-1)


def _status_and_body(raw: bytes) -> tuple[int, dict[str, str], dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, json.loads(body) if body else {}


async def test_a_500_kb_header_gets_431_not_a_reset(edge):
    reader, writer = await _open(edge)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Big: "
        + b"a" * 500_000
        + b"\r\nContent-Length: 2\r\n\r\n{}"
    )
    await writer.drain()  # the server keeps reading what it refuses: no reset while we send
    status, headers, body = _status_and_body(await _read_all(reader))
    writer.close()
    assert status == 431
    assert body["error"]["code"] == "headers_too_large"
    assert "BRIGADE_EDGE_MAX_HEADERS" in body["error"]["message"]
    assert len(headers["x-request-id"]) == 32 and headers["connection"] == "close"


async def test_headers_under_the_limit_and_keep_alive_are_served(edge):
    reader, writer = await _open(edge)
    for _ in range(2):  # two requests on one connection, each within the header bound
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"b" * 8000 + b"\r\n\r\n")
        await writer.drain()
        with anyio.fail_after(5):
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            body = await reader.readexactly(length)
        assert head.startswith(b"HTTP/1.1 200") and json.loads(body)["status"] == "ok"
        await anyio.sleep(TIMEOUT_S * 0.6)  # the header bound counts per request, not per socket
    writer.close()


@pytest.mark.parametrize("sent", [b"", b"GET /healthz HTTP/1.1\r\nHost: x\r\n"])
async def test_silent_or_slow_headers_get_408_within_the_bound(edge, sent):
    reader, writer = await _open(edge)
    began = time.monotonic()
    writer.write(sent)

    async def trickle() -> None:  # a slowloris: one byte of a header every 50 ms
        try:
            while True:
                await anyio.sleep(0.05)
                writer.write(b"x")
                await writer.drain()
        except (ConnectionError, OSError):
            return

    async with anyio.create_task_group() as tg:
        if sent:
            tg.start_soon(trickle)
        raw = await _read_all(reader)
        tg.cancel_scope.cancel()
    elapsed = time.monotonic() - began
    status, headers, body = _status_and_body(raw)
    assert status == 408 and body["error"]["code"] == "request_timeout"
    assert "BRIGADE_EDGE_HEADER_TIMEOUT_S" in body["error"]["message"] and headers["x-request-id"]
    assert TIMEOUT_S * 0.9 <= elapsed < TIMEOUT_S + 1.5, elapsed
    writer.close()


async def test_a_content_length_lie_gets_408_within_the_bound(edge):
    reader, writer = await _open(edge)
    began = time.monotonic()
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
        + f"Authorization: Bearer {ACME_KEY}\r\n".encode()
        + b'Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"model":'
    )
    await writer.drain()
    status, _, body = _status_and_body(await _read_all(reader))
    elapsed = time.monotonic() - began
    assert status == 408 and "BRIGADE_EDGE_BODY_TIMEOUT_S" in body["error"]["message"]
    assert TIMEOUT_S * 0.9 <= elapsed < TIMEOUT_S + 1.5, elapsed
    writer.close()


async def test_many_idle_connections_are_all_closed_within_the_bound(edge):
    conns = [await _open(edge) for _ in range(100)]
    began = time.monotonic()
    with anyio.fail_after(TIMEOUT_S + 3):
        raws = [await reader.read(-1) for reader, _ in conns]
    assert all(raw.startswith(b"HTTP/1.1 408") for raw in raws)
    assert time.monotonic() - began < TIMEOUT_S + 3
    for _, writer in conns:
        writer.close()


async def test_a_websocket_outlives_the_http_bounds(edge):
    auth = {"Authorization": f"Bearer {ACME_KEY}"}
    async with websockets.connect(edge.ws_url, additional_headers=auth) as ws:
        await anyio.sleep(TIMEOUT_S * 3)
        await ws.send(json.dumps({"type": "no.such.type"}))
        with anyio.fail_after(5):
            reply = json.loads(await ws.recv())
    assert reply["type"] == "error"


def test_limits_are_positive():
    with pytest.raises(ValueError, match="positive"):
        HttpLimits(header_timeout_s=0)


def test_an_unknown_protocol_is_refused():
    with pytest.raises(ValueError, match="h11, httptools"):
        bounded_protocol(HttpLimits(), "hyper")
