"""The event log's archived row: one row per message stored in the events stream.

Shared by the archiver (which writes these rows to Parquet) and the DuckDB tools (which read
them). The common event fields become typed columns; the whole payload stays in `data` (JSON
text), so fields added to an event later are queryable without a change here.
"""

from __future__ import annotations

import time
from pathlib import Path

import msgspec

from schemas import settings
from schemas.bounded import decode_bounded

# Column name -> DuckDB type, in file order. `stream_seq` is the JetStream sequence (unique in
# the log); `stored_ns` is the server's store time; `num_tokens` is len(token_ids) of a `tokens`
# event; `text` is the delta of a `text` event; `data` is the raw event JSON.
COLUMNS: dict[str, str] = {
    "stream_seq": "BIGINT",
    "stored_ns": "BIGINT",
    "subject": "VARCHAR",
    "type": "VARCHAR",
    "request_id": "VARCHAR",
    "tenant": "VARCHAR",
    "ts_ns": "BIGINT",
    "service_ns": "BIGINT",
    "seq": "BIGINT",
    "num_tokens": "INTEGER",
    "text": "VARCHAR",
    "data": "VARCHAR",
}


class _Header(msgspec.Struct):
    """The fields every event shares, plus the two the views need per delta; others ignored."""

    type: str | None = None
    request_id: str | None = None
    tenant: str | None = None
    ts_ns: int = 0
    service_ns: int = 0
    seq: int | None = None
    token_ids: list[int] | None = None
    text: str | None = None


_header_decoder = msgspec.json.Decoder(_Header)
_row_encoder = msgspec.json.Encoder()


def row_from_message(stream_seq: int, stored_ns: int, subject: str, data: bytes) -> dict:
    """A row for one stored message. A payload that is not an event (not JSON, nested too deep,
    wrong types) is still archived (the log keeps everything): its type and request id then
    come from the subject."""
    parts = subject.split(".")  # llm.ev.<request_id>.<event>[.<model token>]
    subject_type = parts[3] if len(parts) >= 4 else None
    subject_request = parts[2] if len(parts) >= 4 else None
    text_data = data.decode("utf-8", errors="replace")
    try:  # bounded: a payload nested too deep is kept as data, not a RecursionError
        head = decode_bounded(_header_decoder, data)
    except msgspec.DecodeError:  # ValidationError (JsonBoundsError too) is one
        head = _Header()
    return {
        "stream_seq": stream_seq,
        "stored_ns": stored_ns,
        "subject": subject,
        "type": head.type or subject_type,
        "request_id": head.request_id or subject_request,
        "tenant": head.tenant,
        "ts_ns": head.ts_ns,
        "service_ns": head.service_ns,
        "seq": head.seq,
        "num_tokens": len(head.token_ids) if head.token_ids is not None else None,
        "text": head.text,
        "data": text_data,
    }


def hour_of(row: dict) -> str:
    """The Parquet partition of a row: the UTC hour in which the log stored it."""
    return time.strftime("%Y-%m-%dT%H", time.gmtime(row["stored_ns"] // 1_000_000_000))


def write_ndjson(rows: list[dict], path: Path) -> None:
    with open(path, "wb") as f:
        for row in rows:
            f.write(_row_encoder.encode(row))
            f.write(b"\n")


def read_json_sql(path: Path) -> str:
    """A DuckDB table expression reading rows written by write_ndjson, with the exact types."""
    columns = ", ".join(f"{name}: '{kind}'" for name, kind in COLUMNS.items())
    return f"read_json('{sql_path(path)}', format = 'newline_delimited', columns = {{{columns}}})"


def sql_path(path: Path | str) -> str:
    """A path quoted for a DuckDB string literal."""
    return str(path).replace("'", "''")


def default_archive_dir() -> Path:
    """Where the archiver writes and the tools read: $BRIGADE_ARCHIVE_DIR, else `archive` in
    the data directory ($BRIGADE_DATA_DIR, else .brigade)."""
    return settings.ARCHIVE_DIR.get() or settings.DATA_DIR.get() / "archive"
