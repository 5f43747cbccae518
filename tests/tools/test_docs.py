"""`brigade docs`: files into documents, the progress bar, and list on the store."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from schemas import subjects
from schemas.events import RequestFailed, decode_event
from stages.retrieval.store import Store
from stages.runtime.bus import Bus
from tools import docs
from tools.cli import main


def test_files_become_documents_by_format(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text("# A\n\ntext")
    (tmp_path / "b.jsonl").write_text('{"id": 7, "text": "one"}\n{"text": "two"}\n')
    found = docs.read_documents([tmp_path / "a.md", tmp_path / "b.jsonl"])
    assert found == [("a.md", "# A\n\ntext"), ("b.jsonl#7", "one"), ("b.jsonl#2", "two")]
    (tmp_path / "c.pdf").write_bytes(b"%PDF")
    with pytest.raises(ValueError, match="unknown document format '.pdf'"):
        docs.read_documents([tmp_path / "c.pdf"])


def test_the_progress_bar_counts_to_the_total(capsys) -> None:
    bar = docs.Progress(2, width=4)
    bar.step("a.md: 3 chunks")
    bar.step("b.md: 1 chunks")
    err = capsys.readouterr().err
    assert "[##--] 1/2 a.md: 3 chunks" in err and "[####] 2/2 b.md" in err and err.endswith("\n")


def test_list_shows_only_the_tenants_collections(tmp_path: Path, monkeypatch, capsys) -> None:
    path = tmp_path / "r.duckdb"
    monkeypatch.setenv("BRIGADE_RETRIEVAL_DB", str(path))
    Store(path).create_collection("acme", "notes")
    assert main(["docs", "list", "acme"]) == 0
    assert capsys.readouterr().out == "notes\t0 documents\t0 chunks\n"
    assert main(["docs", "list", "other"]) == 0 and capsys.readouterr().out == ""
    assert main(["docs", "list", "other", "notes"]) == 1
    assert "no collection named 'notes'" in capsys.readouterr().err


@pytest.mark.anyio
async def test_a_document_the_ingest_stage_fails_is_reported_at_once(bus_config, capsys) -> None:
    """A `failed` event for a submitted document (ingest's handler raised) ends the wait for it:
    `docs add` names the document and the error and exits 1, not after its --timeout."""
    bus = await Bus.connect(bus_config)
    await bus.ensure_streams()

    async def fail_it(msg) -> None:
        submitted = decode_event(msg.data)
        await bus.publish(
            RequestFailed(request_id=submitted.request_id, tenant=submitted.tenant,
                          stage="ingest", code="internal", message="the store said no")
        )  # fmt: skip

    sub = await bus.nc.subscribe(subjects.all_events("doc_submitted"), cb=fail_it)
    args = SimpleNamespace(tenant="acme", collection="c", timeout=60.0)
    started = time.monotonic()
    try:
        assert await docs.add(args, bus_config, [("notes.md", "some text")]) == 1
    finally:
        await sub.unsubscribe()
        await bus.close()
    assert time.monotonic() - started < 10
    err = capsys.readouterr().err
    assert "notes.md: failed (internal): the store said no" in err
