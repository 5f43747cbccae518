"""The one stage runtime: pull, decode, handle, publish (deduped), ack, drain — for every stage.

Handler contract (the spec itself is stages/runtime/spec.py). `handle` gets one decoded event
and the state that `setup` returned (None without setup) and returns the events to publish; it does no I/O of its own where it can avoid it. To fail the
request with a precise reason it raises `StageError(code, message, field=...)`; any other
exception becomes a `failed` event with code `internal` (a stage whose errors are transient,
`retry_errors`, retries until its last delivery). Either way the input is acked, so a poison
message never loops. An undecodable input becomes a `failed` event when a request id can be
read from it, else a dead letter (stages/runtime/deadletter.py), and is terminated.

The runtime stamps `service_ns` (monotonic, decode to end of handle) on every output that has
none, the bus stamps `ts_ns` (wall clock) at publish, and every output goes out with
`Nats-Msg-Id` = msg_id(request_id, type[, seq]), so a redelivered input re-publishes nothing new.
The input is acked only after every output is acknowledged by the stream. A crash before the ack
means redelivery after `ack_wait` (or the `backoff` steps), at most `max_deliver` times; while a
handler holds its input the runtime keeps it alive with in-progress acks (up to `max_hold_s`).

Requests whose `cancel` event was seen are skipped unless the spec sets `skip_cancelled=False`
(the engine, detokenize, the ledger): their work is not done, and the run's terminal `cancelled`
event is published instead (msg id `<request_id>:cancelled`, so stages that skip the same run
store it once), so the ledger bills it and frees what it holds. Late events for unknown or
finished requests reach `handle` like any other; handlers must tolerate them.

A stage whose work outlives one call (the engine: one input, then token events for as long as
the request runs) sets `service=` instead of `handle=`: a long-running handler
(stages/runtime/service.py) that takes inputs while its `capacity()` allows and settles each
one itself. A spec with no input (the edge's HTTP server; the archiver, whose consumer starts
at its checkpoint) is a service with nothing to pull. For every kind the runtime owns connect,
streams, the one cancel subscription, the max-deliveries advisory, in-progress acks, the
continuous pull (stages/runtime/pull.py, paced by capacity), decode and invalid-input failures,
ready, signals, and stop: no new input, `drain_s` for what is held to finish, the rest handed
back (nak) for another worker, close.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import signal
import time
from collections import deque
from typing import Any

import anyio
import anyio.abc
import msgspec
import nats.errors
from nats.aio.msg import Msg
from nats.js.errors import NotFoundError

from schemas import subjects
from schemas.bounded import decode_bounded
from schemas.events import CancelRequested, Event, RequestFailed, RunCancelled, encode
from stages.runtime import deadletter, heartbeat
from stages.runtime.bus import Bus, BusConfig
from stages.runtime.failures import (
    Backoff,
    StageError,
    bus_away_delay_s,
    bus_unavailable,
    error_field,
    new_request_id,
    read_envelope,
)
from stages.runtime.heartbeat import Heart
from stages.runtime.pull import ContinuousPull
from stages.runtime.service import Held, InputService, Service
from stages.runtime.spec import StageContext, StageSpec, with_env_overrides

log = logging.getLogger("brigade.runtime")
_cancel_decoder = msgspec.json.Decoder(CancelRequested)
CLOCK_MARGIN_S = 5.0  # how far this host's clock and the server's may disagree


class StageWorker:
    """One worker of one stage: binds to the stage's shared durable and serves until stopped.

    `fetch_timeout_s`: how often the pull re-checks capacity when nothing woke it."""

    def __init__(self, spec: StageSpec, bus: Bus, *, fetch_timeout_s: float = 1.0) -> None:
        spec = with_env_overrides(spec)
        self.spec = spec
        self.ctx = StageContext(bus=bus, spec=spec, room_changed=self._wake)
        self.fetch_timeout_s = fetch_timeout_s
        self.state: Any = None
        self.service: Service | None = None
        self._cancel_sub: Any = None
        # wall clock since which this worker hears every cancel live (its subscription, renewed
        # at each reconnect): an input stored later needs no look for a cancel in the log
        self._cancels_heard_from: float | None = None
        self._gave_up_sub: Any = None
        self._pull: ContinuousPull | None = None
        self._in_flight: dict[int, Held] = {}  # every input delivered and not settled yet
        self._backlog: deque[Held] = deque()  # delivered to a service, not admitted yet
        self._changed = anyio.Event()  # a delivery, a settle or room_changed: re-check capacity
        self._settled = anyio.Event()  # an input settled, or the service ended
        self._async_handler = inspect.iscoroutinefunction(spec.handle)
        self.log = logging.getLogger(f"brigade.{spec.name}")

    @property
    def bus(self) -> Bus:
        return self.ctx.bus

    async def start(self, stop: anyio.Event | None = None) -> None:
        """Streams, the cancel subscription, the advisory, the durable, setup, the service.
        While the bus is away (an election, a restart) the set-up, the spec's `setup` too (its
        bucket lookups), waits and retries, with a bounded backoff, until it answers or `stop`
        is set."""
        await self._until_bus_answers(self.bus.ensure_streams, stop)
        if self.spec.has_input:
            self._cancel_sub = await self.ctx.cancels.subscribe(self.bus)
            self._cancels_heard_from = time.time()
            consumer = self.spec.consumer()
            self._gave_up_sub = await self.bus.nc.subscribe(
                subjects.max_deliveries_advisory(consumer.stream, consumer.durable),
                cb=self._gave_up,
            )
            await self._until_bus_answers(lambda: self.bus.ensure_consumer(consumer), stop)
        if self.spec.setup is not None:
            setup = self.spec.setup
            self.state = await self._until_bus_answers(lambda: setup(self.ctx), stop)
        if self.spec.service is not None:
            self.service = self.spec.service(self.ctx, self.state)
            if self.spec.has_input and not isinstance(self.service, InputService):
                raise TypeError(
                    f"stage {self.spec.name!r} has an input, so its service must be an "
                    f"InputService (capacity, admit), not {type(self.service).__name__}"
                )
            self.ctx.cancels.on_cancel(self.service.on_cancel)

    async def _until_bus_answers(self, call, stop: anyio.Event | None) -> Any:
        backoff = Backoff()
        while True:
            try:
                return await call()
            except Exception as err:  # noqa: BLE001 - only the bus being away is waited out
                if not bus_unavailable(err) or (stop is not None and stop.is_set()):
                    raise
                delay = backoff.delay()
                self.log.warning("the bus is unavailable at start (%s: %s); retrying in %.1f s",
                                 type(err).__name__, err, delay)  # fmt: skip
                await anyio.sleep(delay)

    async def _rebind_after_reconnects(self, period_s: float = 1.0) -> None:
        """A reconnect may follow a server restart that lost what lives in memory (the submit
        queue and its consumer): make the streams and this stage's durable again (both
        idempotent), so the stage goes on pulling."""
        seen = _reconnects(self.bus)
        backoff = Backoff()
        while True:
            await anyio.sleep(period_s)
            now = _reconnects(self.bus)
            if now == seen or not self.bus.nc.is_connected:
                continue
            try:
                await self.bus.ensure_streams()
                if self.spec.has_input:
                    await self.bus.ensure_consumer(self.spec.consumer())
            except Exception as err:  # noqa: BLE001 - the next period tries again
                level = logging.WARNING if bus_unavailable(err) else logging.ERROR
                self.log.log(level, "could not set up the streams again after a reconnect: "
                             "%s: %s", type(err).__name__, err)  # fmt: skip
                await anyio.sleep(backoff.delay())
                continue
            self.log.info("reconnected to NATS; streams and durable in place")
            self._cancels_heard_from = time.time()  # cancels sent while away were not heard
            seen = now
            backoff.reset()

    def decode(self, msg: Msg) -> Any:
        """The typed input, or raises msgspec.DecodeError / ValidationError (JSON too deep too)."""
        assert self.spec.decoder is not None, "a stage with input has a decoder (__post_init__)"
        event = decode_bounded(self.spec.decoder, msg.data)
        if self.spec.with_headers is not None:
            event = self.spec.with_headers(event, msg.headers or {})
        return event

    async def invalid_event(self, data: bytes, err: Exception) -> RequestFailed | None:
        if self.spec.on_invalid is not None:
            failed = self.spec.on_invalid(data, err, self.state)
            return await failed if inspect.isawaitable(failed) else failed
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

    async def _decoded(self, held: Held) -> tuple[bool, Any]:
        """(True, event) for a live input; (False, None) when it was settled here: undecodable
        (its `failed` event published, or recorded as a dead letter and terminated) or
        cancelled (skip_cancelled)."""
        try:
            event = self.decode(held.msg)
        except Exception as err:  # noqa: BLE001 - whatever does not decode is poison, not a crash
            reason = f"undecodable {self._input_kind()}: {type(err).__name__}: {err}"
            try:
                failed = await self.invalid_event(held.msg.data, err)
            except Exception as inner:  # noqa: BLE001 - on_invalid failing buries the message
                self.log.exception("could not fail the request of an undecodable message")
                reason += f" (and failing its request raised {type(inner).__name__}: {inner})"
                failed = None
            if failed is None:
                await self.bury(held, reason)
            else:
                await held.complete([failed])
            return False, None
        request_id = getattr(event, "request_id", None)
        # Where runs wait while no worker may run (the submit queue; a service's input: runs
        # wait there for an engine), a cancel may predate this worker: read it from the log.
        waits = self.spec.stream == subjects.SUBMIT_STREAM or isinstance(self.service, InputService)
        if (
            request_id is not None
            and waits
            and request_id not in self.ctx.cancels
            and self._unheard_cancel_possible(held.msg)
        ):
            await self._cancel_stored(request_id, held.msg)
        if self.spec.skip_cancelled and request_id is not None:
            if request_id in self.ctx.cancels:
                await held.complete([self._cancelled(event, request_id)])
                return False, None
        return True, event

    def _unheard_cancel_possible(self, msg: Msg) -> bool:
        """Whether a cancel of this input may have come while this worker did not listen: the
        input was stored before it heard cancels live (within CLOCK_MARGIN_S of the server's
        clock); a later one's cancel is in the cancel set already."""
        since, stored = self._cancels_heard_from, msg.metadata.timestamp
        return since is None or stored is None or stored.timestamp() < since + CLOCK_MARGIN_S

    async def _cancel_stored(self, request_id: str, submitted: Msg) -> None:
        """An input's cancel may predate this worker (its client gave up on it, told it timed
        out or failed, while no gateway or no engine ran): read it from the log, so a run its
        client gave up on never starts. Only a cancel stored after the input counts: one from
        before it is for the stages that heard it to honour (they end the run there)."""
        subject = subjects.event_subject(request_id, "cancel")
        try:
            msg = await self.bus.js.get_last_msg(subjects.EVENTS_STREAM, subject, direct=True)
            if msg.time is None or msg.time < submitted.metadata.timestamp:
                return
        except Exception:  # noqa: BLE001 - none stored (NotFound), or the bus away: not cancelled
            return
        cancel = None
        try:
            cancel = decode_bounded(_cancel_decoder, msg.data or b"")
        except msgspec.DecodeError:  # a poison on the subject still names the request
            pass
        self.ctx.cancels.add(request_id, cancel)

    def _cancelled(self, event: Any, request_id: str) -> RunCancelled:
        """The terminal event of a run cancelled before this stage did its work."""
        return RunCancelled(
            request_id=request_id,
            tenant=getattr(event, "tenant", None),
            reason=self.ctx.cancels.reason(request_id) or "client",
            stage=self.spec.name,
        )

    def _input_kind(self) -> str:
        return self.spec.input_event if isinstance(self.spec.input_event, str) else "input"

    async def bury(self, held: Held, reason: str) -> None:
        """Record `held` in the dead-letter stream, then terminate it (never redelivered)."""
        request_id, _ = read_envelope(held.msg.data or b"")
        letter = deadletter.letter_for(self.spec.name, held.msg, reason, request_id)
        await deadletter.record(self.bus.js, letter)
        await held.term()

    async def handle_message(self, held: Held) -> None:
        """The handler path: decode -> (skip if cancelled) -> handle -> complete."""
        live, event = await self._decoded(held)
        if not live:
            return
        try:
            result = self.spec.handle(event, self.state)  # type: ignore[misc]
            outputs = await result if self._async_handler else result  # type: ignore[misc]
        except StageError as err:
            outputs = [self._failed(event, err.code, err.message, err.field, err.retry_after_s)]
        except Exception as err:  # noqa: BLE001 - a failing handler fails its request, not us
            self.log.exception("handler failed for %s", getattr(event, "request_id", None))
            if self._retry(held, err):
                await held.nak(delay=_retry_delay(held, err))
                return
            if not self.spec.fails_requests:
                await self.bury(held, f"its handler failed: {type(err).__name__}: {err}")
                return
            outputs = [self._failed(event, "internal", f"{type(err).__name__}: {err}", None, None)]
        await held.complete(outputs)

    def _retry(self, held: Held, err: Exception) -> bool:
        """Whether a handler's error is retried: the bus being away (an election, a restart:
        not the request's fault), or any error where the spec says its errors are transient;
        never on the last delivery (then the request fails, once)."""
        transient = self.spec.retry_errors or bus_unavailable(err)
        return transient and held.num_delivered < self.spec.max_deliver

    async def admit(self, held: Held) -> None:
        """The service path: decode -> (skip if cancelled) -> service.admit, which now owns it."""
        assert isinstance(self.service, InputService), "admit is only for a service's inputs"
        live, event = await self._decoded(held)
        if not live:
            return
        try:
            await self.service.admit(held, event)
        except StageError as err:
            await held.fail(event, err)
        except Exception as err:  # noqa: BLE001 - a failing admission fails its request
            self.log.exception("could not admit %s", getattr(event, "request_id", None))
            if self._retry(held, err):
                await held.nak(delay=_retry_delay(held, err))
                return
            await held.fail(event, StageError("internal", f"{type(err).__name__}: {err}"))

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
            if delivered < self.spec.max_deliver:  # the bus away: 1, 2, 4, 8 s (a restart)
                await msg.nak(delay=bus_away_delay_s(delivered))
                return
            raise
        reply_to = (msg.headers or {}).get(subjects.REPLY_HEADER)
        if reply_to and self.spec.reply is not None:
            await self.bus.nc.publish(reply_to, self.spec.reply(stamped))
        await msg.ack()

    async def fail(self, msg: Msg, event: Any, err: StageError, started_ns: int) -> None:
        """Publish a `failed` event for the input's request, then ack."""
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
                await self._bury_stored(raw, seq)
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
            self.log.exception("could not fail the request of a message out of deliveries")

    async def _bury_stored(self, raw: Any, seq: int) -> None:
        """A message out of deliveries that names no request: a dead letter; off the submit
        queue too (a work queue would keep it until its max age)."""
        data = raw.data or b""
        letter = deadletter.DeadLetter(
            consumer=self.spec.name,
            reason=f"{self.spec.name} gave up after {self.spec.max_deliver} deliveries without "
            "finishing (its workers crashed or hung), and it names no request",
            subject=raw.subject,
            stream=self.spec.stream,
            stream_seq=seq,
            num_delivered=self.spec.max_deliver,
            size=len(data),
            data=data[: deadletter.MAX_KEPT_BYTES].decode("utf-8", errors="replace"),
            ts_ns=time.time_ns(),
        )
        await deadletter.record(self.bus.js, letter)
        if self.spec.stream == subjects.SUBMIT_STREAM:
            with contextlib.suppress(NotFoundError):
                await self.bus.js.delete_msg(self.spec.stream, seq)

    # ---- holding inputs ----

    def _hold(self, msg: Msg) -> Held:
        held = Held(self, msg)
        self._in_flight[id(held)] = held
        return held

    def release(self, held: Held) -> None:
        """`held` is settled (or forgotten): no more in-progress acks, and its room is free."""
        self._in_flight.pop(id(held), None)
        self._settled.set()
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        if self._pull is not None:
            self._pull.wake()

    async def _keep_alive(self) -> None:
        """In-progress acks for inputs held longer than a third of ack_wait (up to max_hold_s)."""
        wait = self.spec.backoff_s[0] if self.spec.backoff_s else self.spec.ack_wait_s
        period = max(wait / 3, 0.05)
        while True:
            await anyio.sleep(period)
            now = time.monotonic_ns()
            for held in list(self._in_flight.values()):
                if period <= (now - held.received_ns) / 1e9 <= self.spec.max_hold_s:
                    try:
                        await held.in_progress()
                    except Exception:  # noqa: BLE001 - a lost in-progress ack only risks redelivery
                        pass

    # ---- serving ----

    def _capacity(self) -> int:
        """How many inputs the pull may have delivered and not yet handled or admitted."""
        if self.service is None:
            return self.spec.max_in_flight
        assert isinstance(self.service, InputService), "a stage with input (start checks it)"
        return max(0, self.service.capacity())

    def _deliver(self, msg: Msg, work: anyio.abc.TaskGroup) -> None:
        held = self._hold(msg)
        if self.service is None:
            work.start_soon(self._handle_one, held)
        else:
            self._backlog.append(held)
            self._changed.set()

    async def _handle_one(self, held: Held) -> None:
        try:
            await self.handle_message(held)
        except Exception:  # noqa: BLE001 - never kill the worker; the message will be redelivered
            self.log.exception("message on %s left unacked", held.msg.subject)
            held.forget()
        finally:
            assert self._pull is not None, "inputs come from the pull"
            self._pull.done()

    async def _admit_loop(self, halt: anyio.Event) -> None:
        """Hand the backlog to the service while its capacity() allows, in arrival order."""
        assert isinstance(self.service, InputService) and self._pull is not None, "with input"
        while not halt.is_set():
            if self._backlog and self.service.capacity() > 0:
                held = self._backlog.popleft()
                try:
                    await self.admit(held)
                except Exception:  # noqa: BLE001 - never kill the worker; redelivered later
                    self.log.exception("message on %s left unacked", held.msg.subject)
                    held.forget()
                finally:
                    self._pull.done()
                continue
            self._changed = anyio.Event()
            with anyio.move_on_after(self.fetch_timeout_s):
                await self._changed.wait()

    async def _run_service(
        self,
        stopping: anyio.Event,
        done: anyio.Event,
        halt: anyio.Event,
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        assert self.service is not None, "a spec with service="
        try:
            await self.service.run(stopping, task_status=task_status)
        finally:
            done.set()
            halt.set()  # a service that ends ends its worker, even before `stop`
            self._settled.set()

    async def run(self, stop: anyio.Event, ready: anyio.Event | None = None) -> None:
        """Serve until `stop` is set; then take no new input, let what is held finish for
        `drain_s`, hand back (nak) the rest, and close (the connection is the caller's)."""
        await self.start(stop)
        stopping, halt = anyio.Event(), anyio.Event()  # halt: stop, or the service ended
        service_done = anyio.Event()
        heart = Heart(
            lambda: self.bus.kv(subjects.STAGES_BUCKET, ttl_s=heartbeat.TTL_S),
            self.spec.name,
            self.service.health if self.service is not None else dict,
        )
        async with anyio.create_task_group() as side:
            side.start_soon(self._keep_alive)
            side.start_soon(_relay, stop, halt)
            side.start_soon(heart.run)
            side.start_soon(self._rebind_after_reconnects)
            async with anyio.create_task_group() as work:
                if self.service is not None:
                    await work.start(self._run_service, stopping, service_done, halt)
                else:
                    service_done.set()
                if self.spec.has_input:
                    await self._start_pull(work, halt)
                heart.mark_ready()  # `brigade up` waits for this beat
                if ready is not None:
                    ready.set()
                if self._pull is not None:
                    try:
                        await self._pull.run(halt, self.fetch_timeout_s)
                    finally:
                        await self._pull.stop()
                else:
                    await halt.wait()
                while self._backlog:  # taken, never admitted: straight back to the durable
                    await self._backlog.popleft().nak()
                stopping.set()
                with anyio.move_on_after(self.spec.drain_s):
                    while self._in_flight or not service_done.is_set():
                        self._settled = anyio.Event()
                        await self._settled.wait()
                work.cancel_scope.cancel()
            side.cancel_scope.cancel()
        await heart.stop()
        for held in list(self._in_flight.values()):  # past the drain: another worker takes it
            try:
                await held.nak()
            except Exception:  # noqa: BLE001 - unacked, it is redelivered after ack_wait anyway
                self.log.warning("could not hand back %s", held.msg.subject)
        await self.close()

    async def _start_pull(self, work: anyio.abc.TaskGroup, halt: anyio.Event) -> None:
        consumer = self.spec.consumer()
        self._pull = ContinuousPull(
            self.bus.nc,
            consumer.stream,
            consumer.durable,
            lambda msg: self._deliver(msg, work),
            capacity=self._capacity,
        )
        await self._pull.start()
        if self.service is not None:
            work.start_soon(self._admit_loop, halt)

    async def close(self) -> None:
        """Unsubscribe (the pull was stopped by run) and tear down; the caller closes the bus."""
        for sub in (self._cancel_sub, self._gave_up_sub):
            if sub is not None:
                await sub.unsubscribe()
        if self.spec.teardown is not None:
            await self.spec.teardown(self.state)


def _reconnects(bus: Bus) -> int:
    stats = getattr(bus.nc, "stats", None)  # a test's fake connection has none
    return stats.get("reconnects", 0) if isinstance(stats, dict) else 0


def _retry_delay(held: Held, err: Exception) -> float:
    """0.2, 0.4, 0.8 s ... up to 5 s; for the bus being away 1, 2, 4, 8 s ... up to 30 s, so
    the default five deliveries span a server restart or an election (15 s)."""
    if bus_unavailable(err):
        return bus_away_delay_s(held.num_delivered)
    return min(0.1 * 2.0**held.num_delivered, 5.0)


async def _relay(stop: anyio.Event, halt: anyio.Event) -> None:
    await stop.wait()
    halt.set()


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
