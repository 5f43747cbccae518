"""Waiting for an engine within a deadline the client sees, on a real nats-server with every
stage but the engine: SSE and websocket streams get keep-alives while they wait; past the
deadline the run is cancelled and the client told so (an SSE error event and no [DONE], a
websocket `error`, a 504 saying `cancelled`); an engine that starts later never runs those runs
(it reads their stored cancels) and they are billed as cancelled with nothing used; a request
whose deadline is longer resumes and completes once the engine is up."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import httpx
import msgspec
import pytest
import websockets

from schemas import settings
from schemas.events import (
    CancelRequested,
    RunBilled,
    RunCancelled,
    RunCompleted,
    TokensGenerated,
)
from stages.edge.deadline import DEADLINE_HEADER, deadline_for, requested
from stages.edge.errors import RequestError
from stages.runtime import natsd
from stages.runtime.bus import Bus, BusConfig
from stages.tenancy import tenants
from tests.stages.edge_harness import ACME_KEY, MODEL, keyring_for_tests, running_edge
from tools.stage import serve_stage

pytestmark = pytest.mark.anyio
AUTH = {"Authorization": f"Bearer {ACME_KEY}"}
LIGHT = ("gateway", "auth", "context", "tokenize", "detokenize", "ledger")
KEEPALIVE_S = 0.25


def _chat(content: str, **more) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}],
            "max_tokens": 4, "temperature": 0, **more}  # fmt: skip


@pytest.fixture
def anyio_backend():
    return "asyncio", {"use_uvloop": True}


@asynccontextmanager
async def _stages(config: BusConfig, names: tuple[str, ...], tg) -> AsyncIterator[anyio.Event]:
    stop = anyio.Event()
    for name in names:
        ready = anyio.Event()
        tg.start_soon(lambda n=name, r=ready: serve_stage(n, config=config, stop=stop, ready=r,
                                                          handle_signals=False))  # fmt: skip
        with anyio.fail_after(120):
            await ready.wait()
    try:
        yield stop
    finally:
        stop.set()


async def _replay(config: BusConfig, rid: str) -> list:
    bus = await Bus.connect(config)
    try:
        return await bus.replay(rid)
    finally:
        await bus.close()


async def _billed(config: BusConfig, rid: str) -> list:
    """The run's events once its `billed` is stored."""
    with anyio.fail_after(30):
        while True:
            events = await _replay(config, rid)
            if any(isinstance(e, RunBilled) for e in events):
                return events
            await anyio.sleep(0.2)


async def _sse(http: httpx.AsyncClient, body: dict, headers: dict, lines: list[str]) -> int:
    """Stream one request; every line (comments included) goes into `lines`; its status."""
    async with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
        lines.append(f"x-request-id: {r.headers['x-request-id']}")
        lines.append(f"deadline: {r.headers.get(DEADLINE_HEADER.lower())}")
        async for line in r.aiter_lines():
            if line:
                lines.append(line)
        return r.status_code


def test_the_request_s_own_deadline_is_checked():
    assert requested(None, 5.0) == 5.0 and requested("2.5", 5.0) == 2.5
    for bad in ("0", "-1", "nan", "x", "86401"):
        with pytest.raises(RequestError) as info:
            requested(bad, None)
        assert info.value.field == DEADLINE_HEADER and info.value.code == "invalid_request"


def test_the_request_s_deadline_wins_then_its_tenant_s_then_the_edge_s(tmp_path):
    assert deadline_for(2.0, 30.0, 300.0) == 2.0
    assert deadline_for(None, 30.0, 300.0) == 30.0
    assert deadline_for(None, None, 300.0) == 300.0
    keys = keyring_for_tests(tmp_path)  # acme and globex in a real tenants.toml
    path = tmp_path / "tenants.toml"
    file = tenants.read_file(path)
    file.tenants["acme"] = msgspec.structs.replace(file.tenants["acme"], deadline_s=30.0)
    tenants.write_file(path, file)
    acme = keys.lookup(ACME_KEY)
    assert acme is not None and acme.deadline_s == 30.0
    path.write_text(path.read_text().replace("deadline_s = 30.0", "deadline_s = 0.0"))
    with pytest.raises(ValueError, match="deadline_s"):  # a deadline is > 0
        tenants.read_file(path)


async def test_requests_wait_for_an_engine_within_their_deadline(tmp_path, monkeypatch):
    monkeypatch.setenv(settings.TENANTS.name, str(tmp_path / "tenants.toml"))
    monkeypatch.setenv(settings.LEDGER_DB.name, str(tmp_path / "ledger.duckdb"))
    keys = keyring_for_tests(tmp_path)
    server = natsd.start(tmp_path / "nats")
    config = BusConfig(servers=(server.url,), ack_wait_s=5.0, max_deliver=3)
    try:
        async with anyio.create_task_group() as tg:
            async with (
                _stages(config, LIGHT, tg),
                running_edge(config, keys, keepalive_s=KEEPALIVE_S, deadline_s=60.0) as edge,
                httpx.AsyncClient(base_url=edge.url, timeout=60) as http,
            ):
                await _while_no_engine_then_with_one(config, edge, http, tg)
    finally:
        natsd.stop(server)


async def _while_no_engine_then_with_one(config, edge, http, tg) -> None:
    # 1. SSE past its deadline (1.5 s, the header's): 200 at once, keep-alives, then the error
    short = {**AUTH, DEADLINE_HEADER: "1.5"}
    lines: list[str] = []
    began = time.monotonic()
    assert await _sse(http, _chat("one", stream=True), short, lines) == 200
    waited = time.monotonic() - began
    sse_rid = lines[0].removeprefix("x-request-id: ")
    assert lines[1] == "deadline: 1.5"
    assert 1.5 <= waited < 5.0
    keepalives = [x for x in lines if x == ": keep-alive"]
    assert len(keepalives) >= 3  # one every 0.25 s of the 1.5 s
    data = [x for x in lines if x.startswith("data: ")]
    error = json.loads(data[-1].removeprefix("data: "))["error"]
    assert error["code"] == "timeout" and "cancelled and will not run" in error["message"]
    assert "data: [DONE]" not in lines  # a failed stream ends without it, as vLLM's do

    # 2. the websocket: response.waiting events, then an error past the body's deadline
    async with websockets.connect(edge.ws_url, additional_headers=AUTH) as ws:
        create = {"type": "response.create",
                  "response": {"prompt": "two", "max_tokens": 4, "deadline_s": 1.0}}  # fmt: skip
        await ws.send(json.dumps(create))
        frames = []
        with anyio.fail_after(10):
            while not frames or frames[-1]["type"] != "error":
                frames.append(json.loads(await ws.recv()))
    ws_rid = frames[0]["request_id"]
    waits = [f for f in frames if f["type"] == "response.waiting"]
    assert frames[0]["type"] == "response.created" and len(waits) >= 2
    assert waits[0]["deadline_s"] == 1.0 and waits[0]["started"] is False
    assert waits[-1]["waited_s"] <= 1.05
    assert frames[-1]["error"]["code"] == "timeout"

    # 3. answered whole: a 504 saying the run is cancelled
    r = await http.post("/v1/chat/completions", json=_chat("three", deadline_s=1.0), headers=AUTH)
    assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
    assert r.headers["x-brigade-run-state"] == "cancelled" and r.headers[DEADLINE_HEADER] == "1"
    whole_rid = r.headers["x-request-id"]

    # 4. a stream with a long deadline waits through keep-alives; an engine starts; it completes
    lines = []
    async with anyio.create_task_group() as inner:
        inner.start_soon(_sse, http, _chat("four", stream=True), AUTH, lines)
        with anyio.fail_after(10):
            while lines.count(": keep-alive") < 2:
                await anyio.sleep(0.05)
        engine_stop = anyio.Event()
        ready = anyio.Event()
        tg.start_soon(lambda: serve_stage("engine", config=config, stop=engine_stop, ready=ready,
                                          handle_signals=False))  # fmt: skip
        with anyio.fail_after(120):
            await ready.wait()
    assert lines[1] == "deadline: 60"
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(x.removeprefix("data: ")) for x in lines if x.startswith("data: {")]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text and not any("error" in c for c in chunks)
    ok_rid = lines[0].removeprefix("x-request-id: ")

    # The runs told "cancelled" never ran: the engine read their stored cancels; each is billed
    # once, as cancelled, with nothing used. The one that waited is completed and billed.
    for rid in (sse_rid, ws_rid, whole_rid):
        events = await _billed(config, rid)
        assert not any(isinstance(e, TokensGenerated) for e in events), rid
        (cancel,) = [e for e in events if isinstance(e, CancelRequested)]
        assert cancel.reason == "timeout"
        assert [type(e) for e in events if isinstance(e, RunCancelled | RunCompleted)] == [
            RunCancelled
        ]
        (billed,) = [e for e in events if isinstance(e, RunBilled)]
        assert billed.status == "cancelled"
        assert (billed.usage.prompt_tokens, billed.usage.completion_tokens) == (0, 0)
    events = await _billed(config, ok_rid)
    (billed,) = [e for e in events if isinstance(e, RunBilled)]
    assert billed.status == "completed" and billed.usage.completion_tokens == 4
    engine_stop.set()
