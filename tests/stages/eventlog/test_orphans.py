"""A dead edge's runs end cancelled, on a real nats-server: the sweeper's edge watch cancels the
runs of an edge worker whose connection is gone (reason `disconnect`), a keyed run only after
the reconnect grace and only if no edge follows it then; a real edge process SIGKILLed
mid-stream leaves its run cancelled and billed for the tokens it had, no more."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import anyio
import httpx
import nats
import pytest

from schemas import settings
from schemas.events import (
    CancelRequested,
    Message,
    Request,
    RequestAccepted,
    RunBilled,
    RunCancelled,
    RunCompleted,
    TokensGenerated,
)
from stages.edge.follow import answer_edge_pings, answer_run_follows
from stages.eventlog.orphans import EdgeWatch
from stages.runtime import natsd
from stages.runtime.bus import Bus, BusConfig
from tests.stages.edge_harness import ACME_KEY, MODEL, free_port, keyring_for_tests
from tools.stage import PIPELINE, serve_stage

pytestmark = pytest.mark.anyio


def _accepted(rid: str, edge: str, key: str | None = None) -> RequestAccepted:
    request = Request(messages=[Message(role="user", content="hi")], edge_worker=edge,
                      idempotency_key=key)  # fmt: skip
    return RequestAccepted(request_id=rid, tenant="acme", request=request)


async def _cancels(bus: Bus, rid: str) -> list[CancelRequested]:
    return [e for e in await bus.replay(rid) if isinstance(e, CancelRequested)]


async def test_the_runs_of_a_gone_edge_are_cancelled(bus_config: BusConfig) -> None:
    bus = await Bus.connect(bus_config)
    edge_a = await nats.connect(bus_config.servers[0])
    edge_b = await nats.connect(bus_config.servers[0])
    await bus.ensure_streams()
    try:
        await answer_edge_pings(edge_a, "edge-a")
        await answer_edge_pings(edge_b, "edge-b")
        await answer_run_follows(edge_b, "a-keyed-back")  # its client came back through b
        watch = EdgeWatch(bus, check_s=0.05, grace_s=0.3, reconnect_grace_s=1.0)
        stopping = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(watch.run, stopping)
            await anyio.sleep(0.2)  # subscribed
            for event in (
                _accepted("a-plain", "edge-a"),
                _accepted("a-keyed-back", "edge-a", "k1"),
                _accepted("a-keyed-gone", "edge-a", "k2"),
                _accepted("a-ended", "edge-a"),
                _accepted("b-plain", "edge-b"),
            ):
                await bus.publish(event)
            await bus.publish(RunCompleted(request_id="a-ended", tenant="acme",
                                           finish_reason="stop"))  # fmt: skip
            with anyio.fail_after(5):
                while set(watch.runs) != {"a-plain", "a-keyed-back", "a-keyed-gone", "b-plain"}:
                    await anyio.sleep(0.02)
            await anyio.sleep(0.5)
            assert watch.num_cancelled == 0  # both edges answer
            await edge_a.close()  # as a killed process's connection ends
            with anyio.fail_after(5):
                while not await _cancels(bus, "a-plain"):
                    await anyio.sleep(0.05)
            (cancel,) = await _cancels(bus, "a-plain")
            assert (cancel.reason, cancel.tenant) == ("disconnect", "acme")
            assert await _cancels(bus, "a-keyed-gone") == []  # keyed: its reconnect grace first
            with anyio.fail_after(5):
                while not await _cancels(bus, "a-keyed-gone"):
                    await anyio.sleep(0.05)
            await anyio.sleep(0.3)
            stopping.set()
        assert await _cancels(bus, "a-keyed-back") == []  # followed through another edge
        assert await _cancels(bus, "b-plain") == [] and await _cancels(bus, "a-ended") == []
        assert watch.num_cancelled == 2 and set(watch.runs) == {"b-plain"}
    finally:
        await edge_b.close()
        await bus.close()


async def test_a_killed_edge_process_leaves_its_run_cancelled_and_billed_as_far_as_it_went(
    tmp_path, monkeypatch
) -> None:
    keyring_for_tests(tmp_path)
    env = {settings.TENANTS.name: str(tmp_path / "tenants.toml"),
           settings.LEDGER_DB.name: str(tmp_path / "ledger.duckdb"),
           settings.SWEEP_EDGE_CHECK_S.name: "0.1", settings.SWEEP_EDGE_GRACE_S.name: "0.3"}  # fmt: skip
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    server = natsd.start(tmp_path / "nats")
    config = BusConfig(servers=(server.url,), ack_wait_s=5.0, max_deliver=3)
    port = free_port()
    edge = None
    try:
        async with anyio.create_task_group() as tg:
            stop = anyio.Event()
            for name in (*PIPELINE, "sweeper"):
                ready = anyio.Event()
                tg.start_soon(lambda n=name, r=ready: serve_stage(
                    n, config=config, stop=stop, ready=r, handle_signals=False))  # fmt: skip
                with anyio.fail_after(120):
                    await ready.wait()
            edge = subprocess.Popen(
                [sys.executable, "-m", "tools.cli", "stage", "edge", "--nats-url", server.url],
                env={**os.environ, **env, settings.EDGE_PORT.name: str(port)},
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
                with anyio.fail_after(60):
                    while True:
                        try:
                            if (await http.get("/healthz")).status_code == 200:
                                break
                        except httpx.TransportError:
                            pass
                        await anyio.sleep(0.2)
                body = {"model": MODEL, "stream": True, "max_tokens": 400, "ignore_eos": True,
                        "temperature": 0, "messages": [{"role": "user", "content": "Count."}]}  # fmt: skip
                auth = {"Authorization": f"Bearer {ACME_KEY}"}
                text = ""
                with pytest.raises(httpx.TransportError):  # the connection is cut
                    async with http.stream("POST", "/v1/chat/completions", json=body,
                                           headers=auth) as r:  # fmt: skip
                        rid = r.headers["x-request-id"]
                        async for line in r.aiter_lines():
                            if line.startswith("data: {"):
                                chunk = json.loads(line.removeprefix("data: "))
                                text += chunk["choices"][0]["delta"].get("content") or ""
                            if text and edge.poll() is None:
                                os.kill(edge.pid, signal.SIGKILL)  # mid-stream
                                edge.wait()
            bus = await Bus.connect(config)
            try:
                with anyio.fail_after(30):
                    while not any(isinstance(e, RunBilled) for e in await bus.replay(rid)):
                        await anyio.sleep(0.2)
                events = await bus.replay(rid)
            finally:
                await bus.close()
            stop.set()
    finally:
        if edge is not None and edge.poll() is None:
            edge.kill()
        natsd.stop(server)
    (cancel,) = [e for e in events if isinstance(e, CancelRequested)]
    assert cancel.reason == "disconnect"
    (end,) = [e for e in events if isinstance(e, RunCancelled | RunCompleted)]
    assert isinstance(end, RunCancelled) and end.reason == "disconnect"
    produced = sum(len(e.token_ids) for e in events if isinstance(e, TokensGenerated))
    (billed,) = [e for e in events if isinstance(e, RunBilled)]
    assert billed.status == "cancelled"
    assert 0 < billed.usage.completion_tokens == produced < 400
