"""The fake bus against a real nats-server: one scenario each, the same pinned results on both.

Every scenario test runs twice, on `FakeBus` and on a `Bus` connected to a private server, and
asserts literal values, so the fake cannot drift from the server (or from nats-py) unseen.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import msgspec
import nats.errors
import pytest
from nats.js.errors import (
    BadRequestError,
    InvalidKeyError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
    NoStreamResponseError,
    NotFoundError,
)

from schemas import subjects
from schemas.events import (
    Message,
    Request,
    RequestAccepted,
    RequestFailed,
    TokensGenerated,
    decode_event,
)
from stages.runtime import natsd
from stages.runtime.bus import Bus
from stages.runtime.failures import StageError
from stages.runtime.spec import StageSpec
from tests.fakebus import FakeBus, FakeServer, deliver, stage_worker, subject_matches

pytestmark = pytest.mark.anyio
EVENTS = subjects.EVENTS_STREAM
Connect = Callable[[], Awaitable[Bus]]


@pytest.fixture(params=["fake", pytest.param("real", marks=pytest.mark.nats)])
def connect(request: pytest.FixtureRequest) -> Connect:
    """Connections to one server: a `FakeServer`, or the test's private nats-server."""
    if request.param == "fake":
        server = FakeServer()

        async def fake() -> Bus:
            return FakeBus(server)

        return fake
    config = request.getfixturevalue("bus_config")
    return lambda: Bus.connect(config)


@asynccontextmanager
async def connected(connect: Connect, n: int) -> AsyncIterator[list[Bus]]:
    buses = [await connect() for _ in range(n)]
    try:
        yield buses
    finally:
        for bus in buses:
            await bus.close()


def accepted(rid: str) -> RequestAccepted:
    request = Request(messages=[Message(role="user", content="hi")])
    return RequestAccepted(request_id=rid, request=request, ts_ns=1)  # ts set: fixed bytes


def tokens(rid: str, seq: int, token_ids: list[int]) -> TokensGenerated:
    return TokensGenerated(request_id=rid, tenant="t", seq=seq, token_ids=token_ids, ts_ns=1)


async def test_publish_dedupes_by_msg_id_and_replay_keeps_stream_order(connect) -> None:
    async with connected(connect, 2) as (bus, other):
        with pytest.raises(NoStreamResponseError):
            await bus.publish(accepted("r1"))  # no stream captures llm.ev.> yet
        with pytest.raises(NotFoundError):
            await bus.replay("r1")
        await bus.ensure_streams()
        await other.ensure_streams()  # idempotent, from another connection too
        acks = [await bus.publish(accepted("r1")), await other.publish(accepted("r1"))]
        acks += await bus.publish_all([tokens("r1", 0, [5]), tokens("r1", 1, [6])])
        acks += await other.publish_all([tokens("r1", 0, [99]), accepted("r2")])
        acks.append(await bus.publish(tokens("r1", 2, [7])))
        assert [(a.stream, a.seq, a.duplicate) for a in acks] == [
            (EVENTS, 1, None),
            (EVENTS, 1, True),  # the same Nats-Msg-Id names the stored message
            (EVENTS, 2, None),
            (EVENTS, 3, None),
            (EVENTS, 2, True),  # dedupe by id, not by body: token 99 is never stored
            (EVENTS, 4, None),
            (EVENTS, 5, None),
        ]
        assert await other.replay("r1") == [
            accepted("r1"),
            tokens("r1", 0, [5]),
            tokens("r1", 1, [6]),
            tokens("r1", 2, [7]),
        ]
        assert await bus.replay("r2") == [accepted("r2")]
        assert await bus.replay("nobody") == []
        info = await bus.js.stream_info(EVENTS)
        assert (info.state.messages, info.state.first_seq, info.state.last_seq) == (5, 1, 5)


async def test_last_message_by_subject_direct_and_stored(connect) -> None:
    async with connected(connect, 1) as (bus,):
        await bus.ensure_streams()
        await bus.publish(accepted("r1"))
        await bus.publish(tokens("r1", 0, [5]))
        subject = subjects.event_subject("r1", "accepted")
        for direct in (True, False):
            msg = await bus.js.get_last_msg(EVENTS, subject, direct=direct)
            assert (msg.subject, msg.seq, decode_event(msg.data)) == (subject, 1, accepted("r1"))
            assert msg.headers["Nats-Msg-Id"] == "r1:accepted"
            with pytest.raises(NotFoundError):
                await bus.js.get_last_msg(EVENTS, subjects.event_subject("r9", "accepted"))
        stored = await bus.js.get_msg(EVENTS, seq=2)
        assert decode_event(stored.data) == tokens("r1", 0, [5])
        with pytest.raises(NotFoundError) as info:
            await bus.js.get_msg(EVENTS, seq=3)
        assert info.value.err_code == 10037
        with pytest.raises(nats.errors.NoRespondersError):  # BRIGADE_IN allows no direct get
            await bus.js.get_last_msg(subjects.SUBMIT_STREAM, subjects.SUBMIT, direct=True)


async def test_kv_revisions_and_compare_and_set_errors(connect) -> None:
    async with connected(connect, 2) as (a, b):
        kv = await a.kv("fakebus_check", ttl_s=60)
        assert await kv.create("k", b"1") == 1
        with pytest.raises(KeyWrongLastSequenceError):
            await kv.create("k", b"again")
        assert await kv.put("other", b"x") == 2
        entry = await kv.get("k")
        assert (entry.bucket, entry.key, entry.value, entry.revision) == (
            "fakebus_check",
            "k",
            b"1",
            1,
        )
        kv_b = await b.kv("fakebus_check", ttl_s=60)  # the existing bucket, another connection
        assert await kv_b.update("k", b"2", last=1) == 3
        with pytest.raises(KeyWrongLastSequenceError) as stale:
            await kv.update("k", b"stale", last=1)
        assert stale.value.description == "wrong last sequence: 3"
        with pytest.raises(BadRequestError) as wrong:
            await kv.delete("k", last=1)  # delete raises the server's error unmapped
        assert not isinstance(wrong.value, KeyWrongLastSequenceError)
        assert (wrong.value.code, wrong.value.err_code) == (400, 10071)
        assert await kv.delete("k", last=3) is True  # a delete marker at revision 4
        with pytest.raises(KeyNotFoundError):
            await kv_b.get("k")
        with pytest.raises(KeyWrongLastSequenceError):
            await kv.update("k", b"x", last=3)  # the marker is the key's last revision
        assert await kv.create("k", b"3") == 5  # create over a delete marker
        assert (await kv_b.get("k")).value == b"3"
        with pytest.raises(KeyNotFoundError):
            await kv.get("never")
        with pytest.raises(KeyWrongLastSequenceError):
            await kv.update("never", b"x", last=9)
        assert await kv.update("empty", b"", last=0) == 6
        assert (await kv.get("empty")).value is None  # an empty value reads back as None
        with pytest.raises(InvalidKeyError):
            await kv.get("no spaces")
        assert (await kv.status()).values == 3  # history 1: one message per key is kept


async def test_payload_above_the_server_limit_is_refused_before_sending(connect) -> None:
    async with connected(connect, 1) as (bus,):
        await bus.ensure_streams()
        assert bus.nc.max_payload == natsd.MAX_PAYLOAD_BYTES
        big = RequestAccepted(
            request_id="big",
            request=Request(messages=[Message(role="user", content="a" * bus.nc.max_payload)]),
        )
        with pytest.raises(nats.errors.MaxPayloadError):
            await bus.publish(big)
        with pytest.raises(nats.errors.MaxPayloadError):
            await bus.publish_all([big, accepted("small")])
        assert await bus.replay("big") == []


# ---- the fake alone: matching, and the stage helpers over the real worker path ----


def test_subject_matching_follows_nats_wildcards() -> None:
    assert subject_matches("llm.ev.>", "llm.ev.r1.accepted")
    assert not subject_matches("llm.ev.>", "llm.ev")
    assert subject_matches("llm.ev.*.tokens", "llm.ev.r1.tokens")
    assert not subject_matches("llm.ev.*.tokens", "llm.ev.r1.tokens.x")
    assert not subject_matches("llm.ev.*.tokens", "llm.ev.r1.text")
    assert subject_matches("$KV.b.k", "$KV.b.k") and not subject_matches("$KV.b.k", "$KV.b.k2")


class Echo(msgspec.Struct):
    calls: int = 0


def _echo(event: TokensGenerated, state: Echo) -> list:
    state.calls += 1
    if event.token_ids == [0]:
        raise StageError("invalid_request", "token 0 is refused", field="token_ids")
    if event.token_ids == [1]:
        raise RuntimeError("disk on fire")
    return [RequestFailed(request_id=event.request_id, stage="echo", code="internal", message="x")]


async def _echo_state(ctx) -> Echo:
    return Echo()


def _spec(**kw) -> StageSpec:
    return StageSpec(
        name="echo",
        input_event="tokens",
        decoder=msgspec.json.Decoder(TokensGenerated),
        handle=_echo,
        setup=_echo_state,
        **kw,
    )


async def test_deliver_runs_the_worker_path_and_redelivery_publishes_nothing_new() -> None:
    bus = FakeBus()
    worker = await stage_worker(_spec(), bus)
    first = await deliver(worker, tokens("r1", 0, [5]))
    again = await deliver(worker, tokens("r1", 0, [5]), num_delivered=2)
    assert (first.outcome, again.outcome, worker.state.calls) == ("ack", "ack", 2)
    (out,) = [e for e in await bus.replay("r1") if isinstance(e, RequestFailed)]
    assert out.stage == "echo" and out.service_ns > 0 and out.ts_ns > 0
    assert (
        len(bus.server.events(subjects.all_events("failed"))) == 2
    )  # published twice, stored once
    refused = await deliver(worker, tokens("r2", 0, [0]))
    (failed,) = [e for e in await bus.replay("r2") if isinstance(e, RequestFailed)]
    assert refused.outcome == "ack"
    assert (failed.code, failed.field, failed.tenant) == ("invalid_request", "token_ids", "t")
    with pytest.raises(ValueError, match="never reaches brigade-echo"):
        await deliver(worker, accepted("r3"))


async def test_a_retried_error_is_nakked_not_failed() -> None:
    bus = FakeBus()
    worker = await stage_worker(_spec(retry_errors=True), bus)
    msg = await deliver(worker, tokens("r1", 0, [1]), num_delivered=3)
    assert (msg.outcome, msg.nak_delay) == ("nak", 0.8)  # 0.1 * 2**3
    assert await bus.replay("r1") == [tokens("r1", 0, [1])]


async def test_what_the_fake_does_not_model_is_refused_by_name() -> None:
    bus = FakeBus()
    with pytest.raises(AttributeError, match=r"no js\.consumer_info.*nats_server"):
        await bus.pull(_spec().consumer())
    with pytest.raises(AttributeError, match=r"no nc\.subscribe"):
        await bus.nc.subscribe("llm.ev.>")
