"""Reading the event log straight from the JetStream stream, as archive rows.

For what the archive does not hold yet (the last second, or no archiver running) and for a
benchmark that checks its own requests at once. One ephemeral consumer per read, never one per
request of a batch.
"""

from __future__ import annotations

import logging
from pathlib import Path

from nats.errors import Error as NatsError
from nats.js import api
from nats.js.errors import NotFoundError

from schemas import subjects
from schemas.logrows import row_from_message

log = logging.getLogger("brigade.logsource")


async def read_rows(
    js,
    *,
    subject: str = subjects.ALL_EVENTS,
    start_seq: int | None = None,
    request_ids: set[str] | None = None,
    timeout_s: float = 5.0,
) -> list[dict]:
    """Every stored message on `subject` (from `start_seq` when given) as rows, in stream order,
    up to the stream's last message at the time of the call; `request_ids` keeps only those."""
    info = await js.stream_info(subjects.EVENTS_STREAM)
    last_seq = info.state.last_seq
    if last_seq == 0 or (start_seq is not None and start_seq > last_seq):
        return []
    config = api.ConsumerConfig(
        ack_policy=api.AckPolicy.NONE,
        deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE
        if start_seq is not None
        else api.DeliverPolicy.ALL,
        opt_start_seq=start_seq,
        inactive_threshold=30.0,
        mem_storage=True,
    )
    sub = await js.pull_subscribe(subject, stream=subjects.EVENTS_STREAM, config=config)
    rows: list[dict] = []
    try:
        pending = (await sub.consumer_info()).num_pending
        while pending:
            msgs = await sub.fetch(min(pending, 1000), timeout=timeout_s)
            for msg in msgs:
                meta = msg.metadata
                pending = meta.num_pending
                seq = meta.sequence.stream
                if seq > last_seq:
                    pending = 0
                    break
                row = row_from_message(
                    seq, int(meta.timestamp.timestamp() * 1e6) * 1000, msg.subject, msg.data
                )
                if request_ids is None or row["request_id"] in request_ids:
                    rows.append(row)
    finally:
        name = sub._consumer  # the server-assigned name of the ephemeral consumer
        await sub.unsubscribe()
        try:
            await js.delete_consumer(subjects.EVENTS_STREAM, name)
        except NotFoundError:
            pass
    return rows


async def request_rows(js, request_id: str, timeout_s: float = 5.0) -> list[dict]:
    """One request's stored events, in stream order."""
    return await read_rows(js, subject=subjects.request_events(request_id), timeout_s=timeout_s)


async def last_seq(js) -> int:
    return (await js.stream_info(subjects.EVENTS_STREAM)).state.last_seq


async def connect(name: str):
    """A Bus for a command-line tool: NATS_URL or the running `brigade up`, failing fast (no
    endless reconnect at start) with the URL in the error."""
    import nats

    from stages.runtime.bus import Bus, BusConfig

    config = BusConfig.from_env(connect_timeout_s=2.0)

    async def quiet(err: Exception) -> None:
        log.debug("nats: %s", err)

    try:
        nc = await nats.connect(
            servers=list(config.servers),
            name=name,
            connect_timeout=config.connect_timeout_s,
            allow_reconnect=False,
            max_reconnect_attempts=1,  # 0 would mean "forever" at start in nats-py
            reconnect_time_wait=0.2,
            error_cb=quiet,
        )
    except (OSError, TimeoutError, NatsError) as err:
        raise RuntimeError(
            f"cannot reach NATS at {', '.join(config.servers)} ({type(err).__name__}: {err}); "
            "is `brigade up` running, or NATS_URL right?"
        ) from err
    return Bus(nc, config)


def stream_tail(archive_dir: Path, *, request_id: str | None = None) -> list[dict] | None:
    """Rows the archive does not hold yet (after its checkpoint; one request's, when given), read
    from the running NATS; None when no NATS is configured or reachable."""
    import anyio

    from stages.eventlog.parquet import archived_through

    checkpoint = archived_through(archive_dir)

    async def read() -> list[dict]:
        bus = await connect("brigade-tools")
        try:
            if request_id is not None:
                rows = await request_rows(bus.js, request_id)
                return [r for r in rows if r["stream_seq"] > checkpoint]
            return await read_rows(bus.js, start_seq=checkpoint + 1)
        finally:
            await bus.close()

    try:
        return anyio.run(read)
    except (RuntimeError, OSError, TimeoutError, NatsError) as err:
        log.info("event stream not read (%s): using the archive alone", err)
        return None
