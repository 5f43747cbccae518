"""The one stage runtime: pull, decode, handle, publish (deduped), ack, drain — for every stage.

Handler contract. A stage module builds a `StageSpec`:

    SPEC = StageSpec(
        name="tokenize",                     # durable "brigade-tokenize"; `failed.stage`
        input_event="assembled",             # consumer filter llm.ev.*.assembled
        decoder=decoder_for(ContextAssembled),
        handle=handle,                       # handle(event, state) -> list[Event] (sync or async)
        setup=setup,                         # optional: async setup(ctx: StageContext) -> state
    )

`handle` gets one decoded event and the state that `setup` returned (None without setup) and
returns the events to publish; it does no I/O of its own where it can avoid it. To fail the
request with a precise reason it raises `StageError(code, message, field=...)`; any other
exception becomes a `failed` event with code `internal`. Either way the input is acked, so a
poison message never loops. An undecodable input becomes a `failed` event when a request id can
be read from it, else it is logged and acked.

The runtime stamps `service_ns` (monotonic, decode to end of handle) on every output that has
none, the bus stamps `ts_ns` (wall clock) at publish, and every output goes out with
`Nats-Msg-Id` = msg_id(request_id, type[, seq]), so a redelivered input re-publishes nothing new.
The input is acked only after every output is acknowledged by the stream. A crash before the ack
means redelivery after `ack_wait` (or the `backoff` steps), at most `max_deliver` times; a
handler that runs long keeps its message alive with periodic in-progress acks.

Requests whose `cancel` event was seen are skipped (acked, nothing published) unless the spec
sets `skip_cancelled=False` (the ledger). Late events for unknown or finished requests reach
`handle` like any other; handlers must tolerate them.

`run` takes each message the moment it arrives (stages/runtime/pull.py: an open pull request topped up
to `max_in_flight`). A stage that publishes many events per input over time (the engine) uses
the parts directly: `StageWorker.fetch` (a batch of at most what it can admit now), `.decode`,
`.complete` / `.fail`, `ctx.bus.publish_async` for pipelined deltas, and
`ctx.cancels.on_cancel(callback)` to abort work.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import msgspec
import nats.errors
from nats.aio.msg import Msg

from schemas import settings, subjects
from schemas.events import Event, RequestFailed, encode
from stages.runtime.bus import Bus, BusConfig, ConsumerSpec
from stages.runtime.cancels import CancelledRequests
from stages.runtime.failures import StageError, error_field, new_request_id, read_envelope
from stages.runtime.pull import ContinuousPull

log = logging.getLogger("brigade.runtime")

Handler = Callable[[Any, Any], "list[Event] | Awaitable[list[Event]]"]
ReplyFn = Callable[[list[Event]], bytes]


@dataclass(frozen=True, kw_only=True)
class StageSpec:
    """What a stage is: its name, its input, its decoder, its handler and delivery settings."""

    name: str
    input_event: str | tuple[str, ...] | None  # event tag(s); None with `subject` (the gateway)
    decoder: msgspec.json.Decoder
    handle: Handler
    setup: Callable[[StageContext], Awaitable[Any]] | None = None
    teardown: Callable[[Any], Awaitable[None]] | None = None
    subject: str | None = None
    stream: str = subjects.EVENTS_STREAM
    ack_wait_s: float = 30.0
    max_deliver: int = 5
    backoff_s: tuple[float, ...] = ()
    max_in_flight: int = 32
    max_hold_s: float = 600.0  # in-progress acks stop after this: a hung handler is redelivered
    skip_cancelled: bool = True
    # True: a handler exception (not a StageError) naks the input for redelivery instead of
    # failing the request — for stages whose errors are transient (the ledger's file lock).
    retry_errors: bool = False
    # Invalid input -> the failed event to publish (None: log and ack). Default: read the
    # request id and tenant from the raw JSON.
    on_invalid: Callable[[bytes, Exception], RequestFailed | None] | None = None
    # When the input carries a reply header, send reply(outputs) there after publishing.
    reply: ReplyFn | None = None

    def consumer(self) -> ConsumerSpec:
        if self.subject is not None:
            subject: str | tuple[str, ...] = self.subject
        elif isinstance(self.input_event, tuple):
            subject = tuple(subjects.all_events(e) for e in self.input_event)
        else:
            subject = subjects.all_events(self.input_event or "")
        return ConsumerSpec(
            durable=subjects.durable_name(self.name),
            filter_subject=subject,
            stream=self.stream,
            ack_wait_s=self.ack_wait_s,
            max_deliver=self.max_deliver,
            backoff_s=self.backoff_s,
            max_ack_pending=max(1024, self.max_in_flight * 8),
            deliver_all=self.stream == subjects.SUBMIT_STREAM,
        )


@dataclass(kw_only=True)
class StageContext:
    """What `setup` gets: the bus, the spec, the cancel set."""

    bus: Bus
    spec: StageSpec
    cancels: CancelledRequests = field(default_factory=CancelledRequests)


def with_env_overrides(spec: StageSpec) -> StageSpec:
    """Operators (and tests) may shorten or lengthen redelivery for every stage at once."""
    found = settings.load()
    changes: dict[str, Any] = {}
    for setting, name in (
        (settings.ACK_WAIT_S, "ack_wait_s"),
        (settings.MAX_DELIVER, "max_deliver"),
    ):
        if found[setting] is not None:
            changes[name] = found[setting]
    return dataclasses.replace(spec, **changes) if changes else spec


class StageWorker:
    """One worker of one stage: binds to the stage's shared durable and serves until stopped."""

    def __init__(self, spec: StageSpec, bus: Bus, *, fetch_timeout_s: float = 1.0) -> None:
        spec = with_env_overrides(spec)
        self.spec = spec
        self.ctx = StageContext(bus=bus, spec=spec)
        self.fetch_timeout_s = fetch_timeout_s
        self.state: Any = None
        self._sub: Any = None
        self._cancel_sub: Any = None
        self._gave_up_sub: Any = None
        self._in_flight: dict[int, tuple[Msg, float]] = {}
        self._async_handler = inspect.iscoroutinefunction(spec.handle)
        self.log = logging.getLogger(f"brigade.{spec.name}")

    @property
    def bus(self) -> Bus:
        return self.ctx.bus

    async def start(self) -> None:
        await self.bus.ensure_streams()
        self._cancel_sub = await self.ctx.cancels.subscribe(self.bus)
        consumer = self.spec.consumer()
        self._gave_up_sub = await self.bus.nc.subscribe(
            subjects.max_deliveries_advisory(consumer.stream, consumer.durable),
            cb=self._gave_up,
        )
        self._sub = await self.bus.pull(consumer)
        if self.spec.setup is not None:
            self.state = await self.spec.setup(self.ctx)

    async def fetch(self, max_msgs: int) -> list[Msg]:
        """Up to `max_msgs` messages; [] when none arrived within the fetch timeout."""
        try:
            return await self._sub.fetch(max_msgs, timeout=self.fetch_timeout_s)
        except TimeoutError:  # nats' TimeoutError and FetchTimeoutError subclass it
            return []
        except nats.errors.Error as err:  # reconnecting, a leader election: try again soon
            self.log.warning("fetch failed, retrying: %s", err)
            await anyio.sleep(self.fetch_timeout_s)
            return []

    def decode(self, msg: Msg) -> Any:
        """The typed input, or raises msgspec.DecodeError / ValidationError."""
        return self.spec.decoder.decode(msg.data)

    def invalid_event(self, data: bytes, err: Exception) -> RequestFailed | None:
        if self.spec.on_invalid is not None:
            return self.spec.on_invalid(data, err)
        request_id, tenant = read_envelope(data)
        if request_id is None:
            return None
        kind = self.spec.input_event if isinstance(self.spec.input_event, str) else "event"
        return RequestFailed(
            request_id=request_id,
            tenant=tenant,
            stage=self.spec.name,
            code="invalid_request",
            message=f"invalid {kind}: {err}",
            field=error_field(err),
        )

    async def handle_message(self, msg: Msg) -> None:
        """The default path: decode -> (skip if cancelled) -> handle -> complete."""
        started = time.monotonic_ns()
        try:
            event = self.decode(msg)
        except (msgspec.DecodeError, msgspec.ValidationError) as err:
            failed = self.invalid_event(msg.data, err)
            if failed is None:
                self.log.warning("dropped undecodable message on %s: %s", msg.subject, err)
                await msg.ack()
                return
            await self.complete(msg, [failed], started)
            return
        request_id = getattr(event, "request_id", None)
        if self.spec.skip_cancelled and request_id in self.ctx.cancels:
            await msg.ack()
            return
        try:
            result = self.spec.handle(event, self.state)
            outputs = await result if self._async_handler else result  # type: ignore[misc]
        except StageError as err:
            outputs = [self._failed(event, err.code, err.message, err.field, err.retry_after_s)]
        except Exception as err:  # noqa: BLE001 - a failing handler fails its request, not us
            self.log.exception("handler failed for %s", request_id)
            if self.spec.retry_errors:
                await msg.nak(delay=min(0.1 * 2.0**msg.metadata.num_delivered, 5.0))
                return
            outputs = [self._failed(event, "internal", f"{type(err).__name__}: {err}", None, None)]
        await self.complete(msg, outputs, started)

    def _failed(
        self, event: Any, code: str, message: str, field: str | None, retry: float | None
    ) -> RequestFailed:
        return RequestFailed(
            request_id=getattr(event, "request_id", None) or new_request_id(),
            tenant=getattr(event, "tenant", None),
            stage=self.spec.name,
            code=code,  # type: ignore[arg-type]
            message=message,
            field=field,
            retry_after_s=retry,
        )

    async def complete(self, msg: Msg, outputs: list[Event], started_ns: int) -> None:
        """Stamp service_ns, publish every output (acknowledged), reply if asked, then ack."""
        service_ns = time.monotonic_ns() - started_ns
        stamped = [
            e if e.service_ns else msgspec.structs.replace(e, service_ns=service_ns)
            for e in outputs
        ]
        try:
            if stamped:
                await self.bus.publish_all(stamped)
        except nats.errors.MaxPayloadError:
            if any(isinstance(e, RequestFailed) for e in stamped):
                raise  # even the small failed event does not fit: nothing better to say
            sizes = [len(encode(e)) for e in stamped]
            first = stamped[0]
            failed = RequestFailed(
                request_id=first.request_id,
                tenant=first.tenant,
                stage=self.spec.name,
                code="invalid_request",
                message=f"the {self.spec.name} stage's output is {max(sizes)} bytes, above the "
                f"NATS server's max_payload of {self.bus.nc.max_payload} bytes; send less text "
                "or raise max_payload in the server's configuration",
            )
            await self.complete(msg, [failed], started_ns)
            return
        except Exception as err:  # noqa: BLE001 - the bus is unwell: let the message come back
            delivered = msg.metadata.num_delivered
            self.log.warning("publish failed (delivery %d): %s", delivered, err)
            if delivered < self.spec.max_deliver:
                await msg.nak(delay=min(2.0**delivered * 0.1, 5.0))
                return
            raise
        reply_to = (msg.headers or {}).get(subjects.REPLY_HEADER)
        if reply_to and self.spec.reply is not None:
            await self.bus.nc.publish(reply_to, self.spec.reply(stamped))
        await msg.ack()

    async def fail(self, msg: Msg, event: Any, err: StageError, started_ns: int) -> None:
        """Publish a `failed` event for the input's request, then ack (for custom loops)."""
        failed = self._failed(event, err.code, err.message, err.field, err.retry_after_s)
        await self.complete(msg, [failed], started_ns)

    async def _gave_up(self, advisory: Msg) -> None:
        """A message ran out of deliveries (its workers crashed or hung): fail its request.

        Every worker of the stage hears the advisory; the `failed` event's msg id dedupes them.
        """
        try:
            seq = json.loads(advisory.data)["stream_seq"]
            raw = await self.bus.js.get_msg(self.spec.stream, seq)
            request_id, tenant = read_envelope(raw.data or b"")
            if request_id is None:
                self.log.error("gave up on stream seq %d (no request id in it)", seq)
                return
            await self.bus.publish(
                RequestFailed(
                    request_id=request_id,
                    tenant=tenant,
                    stage=self.spec.name,
                    code="internal",
                    message=f"{self.spec.name} gave up after {self.spec.max_deliver} deliveries "
                    "without finishing (its workers crashed or hung); see their logs",
                )
            )
        except Exception:  # noqa: BLE001 - a lost advisory only leaves the request unfinished
            self.log.exception("could not fail the request of a dead-lettered message")

    async def _track(self, msg: Msg) -> None:
        key = id(msg)
        self._in_flight[key] = (msg, time.monotonic())
        try:
            await self.handle_message(msg)
        except Exception:  # noqa: BLE001 - never kill the worker; the message will be redelivered
            self.log.exception("message on %s left unacked", msg.subject)
        finally:
            del self._in_flight[key]

    async def _keep_alive(self) -> None:
        """In-progress acks for messages held longer than a third of ack_wait."""
        wait = self.spec.backoff_s[0] if self.spec.backoff_s else self.spec.ack_wait_s
        period = max(wait / 3, 0.05)
        while True:
            await anyio.sleep(period)
            now = time.monotonic()
            for msg, since in list(self._in_flight.values()):
                if period <= now - since <= self.spec.max_hold_s:
                    try:
                        await msg.in_progress()
                    except Exception:  # noqa: BLE001 - a lost in-progress ack only risks redelivery
                        pass

    async def run(self, stop: anyio.Event, ready: anyio.Event | None = None) -> None:
        """Serve until `stop` is set, then finish in-flight messages and return (no drain)."""
        await self.start()
        if ready is not None:
            ready.set()
        consumer = self.spec.consumer()
        async with anyio.create_task_group() as side:
            side.start_soon(self._keep_alive)
            async with anyio.create_task_group() as work:
                pull = ContinuousPull(
                    self.bus.nc,
                    consumer.stream,
                    consumer.durable,
                    lambda msg: work.start_soon(self._run_one, msg, pull),
                    capacity=self.spec.max_in_flight,
                )
                await pull.start()
                try:
                    await pull.run(stop, self.fetch_timeout_s)
                finally:
                    await pull.stop()  # in-flight messages finish before the group exits
            side.cancel_scope.cancel()
        await self.close()

    async def close(self) -> None:
        """Unsubscribe, not drain: nats.py's fetch takes from the pending queue without task_done,
        so a drain would wait forever. Anything still queued is redelivered after ack_wait."""
        await self._sub.unsubscribe()
        await self._cancel_sub.unsubscribe()
        await self._gave_up_sub.unsubscribe()
        if self.spec.teardown is not None:
            await self.spec.teardown(self.state)

    async def _run_one(self, msg: Msg, pull: ContinuousPull) -> None:
        try:
            await self._track(msg)
        finally:
            pull.done()


async def serve(
    spec: StageSpec,
    *,
    config: BusConfig | None = None,
    stop: anyio.Event | None = None,
    ready: anyio.Event | None = None,
    handle_signals: bool = True,
) -> None:
    """Connect, serve `spec` until `stop` (or SIGTERM/SIGINT), finish in-flight, drain."""
    stop = stop or anyio.Event()
    bus = await Bus.connect(config, name=f"brigade-{spec.name}")
    worker = StageWorker(spec, bus)
    try:
        async with anyio.create_task_group() as tg:
            if handle_signals:
                tg.start_soon(stop_on_signal, stop)
            await worker.run(stop, ready)
            tg.cancel_scope.cancel()
    finally:
        await bus.close()


async def stop_on_signal(stop: anyio.Event) -> None:
    """Set `stop` on SIGTERM or SIGINT (graceful drain); off the main thread the caller stops."""
    try:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for _ in signals:
                stop.set()
                return
    except (NotImplementedError, ValueError):  # not the main thread: the caller stops us
        await anyio.sleep_forever()


def run(spec: StageSpec, config: BusConfig | None = None) -> None:
    """Blocking entry point for one stage process: anyio on uvloop."""
    anyio.run(
        lambda: serve(spec, config=config),
        backend="asyncio",
        backend_options={"use_uvloop": True},
    )
