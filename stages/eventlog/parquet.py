"""The archive on disk: Parquet files of event-log rows, partitioned by hour, plus a checkpoint.

A file `hour=YYYY-MM-DDTHH/events-<first seq>-<last seq>.parquet` holds a contiguous run of
stream sequences. It becomes visible only by an atomic rename after fsync, and the checkpoint
(the last stream sequence on disk) is written after it, so on recovery the checkpoint is the
larger of the checkpoint file and the last sequence named by any file: a row is never written
twice, and anything after the checkpoint is fetched again.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

from schemas.logrows import hour_of, read_json_sql, sql_path, write_ndjson

CHECKPOINT_FILE = "checkpoint.json"
_FILE_NAME = re.compile(r"^events-(\d+)-(\d+)\.parquet$")


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_checkpoint(root: Path) -> int:
    try:
        return int(json.loads((root / CHECKPOINT_FILE).read_text())["last_stream_seq"])
    except FileNotFoundError:
        return 0
    except (json.JSONDecodeError, KeyError, ValueError) as err:
        raise RuntimeError(
            f"archive checkpoint {root / CHECKPOINT_FILE} is unreadable ({err}); "
            "delete it to recover from the file names alone"
        ) from err


def archived_through(root: Path) -> int:
    """The last stream sequence on disk: the checkpoint or the last one a file names (read only,
    safe while an archiver runs)."""
    last = read_checkpoint(root)
    for path in root.glob("hour=*/events-*.parquet"):
        match = _FILE_NAME.match(path.name)
        if match:
            last = max(last, int(match.group(2)))
    return last


class ParquetLog:
    """Append-only archive directory. Not safe for two writers: one archiver per directory."""

    def __init__(self, root: Path) -> None:
        import duckdb

        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)
        self.staging = root / ".staging"
        self.staging.mkdir(exist_ok=True)
        self._con = duckdb.connect()

    def files(self) -> list[Path]:
        return sorted(self.root.glob("hour=*/events-*.parquet"))

    def recover(self) -> int:
        """Drop half-written files and return the last stream sequence safely on disk (0: none)."""
        for leftover in list(self.staging.iterdir()) + list(self.root.glob("hour=*/*.tmp")):
            leftover.unlink()
        return archived_through(self.root)

    def read_checkpoint(self) -> int:
        return read_checkpoint(self.root)

    def write(self, rows: list[dict]) -> list[Path]:
        """Write rows (sorted by stream_seq, unique) as one file per contiguous run of the same
        hour; every file is durable when this returns. Then call `commit`."""
        written: list[Path] = []
        run: list[dict] = []
        for row in rows:
            if run and hour_of(row) != hour_of(run[0]):
                written.append(self._write_file(run))
                run = []
            run.append(row)
        if run:
            written.append(self._write_file(run))
        return written

    def _write_file(self, rows: list[dict]) -> Path:
        first, last = rows[0]["stream_seq"], rows[-1]["stream_seq"]
        directory = self.root / f"hour={hour_of(rows[0])}"
        new_dir = not directory.exists()
        directory.mkdir(exist_ok=True)
        final = directory / f"events-{first:012d}-{last:012d}.parquet"
        tmp = final.with_name(final.name + ".tmp")
        staged = self.staging / f"{first}.ndjson"
        write_ndjson(rows, staged)
        self._con.execute(
            f"COPY (SELECT * FROM {read_json_sql(staged)} ORDER BY stream_seq) "
            f"TO '{sql_path(tmp)}' (FORMAT parquet, COMPRESSION zstd)"
        )
        staged.unlink()
        _fsync_path(tmp)
        os.replace(tmp, final)
        _fsync_path(directory)
        if new_dir:
            _fsync_path(self.root)
        return final

    def commit(self, last_stream_seq: int) -> None:
        """Record that every sequence up to `last_stream_seq` is on disk (durably)."""
        path = self.root / CHECKPOINT_FILE
        tmp = path.with_name(path.name + ".tmp")
        state = {"last_stream_seq": last_stream_seq, "updated_ns": time.time_ns()}
        with open(tmp, "w") as f:
            f.write(json.dumps(state))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_path(self.root)

    def close(self) -> None:
        self._con.close()
