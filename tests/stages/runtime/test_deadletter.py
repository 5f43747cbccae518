"""The dead-letter path: an input no stage can decode and no request id names is recorded once
(reason, subject, seq) and terminated; an on_invalid that raises buries it too; a transient
handler error, or the bus being away, is retried only until the last delivery, then fails its
request once; a projection (fails_requests=False) buries what it cannot write instead."""

from __future__ import annotations

import nats.js.errors
import pytest

from schemas import subjects
from schemas.events import Message, Request, RequestAccepted, RequestFailed, decoder_for
from stages.runtime import deadletter
from stages.runtime.service import Held
from stages.runtime.spec import StageSpec
from tests.fakebus import FakeBus, FakeMsg, deliver, stage_worker

pytestmark = pytest.mark.anyio


def _accepted(request_id: str) -> RequestAccepted:
    return RequestAccepted(
        request_id=request_id, request=Request(messages=[Message(role="user", content="hi")])
    )


def _spec(**kw) -> StageSpec:
    return StageSpec(
        name="auth",
        input_event="accepted",
        decoder=decoder_for(RequestAccepted),
        handle=kw.pop("handle", lambda event, state: []),
        **kw,
    )


async def _raw(worker, subject: str, data: bytes, num_delivered: int = 1) -> FakeMsg:
    bus = worker.bus
    ack = await bus.js.publish(subject, data)
    stored = bus.server.stream(ack.stream).messages[ack.seq]
    msg = FakeMsg(stored, consumer="brigade-auth", num_delivered=num_delivered)
    await worker.handle_message(Held(worker, msg))
    return msg


def _letters(bus: FakeBus) -> list[deadletter.DeadLetter]:
    stream = bus.server.stream(subjects.DEAD_STREAM)
    return [deadletter.decode(m.data) for m in stream.messages.values()]


async def test_an_unnamed_poison_is_recorded_once_and_terminated() -> None:
    bus = FakeBus()
    worker = await stage_worker(_spec(), bus)
    deep = b'{"x": ' + b"[" * 3000 + b"]" * 3000 + b"}"
    msg = await _raw(worker, "llm.ev.p1.accepted", deep)
    again = await _raw(worker, "llm.ev.p1.accepted", b"\xff")
    assert (msg.outcome, again.outcome) == ("term", "term")
    first, second = _letters(bus)
    assert (first.consumer, first.subject, first.stream) == ("auth", "llm.ev.p1.accepted",
                                                             subjects.EVENTS_STREAM)  # fmt: skip
    assert first.stream_seq == msg.metadata.sequence.stream and first.num_delivered == 1
    assert "nested deeper than 64 levels" in first.reason and first.size == len(deep)
    assert len(first.data) == deadletter.MAX_KEPT_BYTES
    assert "DecodeError" in second.reason and second.data == "\ufffd"
    assert not bus.server.events("llm.ev.*.failed")  # no request named: nothing to fail


async def test_a_named_poison_fails_its_request_and_is_not_a_dead_letter() -> None:
    bus = FakeBus()
    worker = await stage_worker(_spec(), bus)
    msg = await _raw(worker, "llm.ev.p2.accepted", b'{"request_id": "p2", "request": 7}')
    assert msg.outcome == "ack"
    (failed,) = bus.server.events("llm.ev.*.failed")
    assert isinstance(failed, RequestFailed) and failed.request_id == "p2"
    assert (failed.code, failed.field) == ("invalid_request", "request")
    assert not bus.server.stream(subjects.DEAD_STREAM).messages


async def test_an_on_invalid_that_raises_buries_the_message() -> None:
    def on_invalid(data, err, state):
        raise RuntimeError("the claims bucket is away")

    bus = FakeBus()
    worker = await stage_worker(_spec(on_invalid=on_invalid), bus)
    msg = await _raw(worker, "llm.ev.p3.accepted", b'{"request_id": "p3", "request": 7}')
    assert msg.outcome == "term"
    (letter,) = _letters(bus)
    assert letter.request_id == "p3" and "the claims bucket is away" in letter.reason


async def test_a_transient_error_is_retried_until_the_last_delivery_then_fails_once() -> None:
    def handle(event, state):
        raise OSError("the ledger file is locked")

    bus = FakeBus()
    worker = await stage_worker(_spec(handle=handle, retry_errors=True, max_deliver=3), bus)
    tries = [await deliver(worker, _accepted("p4"), num_delivered=n) for n in (1, 2, 3)]
    assert [m.outcome for m in tries] == ["nak", "nak", "ack"]
    (failed,) = bus.server.events("llm.ev.*.failed")
    assert failed.request_id == "p4" and failed.code == "internal"
    assert "locked" in failed.message


async def test_the_bus_being_away_is_retried_not_a_failed_request() -> None:
    def handle(event, state):
        raise nats.js.errors.ServiceUnavailableError(code=503, description="leader election")

    bus = FakeBus()
    worker = await stage_worker(_spec(handle=handle, max_deliver=3), bus)
    first = await deliver(worker, _accepted("p5"), num_delivered=1)
    assert (first.outcome, first.nak_delay) == ("nak", 1.0)  # 1, 2, 4 s ... spans an election
    assert not bus.server.events("llm.ev.*.failed")
    last = await deliver(worker, _accepted("p5"), num_delivered=3)
    assert last.outcome == "ack"  # out of deliveries: the request fails, once
    (failed,) = bus.server.events("llm.ev.*.failed")
    assert failed.request_id == "p5" and "ServiceUnavailableError" in failed.message


async def test_a_projection_buries_what_it_cannot_write_and_fails_no_run() -> None:
    def handle(event, state):
        raise OSError("the bucket refused the write")

    bus = FakeBus()
    worker = await stage_worker(_spec(handle=handle, fails_requests=False), bus)
    msg = await deliver(worker, _accepted("p6"))
    assert msg.outcome == "term"
    (letter,) = _letters(bus)
    assert letter.request_id == "p6" and "the bucket refused the write" in letter.reason
    assert not bus.server.events("llm.ev.*.failed")
