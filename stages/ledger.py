"""Ledger: every `completed`, `failed` or `cancelled` run is billed exactly once into DuckDB.

The table's primary key is the billing key (tenant, idempotency key or request id, billing
type) and rows go in with ON CONFLICT DO NOTHING, so a redelivered terminal event, or a second
terminal event of the same run, bills nothing more; `billed` always repeats the stored row.
DuckDB lets one process hold the file at a time, so each worker opens it per batch of rows and
retries while another worker holds the lock. A batch is one multi-row INSERT on a one-thread
DuckDB: an open is most of its cost, and the ledger's CPU comes out of the engine's two cores.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import anyio.to_thread
import duckdb

from schemas import settings, subjects
from schemas.events import (
    Event,
    RequestFailed,
    RunBilled,
    RunCancelled,
    RunCompleted,
    Usage,
    decoder_for,
)
from stages.runtime import natsd
from stages.runtime.failures import duckdb_file_busy
from stages.runtime.spec import StageContext, StageSpec
from stages.tenancy import idempotency, ratelimit

STAGE = "ledger"
BILLING_TYPE = "run"
LOCK_TIMEOUT_S = 30.0
# rows gathered into one open of the file: an open costs ~23 ms of CPU whatever its rows, and
# at 32 closed-loop streams runs end one by one (10 ms gathered one row a batch, 0.16 CPU ms a
# generated token); a bill may wait this long, off the request's path
LINGER_S = 0.25

SCHEMA = """
CREATE TABLE IF NOT EXISTS billing (
    billing_key VARCHAR PRIMARY KEY,
    tenant VARCHAR,
    request_id VARCHAR NOT NULL,
    billing_type VARCHAR NOT NULL,
    status VARCHAR NOT NULL,
    prompt_tokens BIGINT NOT NULL,
    completion_tokens BIGINT NOT NULL,
    cached_tokens BIGINT NOT NULL,
    detail VARCHAR,
    event_ts_ns BIGINT NOT NULL,
    billed_ns BIGINT NOT NULL
)
"""
COLUMNS = (
    "billing_key, tenant, request_id, billing_type, status, prompt_tokens, completion_tokens, "
    "cached_tokens, detail, event_ts_ns, billed_ns"
)

Terminal = RunCompleted | RunCancelled | RequestFailed


def default_path() -> Path:
    return settings.LEDGER_DB.get() or natsd.default_data_dir() / "ledger.duckdb"


def billing_key(tenant: str | None, request_id: str, billing_type: str = BILLING_TYPE) -> str:
    return f"{tenant or '-'}:{request_id}:{billing_type}"


@dataclass(frozen=True, kw_only=True)
class Row:
    billing_key: str
    tenant: str | None
    request_id: str
    status: str
    usage: Usage
    detail: str | None
    event_ts_ns: int


def row_for(event: Terminal) -> Row:
    match event:
        case RunCompleted():
            status, detail = "completed", event.finish_reason
        case RunCancelled():
            status, detail = "cancelled", event.reason
        case RequestFailed():
            status, detail = "failed", f"{event.stage}:{event.code}"
    return Row(
        billing_key=billing_key(event.tenant, event.request_id),
        tenant=event.tenant,
        request_id=event.request_id,
        status=status,
        usage=event.usage,
        detail=detail,
        event_ts_ns=event.ts_ns,
    )


def connect(
    path: Path, *, read_only: bool = False, threads: int | None = None
) -> duckdb.DuckDBPyConnection:
    """Open the ledger, waiting while another process holds DuckDB's file lock; `threads` caps
    DuckDB's pool (None: its default)."""
    config = {} if threads is None else {"threads": threads}
    deadline = time.monotonic() + LOCK_TIMEOUT_S
    delay = 0.005
    while True:
        try:
            return duckdb.connect(str(path), read_only=read_only, config=config)
        except duckdb.IOException as err:
            if not duckdb_file_busy(err) or time.monotonic() > deadline:
                raise
            time.sleep(delay)
            delay = min(delay * 2, 0.1)


def write_rows(path: Path, rows: list[Row]) -> dict[str, Row]:
    """Insert rows not billed yet; return the stored row for every key (first bill wins)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    now = time.time_ns()
    con = connect(path, threads=1)  # a few rows need no pool, and starting one costs ~6 ms
    try:
        con.execute(SCHEMA)
        # one statement for the batch (executemany runs the INSERT once a row, ~4 ms each),
        # of each key's first row: the first bill wins inside a batch as across batches
        firsts: dict[str, Row] = {}
        for r in rows:
            firsts.setdefault(r.billing_key, r)
        values = ", ".join("(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)" for _ in firsts)
        con.execute(
            f"INSERT INTO billing ({COLUMNS}) VALUES {values} ON CONFLICT DO NOTHING",
            [
                v
                for r in firsts.values()
                for v in (r.billing_key, r.tenant, r.request_id, BILLING_TYPE, r.status,
                          r.usage.prompt_tokens, r.usage.completion_tokens,
                          r.usage.cached_tokens, r.detail, r.event_ts_ns, now)
            ],
        )  # fmt: skip
        stored = con.execute(
            "SELECT billing_key, tenant, request_id, status, prompt_tokens, completion_tokens, "
            "cached_tokens, detail, event_ts_ns FROM billing WHERE billing_key IN "
            f"({', '.join('?' for _ in rows)})",
            [r.billing_key for r in rows],
        ).fetchall()
    finally:
        con.close()
    return {
        key: Row(
            billing_key=key,
            tenant=tenant,
            request_id=rid,
            status=status,
            usage=Usage(prompt_tokens=p, completion_tokens=c, cached_tokens=k),
            detail=detail,
            event_ts_ns=ts,
        )
        for key, tenant, rid, status, p, c, k, detail, ts in stored
    }


class _Slot:
    def __init__(self, row: Row) -> None:
        self.row = row
        self.error: Exception | None = None
        self.done = anyio.Event()


@dataclass
class LedgerWriter:
    """Batches rows from concurrent handlers into one open of the DuckDB file."""

    path: Path
    _pending: list[_Slot] = field(default_factory=list)
    _flushing: bool = False
    # Issue 4: bill under the idempotency key while the run holds it; settle rate reservations.
    billing_id: Callable[[Terminal], Awaitable[str]] | None = None
    limiter: ratelimit.RateLimiter | None = None

    async def record(self, row: Row) -> Row:
        """The stored row for `row`'s billing key once it is in the file."""
        slot = _Slot(row)
        self._pending.append(slot)
        if not self._flushing:
            self._flushing = True
            try:
                await anyio.sleep(LINGER_S)
                while self._pending:
                    batch, self._pending = self._pending, []
                    rows = [s.row for s in batch]
                    try:
                        stored = await anyio.to_thread.run_sync(write_rows, self.path, rows)
                    except Exception as err:  # noqa: BLE001 - every waiter of the batch fails
                        stored, error = {}, err
                    else:
                        error = None
                    for s in batch:
                        s.row, s.error = stored.get(s.row.billing_key, s.row), error
                        s.done.set()
            finally:
                self._flushing = False
        await slot.done.wait()
        if slot.error is not None:
            raise slot.error
        return slot.row


async def handle(event: Terminal, writer: LedgerWriter) -> list[Event]:
    row = row_for(event)
    if writer.billing_id is not None:
        key = billing_key(event.tenant, await writer.billing_id(event))
        row = dataclasses.replace(row, billing_key=key)
    stored = await writer.record(row)
    if writer.limiter is not None:
        used = event.usage.prompt_tokens + event.usage.completion_tokens
        await writer.limiter.settle(event.request_id, used)
    return [
        RunBilled(
            request_id=event.request_id,
            tenant=stored.tenant,
            status=stored.status,  # type: ignore[arg-type]
            usage=stored.usage,
            billing_key=stored.billing_key,
        )
    ]


async def setup(ctx: StageContext) -> LedgerWriter:
    bus = ctx.bus
    await bus.ensure_kv()
    keys = idempotency.IdempotencyStore(await bus.kv(subjects.IDEMPOTENCY_BUCKET))
    return LedgerWriter(
        default_path(),
        billing_id=functools.partial(idempotency.billing_id, bus.js, keys),
        limiter=ratelimit.RateLimiter(await bus.kv(subjects.RATES_BUCKET)),
    )


def usage_by_tenant(path: Path | None = None, tenant: str | None = None) -> list[tuple]:
    """(tenant, status, runs, prompt_tokens, completion_tokens) per tenant and status."""
    con = connect(path or default_path(), read_only=True)
    try:
        where, args = ("WHERE tenant = ?", [tenant]) if tenant else ("", [])
        return con.execute(
            "SELECT coalesce(tenant, '-'), status, count(*), sum(prompt_tokens), "
            f"sum(completion_tokens) FROM billing {where} GROUP BY ALL ORDER BY ALL",
            args,
        ).fetchall()
    finally:
        con.close()


SPEC = StageSpec(
    name=STAGE,
    input_event=("completed", "failed", "cancelled"),
    decoder=decoder_for(RunCompleted, RunCancelled, RequestFailed),
    handle=handle,
    setup=setup,
    skip_cancelled=False,
    retry_errors=True,
)
