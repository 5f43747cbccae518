"""The archive on disk: hourly files named by their sequence range, recovery, checkpoint."""

from __future__ import annotations

from pathlib import Path

import duckdb

from schemas import events as ev
from schemas.logrows import row_from_message
from stages.eventlog.parquet import ParquetLog

HOUR = 3600 * 10**9
T = 1_800_000_000 * 10**9 - (1_800_000_000 * 10**9) % HOUR  # 2027-01-15T08:00:00Z, an hour start


def row(seq: int, stored_ns: int) -> dict:
    event = ev.TextGenerated(request_id=f"r{seq}", seq=0, text=f"x{seq}")
    return row_from_message(seq, stored_ns, f"llm.ev.r{seq}.text", ev.encode(event))


def test_one_file_per_contiguous_hour_run(tmp_path: Path):
    log = ParquetLog(tmp_path)
    rows = [row(1, T - 5), row(2, T - 1), row(3, T), row(4, T + HOUR - 1), row(5, T + HOUR)]
    files = log.write(rows)
    names = [str(p.relative_to(tmp_path)) for p in files]
    assert names == [
        "hour=2027-01-15T07/events-000000000001-000000000002.parquet",
        "hour=2027-01-15T08/events-000000000003-000000000004.parquet",
        "hour=2027-01-15T09/events-000000000005-000000000005.parquet",
    ]
    texts = duckdb.sql(
        f"SELECT stream_seq, text FROM read_parquet('{tmp_path}/**/*.parquet') ORDER BY 1"
    ).fetchall()
    assert texts == [(1, "x1"), (2, "x2"), (3, "x3"), (4, "x4"), (5, "x5")]


def test_recovery_trusts_renamed_files_and_drops_half_written_ones(tmp_path: Path):
    log = ParquetLog(tmp_path)
    log.write([row(1, T), row(2, T)])
    log.commit(2)
    log.write([row(3, T), row(4, T)])  # crash before commit: the file is complete, though
    half = tmp_path / "hour=2027-01-15T08" / "events-000000000005-000000000009.parquet.tmp"
    half.write_bytes(b"PAR1 torn")
    (tmp_path / ".staging" / "5.ndjson").write_text("{}")
    again = ParquetLog(tmp_path)
    assert again.read_checkpoint() == 2
    assert again.recover() == 4
    assert not half.exists() and not list((tmp_path / ".staging").iterdir())
    again.commit(4)
    assert ParquetLog(tmp_path).read_checkpoint() == 4


def test_empty_archive_starts_at_zero(tmp_path: Path):
    assert ParquetLog(tmp_path / "new").recover() == 0


def test_a_payload_that_is_no_event_takes_its_type_and_request_from_the_subject():
    """A routed subject has its model after the event: the row's type is the event."""
    for subject, kind in (("llm.ev.r1.tokens", "tokens"), ("llm.ev.r1.tokenized.tiny", "tokenized")):  # fmt: skip
        got = row_from_message(1, T, subject, b"\xff not json")
        assert (got["type"], got["request_id"], got["subject"]) == (kind, "r1", subject)
    event = ev.PromptTokenized(request_id="r2", prompt_token_ids=[1], model="tiny")
    got = row_from_message(2, T, "llm.ev.r2.tokenized.tiny", ev.encode(event))
    assert (got["type"], got["request_id"]) == ("tokenized", "r2")
