"""The sweeper: every run reaches a terminal event, even one whose stages all lost it.

Every `period_s` it reads the run-state projection (brigade_runs) and, for each run that is not
terminal and has shown no progress past its deadline (queued: before the engine; prefill and
streaming: in it), reconciles with the log first: a run whose terminal event is stored is only
behind in the projection, and a run with a recent `tokens` event is alive. For the rest it
publishes a `cancel` (reason `timeout`: an engine that holds the run aborts it, frees its KV
blocks and ends it with its usage), and `grace_s` later, if still nothing ended the run, its
terminal `cancelled` event itself (reason `timeout`, stage `sweeper`), which the ledger bills
and which releases the run's rate-limit reservation. Both carry the usual msg ids
(`<id>:cancel`, `<id>:cancelled`), so sweepers racing, or a sweep after a restart, store them
once; at most `max_per_pass` runs are ended per pass.

A run no engine has taken yet is left alone until its own deadline (`deadline_s` on its
`accepted` event: how long its client said it would wait) if that is later. A run whose cancel
is stored but that nothing ended `grace_s` later (cancelled while it waited for an engine, with
no engine running) is ended the same way. Beside the passes, orphans.py cancels the runs of an
edge worker that is gone.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import anyio
import anyio.abc
import msgspec
import nats.errors
from nats.js.errors import NotFoundError
from nats.js.kv import KeyValue

from schemas import settings, subjects
from schemas.bounded import decode_bounded
from schemas.events import TERMINAL_EVENTS, CancelRequested, RunCancelled, decode_event
from stages.eventlog.orphans import EdgeWatch, Run, read_accepted
from stages.eventlog.runstate import TERMINAL, RunRecord
from stages.runtime.bus import Bus
from stages.runtime.service import Service
from stages.runtime.spec import StageContext, StageSpec

log = logging.getLogger("brigade.sweeper")
STAGE = "sweeper"
AFTER_MARKER_S = 0.2  # a pass reads the run records on this long past nats-py's end marker
AFTER_MARKER_MAX_S = 1.0
_record = msgspec.json.Decoder(RunRecord)


@dataclass(frozen=True, kw_only=True)
class SweeperConfig:
    period_s: float = 30.0
    queued_s: float = 600.0  # accepted .. assembled: the light stages take milliseconds
    engine_s: float = 1800.0  # tokenized, streaming: no `tokens` event for this long
    grace_s: float = 60.0  # after the cancel, for the engine to end the run itself
    max_per_pass: int = 1000
    edge_check_s: float = 0.25  # between pings of the edges that follow runs (orphans.py)
    edge_grace_s: float = 1.0  # an edge unreachable this long is gone
    reconnect_grace_s: float = 15.0  # a gone edge's keyed run waits this long for its client

    def __post_init__(self) -> None:
        if min(self.period_s, self.queued_s, self.engine_s) <= 0 or self.grace_s < 0:
            raise ValueError(
                f"sweeper: period_s={self.period_s}, queued_s={self.queued_s} and engine_s="
                f"{self.engine_s} must be > 0, grace_s={self.grace_s} >= 0"
            )
        if self.max_per_pass < 1:
            raise ValueError(f"sweeper: max_per_pass={self.max_per_pass} must be >= 1")
        if self.edge_check_s <= 0 or min(self.edge_grace_s, self.reconnect_grace_s) < 0:
            raise ValueError(
                f"sweeper: edge_check_s={self.edge_check_s} must be > 0, edge_grace_s="
                f"{self.edge_grace_s} and reconnect_grace_s={self.reconnect_grace_s} >= 0"
            )

    @classmethod
    def from_env(cls) -> SweeperConfig:
        """The sweeper's settings, declared in schemas/settings.py (SWEEP_*)."""
        found = settings.load()
        return cls(
            period_s=found[settings.SWEEP_PERIOD_S],
            queued_s=found[settings.SWEEP_QUEUED_S],
            engine_s=found[settings.SWEEP_ENGINE_S],
            grace_s=found[settings.SWEEP_GRACE_S],
            max_per_pass=found[settings.SWEEP_MAX_PER_PASS],
            edge_check_s=found[settings.SWEEP_EDGE_CHECK_S],
            edge_grace_s=found[settings.SWEEP_EDGE_GRACE_S],
            reconnect_grace_s=found[settings.EDGE_RECONNECT_GRACE_S],
        )

    def deadline_s(self, record: RunRecord) -> float:
        return self.queued_s if record.state == "queued" else self.engine_s


@dataclass
class SweepStats:
    num_cancels: int = 0  # cancel events published
    num_ended: int = 0  # terminal events published
    ended_ids: list[str] = field(default_factory=list)


class Sweeper(Service):
    def __init__(self, bus: Bus, config: SweeperConfig, clock=time.time_ns) -> None:
        self.bus = bus
        self.config = config
        self.clock = clock
        self.stats = SweepStats()
        self.edges = EdgeWatch(bus, config.edge_check_s, config.edge_grace_s,
                               config.reconnect_grace_s)  # fmt: skip

    async def run(
        self,
        stopping: anyio.Event,
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        await self.bus.ensure_streams()
        await self.bus.ensure_kv()
        runs = await self.bus.kv(subjects.RUNS_BUCKET)
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.edges.run, stopping)
            task_status.started()
            while not stopping.is_set():
                try:
                    await self.sweep(runs)
                except Exception:  # noqa: BLE001 - a failed pass is retried at the next period
                    log.exception("sweep failed; retrying in %.0f s", self.config.period_s)
                with anyio.move_on_after(self.config.period_s):
                    await stopping.wait()

    async def sweep(self, runs: KeyValue) -> int:
        """One pass; returns how many runs it acted on."""
        num_acted = 0
        for record in await _records(runs):
            if num_acted >= self.config.max_per_pass:
                log.warning("sweep stopped at %d runs; the rest wait for the next pass", num_acted)
                break
            if record.state in TERMINAL or record.state == "billed":
                self.edges.forget(record.request_id)
                continue
            try:
                num_acted += await self._sweep_one(record)
            except Exception:  # noqa: BLE001 - one run's trouble must not stop the pass
                log.exception("sweeping run %s failed; the next pass retries it", record.request_id)
        return num_acted

    async def _sweep_one(self, record: RunRecord) -> int:
        """Cancel, and past the grace end, one run idle past its deadline, or end one whose
        cancel nothing honoured; 1 if it acted."""
        run = await self._run_of(record.request_id)
        idle_s = (self.clock() - await self._last_activity_ns(record)) / 1e9
        deadline = self.config.deadline_s(record)
        if record.state in ("queued", "prefill") and run is not None and run.deadline_s:
            deadline = max(deadline, run.deadline_s)  # its client waits that long for an engine
        if idle_s < deadline:
            return await self._end_unhonoured_cancel(record)
        if await self._ended_in_log(record.request_id):
            return 0
        await self.bus.publish(
            CancelRequested(request_id=record.request_id, tenant=record.tenant, reason="timeout")
        )
        self.stats.num_cancels += 1
        if idle_s >= deadline + self.config.grace_s:
            await self._end(record, idle_s)
        return 1

    async def _end_unhonoured_cancel(self, record: RunRecord) -> int:
        """A run cancelled `grace_s` ago that nothing ended (no stage held it: it waited for an
        engine while none ran): end it; a later engine reads the cancel and never runs it."""
        cancel = await self._last(record.request_id, "cancel")
        if cancel is None or (self.clock() - cancel.ts_ns) / 1e9 < self.config.grace_s:
            return 0
        if await self._ended_in_log(record.request_id):
            return 0
        await self._end(record, (self.clock() - record.updated_ns) / 1e9, cancel.reason)
        return 1

    async def _run_of(self, request_id: str) -> Run | None:
        """What the run's `accepted` event says (its deadline, its edge), kept for the edge
        watch; None when the log holds none."""
        run = self.edges.runs.get(request_id)
        if run is not None:
            return run
        last = await self._last_raw(request_id, "accepted")
        found = read_accepted(last) if last else None
        if found is None:
            return None
        self.edges.track(*found)
        return found[1]

    async def _end(self, record: RunRecord, idle_s: float, reason: str = "timeout") -> None:
        log.warning(
            "ending run %s (%s, no progress for %.0f s): cancelled, reason %s",
            record.request_id,
            record.state,
            idle_s,
            reason,
        )
        await self.bus.publish(
            RunCancelled(
                request_id=record.request_id,
                tenant=record.tenant,
                reason=reason,
                usage=record.usage,
                last_seq=record.last_seq,
                stage=STAGE,
            )
        )
        self.stats.num_ended += 1
        self.stats.ended_ids.append(record.request_id)

    async def _last_activity_ns(self, record: RunRecord) -> int:
        """The record's last change, or the run's last `tokens` event if later (the projection
        skips per-token writes)."""
        if record.state == "queued":
            return record.updated_ns
        last = await self._last(record.request_id, "tokens")
        return max(record.updated_ns, last.ts_ns if last is not None else 0)

    async def _ended_in_log(self, request_id: str) -> bool:
        for kind in TERMINAL_EVENTS:
            if await self._last(request_id, kind) is not None:
                return True
        return False

    async def _last_raw(self, request_id: str, kind: str) -> bytes | None:
        subject = subjects.event_subject(request_id, kind)
        try:
            msg = await self.bus.js.get_last_msg(subjects.EVENTS_STREAM, subject, direct=True)
        except NotFoundError:
            return None
        return msg.data or None

    async def _last(self, request_id: str, kind: str):
        data = await self._last_raw(request_id, kind)
        subject = subjects.event_subject(request_id, kind)
        try:
            return decode_event(data) if data else None
        except msgspec.DecodeError:  # a poison stored on the subject is no event of the run
            log.warning("the last message on %s is not an event; ignored", subject)
            return None


async def _records(runs: KeyValue) -> list[RunRecord]:
    """Every run record in the bucket now (one ordered watch, values included).

    nats-py marks the end of the bucket's entries (None) when the consumer reports nothing
    pending and its subscription has counted no delivery yet; under load the entries can be
    delivered and not yet counted, so the marker came first and a pass saw no runs. The watch
    is read on past the marker until it is quiet for AFTER_MARKER_S (at most AFTER_MARKER_MAX_S),
    the last entry of a key winning."""
    watcher = await runs.watchall(ignore_deletes=True)
    found: dict[str, RunRecord] = {}
    marker_at: float | None = None
    try:
        while True:
            timeout = 5.0
            if marker_at is not None:
                timeout = min(AFTER_MARKER_S, marker_at + AFTER_MARKER_MAX_S - time.monotonic())
                if timeout <= 0:
                    break
            try:
                entry = await watcher.updates(timeout=timeout)
            except nats.errors.TimeoutError:
                break
            if entry is None:  # the end of what the bucket held, or entries still behind it
                marker_at = marker_at or time.monotonic()
                continue
            if entry.value:
                try:
                    found[entry.key] = decode_bounded(_record, entry.value)
                except msgspec.DecodeError:  # ValidationError too
                    log.warning("run record %s does not decode; skipped", entry.key)
    finally:
        await watcher.stop()
    return list(found.values())


def spec(config: SweeperConfig | None = None) -> StageSpec:
    """`brigade stage sweeper`."""

    def service(ctx: StageContext, state: None) -> Sweeper:
        return Sweeper(ctx.bus, config or SweeperConfig.from_env())

    return StageSpec(name=STAGE, service=service, drain_s=5.0)


SPEC = spec()
