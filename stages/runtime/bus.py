"""The connection to NATS JetStream and the idempotent set-up of Brigade's streams, consumers and KV.

`NATS_URL` (comma-separated for a cluster) wins; otherwise the private server of a running
`brigade up` is found through its state file. Every event is published with `Nats-Msg-Id` dedupe,
and a pipelined publish whose ack does not come (lost in an election or a restart) is published
again by the bus itself, so the log has every event soon after it was sent, whoever awaits it.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
from collections import deque
from dataclasses import dataclass, field

import msgspec
import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext, api
from nats.js.errors import APIError, BadRequestError, NotFoundError
from nats.js.kv import KeyValue

from schemas import models, settings, subjects
from schemas.events import AnyEvent, Event, Submit, SubmitReply, decode_event, encode
from stages.runtime import natsd
from stages.runtime.failures import bus_unavailable
from stages.runtime.heartbeat import TTL_S as HEARTBEAT_TTL_S

log = logging.getLogger("brigade.bus")
MSG_ID_HEADER = "Nats-Msg-Id"
_reply_decoder = msgspec.json.Decoder(SubmitReply)
STREAM_NAME_IN_USE = 10058  # JetStream err_code: a stream exists with another configuration
# A pipelined publish's ack, before it is published again; each later try waits twice as long,
# up to PUBLISH_RETRY_MAX_S. A healthy server acks in well under a millisecond (tens under load).
PUBLISH_ACK_TIMEOUT_S = 1.0
PUBLISH_RETRY_MAX_S = 5.0
PUBLISH_GIVE_UP_S = 60.0  # no ack for this long, across every attempt: the publish fails
ACK_CHECK_S = 0.25  # how often the unacked publishes are looked over
# Submits wait in memory until the gateway takes them; past this the publisher is refused.
SUBMIT_STREAM_MAX_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True, kw_only=True)
class BusConfig:
    """Where NATS is and how long things are kept. Durations in seconds."""

    servers: tuple[str, ...]
    events_max_age_s: float = 7 * 24 * 3600.0
    replicas: int = 1  # 3 for an R3 cluster
    ack_wait_s: float = 30.0  # the default per consumer; a stage may ask for its own
    max_deliver: int = 5
    idempotency_ttl_s: float = 24 * 3600.0
    rates_ttl_s: float = 3600.0
    connect_timeout_s: float = 5.0
    publish_ack_timeout_s: float = PUBLISH_ACK_TIMEOUT_S
    publish_give_up_s: float = PUBLISH_GIVE_UP_S
    user: str | None = None  # NATS authentication (deploy/nats/brigade.conf's users)
    password: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.servers:
            raise ValueError("BusConfig.servers is empty: give at least one nats:// URL")
        if self.replicas not in (1, 3, 5):
            raise ValueError(f"replicas={self.replicas}: JetStream allows 1, 3 or 5")
        if self.events_max_age_s <= 0:
            raise ValueError(f"events_max_age_s={self.events_max_age_s} must be > 0")
        if not 0 < self.publish_ack_timeout_s < self.publish_give_up_s:
            raise ValueError(
                f"need 0 < publish_ack_timeout_s ({self.publish_ack_timeout_s}) < "
                f"publish_give_up_s ({self.publish_give_up_s})"
            )

    @property
    def duplicate_window_s(self) -> float:
        """Covers every redelivery of a message, so a republished output is stored once."""
        return max(120.0, self.ack_wait_s * self.max_deliver * 2)

    @classmethod
    def from_env(cls, url: str | None = None, **overrides: float | int) -> BusConfig:
        """NATS_URL / `url` (comma-separated), else the running private server, else an error."""
        servers = _split(url) if url else settings.NATS_URL.get()
        if not servers:
            running = natsd.find_running()
            if running is None:
                raise RuntimeError(
                    "no NATS server: set NATS_URL=nats://host:4222 (comma-separated for a "
                    f"cluster) or start `brigade up` (looked for {natsd.default_data_dir()}/"
                    f"{natsd.STATE_FILE})"
                )
            servers = (running.url,)
        kwargs: dict[str, float | int | str | None] = {
            "events_max_age_s": settings.EVENTS_MAX_AGE_S.get(),
            "replicas": settings.STREAM_REPLICAS.get(),
            "user": settings.NATS_USER.get(),
            "password": settings.NATS_PASSWORD.get(),
        }
        kwargs.update(overrides)
        return cls(servers=servers, **kwargs)  # type: ignore[arg-type]


def _split(url: str) -> tuple[str, ...]:
    return tuple(u.strip() for u in url.split(",") if u.strip())


@dataclass(frozen=True, kw_only=True)
class ConsumerSpec:
    """A shared durable pull consumer: every worker of one stage binds to the same durable."""

    durable: str
    filter_subject: str | tuple[str, ...]  # several subjects: one consumer over all of them
    stream: str = subjects.EVENTS_STREAM
    ack_wait_s: float = 30.0
    max_deliver: int = 5
    backoff_s: tuple[float, ...] = ()  # redelivery delays; the first replaces ack_wait
    max_ack_pending: int = 1024
    deliver_all: bool = False  # required on a work-queue stream (submissions)

    def __post_init__(self) -> None:
        if self.backoff_s and len(self.backoff_s) > self.max_deliver:
            raise ValueError(
                f"{self.durable}: {len(self.backoff_s)} backoff steps but max_deliver="
                f"{self.max_deliver}; give at most max_deliver steps"
            )


@dataclass(eq=False)
class _Unacked:
    """A pipelined publish not acknowledged yet: `sent` is the attempt in flight, `acked` what the
    publisher awaits (the first attempt's ack, or a later one's)."""

    event: Event
    message: tuple[str, bytes, dict[str, str]]  # subject, payload, headers: sent again as they were
    sent: asyncio.Future[api.PubAck]
    acked: asyncio.Future[api.PubAck]
    due: float  # monotonic: published again when no ack came by then
    give_up: float  # monotonic: past this the publish fails
    wait_s: float  # how long the attempt in flight is given
    sent_at: float  # monotonic: when the attempt in flight went out


class Bus:
    """One NATS connection with its JetStream context. Build with `await Bus.connect(...)`."""

    def __init__(self, nc: Client, config: BusConfig) -> None:
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream()
        self.config = config
        self._kv: dict[str, KeyValue] = {}
        self._pulls: list[JetStreamContext.PullSubscription] = []
        self._unacked: deque[_Unacked] = deque()  # pipelined publishes without an ack yet
        self._ack_watch: asyncio.Task | None = None
        self._acked_sent_at = 0.0  # the latest-sent attempt that got its ack: the bus was up then
        self.num_republished = 0

    @classmethod
    async def connect(cls, config: BusConfig | None = None, *, name: str = "brigade") -> Bus:
        config = config or BusConfig.from_env()
        nc = await nats.connect(
            servers=list(config.servers),
            name=name,
            connect_timeout=config.connect_timeout_s,
            user=config.user,
            password=config.password,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,
            allow_reconnect=True,
            drain_timeout=10,
        )
        return cls(nc, config)

    async def close(self) -> None:
        """Flush what was published, then close (`drain` also unsubscribes gracefully)."""
        if self._ack_watch is not None:
            self._ack_watch.cancel()
        while self._unacked:  # nobody publishes them again now: their awaiters hear it
            pending = self._unacked.popleft()
            if not pending.acked.done():
                pending.acked.set_exception(nats.errors.ConnectionClosedError())
        if self.nc.is_closed:
            return
        # nats.py drains a subscription by waiting until its queue has been read: a pull
        # subscription's (fetch takes messages without task_done) never is, nor one read with
        # next_msg whose reader is done (a run's events after its end), so either would hold
        # the close for drain_timeout. Nobody reads them after close: unsubscribe them first
        # (unacked work is redelivered). The connection's own table is the only list of them.
        unread = [s for s in getattr(self.nc, "_subs", {}).values() if _read_by_next_msg(s)]
        for sub in [*self._pulls, *unread]:
            try:
                await sub.unsubscribe()
            except Exception:  # noqa: BLE001 - already unsubscribed
                pass
        try:
            await self.nc.drain()
        except Exception:  # noqa: BLE001 - already closing, or reconnecting: nothing to drain
            try:
                await self.nc.close()
            except Exception as err:  # noqa: BLE001 - its socket is gone already (uvloop raises)
                log.debug("closing the NATS connection: %s", err)

    # ---- set-up (idempotent) ----

    async def ensure_streams(self) -> None:
        """The event log over llm.ev.> and the submissions work queue on llm.in.

        The work queue is in memory: a submit (and the API key in its header) lives only until
        the gateway acks it and never reaches the server's disk. One that a restart drops gets
        no answer, and its client submits again."""
        c = self.config
        await self._ensure_stream(
            api.StreamConfig(
                name=subjects.EVENTS_STREAM,
                subjects=[subjects.ALL_EVENTS],
                retention=api.RetentionPolicy.LIMITS,
                storage=api.StorageType.FILE,
                max_age=c.events_max_age_s,
                duplicate_window=c.duplicate_window_s,
                num_replicas=c.replicas,
                allow_direct=True,
            )
        )
        await self._ensure_stream(
            api.StreamConfig(
                name=subjects.SUBMIT_STREAM,
                subjects=[subjects.SUBMIT],
                retention=api.RetentionPolicy.WORK_QUEUE,
                storage=api.StorageType.MEMORY,
                max_age=c.idempotency_ttl_s,
                max_bytes=SUBMIT_STREAM_MAX_BYTES,
                discard=api.DiscardPolicy.NEW,
                duplicate_window=c.duplicate_window_s,
                num_replicas=c.replicas,
            )
        )
        await self._ensure_stream(
            api.StreamConfig(
                name=subjects.DEAD_STREAM,
                subjects=[subjects.ALL_DEAD],
                retention=api.RetentionPolicy.LIMITS,
                storage=api.StorageType.FILE,
                max_age=c.events_max_age_s,
                duplicate_window=c.duplicate_window_s,
                num_replicas=c.replicas,
            )
        )

    async def _ensure_stream(self, config: api.StreamConfig) -> None:
        try:
            await self.js.add_stream(config)
        except BadRequestError as e:
            if e.err_code != STREAM_NAME_IN_USE:
                raise
            have = (await self.js.stream_info(config.name)).config
            if have.storage == config.storage:
                await self.js.update_stream(config)
                return
            # JetStream cannot change a stream's storage in place. The file-backed submit queue
            # of earlier versions held API keys on disk: deleting it removes its files.
            info = await self.js.stream_info(config.name)
            log.warning(
                "recreating stream %s with %s storage (was %s); %d message(s) waiting in it are "
                "dropped, their clients get no answer and submit again",
                config.name,
                config.storage,
                have.storage,
                info.state.messages,
            )
            await self.js.delete_stream(config.name)
            await self.js.add_stream(config)

    async def ensure_kv(self) -> None:
        c = self.config
        buckets = {
            subjects.IDEMPOTENCY_BUCKET: c.idempotency_ttl_s,
            subjects.RUNS_BUCKET: c.events_max_age_s,
            subjects.RATES_BUCKET: c.rates_ttl_s,
            subjects.STAGES_BUCKET: HEARTBEAT_TTL_S,
        }
        for bucket, ttl in buckets.items():
            await self.kv(bucket, ttl_s=ttl)

    async def kv(self, bucket: str, *, ttl_s: float | None = None) -> KeyValue:
        """A KV bucket, created on first use (history 1, file storage, the bus's replicas)."""
        if bucket in self._kv:
            return self._kv[bucket]
        try:
            store = await self.js.key_value(bucket)
        except (NotFoundError, BadRequestError):
            store = await self.js.create_key_value(
                api.KeyValueConfig(
                    bucket=bucket,
                    history=1,
                    ttl=ttl_s,
                    storage=api.StorageType.FILE,
                    replicas=self.config.replicas,
                )
            )
        self._kv[bucket] = store
        return store

    async def ensure_consumer(self, spec: ConsumerSpec) -> None:
        """Create or update a shared durable pull consumer.

        A new durable starts one dedupe window back, so events published while no worker of the
        stage existed yet are still handled, and re-handling an older one stores nothing new.
        """
        start = datetime.datetime.now(datetime.UTC) - datetime.timedelta(
            seconds=self.config.duplicate_window_s
        )
        config = api.ConsumerConfig(
            durable_name=spec.durable,
            filter_subject=spec.filter_subject if isinstance(spec.filter_subject, str) else None,
            filter_subjects=None
            if isinstance(spec.filter_subject, str)
            else list(spec.filter_subject),
            deliver_policy=api.DeliverPolicy.ALL
            if spec.deliver_all
            else api.DeliverPolicy.BY_START_TIME,
            opt_start_time=None if spec.deliver_all else start,
            ack_policy=api.AckPolicy.EXPLICIT,
            ack_wait=spec.backoff_s[0] if spec.backoff_s else spec.ack_wait_s,
            max_deliver=spec.max_deliver,
            backoff=list(spec.backoff_s) or None,
            max_ack_pending=spec.max_ack_pending,
            max_waiting=512,
            num_replicas=self.config.replicas if self.config.replicas > 1 else None,
        )
        try:
            info = await self.js.consumer_info(spec.stream, spec.durable)
        except NotFoundError:
            try:
                await self.js.add_consumer(spec.stream, config)
                return
            except APIError:  # another worker created it just now (its start time differs)
                info = await self.js.consumer_info(spec.stream, spec.durable)
        have = info.config
        if (
            have.ack_wait,
            have.max_deliver,
            have.max_ack_pending,
            have.backoff or None,
            _filters(have),
        ) != (
            config.ack_wait,
            config.max_deliver,
            config.max_ack_pending,
            config.backoff,
            _filters(config),
        ):  # a durable made by an older release is brought up to this one's filters too
            config.deliver_policy = have.deliver_policy
            config.opt_start_time = have.opt_start_time
            await self.js.add_consumer(spec.stream, config)  # the server updates in place

    async def pull(self, spec: ConsumerSpec) -> JetStreamContext.PullSubscription:
        await self.ensure_consumer(spec)
        sub = await self.js.pull_subscribe_bind(durable=spec.durable, stream=spec.stream)
        self._pulls.append(sub)
        return sub

    # ---- publishing ----

    async def publish(self, event: Event) -> api.PubAck:
        """Publish one event into the log and wait for the stream's ack (dedupe by Nats-Msg-Id)."""
        subject, payload, headers = self._prepare(event)
        sent_at = time.monotonic()
        ack = await self.js.publish(subject, payload, headers=headers)
        self._acked_sent_at = max(self._acked_sent_at, sent_at)  # the bus is up: see _watch_acks
        return ack

    async def publish_async(self, event: Event) -> asyncio.Future[api.PubAck]:
        """Pipelined publish: returns the ack future at once (tokens, text deltas).

        nats-py's own future has no deadline, and a publish that reaches a stream with no leader
        (an election) or a server that dies before storing it gets no answer at all. So the bus
        watches every pipelined publish: one without an ack after `publish_ack_timeout_s` (1 s)
        is published again (its Nats-Msg-Id stores it once), then after 2, 4, 5, 5 ... s, until
        `publish_give_up_s`, when the future fails. It is published again then, not when the
        publisher comes to await it: a run's tokens lost in an election are stored a few seconds
        late, not after its end. And once a publish sent later is acked, the stream is back: what
        still waits on a backoff is published again at the next look (`ACK_CHECK_S`), so an
        event sent after it (a run's `finished`) is not stored seconds ahead of it."""
        message = self._prepare(event)
        subject, payload, headers = message
        sent = await self.js.publish_async(subject, payload, headers=headers)
        acked: asyncio.Future[api.PubAck] = asyncio.get_running_loop().create_future()
        now = time.monotonic()
        c = self.config
        pending = _Unacked(event, message, sent, acked, now + c.publish_ack_timeout_s,
                           now + c.publish_give_up_s, c.publish_ack_timeout_s, now)  # fmt: skip
        sent.add_done_callback(lambda f: self._settle(pending, f))
        self._unacked.append(pending)
        if self._ack_watch is None or self._ack_watch.done():
            self._ack_watch = asyncio.create_task(self._watch_acks())
        return acked

    async def _watch_acks(self) -> None:
        """Publish again what has no ack by its due time, until nothing is unacked."""
        while self._unacked:
            now = time.monotonic()
            waiting: deque[_Unacked] = deque()
            again: list[_Unacked] = []
            back = self._acked_sent_at  # a later attempt got its ack: the stream is up again
            for pending in self._unacked:  # few: a healthy server acks within milliseconds
                if not pending.acked.done():
                    lost = pending.sent_at < back and now - pending.sent_at >= ACK_CHECK_S
                    (again if pending.due <= now or lost else waiting).append(pending)
            self._unacked = waiting
            if again:
                await self._publish_again(again, now)
            await asyncio.sleep(ACK_CHECK_S)

    async def _publish_again(self, again: list[_Unacked], now: float) -> None:
        first = again[0].event
        log.warning(
            "no ack within %.1f s for %d event(s) (the first: %s of %s, seq %s); publishing "
            "them again", again[0].wait_s, len(again), event_tag(first), first.request_id,
            getattr(first, "seq", None),
        )  # fmt: skip
        for pending in again:
            pending.sent.cancel()
            if now >= pending.give_up:
                pending.acked.set_exception(
                    TimeoutError(
                        f"no ack for {event_tag(pending.event)} of {pending.event.request_id} "
                        f"within {self.config.publish_give_up_s:.0f} s of publishing it "
                        f"(published again after {self.config.publish_ack_timeout_s:.1f} s, "
                        f"then at most every {PUBLISH_RETRY_MAX_S:.0f} s)"
                    )
                )
                continue
            pending.wait_s = min(
                2 * pending.wait_s, max(PUBLISH_RETRY_MAX_S, self.config.publish_ack_timeout_s)
            )
            pending.due = min(now + pending.wait_s, pending.give_up)
            pending.sent_at = time.monotonic()
            try:
                subject, payload, headers = pending.message
                pending.sent = await self.js.publish_async(subject, payload, headers=headers)
            except Exception as err:  # noqa: BLE001 - the connection is away: the next round
                if not bus_unavailable(err):
                    pending.acked.set_exception(err)
                    continue
            else:
                pending.sent.add_done_callback(lambda f, p=pending: self._settle(p, f))
            self.num_republished += 1
            self._unacked.append(pending)

    def _settle(self, pending: _Unacked, sent: asyncio.Future[api.PubAck]) -> None:
        """An attempt answered: any attempt's ack is the publish's; the current attempt's
        refusal fails it unless it says the bus is away (no responders mid-election: the next
        attempt). The current attempt's ack also says the bus was up when it went out."""
        if pending.acked.done() or sent.cancelled():
            return
        err = sent.exception()
        if err is None:
            pending.acked.set_result(sent.result())
            if sent is pending.sent and pending.sent_at > self._acked_sent_at:
                self._acked_sent_at = pending.sent_at
        elif sent is pending.sent and not bus_unavailable(err):
            pending.acked.set_exception(err)

    async def publish_all(self, events: list[Event]) -> list[api.PubAck]:
        """Publish several events pipelined and wait until every one is acknowledged."""
        if len(events) == 1:
            return [await self.publish(events[0])]
        futures = [await self.publish_async(e) for e in events]
        return [await f for f in futures]

    async def acked(self, event: Event, future: asyncio.Future[api.PubAck]) -> api.PubAck:
        """The stream's ack of a pipelined publish (`future` from publish_async): the bus has
        published it again meanwhile if need be; raises once it gave up."""
        return await future

    def _prepare(self, event: Event) -> tuple[str, bytes, dict[str, str]]:
        tag = event_tag(event)
        if event.ts_ns == 0:
            event = msgspec.structs.replace(event, ts_ns=time.time_ns())
        seq = getattr(event, "seq", None)
        # a routed event goes to its model's engine workers (none named: the default model's)
        route = None
        if tag in subjects.ROUTED_EVENTS:
            route = subjects.model_token(getattr(event, "model", None) or models.default().id)
        return (
            subjects.event_subject(event.request_id, tag, route),
            encode(event),
            {MSG_ID_HEADER: subjects.msg_id(event.request_id, tag, seq)},
        )

    async def submit(
        self, submit: Submit | bytes, *, api_key: str | None = None, timeout_s: float = 10.0
    ) -> SubmitReply:
        """Publish a submit to llm.in and wait for the gateway's answer (request id or error)."""
        inbox = self.nc.new_inbox()
        sub = await self.nc.subscribe(inbox, max_msgs=1)
        try:
            await publish_submit(self.js, submit, api_key=api_key, reply_to=inbox)
            msg = await sub.next_msg(timeout=timeout_s)
        finally:
            await sub.unsubscribe()
        return _reply_decoder.decode(msg.data)

    # ---- reading the log ----

    async def replay(self, request_id: str, *, timeout_s: float = 5.0) -> list[AnyEvent]:
        """Every stored event of one request, in stream order (an ephemeral consumer)."""
        sub = await self.js.pull_subscribe(
            subjects.request_events(request_id),
            stream=subjects.EVENTS_STREAM,
            config=api.ConsumerConfig(
                ack_policy=api.AckPolicy.NONE,
                deliver_policy=api.DeliverPolicy.ALL,
                inactive_threshold=30.0,
            ),
        )
        events: list[AnyEvent] = []
        try:
            pending = (await sub.consumer_info()).num_pending
            while pending:
                for msg in await sub.fetch(min(pending, 256), timeout=timeout_s):
                    pending = msg.metadata.num_pending
                    try:
                        events.append(decode_event(msg.data))
                    except (msgspec.DecodeError, msgspec.ValidationError) as err:
                        log.warning("skipped undecodable %s in the log: %s", msg.subject, err)
        finally:
            await sub.unsubscribe()
            try:
                await self.js.delete_consumer(subjects.EVENTS_STREAM, sub._consumer)
            except NotFoundError:
                pass
        return events


def submit_message(
    submit: Submit | bytes, *, api_key: str | None = None, reply_to: str | None = None
) -> tuple[bytes, dict[str, str]]:
    """The body and headers of a submit on llm.in. The API key travels in the Brigade-Api-Key
    header, never in the body: a Submit's `api_key` moves there. Without `reply_to` the queue
    dedupes it by its request id (a retried publish is queued once); a submit that waits for the
    gateway's answer is queued every time, so a repeat is answered too."""
    headers: dict[str, str] = {}
    if isinstance(submit, Submit):
        api_key = api_key or submit.api_key
        if submit.api_key is not None:
            submit = msgspec.structs.replace(submit, api_key=None)
        if submit.request_id is not None and reply_to is None:
            headers[MSG_ID_HEADER] = f"{submit.request_id}:submit"
        submit = encode(submit)
    if api_key is not None:
        headers[subjects.API_KEY_HEADER] = api_key
    if reply_to is not None:
        headers[subjects.REPLY_HEADER] = reply_to
    return submit, headers


async def publish_submit(
    js: JetStreamContext,
    submit: Submit | bytes,
    *,
    api_key: str | None = None,
    reply_to: str | None = None,
) -> api.PubAck:
    """Publish one submit on llm.in (see submit_message) and wait for the queue's ack."""
    payload, headers = submit_message(submit, api_key=api_key, reply_to=reply_to)
    return await js.publish(subjects.SUBMIT, payload, headers=headers)


def _filters(config: api.ConsumerConfig) -> frozenset[str]:
    """A consumer's subject filters, one or several, as a set."""
    return frozenset(config.filter_subjects or ()) | (
        {config.filter_subject} if config.filter_subject else set()
    )


def _read_by_next_msg(sub: Subscription) -> bool:
    """A subscription with neither a callback nor a request's future: its reader calls next_msg."""
    return getattr(sub, "_cb", None) is None and getattr(sub, "_future", None) is None


def event_tag(event: Event) -> str:
    return type(event).__struct_config__.tag  # type: ignore[return-value]
