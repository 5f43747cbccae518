"""The archiver: a durable consumer over the whole event log that writes it to hourly Parquet.

Exactly once across restarts: rows are written (fsync, atomic rename), then the checkpoint, then
the ack. The checkpoint, not the consumer's ack state, says where to resume: at start the
durable is reused only when its ack floor equals the checkpoint with nothing pending, otherwise
it is recreated to start at checkpoint + 1. One archiver per archive directory. It runs as a
service of the stage runtime with no input of its own there (its consumer is the one above).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import anyio
import anyio.abc
from nats.aio.msg import Msg
from nats.js import api
from nats.js.errors import NotFoundError

from schemas import settings, subjects
from schemas.logrows import default_archive_dir, row_from_message
from stages.eventlog.parquet import ParquetLog
from stages.runtime.bus import Bus
from stages.runtime.failures import Backoff, bus_unavailable
from stages.runtime.service import Service
from stages.runtime.spec import StageContext, StageSpec

log = logging.getLogger("brigade.archiver")
DURABLE = subjects.durable_name("archiver")


@dataclass(frozen=True, kw_only=True)
class ArchiverConfig:
    """A file is cut every `max_rows` rows or `max_age_s` seconds after its first row."""

    archive_dir: Path
    max_rows: int = 5000
    max_age_s: float = 5.0  # the tools read the stream beyond the archive, so files can be few
    fetch_batch: int = 500
    # after a fetch that did not fill its batch, wait this long before the next: what the
    # stream stores meanwhile then comes in one delivery, not a wake-up (of this process and
    # the server's delivery to it) for every few events while tokens stream
    pace_s: float = 0.5
    ack_wait_s: float = 60.0

    def __post_init__(self) -> None:
        if self.max_rows < 1 or self.fetch_batch < 1:
            raise ValueError(
                f"max_rows={self.max_rows} and fetch_batch={self.fetch_batch} must be >= 1"
            )
        if (
            self.max_age_s <= 0
            or self.pace_s < 0
            or self.ack_wait_s <= self.max_age_s + self.pace_s
        ):
            raise ValueError(
                f"need 0 < max_age_s ({self.max_age_s}), 0 <= pace_s ({self.pace_s}) and "
                f"max_age_s + pace_s < ack_wait_s ({self.ack_wait_s}): a file must be cut before "
                "its messages are redelivered"
            )


@dataclass
class ArchiverStats:
    last_stream_seq: int = 0
    num_rows: int = 0
    num_files: int = 0
    num_skipped: int = 0  # redelivered messages already on disk
    num_lost: int = 0  # sequences the stream no longer held when we got to them (max age)


class Archiver(Service):
    def __init__(self, bus: Bus, config: ArchiverConfig) -> None:
        self.bus = bus
        self.config = config
        self.log = ParquetLog(config.archive_dir)
        self.stats = ArchiverStats()
        self._rows: list[dict] = []
        self._first_at = 0.0
        self._to_ack: Msg | None = None

    async def start(self) -> None:
        await self.bus.ensure_streams()
        self.stats.last_stream_seq = self.log.recover()
        info = await self.bus.js.stream_info(subjects.EVENTS_STREAM)
        if info.state.last_seq < self.stats.last_stream_seq:
            raise RuntimeError(
                f"the archive in {self.config.archive_dir} holds stream sequences up to "
                f"{self.stats.last_stream_seq} but the {subjects.EVENTS_STREAM} stream ends at "
                f"{info.state.last_seq}: the stream was recreated. Move the archive aside or set "
                "BRIGADE_ARCHIVE_DIR to start a new one (sequences would collide otherwise)"
            )
        await self._bind_consumer(self.stats.last_stream_seq)

    async def _bind_consumer(self, checkpoint: int) -> None:
        js = self.bus.js
        try:
            info = await js.consumer_info(subjects.EVENTS_STREAM, DURABLE)
            in_step = (
                info.ack_floor is not None
                and info.ack_floor.stream_seq == checkpoint
                and not info.num_ack_pending
                and info.config.ack_policy == api.AckPolicy.ALL
            )
            if not in_step:
                log.info("archiver durable out of step with checkpoint %d: recreating", checkpoint)
                await js.delete_consumer(subjects.EVENTS_STREAM, DURABLE)
        except NotFoundError:
            in_step = False
        if not in_step:
            await js.add_consumer(
                subjects.EVENTS_STREAM,
                api.ConsumerConfig(
                    durable_name=DURABLE,
                    filter_subject=subjects.ALL_EVENTS,
                    deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE,
                    opt_start_seq=checkpoint + 1,
                    ack_policy=api.AckPolicy.ALL,
                    ack_wait=self.config.ack_wait_s,
                    max_deliver=-1,  # the archive never gives up on a message
                    max_ack_pending=self.config.max_rows * 4,
                ),
            )
        self._sub = await js.pull_subscribe_bind(durable=DURABLE, stream=subjects.EVENTS_STREAM)

    async def _step(self, timeout: float) -> int:
        """One fetch, then a flush when a file is due; returns the messages fetched. A fetch
        that finds nothing is not an error; one the bus refuses raises, and the caller waits and
        retries: what was fetched and not flushed stays buffered, what was flushed and not acked
        is skipped when the server redelivers it (its seq is on disk)."""
        try:
            msgs = await self._sub.fetch(self.config.fetch_batch, timeout=timeout)
        except TimeoutError:  # nats.errors.TimeoutError too: nothing new
            msgs = []
        for msg in msgs:
            self.accept(msg)
        if self.due() or (not self._rows and self._to_ack is not None):
            await self.flush()
        return len(msgs)

    def accept(self, msg: Msg) -> None:
        """Buffer one delivered message (or skip it when its sequence is already on disk)."""
        seq = msg.metadata.sequence.stream
        self._to_ack = msg
        newest = self._rows[-1]["stream_seq"] if self._rows else self.stats.last_stream_seq
        if seq <= newest:
            self.stats.num_skipped += 1
            return
        if seq > newest + 1:
            self.stats.num_lost += seq - newest - 1
            log.warning(
                "stream sequences %d..%d expired before they were archived; raise the events "
                "stream's max age (BRIGADE_EVENTS_MAX_AGE_S) or keep the archiver running",
                newest + 1,
                seq - 1,
            )
        stored_ns = int(msg.metadata.timestamp.timestamp() * 1e6) * 1000
        if not self._rows:
            self._first_at = time.monotonic()
        self._rows.append(row_from_message(seq, stored_ns, msg.subject, msg.data))

    def due(self) -> bool:
        return bool(self._rows) and (
            len(self._rows) >= self.config.max_rows
            or time.monotonic() - self._first_at >= self.config.max_age_s
        )

    async def flush(self, *, confirm: bool = False) -> None:
        """Write buffered rows durably, checkpoint, then ack everything delivered so far.

        `confirm` waits for the server to record the ack (the last flush before stopping, so a
        restart finds the durable's ack floor at the checkpoint and reuses it)."""
        if self._rows:
            rows, self._rows = self._rows, []
            files = await anyio.to_thread.run_sync(self.log.write, rows)
            last = rows[-1]["stream_seq"]
            self.log.commit(last)
            self.stats.last_stream_seq = last
            self.stats.num_rows += len(rows)
            self.stats.num_files += len(files)
        if self._to_ack is not None:
            msg, self._to_ack = self._to_ack, None
            # AckPolicy.ALL: acknowledges every earlier delivery too
            await (msg.ack_sync() if confirm else msg.ack())

    async def run(
        self,
        stopping: anyio.Event,
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Archive until `stopping`, then fetch what the log still holds for it (a paced
        archiver may be mid-wait; at most max_age_s), write what is buffered and ack it
        (confirmed). While the bus is away at start (a JetStream election answers
        ServiceUnavailable) the start waits and is tried again, with a bounded backoff."""
        backoff = Backoff()
        while True:
            try:
                await self.start()
                break
            except Exception as err:  # noqa: BLE001 - only the bus being away is waited out
                if not bus_unavailable(err) or stopping.is_set():
                    raise
                delay = backoff.delay()
                log.warning("archiver: the bus is unavailable at start (%s: %s); retrying in "
                            "%.1f s", type(err).__name__, err, delay)  # fmt: skip
                with anyio.move_on_after(delay):
                    await stopping.wait()
        task_status.started()
        timeout = min(self.config.max_age_s, 1.0)
        backoff.reset()
        while not stopping.is_set():
            try:
                fetched = await self._step(timeout)
                backoff.reset()
                if 0 < fetched < self.config.fetch_batch:  # caught up: let the next batch gather
                    with anyio.move_on_after(self.config.pace_s):
                        await stopping.wait()
            except Exception as err:  # noqa: BLE001 - the bus away (an election, a restart)
                if not bus_unavailable(err):
                    raise
                delay = backoff.delay()
                log.warning("archiver: the bus is unavailable (%s: %s); retrying in %.1f s",
                            type(err).__name__, err, delay)  # fmt: skip
                with anyio.move_on_after(delay):
                    await stopping.wait()
        try:  # what the log holds for us now, so the archive ends where the log does
            with anyio.move_on_after(self.config.max_age_s):
                while await self._step(0.2):
                    pass
        except Exception as err:  # noqa: BLE001 - the bus away: the rest waits in the durable
            if not bus_unavailable(err):
                raise
            log.warning("archiver: no last fetch at stop (%s)", err)
        try:
            await self.flush(confirm=True)
        except Exception as err:  # noqa: BLE001 - written and checkpointed: a restart skips them
            if not bus_unavailable(err):
                raise
            log.warning("archiver: the last ack was not confirmed (%s)", err)
        await self._sub.unsubscribe()  # a pending pull would hold the connection's drain
        await self.bus.nc.flush()
        self.log.close()
        log.info(
            "archiver stopped at stream seq %d (%d rows, %d files this run)",
            self.stats.last_stream_seq,
            self.stats.num_rows,
            self.stats.num_files,
        )


def spec(config: ArchiverConfig | None = None) -> StageSpec:
    """`brigade stage archiver`; `config` defaults to the archive directory of
    schemas.logrows.default_archive_dir(), read when the stage starts."""

    def service(ctx: StageContext, state: None) -> Archiver:
        return Archiver(
            ctx.bus,
            config
            or ArchiverConfig(
                archive_dir=default_archive_dir(), pace_s=settings.ARCHIVER_PACE_S.get()
            ),
        )

    # the final write on stop gets the drain; past it the rows are redelivered (not acked)
    return StageSpec(name="archiver", service=service, drain_s=30.0)


SPEC = spec()
