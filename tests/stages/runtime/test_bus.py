"""Bus set-up is idempotent; events are stored once per Nats-Msg-Id; replay is in order."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import anyio
import pytest

from schemas import settings, subjects
from schemas.events import CancelRequested, RunFinished, TextGenerated, TokensGenerated
from stages.runtime import natsd
from stages.runtime.bus import Bus, BusConfig, ConsumerSpec

pytestmark = pytest.mark.anyio


async def test_streams_kv_and_consumers_are_created_idempotently(bus_config: BusConfig) -> None:
    bus = await Bus.connect(bus_config)
    try:
        for _ in range(2):
            await bus.ensure_streams()
            await bus.ensure_kv()
        events = (await bus.js.stream_info(subjects.EVENTS_STREAM)).config
        assert events.subjects == ["llm.ev.>"]
        assert (events.retention, events.storage) == ("limits", "file")
        assert events.max_age == bus_config.events_max_age_s == 7 * 24 * 3600
        assert events.duplicate_window >= bus_config.ack_wait_s * bus_config.max_deliver
        submit = (await bus.js.stream_info(subjects.SUBMIT_STREAM)).config
        assert (submit.subjects, submit.retention) == (["llm.in"], "workqueue")
        for bucket in (subjects.IDEMPOTENCY_BUCKET, subjects.RUNS_BUCKET, subjects.RATES_BUCKET):
            assert (await (await bus.js.key_value(bucket)).status()).bucket == bucket

        spec = ConsumerSpec(durable="brigade-t", filter_subject="llm.ev.*.text", ack_wait_s=4.0)
        await bus.ensure_consumer(spec)
        await bus.ensure_consumer(spec)
        slower = ConsumerSpec(
            durable="brigade-t", filter_subject="llm.ev.*.text", backoff_s=(1.0, 3.0), max_deliver=3
        )
        await bus.ensure_consumer(slower)
        info = await bus.js.consumer_info(subjects.EVENTS_STREAM, "brigade-t")
        assert (info.config.ack_wait, info.config.backoff, info.config.max_deliver) == (
            1.0,
            [1.0, 3.0],
            3,
        )
        assert info.config.deliver_policy == "by_start_time"
    finally:
        await bus.close()


async def test_republished_event_is_stored_once_and_replays_in_order(
    bus_config: BusConfig,
) -> None:
    bus = await Bus.connect(bus_config)
    try:
        await bus.ensure_streams()
        first = await bus.publish(TextGenerated(request_id="r1", seq=0, text="Hel"))
        again = await bus.publish(TextGenerated(request_id="r1", seq=0, text="Hel"))
        assert (again.seq, again.duplicate) == (first.seq, True)
        acks = await bus.publish_all(
            [
                TextGenerated(request_id="r1", seq=i, text=t)
                for i, t in enumerate(["Hel", "lo", "!"])
            ]
            + [CancelRequested(request_id="r2")]
        )
        assert [bool(a.duplicate) for a in acks] == [True, False, False, False]
        info = await bus.js.stream_info(subjects.EVENTS_STREAM, subjects_filter="llm.ev.r1.>")
        assert info.state.messages == 4 and info.state.subjects == {"llm.ev.r1.text": 3}
        replayed = await bus.replay("r1")
        assert [(e.seq, e.text) for e in replayed] == [(0, "Hel"), (1, "lo"), (2, "!")]
        assert all(e.ts_ns > 0 for e in replayed)
        assert await bus.replay("nobody") == []
    finally:
        await bus.close()


async def test_config_from_env_url_list_and_running_server(
    nats_server: natsd.NatsServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("NATS_URL", "nats://a:4222, nats://b:4222,nats://c:4222")
    assert BusConfig.from_env().servers == ("nats://a:4222", "nats://b:4222", "nats://c:4222")
    monkeypatch.delenv("NATS_URL")
    monkeypatch.setenv(settings.DATA_DIR.name, str(nats_server.data_dir))
    assert BusConfig.from_env().servers == (nats_server.url,)
    monkeypatch.setenv(settings.DATA_DIR.name, str(tmp_path / "empty"))
    with pytest.raises(RuntimeError, match="set NATS_URL"):
        BusConfig.from_env()


async def test_workers_racing_to_create_one_durable_both_succeed(bus_config: BusConfig) -> None:
    buses = [await Bus.connect(bus_config) for _ in range(4)]
    try:
        await buses[0].ensure_streams()
        spec = ConsumerSpec(durable="brigade-race", filter_subject="llm.ev.*.tokens")
        for _ in range(3):
            async with anyio.create_task_group() as tg:
                for bus in buses:
                    tg.start_soon(bus.ensure_consumer, spec)
        info = await buses[0].js.consumer_info(subjects.EVENTS_STREAM, "brigade-race")
        assert info.config.filter_subject == "llm.ev.*.tokens"
    finally:
        for bus in buses:
            await bus.close()


async def test_pipelined_publishes_with_no_answer_are_published_again_together(
    bus_config: BusConfig,
) -> None:
    """20 token events published while no stream takes them (a stream with no leader answers
    nothing, a missing one answers no responders): the bus publishes each again after its ack
    timeout, all in the same round, not one timeout per event as its awaiter reaches it, and
    each is stored once, in the order it was sent."""
    config = dataclasses.replace(bus_config, publish_ack_timeout_s=0.5)
    bus = await Bus.connect(config)
    try:
        events = [TokensGenerated(request_id="r1", seq=i, token_ids=[i]) for i in range(20)]
        started = time.monotonic()
        futures = [await bus.publish_async(e) for e in events]
        await anyio.sleep(0.1)
        assert not any(f.done() for f in futures)  # refused, and waiting for the next attempt
        await bus.ensure_streams()
        acks = [await bus.acked(e, f) for e, f in zip(events, futures, strict=True)]
        elapsed = time.monotonic() - started
        assert bus.num_republished == 20 and elapsed < 0.5 + 1.0, elapsed
        assert [a.seq for a in acks] == list(range(1, 21))  # stored in seq order, once each
        replayed = await bus.replay("r1")
        assert [e.seq for e in replayed] == list(range(20))
    finally:
        await bus.close()


@pytest.mark.parametrize("later", ["pipelined", "awaited"])
async def test_once_a_later_publish_is_acked_the_ones_on_a_backoff_go_again_at_once(
    bus_config: BusConfig, later: str
) -> None:
    """10 token events refused twice (no stream yet: published at 0, again at 0.5 and 1.5 s,
    the next try due at 3.5 s). The stream comes back and a `finished` sent after them is
    acked: the 10 are published again at the bus's next look, not 2 s later on their backoff,
    so the log does not hold the run's end seconds ahead of its tokens."""
    config = dataclasses.replace(bus_config, publish_ack_timeout_s=0.5)
    bus = await Bus.connect(config)
    try:
        events = [TokensGenerated(request_id="r1", seq=i, token_ids=[i]) for i in range(10)]
        futures = [await bus.publish_async(e) for e in events]
        started = time.monotonic()
        # the second tries are due at 1.5 s, give or take one look of the bus on a slow machine
        while bus.num_republished < 20 and time.monotonic() - started < 3.0:
            await anyio.sleep(0.05)
        assert bus.num_republished == 20 and not any(f.done() for f in futures)
        await bus.ensure_streams()
        back = time.monotonic()
        end = RunFinished(request_id="r1", finish_reason="length", last_seq=9)
        await (bus.publish(end) if later == "awaited" else await bus.publish_async(end))
        acks = [await bus.acked(e, f) for e, f in zip(events, futures, strict=True)]
        waited = time.monotonic() - back
        assert bus.num_republished == 30 and waited < 0.6, waited  # the backoff: 1.8 s
        assert sorted(a.seq for a in acks) == list(range(2, 12))  # stored once each
        replayed = await bus.replay("r1")
        assert [(type(e).__name__, getattr(e, "seq", None)) for e in replayed] == [
            ("RunFinished", None)
        ] + [("TokensGenerated", i) for i in range(10)]
    finally:
        await bus.close()


async def test_a_pipelined_publish_never_answered_fails_at_its_give_up_time(
    bus_config: BusConfig,
) -> None:
    config = dataclasses.replace(bus_config, publish_ack_timeout_s=0.2, publish_give_up_s=1.0)
    bus = await Bus.connect(config)
    try:
        started = time.monotonic()
        future = await bus.publish_async(TokensGenerated(request_id="r1", seq=0, token_ids=[1]))
        with pytest.raises(TimeoutError, match="within 1 s"):
            await future
        assert 1.0 <= time.monotonic() - started < 1.6
        # published again at 0.2 and 0.6 s (each wait twice the last), given up at 1 s
        assert bus.num_republished == 2
    finally:
        await bus.close()


async def test_close_leaves_unread_next_msg_subscriptions_without_waiting_out_the_drain(
    bus_config: BusConfig,
) -> None:
    """A run's events after its end that nobody reads (next_msg's queue) used to hold close()
    for nats.py's whole drain_timeout (10 s); callback subscriptions still drain, and what was
    published before close is delivered."""
    bus = await Bus.connect(bus_config)
    handled: list[bytes] = []

    async def handle(msg) -> None:
        handled.append(msg.data)

    unread = await bus.nc.subscribe("t.unread")
    await bus.nc.subscribe("t.handled", cb=handle)
    for i in range(3):
        await bus.nc.publish("t.unread", b"%d" % i)
        await bus.nc.publish("t.handled", b"%d" % i)
    assert (await unread.next_msg(timeout=5)).data == b"0"  # the reader is done after one
    began = time.monotonic()
    await bus.close()
    assert time.monotonic() - began < 5.0  # the drain timeout is 10 s
    assert bus.nc.is_closed and handled == [b"0", b"1", b"2"]
