"""The store: tenants never see each other's collections, re-adding is a no-op, deletes."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from stages.retrieval.ingest import Chunking, add_text
from stages.retrieval.search import Indexes
from stages.retrieval.store import EMBEDDING_DIM, CollectionNotFound, NewChunk, Store, check_name
from stages.runtime.failures import StageError

CHUNKING = Chunking(max_tokens=64, overlap=8)
TEXT_A = "Alpha's secret launch code is 7741.\n\nThe alpha team meets on Mondays."
TEXT_B = "Beta keeps bees.\n\nThe beta team meets on Fridays."


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(tmp_path / "retrieval.duckdb")


def add(store, embed, tok, tenant, collection, text, source="doc.md"):
    return add_text(
        store, embed, tok, CHUNKING, tenant=tenant, collection=collection, source=source, text=text
    )


def test_re_adding_the_same_text_is_a_no_op(store, embed, tok) -> None:
    store.create_collection("a", "notes")
    first, added = add(store, embed, tok, "a", "notes", TEXT_A)
    again, added_again = add(store, embed, tok, "a", "notes", TEXT_A, source="renamed.md")
    assert added and not added_again and again == first
    info = store.get_collection("a", "notes")
    assert (info.num_documents, info.num_chunks, info.version) == (1, first.num_chunks, 1)
    chunks, vectors = store.chunks("a", "notes")
    assert [c.chunk_id for c in chunks] == [f"{first.doc_id}:{i}" for i in range(len(chunks))]
    assert vectors.shape == (len(chunks), 384) and vectors.dtype == np.float32
    for c in chunks:
        assert TEXT_A[c.start : c.end] == c.text and c.source == "doc.md"


def test_a_tenant_cannot_see_or_search_another_tenants_collection(store, embed, tok) -> None:
    store.create_collection("a", "shared-name")
    add(store, embed, tok, "a", "shared-name", TEXT_A)
    assert store.list_collections("b") == []
    for call in (
        lambda: store.get_collection("b", "shared-name"),
        lambda: store.list_documents("b", "shared-name"),
        lambda: store.chunks("b", "shared-name"),
        lambda: store.delete_collection("b", "shared-name"),
        lambda: Indexes(store).get("b", ["shared-name"]),
    ):
        with pytest.raises(CollectionNotFound) as err:
            call()
        assert str(err.value) == "no collection named 'shared-name'"  # as for a missing one
    with pytest.raises(CollectionNotFound) as missing:
        store.get_collection("b", "never-made")
    assert str(missing.value) == "no collection named 'never-made'"
    # b's own collection of the same name holds only b's text
    store.create_collection("b", "shared-name")
    add(store, embed, tok, "b", "shared-name", TEXT_B)
    index = Indexes(store).get("b", ["shared-name"])
    assert all("7741" not in c.text for c in index.chunks)
    hits = index.keyword_ranked("secret launch code 7741", 10)
    assert hits == []
    vec = embed(["What is alpha's secret launch code?"])[0]
    assert all("Alpha" not in index.chunks[i].text for i, _ in index.vector_ranked(vec, 10))
    assert [c.name for c in store.list_collections("a")] == ["shared-name"]
    assert store.list_collections("a")[0].num_documents == 1


def test_deleting_documents_and_collections(store, embed, tok) -> None:
    store.create_collection("a", "notes")
    doc, _ = add(store, embed, tok, "a", "notes", TEXT_A)
    add(store, embed, tok, "a", "notes", TEXT_B, source="b.md")
    indexes = Indexes(store)
    assert len(indexes.get("a", ["notes"]).chunks) == 2
    assert store.delete_document("a", "notes", doc.doc_id)
    assert not store.delete_document("a", "notes", doc.doc_id)
    assert [d.source for d in store.list_documents("a", "notes")] == ["b.md"]
    assert [c.source for c in indexes.get("a", ["notes"]).chunks] == ["b.md"]  # rebuilt
    store.delete_collection("a", "notes")
    assert store.list_collections("a") == []
    with pytest.raises(CollectionNotFound):
        indexes.get("a", ["notes"])


def test_creating_twice_returns_the_first_and_names_are_checked(store) -> None:
    first, created = store.create_collection("a", "notes")
    again, created_again = store.create_collection("a", "notes")
    assert created and not created_again and again == first
    for bad in ("", "a b", "../x", "-x", "x" * 65, "x\n"):
        with pytest.raises(StageError, match="collection name"):
            check_name(bad)


def test_concurrent_adds_to_one_collection_all_land(tmp_path) -> None:
    """Ingest adds up to four documents at once (threads of one process); each bumps the
    collection's version. DuckDB's optimistic transactions failed all but one of such writers
    ("Conflict on update!"); the store's writes take turns, so every add lands, once."""
    store = Store(tmp_path / "race.duckdb")
    store.create_collection("t", "c")
    errors: list[str] = []

    def add(i: int) -> None:
        try:
            for j in range(5):
                store.add_document(
                    "t", "c", source=f"s{i}-{j}", digest=f"d{i}-{j}", num_chars=3,
                    chunks=[NewChunk(text="abc", start=0, end=3, num_tokens=1)],
                    vectors=np.zeros((1, EMBEDDING_DIM), np.float32),
                )  # fmt: skip
        except Exception as err:  # noqa: BLE001 - collected and asserted below
            errors.append(repr(err))

    threads = [threading.Thread(target=add, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(store.list_documents("t", "c")) == 20
    assert store.get_collection("t", "c").version == 20
