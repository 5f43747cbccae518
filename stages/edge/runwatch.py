"""Follow one run's events and yield its text deltas in `seq` order, then its terminal event.

Live: plain subscriptions made before the submit, one for each kind of event the edge reads
(LIVE_EVENTS: the run's lifecycle, its text and its end), not `llm.ev.<id>.>`: a run's `tokens`,
one a step, are the detokenizer's to read, and the edge takes them only for a run that asks for
logprobs (`with_tokens`). Resume: an ordered consumer over the log from the start (then
live), skipping seqs <= `starting_after` (-1: all). Gaps (a slow-consumer drop, a worker racing
the terminal event) are filled from the log; every ordered consumer is unsubscribed when done,
so nothing is left behind per request. While the bus is away (an election, a server restart)
it keeps waiting, within its idle timeout, and asks again.
Until an engine takes the run (its `started`), the wait is bounded by the run's deadline
instead (`DeadlinePassed`), and `events()` says every `keepalive_s` of silence that it waits.
After the terminal event, missing deltas are waited for `gap_timeout_s`: the edge sets it past
the bus's redelivery time (`gap_timeout_for`). A detokenizer killed holding a `tokens` event
has it redelivered only after the ack wait, and one whose publish found the bus away (an
election) hands it back for 1, 2, 4 ... s; either way its successor may already have ended the
run from the `finished` that came next.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import anyio
import msgspec
import nats.errors
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from schemas import subjects
from schemas.events import (
    AnyEvent,
    RequestFailed,
    RunCancelled,
    RunCompleted,
    RunFinished,
    RunStarted,
    TextGenerated,
    TokensGenerated,
    decode_event,
)
from stages.edge.follow import answer_run_follows
from stages.edge.reorder import ReorderBuffer
from stages.runtime.failures import bus_away_span_s, bus_unavailable

Terminal = RunCompleted | RunCancelled | RequestFailed
TERMINAL_TAGS = ("completed", "cancelled", "failed")
# What a live watch subscribes to: the stages' lifecycle events (the edge's per-stage metrics),
# the engine's start and finish (its gauges, admission), the text, and the run's end.
LIVE_EVENTS = ("accepted", "authorized", "assembled", "tokenized", "started", "finished", "text",
               *TERMINAL_TAGS)  # fmt: skip


class DeltasMissing(TimeoutError):
    """The run ended but some of its text deltas never reached the log in time."""


class DeadlinePassed(TimeoutError):
    """No engine took the run (no `started` event) within its deadline."""


@dataclass(frozen=True)
class Waiting:
    """`keepalive_s` passed with nothing to send: the run still waits (`started`: an engine has
    it, its text has not come yet)."""

    waited_s: float  # since the watch started
    deadline_s: float | None  # the run's wait for an engine, from the same start
    started: bool


GAP_SLACK_S = 2.0  # past the redelivery: the restarted detokenizer's work and its publish


def gap_timeout_for(ack_wait_s: float, max_deliver: int) -> float:
    """How long after its terminal event a run's missing text may still come: a delivery to a
    dead consumer is redelivered after `ack_wait_s`, one whose publish found the bus away comes
    back over its stage's nak waits (`bus_away_span_s`); then it is decoded and published."""
    return max(ack_wait_s, bus_away_span_s(max_deliver)) + GAP_SLACK_S


class RunWatch:
    def __init__(
        self,
        nc: NATS,
        js: JetStreamContext,
        request_id: str,
        *,
        starting_after: int | None = None,
        idle_timeout_s: float = 300.0,
        deadline_s: float | None = None,
        keepalive_s: float | None = None,
        gap_timeout_s: float = 2.0,
        poll_s: float = 5.0,
        on_event: Callable[[AnyEvent, int], None] | None = None,
        with_tokens: bool = False,
    ) -> None:
        self.nc, self.js, self.request_id = nc, js, request_id
        start = 0 if starting_after is None else starting_after + 1
        self.buffer = ReorderBuffer[TextGenerated](start=start)
        self.idle_timeout_s = idle_timeout_s  # once an engine has the run (or without deadline)
        self.deadline_s = deadline_s  # until an engine takes it (its `started`)
        self.keepalive_s = keepalive_s  # events() yields Waiting after this much silence
        self.started = False  # an engine took the run: its `started` (or a later event) came
        self.gap_timeout_s = gap_timeout_s
        self.poll_s = poll_s  # live and silent this long: look for the end in the log
        self.on_event = on_event
        self.with_tokens = with_tokens  # live, also every `tokens` event (for on_event)
        self.terminal: Terminal | None = None
        self.idempotency_key: str | None = None  # set by the edge for a keyed run
        self.num_gap_fills = 0
        self._replay = starting_after is not None
        self._sub = None  # the replay's ordered consumer
        self._live: list = []  # the live subscriptions, all feeding _inbox
        self._inbox_in = self._inbox = None
        self._follow = None  # answers "is anyone following this run?" (stages/edge/follow.py)
        self._started_at = time.monotonic()

    async def start(self) -> None:
        """Subscribe; call before submitting, so no event can be missed. The deadline runs
        from here."""
        self._started_at = time.monotonic()
        subject = subjects.request_events(self.request_id)
        if self._replay:
            self._sub = await self.js.subscribe(
                subject, stream=subjects.EVENTS_STREAM, ordered_consumer=True
            )
        else:
            # unbounded: each subscription's pending limits bound what reaches it
            self._inbox_in, self._inbox = anyio.create_memory_object_stream[bytes](math.inf)
            tags = (*LIVE_EVENTS, "tokens") if self.with_tokens else LIVE_EVENTS
            for tag in tags:
                route = "*" if tag in subjects.ROUTED_EVENTS else None  # any model's
                live = subjects.event_subject(self.request_id, tag, route)
                self._live.append(await self.nc.subscribe(live, cb=self._on_live))
        self._follow = await answer_run_follows(self.nc, self.request_id)  # someone follows it

    async def _on_live(self, msg) -> None:
        with contextlib.suppress(anyio.ClosedResourceError, anyio.BrokenResourceError):
            self._inbox_in.send_nowait(msg.data)  # closed: the watch is over

    async def close(self) -> None:
        if self._follow is not None:
            follow, self._follow = self._follow, None
            with contextlib.suppress(nats.errors.Error):  # a closed connection ended it already
                await follow.unsubscribe()
        live, self._live = self._live, []
        for sub in live:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()
        if self._inbox is not None:
            self._inbox_in.close()
            self._inbox.close()
        if self._sub is not None:
            sub, self._sub = self._sub, None
            await _drop_consumer(self.js, sub)

    async def _next(self, timeout: float) -> bytes | None:
        """The next event's bytes, None after `timeout` seconds without one."""
        if self._sub is not None:
            try:
                return (await self._sub.next_msg(timeout=timeout)).data
            except nats.errors.TimeoutError:
                return None
        with anyio.move_on_after(timeout):
            return await self._inbox.receive()
        return None

    async def __aenter__(self) -> RunWatch:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _accept(self, data: bytes) -> list[TextGenerated]:
        try:
            event = decode_event(data)
        except msgspec.DecodeError:
            return []  # not ours to judge: the log keeps it, the stage that owns it fails it
        if self.on_event is not None:
            self.on_event(event, time.monotonic_ns())
        if isinstance(event, RunStarted | TokensGenerated | RunFinished | TextGenerated):
            self.started = True
        if isinstance(event, TextGenerated):
            return self.buffer.push(event.seq, event)
        if isinstance(event, Terminal) and self.terminal is None:
            self.terminal = event
        return []

    def _last_seq(self) -> int | None:
        term = self.terminal
        if isinstance(term, RequestFailed):
            return None  # nothing more will come; deliver what is contiguous
        return term.last_seq if term is not None else None

    def _done(self) -> bool:
        return self.terminal is not None and self.buffer.complete(self._last_seq())

    async def deltas(self) -> AsyncIterator[TextGenerated]:
        """Text deltas in order; afterwards `self.terminal` holds the run's end."""
        async for item in self.events():
            if isinstance(item, TextGenerated):
                yield item

    def _waits_for_engine(self) -> bool:
        """The deadline, not the idle timeout, bounds the wait: no engine has the run yet."""
        return self.deadline_s is not None and not self.started and self.terminal is None

    async def events(self) -> AsyncIterator[TextGenerated | Waiting]:
        """Text deltas in order, and a `Waiting` after each `keepalive_s` with nothing sent;
        raises DeadlinePassed when no engine took the run within its deadline, TimeoutError
        when an engine's run shows no event for the idle timeout."""
        assert self._sub is not None or self._live, "call start() before deltas()"
        gap_deadline: float | None = None
        next_fill = 0.0
        heard = quiet = time.monotonic()  # quiet: since the last delta or keep-alive
        next_poll = heard + self.poll_s
        while not self._done():
            now = time.monotonic()
            if self.terminal is not None:
                if gap_deadline is None:  # give racing deltas a moment to arrive live first
                    gap_deadline, next_fill = now + self.gap_timeout_s, now + 0.2
                if now >= next_fill:
                    next_fill = now + 0.5
                    for delta in await self._fill_from_log_if_up():
                        yield delta
                    if self._done():
                        break
                if now > gap_deadline:
                    missing = self.buffer.missing(self._last_seq())
                    raise DeltasMissing(
                        f"run {self.request_id}: text seqs {missing[:8]} never reached the log "
                        f"within {self.gap_timeout_s}s of its end"
                    )
            elif self._waits_for_engine() and now - self._started_at >= self.deadline_s:
                raise DeadlinePassed(
                    f"run {self.request_id}: no engine started it within its deadline of "
                    f"{self.deadline_s:g} s"
                )
            if (
                self.keepalive_s is not None
                and self.terminal is None
                and now - quiet >= self.keepalive_s
            ):
                quiet = now
                yield Waiting(now - self._started_at, self.deadline_s, self.started)
            timeout = self._timeout(now, heard, quiet, next_poll)
            data = await self._next(timeout)
            if data is None:
                now = time.monotonic()
                if self.terminal is None and not self._replay and now >= next_poll:
                    next_poll = now + self.poll_s
                    await self._end_from_log()  # a dropped live message: the log has it
                if (
                    self.terminal is None
                    and not self._waits_for_engine()
                    and time.monotonic() - heard > self.idle_timeout_s
                ):
                    raise TimeoutError(
                        f"run {self.request_id}: no event for {self.idle_timeout_s}s"
                    ) from None
                continue
            heard = time.monotonic()
            for delta in self._accept(data):
                quiet = heard
                yield delta

    def _timeout(self, now: float, heard: float, quiet: float, next_poll: float) -> float:
        """How long the next wait for a message may take: until the log is polled, the next
        keep-alive, the deadline or the idle timeout, whichever is first."""
        if self.terminal is not None:
            return 0.05
        ends = [next_poll]
        if self._waits_for_engine():
            ends.append(self._started_at + self.deadline_s)
        else:
            ends.append(heard + self.idle_timeout_s + 0.01)
        if self.keepalive_s is not None:
            ends.append(quiet + self.keepalive_s)
        return max(0.01, min(ends) - now)

    async def _end_from_log(self) -> None:
        for tag in TERMINAL_TAGS:
            subject = subjects.event_subject(self.request_id, tag)
            try:
                msg = await self.js.get_last_msg(subjects.EVENTS_STREAM, subject, direct=True)
            except NotFoundError:
                continue  # not stored: keep waiting live
            except Exception as err:  # noqa: BLE001 - the bus away: wait live, ask again later
                if not bus_unavailable(err):
                    raise
                return
            if msg.data:
                self._accept(msg.data)
                return

    async def _fill_from_log_if_up(self) -> list[TextGenerated]:
        """The stored text deltas, or none while the bus is away (the gap deadline bounds it)."""
        try:
            return await self._fill_from_log()
        except Exception as err:  # noqa: BLE001 - an election or a restart: try again later
            if not bus_unavailable(err):
                raise
            return []

    async def _fill_from_log(self) -> list[TextGenerated]:
        """Read this run's stored text deltas (an ordered consumer, then unsubscribed)."""
        self.num_gap_fills += 1
        subject = subjects.event_subject(self.request_id, "text")
        sub = await self.js.subscribe(subject, stream=subjects.EVENTS_STREAM, ordered_consumer=True)
        ready: list[TextGenerated] = []
        try:
            while True:
                try:
                    msg = await sub.next_msg(timeout=0.5)
                except nats.errors.TimeoutError:
                    break  # nothing stored for this subject
                ready.extend(self._accept(msg.data))
                if msg.metadata.num_pending == 0:
                    break
        finally:
            await _drop_consumer(self.js, sub)
        return ready


async def _drop_consumer(js: JetStreamContext, sub) -> None:
    """Unsubscribe and delete the ephemeral consumer now (not seconds later, on inactivity)."""
    with anyio.CancelScope(shield=True):
        try:
            info = await sub.consumer_info()
            await sub.unsubscribe()
            await js.delete_consumer(subjects.EVENTS_STREAM, info.name)
        except (nats.errors.Error, NotFoundError):
            pass  # already gone: the server removes an ephemeral consumer without interest
