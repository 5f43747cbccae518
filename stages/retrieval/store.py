"""Per-tenant document collections in one DuckDB file: collections, documents (content hash:
re-adding the same text is a no-op) and chunks with text, source, offsets and a FLOAT[384] vector.

Every statement names its tenant; a collection is found only by (tenant, name), so another
tenant's collection is indistinguishable from one that does not exist. Each operation opens the
file and closes it, waiting while another process holds DuckDB's file lock, so the ingest
service, the context stage and the edge share the file.
"""

from __future__ import annotations

import hashlib
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import duckdb
import numpy as np

from schemas import settings
from stages.runtime import natsd
from stages.runtime.failures import StageError, duckdb_file_busy

EMBEDDING_DIM = 384  # engine/embedding.py's all-MiniLM-L6-v2; the store does not import torch
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")  # whole name (fullmatch)

SCHEMA = f"""
CREATE TABLE IF NOT EXISTS collections (
    tenant VARCHAR NOT NULL, name VARCHAR NOT NULL, created_ns BIGINT NOT NULL,
    version BIGINT NOT NULL, PRIMARY KEY (tenant, name));
CREATE TABLE IF NOT EXISTS documents (
    tenant VARCHAR NOT NULL, collection VARCHAR NOT NULL, doc_id VARCHAR NOT NULL,
    source VARCHAR NOT NULL, content_hash VARCHAR NOT NULL, num_chunks INTEGER NOT NULL,
    num_chars BIGINT NOT NULL, added_ns BIGINT NOT NULL,
    PRIMARY KEY (tenant, collection, doc_id));
CREATE TABLE IF NOT EXISTS chunks (
    tenant VARCHAR NOT NULL, collection VARCHAR NOT NULL, doc_id VARCHAR NOT NULL,
    chunk_id VARCHAR NOT NULL, seq INTEGER NOT NULL, source VARCHAR NOT NULL,
    start_char INTEGER NOT NULL, end_char INTEGER NOT NULL, num_tokens INTEGER NOT NULL,
    text VARCHAR NOT NULL, vector FLOAT[{EMBEDDING_DIM}] NOT NULL);
"""


class CollectionNotFound(StageError):
    def __init__(self, name: str, field: str = "collection") -> None:
        super().__init__("invalid_request", f"no collection named {name!r}", field=field)


@dataclass(frozen=True, kw_only=True)
class CollectionInfo:
    name: str
    created_ns: int
    version: int
    num_documents: int = 0
    num_chunks: int = 0


@dataclass(frozen=True, kw_only=True)
class DocumentInfo:
    doc_id: str
    collection: str
    source: str
    content_hash: str
    num_chunks: int
    num_chars: int
    added_ns: int


@dataclass(frozen=True, kw_only=True)
class NewChunk:
    text: str
    start: int
    end: int
    num_tokens: int


@dataclass(frozen=True, kw_only=True)
class StoredChunk:
    chunk_id: str
    collection: str
    doc_id: str
    source: str
    start: int
    end: int
    num_tokens: int
    text: str


def default_path() -> Path:
    """BRIGADE_RETRIEVAL_DB, else retrieval.duckdb in the data dir (as the ledger's file)."""
    return settings.RETRIEVAL_DB.get() or natsd.default_data_dir() / "retrieval.duckdb"


def content_hash(text: str) -> str:
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def document_id(tenant: str, collection: str, digest: str) -> str:
    """Deterministic, so a replayed or redelivered add names the same document."""
    key = f"{tenant}\0{collection}\0{digest}".encode()
    return "doc_" + hashlib.sha256(key).hexdigest()[:24]


def check_name(name: str, field: str = "collection") -> str:
    if not NAME_PATTERN.fullmatch(name):
        raise StageError(
            "invalid_request",
            f"collection name {name[:80]!r} must be 1-64 letters, digits, '_', '.' or '-', "
            "starting with a letter or digit",
            field=field,
        )
    return name


# One lock per database file in this process: DuckDB's connections to one file in one process
# share its database, whose transactions are optimistic, so two writers that both bump one
# collection's version ("Conflict on update!") would fail one of them. Writes take turns;
# another process cannot open the file while this one has it (connect's retry below).
_WRITE_LOCKS: dict[Path, threading.Lock] = {}
_WRITE_LOCKS_GUARD = threading.Lock()


def _write_lock(path: Path) -> threading.Lock:
    with _WRITE_LOCKS_GUARD:
        return _WRITE_LOCKS.setdefault(path.resolve(), threading.Lock())


class Store:
    def __init__(self, path: Path, *, lock_timeout_s: float = 10.0) -> None:
        self.path = Path(path)
        self.lock_timeout_s = lock_timeout_s
        self._write = _write_lock(self.path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.connect() as con:
            con.execute(SCHEMA)

    @contextmanager
    def connect(self) -> Iterator[duckdb.DuckDBPyConnection]:
        deadline = time.monotonic() + self.lock_timeout_s
        while True:
            try:
                con = duckdb.connect(str(self.path))
                break
            except duckdb.IOException as err:
                if not duckdb_file_busy(err) or time.monotonic() > deadline:
                    raise
                time.sleep(0.005)
        try:
            yield con
        finally:
            con.close()

    def stamp(self) -> tuple[int, ...]:
        """Changes whenever the file (or its write-ahead log) does: a cheap cache check."""
        found: list[int] = []
        for p in (self.path, self.path.with_name(self.path.name + ".wal")):
            try:
                st = p.stat()
                found += [st.st_mtime_ns, st.st_size]
            except FileNotFoundError:
                found += [0, 0]
        return tuple(found)

    # collections

    def create_collection(self, tenant: str, name: str) -> tuple[CollectionInfo, bool]:
        """The collection, and whether it was created now (an existing one is returned as is)."""
        check_name(name)
        with self._write, self.connect() as con:
            found = self._collection(con, tenant, name)
            if found is not None:
                return found, False
            con.execute(
                "INSERT INTO collections VALUES (?, ?, ?, 0)", [tenant, name, time.time_ns()]
            )
            return self._require(con, tenant, name), True

    def list_collections(self, tenant: str) -> list[CollectionInfo]:
        with self.connect() as con:
            rows = con.execute(
                """SELECT c.name, c.created_ns, c.version,
                          (SELECT count(*) FROM documents d
                            WHERE d.tenant = c.tenant AND d.collection = c.name),
                          (SELECT count(*) FROM chunks k
                            WHERE k.tenant = c.tenant AND k.collection = c.name)
                   FROM collections c WHERE c.tenant = ? ORDER BY c.name""",
                [tenant],
            ).fetchall()
        return [_info(r) for r in rows]

    def get_collection(self, tenant: str, name: str) -> CollectionInfo:
        with self.connect() as con:
            return self._require(con, tenant, name)

    def delete_collection(self, tenant: str, name: str) -> None:
        with self._write, self.connect() as con:
            self._require(con, tenant, name)
            con.execute("BEGIN")
            for table in ("chunks", "documents"):
                con.execute(
                    f"DELETE FROM {table} WHERE tenant = ? AND collection = ?", [tenant, name]
                )
            con.execute("DELETE FROM collections WHERE tenant = ? AND name = ?", [tenant, name])
            con.execute("COMMIT")

    def versions(self, tenant: str, names: list[str]) -> dict[str, int]:
        with self.connect() as con:
            rows = con.execute(
                "SELECT name, version FROM collections WHERE tenant = ? AND list_contains(?, name)",
                [tenant, names],
            ).fetchall()
        return dict(rows)

    # documents

    def find_document(self, tenant: str, collection: str, digest: str) -> DocumentInfo | None:
        with self.connect() as con:
            self._require(con, tenant, collection)
            return self._document(con, tenant, collection, document_id(tenant, collection, digest))

    def add_document(
        self,
        tenant: str,
        collection: str,
        *,
        source: str,
        digest: str,
        num_chars: int,
        chunks: list[NewChunk],
        vectors: np.ndarray,  # [len(chunks), EMBEDDING_DIM] float32
    ) -> tuple[DocumentInfo, bool]:
        """The document, and whether it was added now (the same content again is a no-op)."""
        assert vectors.shape == (len(chunks), EMBEDDING_DIM), vectors.shape
        doc_id = document_id(tenant, collection, digest)
        with self._write, self.connect() as con:
            self._require(con, tenant, collection)
            found = self._document(con, tenant, collection, doc_id)
            if found is not None:
                return found, False
            con.execute("BEGIN")
            con.execute(
                "INSERT INTO documents VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                [
                    tenant,
                    collection,
                    doc_id,
                    source,
                    digest,
                    len(chunks),
                    num_chars,
                    time.time_ns(),
                ],
            )
            if chunks:
                con.execute(
                    f"""INSERT INTO chunks SELECT ?, ?, ?, ? || ':' || seq, seq, ?, s, e, n, t,
                               v::FLOAT[{EMBEDDING_DIM}]
                        FROM (SELECT unnest(range(?)) AS seq, unnest(?::INTEGER[]) AS s,
                                     unnest(?::INTEGER[]) AS e, unnest(?::INTEGER[]) AS n,
                                     unnest(?::VARCHAR[]) AS t, unnest(?::FLOAT[][]) AS v)""",
                    [
                        tenant,
                        collection,
                        doc_id,
                        doc_id,
                        source,
                        len(chunks),
                        [c.start for c in chunks],
                        [c.end for c in chunks],
                        [c.num_tokens for c in chunks],
                        [c.text for c in chunks],
                        vectors.astype(np.float32).tolist(),
                    ],
                )
            self._bump(con, tenant, collection)
            con.execute("COMMIT")
            return self._document(con, tenant, collection, doc_id), True

    def list_documents(self, tenant: str, collection: str) -> list[DocumentInfo]:
        with self.connect() as con:
            self._require(con, tenant, collection)
            rows = con.execute(
                f"SELECT {_DOC_COLUMNS} FROM documents WHERE tenant = ? AND collection = ? "
                "ORDER BY added_ns, doc_id",
                [tenant, collection],
            ).fetchall()
        return [DocumentInfo(**dict(zip(_DOC_FIELDS, r, strict=True))) for r in rows]

    def delete_document(self, tenant: str, collection: str, doc_id: str) -> bool:
        with self._write, self.connect() as con:
            self._require(con, tenant, collection)
            if self._document(con, tenant, collection, doc_id) is None:
                return False
            con.execute("BEGIN")
            for table in ("chunks", "documents"):
                con.execute(
                    f"DELETE FROM {table} WHERE tenant = ? AND collection = ? AND doc_id = ?",
                    [tenant, collection, doc_id],
                )
            self._bump(con, tenant, collection)
            con.execute("COMMIT")
            return True

    def chunks(self, tenant: str, collection: str) -> tuple[list[StoredChunk], np.ndarray]:
        """Every chunk of one collection in document order, and their vectors [n, 384]."""
        with self.connect() as con:
            self._require(con, tenant, collection)
            result = con.execute(
                """SELECT chunk_id, collection, doc_id, source, start_char, end_char, num_tokens,
                          text, vector
                   FROM chunks WHERE tenant = ? AND collection = ? ORDER BY doc_id, seq""",
                [tenant, collection],
            ).fetchnumpy()
        n = len(result["chunk_id"])
        found = [
            StoredChunk(
                chunk_id=str(result["chunk_id"][i]),
                collection=str(result["collection"][i]),
                doc_id=str(result["doc_id"][i]),
                source=str(result["source"][i]),
                start=int(result["start_char"][i]),
                end=int(result["end_char"][i]),
                num_tokens=int(result["num_tokens"][i]),
                text=str(result["text"][i]),
            )
            for i in range(n)
        ]
        vectors = (
            np.stack([np.asarray(v, dtype=np.float32) for v in result["vector"]])
            if n
            else np.zeros((0, EMBEDDING_DIM), dtype=np.float32)
        )
        return found, vectors

    # helpers

    def _collection(self, con, tenant: str, name: str) -> CollectionInfo | None:
        row = con.execute(
            """SELECT c.name, c.created_ns, c.version,
                      (SELECT count(*) FROM documents d WHERE d.tenant = ? AND d.collection = ?),
                      (SELECT count(*) FROM chunks k WHERE k.tenant = ? AND k.collection = ?)
               FROM collections c WHERE c.tenant = ? AND c.name = ?""",
            [tenant, name, tenant, name, tenant, name],
        ).fetchone()
        return _info(row) if row else None

    def _require(self, con, tenant: str, name: str) -> CollectionInfo:
        found = self._collection(con, tenant, name)
        if found is None:
            raise CollectionNotFound(name)
        return found

    def _document(self, con, tenant: str, collection: str, doc_id: str) -> DocumentInfo | None:
        row = con.execute(
            f"SELECT {_DOC_COLUMNS} FROM documents "
            "WHERE tenant = ? AND collection = ? AND doc_id = ?",
            [tenant, collection, doc_id],
        ).fetchone()
        return DocumentInfo(**dict(zip(_DOC_FIELDS, row, strict=True))) if row else None

    def _bump(self, con, tenant: str, collection: str) -> None:
        con.execute(
            "UPDATE collections SET version = version + 1 WHERE tenant = ? AND name = ?",
            [tenant, collection],
        )


_DOC_FIELDS = ("doc_id", "collection", "source", "content_hash", "num_chunks", "num_chars", "added_ns")  # fmt: skip
_DOC_COLUMNS = ", ".join(_DOC_FIELDS)


def _info(row) -> CollectionInfo:
    name, created_ns, version, num_documents, num_chunks = row
    return CollectionInfo(
        name=name,
        created_ns=created_ns,
        version=version,
        num_documents=num_documents,
        num_chunks=num_chunks,
    )
