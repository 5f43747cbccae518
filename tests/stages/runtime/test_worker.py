"""The shared stage runtime against a real nats-server: poison, crash redelivery, dedupe, drain."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request

import anyio
import anyio.abc
import pytest

from schemas import subjects
from schemas.events import (
    CancelRequested,
    Message,
    Request,
    RequestAccepted,
    RequestAuthorized,
    RequestFailed,
    RunCancelled,
    decoder_for,
)
from stages.runtime.bus import Bus, BusConfig
from stages.runtime.failures import StageError
from stages.runtime.service import Held, InputService, Service
from stages.runtime.spec import StageSpec
from stages.runtime.worker import StageWorker, serve
from tools.stage_procs import connected

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
    a_ready = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(a.run, anyio.Event(), a_ready)
        await a_ready.wait()
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
    # the skipped run is ended, not dropped: its terminal event names the stage and the reason
    msg = await bus.js.get_last_msg(subjects.EVENTS_STREAM, "llm.ev.gone1.cancelled")
    ended = decoder_for(RunCancelled).decode(msg.data)
    assert (ended.tenant, ended.reason, ended.stage) == ("t1", "client", "echo")
    assert await wait_for(bus, "llm.ev.kept1.cancelled", 1, timeout_s=0.1) == 0
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


# ---- long-running handlers (services) ----


class Holder(InputService):
    """Holds each input until its request is cancelled (then completes it with `authorized`),
    or until the stop for those in `finish_on_stop`; the rest it never settles."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held: dict[str, tuple[Held, RequestAccepted]] = {}
        self.admitted: list[tuple[str, int]] = []  # (request id, delivery)
        self.cancels: list[CancelRequested] = []
        self.finish_on_stop: set[str] = set()
        self._tg: anyio.abc.TaskGroup | None = None

    def capacity(self) -> int:
        return self.limit - len(self.held)

    async def admit(self, held: Held, event: RequestAccepted) -> None:
        assert len(self.held) < self.limit, "handed an input beyond capacity()"
        self.held[event.request_id] = (held, event)
        self.admitted.append((event.request_id, held.num_delivered))

    def on_cancel(self, cancel: CancelRequested) -> None:
        self.cancels.append(cancel)
        if cancel.request_id in self.held and self._tg is not None:
            self._tg.start_soon(self.finish, cancel.request_id)

    async def finish(self, request_id: str) -> None:
        held, event = self.held.pop(request_id)
        await held.complete(
            [RequestAuthorized(request_id=request_id, tenant="t1", request=event.request)]
        )

    async def run(self, stopping, *, task_status) -> None:  # noqa: ANN001
        async with anyio.create_task_group() as tg:
            self._tg = tg
            task_status.started()
            await stopping.wait()
            for request_id in self.finish_on_stop & set(self.held):
                tg.start_soon(self.finish, request_id)


def holder_spec(holder: Holder, **kw) -> StageSpec:
    return StageSpec(
        name="echo",
        input_event="accepted",
        decoder=decoder_for(RequestAccepted),
        service=lambda ctx, state: holder,
        skip_cancelled=False,
        **kw,
    )


def subscriptions(monitor_url: str, name: str) -> list[str]:
    """The subjects the client named brigade-<name> subscribes to, from the server's monitor
    (less its request-reply inboxes)."""
    with urllib.request.urlopen(f"{monitor_url}/connz?subs=1&limit=1024", timeout=2) as r:
        conns = json.load(r)["connections"]
    (conn,) = [c for c in conns if c.get("name") == f"brigade-{name}"]
    return [s for s in conn.get("subscriptions_list", []) if not s.startswith("_INBOX.")]


async def until(check, timeout_s: float = 5.0) -> None:  # noqa: ANN001
    with anyio.fail_after(timeout_s):
        while not check():
            await anyio.sleep(0.02)


async def test_a_service_is_paced_by_capacity_and_hears_the_one_cancel_subscription(
    bus_config: BusConfig, nats_server
) -> None:
    bus = await Bus.connect(bus_config)
    holder = Holder(limit=2)
    stop, ready = anyio.Event(), anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(
            lambda: serve(
                holder_spec(holder, ack_wait_s=30.0),
                config=bus_config,
                stop=stop,
                ready=ready,
                handle_signals=False,
            )
        )
        await ready.wait()
        subs = subscriptions(nats_server.monitor_url, "echo")
        assert subs.count(subjects.all_events("cancel")) == 1
        for i in range(6):
            await bus.publish(accepted(f"p{i}", "hi"))
        await until(lambda: len(holder.admitted) == 2)
        await anyio.sleep(0.3)  # room for a third, if the pull took more than capacity()
        assert await pending(bus) == (2, 4)  # only what it could admit was taken from the durable
        await bus.publish(CancelRequested(request_id="p0", reason="stop_string", seq=3))
        for i in range(1, 6):
            await until(lambda n=i: len(holder.admitted) == min(n + 2, 6))
            await bus.publish(CancelRequested(request_id=f"p{i}"))
        assert await wait_for(bus, "llm.ev.*.authorized", 6) == 6
        await until(lambda: not holder.held)
        stop.set()
    assert holder.admitted == [(f"p{i}", 1) for i in range(6)]  # in order, each once
    assert (holder.cancels[0].reason, holder.cancels[0].seq) == ("stop_string", 3)
    assert await pending(bus) == (0, 0)
    await bus.close()


async def test_a_held_input_is_kept_alive_past_ack_wait(bus_config: BusConfig) -> None:
    bus = await Bus.connect(bus_config)
    holder = Holder(limit=2)
    stop, ready = anyio.Event(), anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(
            lambda: serve(
                holder_spec(holder, ack_wait_s=1.0, max_deliver=3),
                config=bus_config,
                stop=stop,
                ready=ready,
                handle_signals=False,
            )
        )
        await ready.wait()
        await bus.publish(accepted("k1", "hi"))
        await until(lambda: len(holder.admitted) == 1)
        await anyio.sleep(2.5)  # 2.5 x ack_wait: in-progress acks keep it from redelivery
        info = await bus.js.consumer_info(subjects.EVENTS_STREAM, subjects.durable_name("echo"))
        assert (info.num_ack_pending, info.num_redelivered) == (1, 0)
        await bus.publish(CancelRequested(request_id="k1"))
        assert await wait_for(bus, "llm.ev.k1.authorized", 1) == 1
        stop.set()
    assert holder.admitted == [("k1", 1)]
    assert await pending(bus) == (0, 0)
    await bus.close()


async def test_a_stop_drains_within_the_bound_then_hands_back_the_rest(
    bus_config: BusConfig,
) -> None:
    """ack_wait is 30 s: the held input comes back to the next worker at once only if naked."""
    bus = await Bus.connect(bus_config)
    holder = Holder(limit=2)
    holder.finish_on_stop = {"k1"}
    stop, ready = anyio.Event(), anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(
            lambda: serve(
                holder_spec(holder, ack_wait_s=30.0, drain_s=0.5),
                config=bus_config,
                stop=stop,
                ready=ready,
                handle_signals=False,
            )
        )
        await ready.wait()
        await bus.publish(accepted("k1", "hi"))
        await bus.publish(accepted("k2", "hi"))
        await until(lambda: len(holder.admitted) == 2)
        stop.set()
        t0 = time.monotonic()
    assert 0.4 < time.monotonic() - t0 < 2.0  # k2 was held to the end of the 0.5 s drain
    assert await wait_for(bus, "llm.ev.k1.authorized", 1) == 1  # finished during the drain

    again = Holder(limit=2)
    stop, ready = anyio.Event(), anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(
            lambda: serve(
                holder_spec(again, ack_wait_s=30.0),
                config=bus_config,
                stop=stop,
                ready=ready,
                handle_signals=False,
            )
        )
        await ready.wait()
        await until(lambda: again.admitted == [("k2", 2)])  # handed back, redelivered at once
        await bus.publish(CancelRequested(request_id="k2"))
        assert await wait_for(bus, "llm.ev.k2.authorized", 1) == 1
        stop.set()
    assert holder.admitted == [("k1", 1), ("k2", 1)]
    assert await pending(bus) == (0, 0)
    await bus.close()


async def test_a_service_without_input_runs_until_stop_and_is_cut_at_the_drain(
    bus_config: BusConfig, nats_server
) -> None:
    seen: list[str] = []

    class Server(Service):
        async def run(self, stopping, *, task_status) -> None:  # noqa: ANN001
            seen.append("started")
            task_status.started()
            await stopping.wait()
            try:
                await anyio.sleep_forever()  # ignores the stop: cut after drain_s
            finally:
                seen.append("cut")

    spec = StageSpec(name="door", service=lambda ctx, state: Server(), drain_s=0.3)
    stop, ready = anyio.Event(), anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(
            lambda: serve(spec, config=bus_config, stop=stop, ready=ready, handle_signals=False)
        )
        await ready.wait()
        assert connected(nats_server.monitor_url, "door") is True
        assert subscriptions(nats_server.monitor_url, "door") == []  # no input: no consumer
        stop.set()
        t0 = time.monotonic()
    assert 0.25 < time.monotonic() - t0 < 2.0
    assert seen == ["started", "cut"]
    with anyio.fail_after(5):  # the server shows a closed connection a moment later
        while connected(nats_server.monitor_url, "door") is not False:
            await anyio.sleep(0.05)


def test_a_spec_has_exactly_one_handler_and_a_decoder_for_its_input() -> None:
    decoder = decoder_for(RequestAccepted)
    with pytest.raises(ValueError, match="exactly one of handle= .* or service="):
        StageSpec(name="x", input_event="accepted", decoder=decoder)
    with pytest.raises(ValueError, match="exactly one of"):
        StageSpec(
            name="x",
            input_event="accepted",
            decoder=decoder,
            handle=handle,
            service=lambda ctx, state: Service(),
        )
    with pytest.raises(ValueError, match="has an input but no decoder="):
        StageSpec(name="x", input_event="accepted", service=lambda ctx, state: Service())
    with pytest.raises(ValueError, match="has no input .* a stage without input is a service="):
        StageSpec(name="x", handle=handle)
    assert not StageSpec(name="x", service=lambda ctx, state: Service()).has_input


async def test_a_stage_with_input_refuses_a_service_that_takes_none(
    bus_config: BusConfig, nats_server
) -> None:
    class Door(Service):  # runs, but has no capacity() or admit() for the spec's input
        async def run(self, stopping, *, task_status) -> None:  # noqa: ANN001
            task_status.started()
            await stopping.wait()

    spec = StageSpec(
        name="door-with-input",
        input_event="accepted",
        decoder=decoder_for(RequestAccepted),
        service=lambda ctx, state: Door(),
    )
    with pytest.raises(Exception) as info:  # noqa: PT011 - a group or the error itself
        await serve(spec, config=bus_config, stop=anyio.Event(), handle_signals=False)
    errors = info.value.exceptions if isinstance(info.value, BaseExceptionGroup) else [info.value]
    while any(isinstance(e, BaseExceptionGroup) for e in errors):
        errors = [x for e in errors for x in getattr(e, "exceptions", [e])]
    assert [type(e) for e in errors] == [TypeError]
    assert "must be an InputService (capacity, admit), not Door" in str(errors[0])
