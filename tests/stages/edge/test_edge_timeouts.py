"""What the client is told is what happens: a streamed request that times out before its first
token is cancelled (and never starts later, even at a gateway that starts after the cancel), or,
with an idempotency key, reported as still running and resumable; while NATS is away the edge
answers 503 with Retry-After and submits nothing that could run after the bus is back."""

from __future__ import annotations

from urllib.parse import urlparse

import anyio
import httpx
import pytest
from nats.js.errors import NotFoundError

from schemas import subjects
from schemas.events import CancelRequested, RequestAccepted, RunCancelled
from stages import gateway
from stages.runtime import natsd
from stages.runtime import worker as runtime
from stages.runtime.bus import Bus, BusConfig
from tests.stages.edge_harness import ACME_KEY, MODEL, keyring_for_tests, running_edge

pytestmark = pytest.mark.anyio
AUTH = {"Authorization": f"Bearer {ACME_KEY}"}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
        "stream": True}  # fmt: skip


async def _events(config: BusConfig, request_id: str) -> list:
    bus = await Bus.connect(config)
    try:
        return await bus.replay(request_id)
    finally:
        await bus.close()


async def test_a_stream_that_times_out_before_its_first_token_is_cancelled_for_good(
    bus_config, tmp_path
):
    keys = keyring_for_tests(tmp_path)
    async with (
        running_edge(bus_config, keys, deadline_s=1.0) as edge,
        httpx.AsyncClient(base_url=edge.url, timeout=30) as http,
    ):
        r = await http.post("/v1/chat/completions", json=CHAT, headers=AUTH)  # no stage runs
        assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
        assert r.headers["x-brigade-run-state"] == "cancelled"
        assert "cancelled and will not run" in r.json()["error"]["message"]
        rid = r.headers["x-request-id"]
    events = await _events(bus_config, rid)
    assert [type(e) for e in events] == [CancelRequested]
    assert events[0].reason == "timeout"
    # A gateway that starts only now never heard that cancel live: it reads it from the log.
    stop, ready = anyio.Event(), anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: runtime.serve(gateway.SPEC, config=bus_config, stop=stop,
                                            ready=ready, handle_signals=False))  # fmt: skip
        await ready.wait()
        with anyio.fail_after(10):
            while len(events := await _events(bus_config, rid)) < 2:
                await anyio.sleep(0.1)
        stop.set()
    assert not any(isinstance(e, RequestAccepted) for e in events)  # it never started
    assert isinstance(events[-1], RunCancelled) and events[-1].stage == "gateway"


async def test_a_keyed_stream_that_times_out_is_reported_running_and_resumable(
    bus_config, tmp_path
):
    keys = keyring_for_tests(tmp_path)
    async with (
        running_edge(bus_config, keys, deadline_s=1.0, reconnect_grace_s=30.0) as edge,
        httpx.AsyncClient(base_url=edge.url, timeout=30) as http,
    ):
        headers = {**AUTH, "Idempotency-Key": "k-timeout-1"}
        r = await http.post("/v1/chat/completions", json=CHAT, headers=headers)
        assert r.status_code == 504 and r.headers["x-brigade-run-state"] == "running"
        rid = r.headers["x-request-id"]
        assert f"GET /v1/runs/{rid}/stream" in r.json()["error"]["message"]
        await anyio.sleep(0.5)
        assert await _events(bus_config, rid) == []  # not cancelled: it may still run


async def test_while_nats_is_away_the_edge_answers_503_and_submits_nothing(nats_server, tmp_path):
    config = BusConfig(servers=(nats_server.url,), ack_wait_s=2.0, max_deliver=3)
    keys = keyring_for_tests(tmp_path)
    port = urlparse(nats_server.url).port
    restarted = None
    try:
        async with (
            running_edge(config, keys, idle_timeout_s=5.0) as edge,
            httpx.AsyncClient(base_url=edge.url, timeout=30) as http,
        ):
            natsd.stop(nats_server)
            answers = [
                await http.post(
                    "/v1/chat/completions", json={**CHAT, "stream": stream}, headers=AUTH
                )  # fmt: skip
                for stream in (True, False)
            ]
            for r in answers:
                assert r.status_code == 503, r.text
                assert r.headers["retry-after"] == "1"
                assert r.json()["error"]["code"] == "unavailable"
            restarted = natsd.start(nats_server.data_dir, port=port)
            with anyio.fail_after(15):  # the edge reconnects by itself and serves again
                while (await http.get("/healthz")).status_code != 200:
                    await anyio.sleep(0.2)
            for r in answers:
                assert await _events(config, r.headers["x-request-id"]) == []
            bus = await Bus.connect(config)
            try:  # no submit waits to run for a client told 503 (the queue is in memory)
                waiting = (await bus.js.stream_info(subjects.SUBMIT_STREAM)).state.messages
            except NotFoundError:
                waiting = 0
            await bus.close()
            assert waiting == 0
    finally:
        if restarted is not None:
            natsd.stop(restarted)
