"""DuckDB over the event log: an `events` table from the archive's Parquet files (or given rows),
filtered by time and tenant, and the views of tools/log/views.sql on top of it."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from schemas import settings
from schemas.logrows import (
    COLUMNS,
    default_archive_dir,
    read_json_sql,
    sql_path,
    write_ndjson,
)

VIEWS_SQL = Path(__file__).with_name("views.sql")
VIEW_NAMES = (
    "ev",
    "arrivals",
    "requests",
    "token_gaps",
    "stage_hops",
    "request_stages",
    "stage_latency",
    "engine_gauges",
    "queue_depth",
)


def parquet_files(archive_dir: Path) -> list[Path]:
    return sorted(archive_dir.glob("**/*.parquet"))


def connect(
    archive_dir: Path | None = None,
    *,
    rows: list[dict] | None = None,
    since_ns: int | None = None,
    tenant: str | None = None,
    request_ids: list[str] | None = None,
):
    """An in-memory DuckDB with `events` and the views, over every Parquet file under
    `archive_dir` plus `rows` (e.g. the stream's tail, see tools.log.source). `since_ns` and
    `tenant` keep only the requests first seen at or after that wall-clock time / of that
    tenant (whole requests, never parts); `request_ids` keeps only those requests."""
    import duckdb

    con = duckdb.connect()
    source = _source_sql(con, archive_dir, rows)
    if request_ids is not None:
        wanted = ", ".join(f"'{sql_path(r)}'" for r in request_ids) or "NULL"
        source = f"SELECT * FROM ({source}) WHERE request_id IN ({wanted})"
    con.execute(f"CREATE TABLE events_all AS {source}")
    conditions = []
    if since_ns is not None:
        conditions.append(f"min(ts_ns - service_ns) >= {int(since_ns)}")
    if tenant is not None:
        conditions.append(f"max(tenant) = '{sql_path(tenant)}'")
    if conditions:
        con.execute(
            "CREATE TABLE events AS SELECT * FROM events_all WHERE request_id IN ("
            "SELECT request_id FROM events_all GROUP BY request_id HAVING "
            + " AND ".join(conditions)
            + ")"
        )
    else:
        con.execute("ALTER TABLE events_all RENAME TO events")
    con.execute(VIEWS_SQL.read_text())
    return con


def _source_sql(con, archive_dir: Path | None, rows: list[dict] | None) -> str:
    parts = []
    names = ", ".join(COLUMNS)
    if rows:
        with tempfile.TemporaryDirectory(prefix="brigade-rows-") as tmp:
            path = Path(tmp) / "rows.ndjson"
            write_ndjson(rows, path)
            con.execute(f"CREATE TEMP TABLE given_rows AS SELECT * FROM {read_json_sql(path)}")
        parts.append(f"SELECT {names} FROM given_rows")
    if archive_dir is not None and parquet_files(archive_dir):
        pattern = sql_path(archive_dir / "**" / "*.parquet")
        parts.append(f"SELECT {names} FROM read_parquet('{pattern}', union_by_name = true)")
    if not parts:
        empty = ", ".join(f"NULL::{kind} AS {name}" for name, kind in COLUMNS.items())
        return f"SELECT {empty} WHERE false"
    # The same stream sequence from both sources (archived meanwhile) is kept once.
    union = " UNION ALL ".join(parts)
    return f"SELECT DISTINCT ON (stream_seq) * FROM ({union}) ORDER BY stream_seq"


def add_source_args(parser) -> None:
    """--archive DIR and --no-stream, for every command that reads the log."""
    parser.add_argument(
        "--archive",
        type=Path,
        default=None,
        help=f"archive directory (default: ${settings.ARCHIVE_DIR.name} or .brigade/archive)",
    )
    parser.add_argument(
        "--no-stream",
        action="store_true",
        help="read only the archive, not the newest events from the running NATS stream",
    )


def open_log(
    args,
    *,
    since_ns: int | None = None,
    tenant: str | None = None,
    request_id: str | None = None,
):
    """DuckDB over the archive plus, unless --no-stream, what the stream holds beyond it (for
    one request only, when `request_id` is given)."""
    from tools.log.source import stream_tail

    archive_dir = args.archive or default_archive_dir()
    tail = None if args.no_stream else stream_tail(archive_dir, request_id=request_id)
    return connect(
        archive_dir,
        rows=tail,
        since_ns=since_ns,
        tenant=tenant,
        request_ids=None if request_id is None else [request_id],
    )


def parse_duration_ns(text: str) -> int:
    """'90s', '10m', '2h', '1d' or a bare number of seconds -> nanoseconds."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    value = text.strip().lower()
    scale = units.get(value[-1:], None)
    number = value[:-1] if scale is not None else value
    try:
        seconds = float(number) * (scale or 1)
    except ValueError:
        raise ValueError(
            f"duration {text!r} not understood: use a number with s, m, h or d, e.g. 10m"
        ) from None
    if seconds <= 0:
        raise ValueError(f"duration {text!r} must be positive")
    return int(seconds * 1e9)


def since_cutoff_ns(since: str | None) -> int | None:
    return None if since is None else time.time_ns() - parse_duration_ns(since)
