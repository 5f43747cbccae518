"""Runs whose edge is gone: a run an edge worker submitted names it (`edge_worker`), and while
the run is not over the sweeper pings that worker (stages/edge/follow.py) every `check_s`. NATS
drops a dead process's subscriptions with its connection, so a killed edge stops answering at
once: unreachable for `grace_s` (and not just after the sweeper's own reconnect, when the edges
may still be reconnecting), its runs are cancelled, reason `disconnect`, as the edge itself would
have on its client's disconnect. A run with an idempotency key is resumable: it is cancelled
only if, `reconnect_grace_s` later, no edge follows it (a client that came back through another
edge re-attached to it). Runs are learnt live from `accepted` and forgotten at their end; the
sweeper's passes add those this missed (`track`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import anyio
import msgspec
import nats.errors

from schemas import subjects
from schemas.bounded import decode_bounded
from schemas.events import CancelRequested
from stages.runtime.bus import Bus

log = logging.getLogger("brigade.sweeper")
PING_TIMEOUT_S = 0.5
ENDS = ("completed", "cancelled", "failed")


class _Followed(msgspec.Struct, frozen=True):
    edge_worker: str | None = None
    idempotency_key: str | None = None
    deadline_s: float | None = None


class _Accepted(msgspec.Struct, frozen=True):
    """The part of an `accepted` event this reads (the rest is skipped, not decoded)."""

    request_id: str
    tenant: str | None = None
    request: _Followed = _Followed()


_accepted = msgspec.json.Decoder(_Accepted)


@dataclass(frozen=True)
class Run:
    tenant: str | None
    edge_worker: str | None
    keyed: bool
    deadline_s: float | None


def read_accepted(data: bytes) -> tuple[str, Run] | None:
    """(request id, what the sweeper keeps of it) from an `accepted` event; None if it is not one."""
    try:
        event = decode_bounded(_accepted, data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    req = event.request
    return event.request_id, Run(
        event.tenant, req.edge_worker, req.idempotency_key is not None, req.deadline_s
    )


@dataclass
class EdgeWatch:
    bus: Bus
    check_s: float = 0.25
    grace_s: float = 1.0
    reconnect_grace_s: float = 15.0
    clock: Callable[[], float] = time.monotonic
    runs: dict[str, Run] = field(default_factory=dict)  # not over yet, by request id
    gone_since: dict[str, float] = field(default_factory=dict)  # edge worker -> first miss
    keyed_due: dict[str, float] = field(default_factory=dict)  # request id -> when to look
    num_cancelled: int = 0
    _reconnects: int = 0
    _connected_since: float = 0.0

    def track(self, request_id: str, run: Run) -> None:
        if run.edge_worker is not None:
            self.runs.setdefault(request_id, run)

    def forget(self, request_id: str) -> None:
        self.runs.pop(request_id, None)
        self.keyed_due.pop(request_id, None)

    async def run(self, stopping: anyio.Event) -> None:
        """Follow `accepted` and the ends live, and check the edges every `check_s`."""
        accepted = await self.bus.nc.subscribe(subjects.all_events("accepted"))
        ends = [await self.bus.nc.subscribe(subjects.all_events(tag)) for tag in ENDS]
        self._connected_since = self.clock()
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._learn, accepted)
                for sub in ends:
                    tg.start_soon(self._end, sub)
                while not stopping.is_set():
                    try:
                        await self.check()
                    except Exception:  # noqa: BLE001 - the bus away: the next check retries
                        log.exception("checking the edges failed; retrying")
                    with anyio.move_on_after(self.check_s):
                        await stopping.wait()
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                for sub in (accepted, *ends):
                    try:
                        await sub.unsubscribe()
                    except nats.errors.Error:
                        pass  # the connection is gone: so is the subscription

    async def _learn(self, sub) -> None:
        async for msg in sub.messages:
            found = read_accepted(msg.data)
            if found is not None:
                self.track(*found)

    async def _end(self, sub) -> None:
        async for msg in sub.messages:
            self.forget(msg.subject.split(".")[2])  # llm.ev.<request id>.<end>

    async def _ping(self, subject: str) -> bool | None:
        """True: answered; False: nobody subscribes; None: cannot tell (the bus away, slow)."""
        try:
            await self.bus.nc.request(subject, b"", timeout=PING_TIMEOUT_S)
            return True
        except nats.errors.NoRespondersError:
            return False
        except Exception:  # noqa: BLE001 - a timeout, a reconnect: no judgment this time
            return None

    async def check(self) -> int:
        """Ping every edge that follows a run; cancel the runs of those gone past the grace,
        and the keyed runs nobody re-attached to; returns how many it cancelled."""
        now = self.clock()
        reconnects = self.bus.nc.stats.get("reconnects", 0)
        if reconnects != self._reconnects:  # back from a reconnect: the edges may still be away
            self._reconnects, self._connected_since = reconnects, now
            self.gone_since.clear()
        edges = sorted({r.edge_worker for rid, r in self.runs.items()
                        if r.edge_worker is not None and rid not in self.keyed_due})  # fmt: skip
        answers: dict[str, bool | None] = {}

        async def ping(edge: str) -> None:
            answers[edge] = await self._ping(subjects.edge_ping(edge))

        async with anyio.create_task_group() as tg:
            for edge in edges:
                tg.start_soon(ping, edge)
        settled = now - self._connected_since >= self.grace_s
        num = 0
        for edge in edges:
            if answers.get(edge):
                self.gone_since.pop(edge, None)
            elif answers.get(edge) is False and settled:
                since = self.gone_since.setdefault(edge, now)
                if now - since >= self.grace_s:
                    num += await self._orphaned(edge, now)
        for rid, due in sorted(self.keyed_due.items(), key=lambda item: item[1]):
            if due <= now:
                del self.keyed_due[rid]
                num += await self._cancel_unless_followed(rid)
        self.num_cancelled += num
        return num

    async def _orphaned(self, edge: str, now: float) -> int:
        """`edge` is gone: its runs have nobody to tell. Cancel them (keyed: look again later)."""
        self.gone_since.pop(edge, None)
        num = 0
        mine = [
            r for r, run in self.runs.items() if run.edge_worker == edge and r not in self.keyed_due
        ]
        for rid in mine:
            run = self.runs[rid]
            if run.keyed and self.reconnect_grace_s > 0:
                self.keyed_due[rid] = now + self.reconnect_grace_s
            else:
                num += await self._cancel_unless_followed(rid)
        return num

    async def _cancel_unless_followed(self, rid: str) -> int:
        run = self.runs.get(rid)
        if run is None:
            return 0  # it ended meanwhile
        followed = await self._ping(subjects.run_followers(rid))
        if followed is None:  # cannot tell now: ask again at the next check
            self.keyed_due[rid] = self.clock()
            return 0
        del self.runs[rid]
        if followed:
            return 0  # another edge follows it (its client re-attached there)
        log.warning("cancelling run %s: its edge %s is gone (its client with it)", rid,
                    run.edge_worker)  # fmt: skip
        await self.bus.publish(
            CancelRequested(request_id=rid, tenant=run.tenant, reason="disconnect")
        )
        return 1
