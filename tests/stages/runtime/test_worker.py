"""The shared stage runtime against a real nats-server: poison, crash redelivery, dedupe, drain."""

from __future__ import annotations

import os
import signal
import time

import anyio
import pytest

from schemas import subjects
from schemas.events import (
    CancelRequested,
    Message,
    Request,
    RequestAccepted,
    RequestAuthorized,
    RequestFailed,
    decoder_for,
)
from stages.runtime.bus import Bus, BusConfig
from stages.runtime.worker import StageError, StageSpec, StageWorker, serve

pytestmark = pytest.mark.anyio


def accepted(request_id: str, text: str) -> RequestAccepted:
    return RequestAccepted(
        request_id=request_id,
        tenant="t1",
        request=Request(messages=[Message(role="user", content=text)]),
    )


def handle(event: RequestAccepted, state: dict) -> list[RequestAuthorized]:
    text = event.request.messages[0].content
    state.setdefault("seen", []).append(event.request_id)
    if text == "boom":
        raise ValueError("the handler broke")
    if text == "refuse":
        raise StageError("forbidden", "tenant t1 may not use model x", field="model")
    return [RequestAuthorized(request_id=event.request_id, tenant="t1", request=event.request)]


def make_spec(state: dict, **kw) -> StageSpec:
    async def setup(ctx) -> dict:
        return state

    return StageSpec(
        name="echo",
        input_event="accepted",
        decoder=decoder_for(RequestAccepted),
        handle=kw.pop("handle", handle),
        setup=setup,
        ack_wait_s=1.0,
        max_deliver=3,
        **kw,
    )


async def wait_for(bus: Bus, subject: str, count: int, timeout_s: float = 5.0) -> int:
    """Messages stored under `subject` once `count` are there (or the timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        info = await bus.js.stream_info(subjects.EVENTS_STREAM, subjects_filter=subject)
        n = sum((info.state.subjects or {}).values())
        if n >= count or time.monotonic() > deadline:
            return n
        await anyio.sleep(0.02)


async def pending(bus: Bus) -> tuple[int, int]:
    info = await bus.js.consumer_info(subjects.EVENTS_STREAM, subjects.durable_name("echo"))
    return info.num_ack_pending, info.num_pending


async def test_handles_stamps_and_fails_precisely(bus_config: BusConfig) -> None:
    bus = await Bus.connect(bus_config)
    state: dict = {}
    stop, ready = anyio.Event(), anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(
            lambda: serve(
                make_spec(state), config=bus_config, stop=stop, ready=ready, handle_signals=False
            )
        )
        await ready.wait()
        before = time.time_ns()
        for rid, text in [("ok1", "hi"), ("boom1", "boom"), ("no1", "refuse")]:
            await bus.publish(accepted(rid, text))
        # poison: a known request id but a wrong field type; and bytes with no request id at all
        await bus.js.publish(
            "llm.ev.bad1.accepted",
            b'{"type":"accepted","request_id":"bad1","request":{"messages":7}}',
        )
        await bus.js.publish("llm.ev.junk.accepted", b"\xff not json")
        assert await wait_for(bus, "llm.ev.*.failed", 3) == 3
        assert await wait_for(bus, "llm.ev.*.authorized", 1) == 1
        for _ in range(100):
            if await pending(bus) == (0, 0):
                break
            await anyio.sleep(0.02)
        assert await pending(bus) == (0, 0)  # everything acked, poison included
        stop.set()

    ok = await bus.replay("ok1")
    assert [type(e) for e in ok] == [RequestAccepted, RequestAuthorized]
    assert ok[1].service_ns > 0 and ok[1].ts_ns >= before and ok[1].tenant == "t1"
    (boom,) = [e for e in await bus.replay("boom1") if isinstance(e, RequestFailed)]
    assert (boom.stage, boom.code, boom.message) == (
        "echo",
        "internal",
        "ValueError: the handler broke",
    )
    (no,) = [e for e in await bus.replay("no1") if isinstance(e, RequestFailed)]
    assert (no.code, no.field, no.message) == (
        "forbidden",
        "model",
        "tenant t1 may not use model x",
    )
    (bad,) = [e for e in await bus.replay("bad1") if isinstance(e, RequestFailed)]
    assert (bad.code, bad.field) == ("invalid_request", "request.messages")
    assert bad.message == "invalid accepted: Expected `array`, got `int` - at `$.request.messages`"
    assert sorted(state["seen"]) == ["boom1", "no1", "ok1"]  # each handled exactly once
    await bus.close()


async def test_crash_before_ack_redelivers_and_dedupes_output(bus_config: BusConfig) -> None:
    """Worker A publishes its output and dies before the ack; B gets the redelivery."""
    bus = await Bus.connect(bus_config)
    published = anyio.Event()

    class DiesBeforeAck(StageWorker):
        async def complete(self, msg, outputs, started_ns):  # noqa: ANN001
            await self.bus.publish_all(outputs)
            published.set()
            await anyio.sleep_forever()

    state_a: dict = {}
    a_bus = await Bus.connect(bus_config)
    a = DiesBeforeAck(make_spec(state_a), a_bus)
    async with anyio.create_task_group() as tg:
        tg.start_soon(a.run, anyio.Event())
        while a._sub is None:
            await anyio.sleep(0.01)
        await bus.publish(accepted("crash1", "hi"))
        with anyio.fail_after(5):
            await published.wait()
        tg.cancel_scope.cancel()
    await a_bus.nc.close()  # the process is gone: no ack, no nak

    state_b: dict = {}
    stop, ready = anyio.Event(), anyio.Event()
    t0 = time.monotonic()
    async with anyio.create_task_group() as tg:
        tg.start_soon(
            lambda: serve(
                make_spec(state_b), config=bus_config, stop=stop, ready=ready, handle_signals=False
            )
        )
        await ready.wait()
        for _ in range(300):
            if state_b.get("seen") and await pending(bus) == (0, 0):
                break
            await anyio.sleep(0.02)
        stop.set()
    assert state_a["seen"] == ["crash1"] and state_b["seen"] == ["crash1"]
    assert 0.8 < time.monotonic() - t0 < 4.0  # redelivered after ack_wait (1 s)
    assert await wait_for(bus, "llm.ev.crash1.authorized", 1) == 1  # B's publish was a duplicate
    assert await pending(bus) == (0, 0)
    await bus.close()


async def test_cancelled_requests_are_skipped(bus_config: BusConfig) -> None:
    bus = await Bus.connect(bus_config)
    state: dict = {}
    stop, ready = anyio.Event(), anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(
            lambda: serve(
                make_spec(state), config=bus_config, stop=stop, ready=ready, handle_signals=False
            )
        )
        await ready.wait()
        await bus.publish(CancelRequested(request_id="gone1"))
        await bus.nc.flush()
        await anyio.sleep(0.05)
        await bus.publish(accepted("gone1", "hi"))
        await bus.publish(accepted("kept1", "hi"))
        assert await wait_for(bus, "llm.ev.kept1.authorized", 1) == 1
        for _ in range(100):
            if await pending(bus) == (0, 0):
                break
            await anyio.sleep(0.02)
        stop.set()
    assert state["seen"] == ["kept1"]
    assert await wait_for(bus, "llm.ev.gone1.authorized", 1, timeout_s=0.1) == 0
    await bus.close()


async def test_sigterm_finishes_in_flight_then_drains(bus_config: BusConfig) -> None:
    bus = await Bus.connect(bus_config)
    started = anyio.Event()

    async def slow(event: RequestAccepted, state: dict) -> list[RequestAuthorized]:
        started.set()
        await anyio.sleep(0.5)
        return handle(event, state)

    state: dict = {}
    ready = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: serve(make_spec(state, handle=slow), config=bus_config, ready=ready))
        await ready.wait()
        await bus.publish(accepted("slow1", "hi"))
        await started.wait()
        os.kill(os.getpid(), signal.SIGTERM)
    # serve returned: the in-flight message was finished, published and acked before the drain
    assert state["seen"] == ["slow1"]
    assert await wait_for(bus, "llm.ev.slow1.authorized", 1) == 1
    assert await pending(bus) == (0, 0)
    await bus.close()


async def test_message_out_of_deliveries_fails_its_request(bus_config: BusConfig) -> None:
    """A handler that hangs every time: after max_deliver deliveries the request fails."""

    async def hang(event: RequestAccepted, state: dict) -> list[RequestAuthorized]:
        state.setdefault("seen", []).append(event.request_id)
        await anyio.sleep_forever()

    bus = await Bus.connect(bus_config)
    state: dict = {}
    spec = StageSpec(
        name="echo",
        input_event="accepted",
        decoder=decoder_for(RequestAccepted),
        handle=hang,
        setup=lambda ctx: _const(state),
        ack_wait_s=0.3,
        max_deliver=2,
        max_hold_s=0.0,
    )
    ready = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: serve(spec, config=bus_config, ready=ready, handle_signals=False))
        await ready.wait()
        await bus.publish(accepted("hung1", "hi"))
        assert await wait_for(bus, "llm.ev.hung1.failed", 1) == 1
        tg.cancel_scope.cancel()
    assert state["seen"] == ["hung1", "hung1"]
    (failed,) = [e for e in await bus.replay("hung1") if isinstance(e, RequestFailed)]
    assert (failed.stage, failed.code, failed.tenant) == ("echo", "internal", "t1")
    assert failed.message.startswith("echo gave up after 2 deliveries without finishing")
    await bus.close()


async def _const(value):
    return value


async def test_output_above_max_payload_fails_the_request(tmp_path) -> None:
    from stages.runtime import natsd

    server = natsd.start(tmp_path / "small", max_payload=64 * 1024)
    try:
        config = BusConfig(servers=(server.url,))

        def grow(event: RequestAccepted, state: dict) -> list[RequestAuthorized]:
            text = event.request.messages[0].content * 4
            big = Request(messages=[Message(role="user", content=text)])
            return [RequestAuthorized(request_id=event.request_id, tenant="t1", request=big)]

        bus = await Bus.connect(config)
        stop, ready = anyio.Event(), anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(
                lambda: serve(
                    make_spec({}, handle=grow),
                    config=config,
                    stop=stop,
                    ready=ready,
                    handle_signals=False,
                )
            )
            await ready.wait()
            await bus.publish(accepted("big1", "x" * 30_000))
            assert await wait_for(bus, "llm.ev.big1.failed", 1) == 1
            stop.set()
        (failed,) = [e for e in await bus.replay("big1") if isinstance(e, RequestFailed)]
        assert (failed.code, failed.stage) == ("invalid_request", "echo")
        assert failed.message.startswith("the echo stage's output is 120")
        assert "above the NATS server's max_payload of 65536 bytes" in failed.message
        await bus.close()
    finally:
        natsd.stop(server)


async def test_worker_survives_a_server_restart(tmp_path) -> None:
    """The server goes away and comes back on the same port with its data: serving resumes."""
    from stages.runtime import natsd

    server = natsd.start(tmp_path / "n")
    port = int(server.url.rsplit(":", 1)[1])
    config = BusConfig(servers=(server.url,))
    state: dict = {}
    stop, ready = anyio.Event(), anyio.Event()
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(
                lambda: serve(
                    make_spec(state), config=config, stop=stop, ready=ready, handle_signals=False
                )
            )
            await ready.wait()
            natsd.stop(server)
            await anyio.sleep(1.0)
            server = natsd.start(tmp_path / "n", port=port)
            bus = await Bus.connect(config)
            await bus.publish(accepted("after1", "hi"))
            assert await wait_for(bus, "llm.ev.after1.authorized", 1, timeout_s=15) == 1
            stop.set()
        assert state["seen"] == ["after1"]
        await bus.close()
    finally:
        natsd.stop(server)
