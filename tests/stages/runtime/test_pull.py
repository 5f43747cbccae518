"""The continuous pull on a real nats-server: never more than `capacity` messages out at once,
each delivered once and in order, and requests renewed after they expire."""

from __future__ import annotations

import time

import anyio
import pytest
from nats.js import api

from stages.runtime.bus import Bus
from stages.runtime.pull import ContinuousPull

pytestmark = pytest.mark.anyio
STREAM = "PULLTEST"


async def _bus_with_durable(bus_config, durable: str) -> Bus:
    bus = await Bus.connect(bus_config)
    await bus.js.add_stream(api.StreamConfig(name=STREAM, subjects=["pt.>"]))
    await bus.js.add_consumer(
        STREAM,
        api.ConsumerConfig(durable_name=durable, ack_policy=api.AckPolicy.EXPLICIT, ack_wait=30),
    )
    return bus


async def test_at_most_capacity_messages_are_out_and_each_comes_once_in_order(bus_config):
    bus = await _bus_with_durable(bus_config, "cap")
    for i in range(10):
        await bus.js.publish(f"pt.{i}", str(i).encode())
    got: list = []
    stop = anyio.Event()
    pull = ContinuousPull(bus.nc, STREAM, "cap", got.append, capacity=4)
    await pull.start()
    async with anyio.create_task_group() as tg:
        tg.start_soon(pull.run, stop, 0.1)
        with anyio.fail_after(5):
            while len(got) < 4:
                await anyio.sleep(0.01)
        await anyio.sleep(0.2)  # nothing more comes while all four are out
        assert [m.data for m in got] == [b"0", b"1", b"2", b"3"]
        assert pull.num_active == 4
        for msg in got[:2]:  # two done: room for two more, asked in one request
            await msg.ack_sync()
            pull.done()
        with anyio.fail_after(5):
            while len(got) < 6:
                await anyio.sleep(0.01)
        await anyio.sleep(0.2)
        assert len(got) == 6
        for msg in got[2:]:
            await msg.ack_sync()
            pull.done()
        with anyio.fail_after(5):
            while len(got) < 10:
                await anyio.sleep(0.01)
        for msg in got[6:]:
            await msg.ack_sync()
            pull.done()
        stop.set()
    await pull.stop()
    assert [m.data for m in got] == [str(i).encode() for i in range(10)]
    assert pull.num_active == 0
    info = await bus.js.consumer_info(STREAM, "cap")  # ack_sync: every ack is recorded by now
    assert (info.num_pending, info.num_ack_pending, info.num_redelivered) == (0, 0, 0)
    await bus.close()


async def test_an_expired_request_is_renewed_and_the_next_message_comes_at_once(bus_config):
    bus = await _bus_with_durable(bus_config, "exp")
    arrived: list[tuple[float, bytes]] = []
    stop = anyio.Event()
    pull = ContinuousPull(
        bus.nc,
        STREAM,
        "exp",
        lambda m: arrived.append((time.monotonic(), m.data)),
        capacity=8,
        expires_s=0.2,
    )
    await pull.start()
    async with anyio.create_task_group() as tg:
        tg.start_soon(pull.run, stop, 5.0)  # only the server's 408 wakes it to ask again
        await anyio.sleep(0.7)  # three requests expire meanwhile
        assert pull.num_requested == 8  # one open request for the whole capacity
        sent = time.monotonic()
        await bus.js.publish("pt.late", b"late")
        with anyio.fail_after(2):
            while not arrived:
                await anyio.sleep(0.005)
        stop.set()
        pull.done()
    await pull.stop()
    assert arrived[0][1] == b"late"
    assert arrived[0][0] - sent < 1.0  # not a whole check interval (5 s) late
    await bus.close()


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="capacity=0 must be >= 1"):
        ContinuousPull(None, STREAM, "x", print, capacity=0)  # type: ignore[arg-type]
