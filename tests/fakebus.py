"""An in-memory JetStream under the real `Bus`, for stage tests where a nats-server adds nothing.

The fake answers the JetStream calls that `Bus` and nats-py's own `KeyValue` make: publish with
`Nats-Msg-Id` dedupe and expected-last-subject-sequence checks, stored and direct gets, stream
add/update/info. `Bus.publish`, `Bus.kv` and `KeyValue` run unchanged on top, so revisions and
error types are nats-py's; tests/test_fakebus.py pins them against a real server. Several
`FakeBus` on one `FakeServer` share its state like connections to one server. Not modelled:
consumers (delivery, redelivery, acks, cancels), core subscriptions, max_age expiry; tests of
those use the `nats_server` fixture. `stage_worker` + `deliver` run one stage's real
decode/handle/publish/ack path without a consumer.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import anyio.lowlevel
import msgspec
import nats.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api
from nats.js.errors import APIError, BadRequestError, NoStreamResponseError, NotFoundError
from nats.js.manager import JetStreamManager

from schemas import subjects
from schemas.events import AnyEvent, Event, decode_event
from stages.runtime import natsd
from stages.runtime.bus import MSG_ID_HEADER, Bus, BusConfig
from stages.runtime.service import Held
from stages.runtime.spec import StageSpec
from stages.runtime.worker import StageWorker

log = logging.getLogger("brigade.fakebus")
EXPECTED_LAST_SUBJECT_SEQ = api.Header.EXPECTED_LAST_SUBJECT_SEQUENCE.value
KV_OPERATION = "KV-Operation"
MODELLED_HEADERS = {MSG_ID_HEADER, EXPECTED_LAST_SUBJECT_SEQ}
DEFAULT_DUPLICATE_WINDOW_S = 120.0  # the server's default
# JetStream's answers, as the server spells them
STREAM_NOT_FOUND = {"code": 404, "err_code": 10059, "description": "stream not found"}
NO_MESSAGE_FOUND = {"code": 404, "err_code": 10037, "description": "no message found"}
STREAM_NAME_IN_USE = {
    "code": 400,
    "err_code": 10058,
    "description": "stream name already in use with a different configuration",
}
WRONG_LAST_SEQUENCE = 10071


def subject_matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: `*` is one token, a final `>` is one or more."""
    want, have = pattern.split("."), subject.split(".")
    for i, token in enumerate(want):
        if token == ">":
            return len(have) > i
        if i >= len(have) or (token != "*" and token != have[i]):
            return False
    return len(want) == len(have)


@dataclass(frozen=True)
class StoredMsg:
    stream: str
    subject: str
    seq: int
    data: bytes
    headers: dict[str, str]
    time: datetime.datetime


@dataclass
class FakeStream:
    """One stream: its config, its stored messages by sequence, the msg ids in its window."""

    config: api.StreamConfig
    messages: dict[int, StoredMsg] = field(default_factory=dict)
    last_seq: int = 0
    _msg_ids: dict[str, tuple[int, float]] = field(default_factory=dict)

    @property
    def name(self) -> str:
        assert self.config.name is not None, "a stream has a name"
        return self.config.name

    def captures(self, subject: str) -> bool:
        return any(subject_matches(p, subject) for p in self.config.subjects or ())

    def last_for(self, subject: str) -> StoredMsg | None:
        found = [m for m in self.messages.values() if m.subject == subject]
        return found[-1] if found else None

    def matching(self, pattern: str) -> list[StoredMsg]:
        return [m for m in self.messages.values() if subject_matches(pattern, m.subject)]

    def store(self, subject: str, data: bytes, headers: dict[str, str]) -> api.PubAck:
        """What the server does with one publish; raises the APIError it would answer."""
        window = self.config.duplicate_window or DEFAULT_DUPLICATE_WINDOW_S
        now = time.monotonic()
        self._msg_ids = {k: v for k, v in self._msg_ids.items() if now - v[1] < window}
        msg_id = headers.get(MSG_ID_HEADER)
        if msg_id is not None and msg_id in self._msg_ids:
            return api.PubAck(stream=self.name, seq=self._msg_ids[msg_id][0], duplicate=True)
        expected = headers.get(EXPECTED_LAST_SUBJECT_SEQ)
        if expected is not None:
            last = self.last_for(subject)
            actual = last.seq if last is not None else 0
            if int(expected) != actual:
                raise BadRequestError(
                    code=400,
                    err_code=WRONG_LAST_SEQUENCE,
                    description=f"wrong last sequence: {actual}",
                )
        self.last_seq += 1
        self.messages[self.last_seq] = StoredMsg(
            stream=self.name,
            subject=subject,
            seq=self.last_seq,
            data=data,
            headers=headers,
            time=datetime.datetime.now(datetime.UTC),
        )
        limit = self.config.max_msgs_per_subject
        if limit is not None and limit > 0:
            for old in [m for m in self.messages.values() if m.subject == subject][:-limit]:
                del self.messages[old.seq]
        if msg_id is not None:
            self._msg_ids[msg_id] = (self.last_seq, now)
        return api.PubAck(stream=self.name, seq=self.last_seq)

    def info(self) -> api.StreamInfo:
        seqs = sorted(self.messages)
        return api.StreamInfo(
            config=self.config,
            state=api.StreamState(
                messages=len(seqs),
                bytes=sum(len(m.data) for m in self.messages.values()),
                first_seq=seqs[0] if seqs else self.last_seq + 1,
                last_seq=self.last_seq,
                consumer_count=0,
            ),
        )


class FakeServer:
    """The shared state: streams by name, and every message published, duplicates included (what
    a core subscriber on `>` would see)."""

    def __init__(self, *, max_payload: int = natsd.MAX_PAYLOAD_BYTES) -> None:
        self.max_payload = max_payload
        self.streams: dict[str, FakeStream] = {}
        self.sent: list[tuple[str, bytes]] = []

    def stream(self, name: str) -> FakeStream:
        if name not in self.streams:
            raise NotFoundError(**STREAM_NOT_FOUND)
        return self.streams[name]

    def events(self, pattern: str = subjects.ALL_EVENTS) -> list[AnyEvent]:
        """Every event published on subjects matching `pattern`, in publish order, duplicates
        included (a stored event appears once in `Bus.replay`, a republished one twice here)."""
        return [decode_event(data) for s, data in self.sent if subject_matches(pattern, s)]


def _refusal(owner: str, name: str) -> AttributeError:
    return AttributeError(
        f"the fake bus has no {owner}.{name}: it models streams, publishes and KV only; a test "
        "of consumers, delivery or subscriptions needs the `nats_server` fixture"
    )


class NeedsRealServer(Exception):
    """A call the fake does not model (a header, a kind of get): the test needs a real server
    (the `nats_server` fixture), so the fake says so rather than answer wrongly."""


def _plain_headers(headers: dict[Any, Any] | None) -> dict[str, str]:
    plain = {
        (k.value if isinstance(k, Enum) else str(k)): str(v) for k, v in (headers or {}).items()
    }
    unknown = {k for k in plain if k.startswith("Nats-") and k not in MODELLED_HEADERS}
    if unknown:
        raise NeedsRealServer(
            f"the fake bus does not model the headers {sorted(unknown)}; use the `nats_server` "
            "fixture for this test"
        )
    return plain


class FakeJetStream:
    """The JetStream calls `Bus` and `KeyValue` make, answered from a `FakeServer`."""

    def __init__(self, conn: FakeConnection) -> None:
        self._conn = conn
        self._server = conn.server

    def __getattr__(self, name: str) -> Any:
        raise _refusal("js", name)

    # nats-py's own bucket and last-message code, on this class's stream calls: a bucket is
    # created with exactly the stream config the real client sends.
    key_value = JetStreamContext.key_value
    create_key_value = JetStreamContext.create_key_value
    get_last_msg = JetStreamManager.get_last_msg

    async def add_stream(
        self, config: api.StreamConfig | None = None, **params: Any
    ) -> api.StreamInfo:
        await anyio.lowlevel.checkpoint()
        config = (config or api.StreamConfig()).evolve(**params)
        assert config.name, "add_stream needs a name"
        have = self._server.streams.get(config.name)
        if have is not None:
            if have.config.as_dict() != config.as_dict():
                raise BadRequestError(**STREAM_NAME_IN_USE)
            return have.info()
        self._server.streams[config.name] = FakeStream(config)
        return self._server.streams[config.name].info()

    async def update_stream(
        self, config: api.StreamConfig | None = None, **params: Any
    ) -> api.StreamInfo:
        await anyio.lowlevel.checkpoint()
        config = (config or api.StreamConfig()).evolve(**params)
        stream = self._server.stream(config.name or "")
        stream.config = config
        return stream.info()

    async def stream_info(self, name: str, subjects_filter: str | None = None) -> api.StreamInfo:
        await anyio.lowlevel.checkpoint()
        return self._server.stream(name).info()

    def _check_publish(self, payload: bytes) -> None:
        if self._conn.is_closed:
            raise nats.errors.ConnectionClosedError
        if len(payload) > self._server.max_payload:
            raise nats.errors.MaxPayloadError

    def _store(self, subject: str, payload: bytes, headers: dict[Any, Any] | None) -> api.PubAck:
        plain = _plain_headers(headers)
        self._server.sent.append((subject, payload))
        for stream in self._server.streams.values():
            if stream.captures(subject):
                return stream.store(subject, payload, plain)
        raise NoStreamResponseError

    async def publish(
        self,
        subject: str,
        payload: bytes = b"",
        timeout: float | None = None,
        stream: str | None = None,
        headers: dict[Any, Any] | None = None,
        msg_ttl: float | None = None,
    ) -> api.PubAck:
        await anyio.lowlevel.checkpoint()
        if stream is not None or msg_ttl is not None:
            raise NeedsRealServer("the fake bus models no expected-stream or msg_ttl publish")
        self._check_publish(payload)
        return self._store(subject, payload, headers)

    async def publish_async(
        self,
        subject: str,
        payload: bytes = b"",
        wait_stall: float | None = None,
        stream: str | None = None,
        headers: dict[Any, Any] | None = None,
        msg_ttl: float | None = None,
    ) -> asyncio.Future[api.PubAck]:
        """As nats-py: a too-large payload raises here, the stream's answer comes in the future."""
        await anyio.lowlevel.checkpoint()
        if stream is not None or msg_ttl is not None:
            raise NeedsRealServer("the fake bus models no expected-stream or msg_ttl publish")
        self._check_publish(payload)
        future: asyncio.Future[api.PubAck] = asyncio.get_running_loop().create_future()
        try:
            future.set_result(self._store(subject, payload, headers))
        except (APIError, NoStreamResponseError) as err:
            future.set_exception(err)
        return future

    async def get_msg(
        self,
        stream_name: str,
        seq: int | None = None,
        subject: str | None = None,
        direct: bool | None = False,
        next: bool | None = False,
    ) -> api.RawStreamMsg:
        """A stored message by sequence or the last on `subject`. Direct gets answer as the
        server's direct-get responder does: no responder without allow_direct, a bare 404."""
        await anyio.lowlevel.checkpoint()
        if next:
            raise NeedsRealServer("the fake bus models no next_by_subj get")
        stream = self._server.streams.get(stream_name)
        if direct and (stream is None or not stream.config.allow_direct):
            raise nats.errors.NoRespondersError
        if stream is None:
            raise NotFoundError(**STREAM_NOT_FOUND)
        msg = stream.last_for(subject) if subject else stream.messages.get(seq or 0)
        if msg is None:
            raise NotFoundError() if direct else NotFoundError(**NO_MESSAGE_FOUND)
        headers: dict[str, str] | None = dict(msg.headers) or None
        if direct:
            stamp = msg.time.isoformat().replace("+00:00", "Z")
            headers = {
                "Nats-Stream": stream_name,
                "Nats-Subject": msg.subject,
                "Nats-Sequence": str(msg.seq),
                "Nats-Time-Stamp": stamp,
                **msg.headers,
            }
        return api.RawStreamMsg(
            subject=msg.subject, seq=msg.seq, data=msg.data or None, headers=headers, time=msg.time
        )


class FakeConnection:
    """The part of a nats-py client the `Bus` touches: its JetStream context, closing, limits."""

    def __init__(self, server: FakeServer) -> None:
        self.server = server
        self.is_closed = False

    def __getattr__(self, name: str) -> Any:
        raise _refusal("nc", name)

    @property
    def max_payload(self) -> int:
        return self.server.max_payload

    def jetstream(self, **options: Any) -> FakeJetStream:
        return FakeJetStream(self)

    async def drain(self) -> None:
        self.is_closed = True

    async def close(self) -> None:
        self.is_closed = True


class FakeBus(Bus):
    """The real `Bus` on a `FakeServer` (a new one unless given); `replay` reads the stream."""

    def __init__(self, server: FakeServer | None = None, config: BusConfig | None = None) -> None:
        self.server = server or FakeServer()
        super().__init__(
            FakeConnection(self.server),  # type: ignore[arg-type]
            config or BusConfig(servers=("nats://fake.invalid:4222",)),
        )

    async def replay(self, request_id: str, *, timeout_s: float = 5.0) -> list[AnyEvent]:
        """Every stored event of one request, in stream order (as `Bus.replay`)."""
        await anyio.lowlevel.checkpoint()
        stream = self.server.stream(subjects.EVENTS_STREAM)
        events: list[AnyEvent] = []
        for msg in stream.matching(subjects.request_events(request_id)):
            try:
                events.append(decode_event(msg.data))
            except (msgspec.DecodeError, msgspec.ValidationError) as err:
                log.warning("skipped undecodable %s in the log: %s", msg.subject, err)
        return events


class FakeMsg:
    """A stored message as a consumer hands it to a worker; records how the worker settled it."""

    def __init__(self, stored: StoredMsg, *, consumer: str, num_delivered: int = 1) -> None:
        self.subject = stored.subject
        self.data = stored.data
        self.headers = dict(stored.headers) or None
        self.metadata = Msg.Metadata(
            sequence=Msg.Metadata.SequencePair(consumer=num_delivered, stream=stored.seq),
            num_pending=0,
            num_delivered=num_delivered,
            timestamp=stored.time,
            stream=stored.stream,
            consumer=consumer,
        )
        self.outcome: str | None = None  # "ack", "nak", "term"
        self.nak_delay: float | None = None

    def _settle(self, outcome: str) -> None:
        if self.outcome is not None:
            raise nats.errors.MsgAlreadyAckdError(self)
        self.outcome = outcome

    async def ack(self) -> None:
        self._settle("ack")

    async def nak(self, delay: float | None = None) -> None:
        self._settle("nak")
        self.nak_delay = delay

    async def term(self) -> None:
        self._settle("term")

    async def in_progress(self) -> None:
        if self.outcome is not None:
            raise nats.errors.MsgAlreadyAckdError(self)


async def stage_worker(spec: StageSpec, bus: FakeBus) -> StageWorker:
    """A worker of `spec` holding what its setup returned; no consumer (`deliver` feeds it)."""
    await bus.ensure_streams()
    worker = StageWorker(spec, bus)
    if worker.spec.setup is not None:
        worker.state = await worker.spec.setup(worker.ctx)
    return worker


async def deliver(worker: StageWorker, event: Event, *, num_delivered: int = 1) -> FakeMsg:
    """Publish `event` as the bus does (deduped), then hand the stored message to `worker` as its
    durable would; returns the message with the worker's ack or nak on it."""
    bus = worker.bus
    assert isinstance(bus, FakeBus), "deliver feeds a worker built by stage_worker"
    ack = await bus.publish(event)
    stored = bus.server.stream(ack.stream).messages[ack.seq]
    consumer = worker.spec.consumer()
    filters = consumer.filter_subject
    filters = (filters,) if isinstance(filters, str) else filters
    if ack.stream != consumer.stream or not any(
        subject_matches(f, stored.subject) for f in filters
    ):
        raise ValueError(
            f"{stored.subject} in {ack.stream} never reaches {consumer.durable} "
            f"(it reads {consumer.stream} {', '.join(filters)})"
        )
    msg = FakeMsg(stored, consumer=consumer.durable, num_delivered=num_delivered)
    await worker.handle_message(Held(worker, msg))  # type: ignore[arg-type]
    return msg
