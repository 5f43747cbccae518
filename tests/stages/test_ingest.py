"""The ingest stage: a submitted document is chunked, embedded and stored once."""

from __future__ import annotations

from pathlib import Path

import pytest

from schemas.events import DocumentAdded, DocumentRejected, DocumentSubmitted
from stages.ingest import IngestState, handle
from stages.retrieval.ingest import Chunking, parse
from stages.retrieval.store import Store

pytestmark = pytest.mark.anyio

TEXT = "# Notes\nThe blue door opens at nine.\n\nThe red door never opens."


@pytest.fixture
def state(tmp_path: Path, tok, embed) -> IngestState:
    return IngestState(
        store=Store(tmp_path / "r.duckdb"),
        embed=embed,
        tok=tok,
        chunking=Chunking(max_tokens=64, overlap=8),
    )


def submitted(rid: str, tenant: str | None = "acme", collection: str = "notes", text: str = TEXT):
    return DocumentSubmitted(
        request_id=rid, tenant=tenant, collection=collection, source="notes.md", text=text
    )


async def test_a_document_is_added_once_and_its_chunks_are_stored(state: IngestState) -> None:
    (first,) = await handle(submitted("ing-1"), state)
    assert isinstance(first, DocumentAdded) and first.added and first.num_chunks == 1
    (again,) = await handle(submitted("ing-2"), state)  # a replay, or the same file again
    assert isinstance(again, DocumentAdded) and not again.added and again.doc_id == first.doc_id
    chunks, _ = state.store.chunks("acme", "notes")
    assert [c.text for c in chunks] == [TEXT]
    assert state.store.list_collections("other") == []


async def test_a_bad_collection_or_missing_tenant_is_rejected(state: IngestState) -> None:
    (bad,) = await handle(submitted("ing-3", collection="-bad"), state)
    assert isinstance(bad, DocumentRejected) and bad.field == "collection"
    (anon,) = await handle(submitted("ing-4", tenant=None), state)
    assert isinstance(anon, DocumentRejected) and anon.field == "tenant"


def test_json_lines_are_a_document_per_record() -> None:
    data = '{"id": "a", "text": "first"}\n\n{"content": "second"}\n'
    assert [(d.source, d.text) for d in parse("f.jsonl", data, "jsonl")] == [
        ("f.jsonl#a", "first"),
        ("f.jsonl#3", "second"),
    ]
    with pytest.raises(ValueError, match="f.jsonl:1: a record needs"):
        list(parse("f.jsonl", '{"title": "x"}', "jsonl"))
    with pytest.raises(ValueError, match="f.jsonl:1: not JSON"):
        list(parse("f.jsonl", "{", "jsonl"))
    with pytest.raises(ValueError, match="BRIGADE_CHUNK_OVERLAP"):
        Chunking(max_tokens=8, overlap=8)
