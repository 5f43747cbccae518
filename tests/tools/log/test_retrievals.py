"""The `retrievals` and `retrieved_chunks` views over an assembled event with a retrieval trace."""

from __future__ import annotations

import pytest

from schemas import events as ev
from tests.tools.log.synthlog import REQUEST, at, dur, example_rows, to_rows
from tools.log.views import connect

TRACE = ev.RetrievalTrace(
    collections=["notes", "faq"],
    num_candidates=3,
    num_kept=1,
    num_tokens=120,
    search_ns=dur(4.5),
    rerank_ns=dur(900),
    chunks=[
        ev.RetrievedChunk(chunk_id="doc_a:0", collection="notes", source="a.md", num_tokens=110,
                          fused_score=0.032, vector_score=0.71, keyword_score=3.5,
                          rerank_score=-1.2, kept=True),
        ev.RetrievedChunk(chunk_id="doc_b:3", collection="faq", source="b.md", num_tokens=90,
                          fused_score=0.016, vector_score=0.52, rerank_score=-2.5,
                          reason="budget"),
        ev.RetrievedChunk(chunk_id="doc_c:1", collection="faq", source="c.md", num_tokens=80,
                          fused_score=0.015, keyword_score=1.25, rerank_score=-3.0,
                          reason="rank"),
    ],
)  # fmt: skip


@pytest.fixture(scope="module")
def con():
    assembled = ev.ContextAssembled(
        request_id="req-r", tenant="acme", request=REQUEST, num_prompt_tokens=150,
        retrieval=TRACE, ts_ns=at(30), service_ns=dur(910),
    )  # fmt: skip
    return connect(rows=example_rows() + to_rows([assembled], first_stream_seq=1000))


def test_one_row_per_request_with_retrieval(con) -> None:
    rows = con.execute(
        "SELECT request_id, collections, num_candidates, num_kept, num_tokens, search_ms, "
        "rerank_ms, rerank_fallback, context_ms FROM retrievals"
    ).fetchall()
    assert rows == [("req-r", ["notes", "faq"], 3, 1, 120, 4.5, 900.0, None, 910.0)]


def test_every_candidate_with_its_scores_and_fate(con) -> None:
    rows = con.execute(
        "SELECT chunk_id, source, vector_score, keyword_score, rerank_score, kept, reason "
        "FROM retrieved_chunks ORDER BY fused_score DESC"
    ).fetchall()
    assert rows == [
        ("doc_a:0", "a.md", 0.71, 3.5, -1.2, True, "kept"),
        ("doc_b:3", "b.md", 0.52, None, -2.5, False, "budget"),
        ("doc_c:1", "c.md", None, 1.25, -3.0, False, "rank"),
    ]


def test_an_empty_log_has_both_views(tmp_path) -> None:
    empty = connect(tmp_path)
    for view in ("retrievals", "retrieved_chunks"):
        assert empty.execute(f"SELECT count(*) FROM {view}").fetchone() == (0,)


def test_trace_shows_the_retrieval_and_every_candidate(con) -> None:
    from tools.log.trace import format_trace

    text = format_trace(con, "req-r")
    assert "retrieved 1 of 3 chunks (120 tokens), search 4.5 ms, rerank 900.0 ms" in text
    lines = text.splitlines()
    assert any(line.startswith("doc_a:0") and "kept" in line and "a.md" in line for line in lines)
    assert any(line.startswith("doc_b:3") and "budget" in line for line in lines)
    assert any(line.startswith("doc_c:1") and " rank " in line for line in lines)


def test_the_report_has_a_retrieval_section(con) -> None:
    from tools.log.report import format_report, summarize

    summary = summarize(con)
    assert summary["retrieval"]["requests"] == 1
    assert summary["retrieval"]["search_ms"]["p50"] == 4.5
    text = format_report(summary, [])
    assert "## Retrieval (1 requests)" in text and "| rerank (ms) | 900.0 | 900.0 | 900.0 |" in text
    assert "## Retrieval" not in format_report(summarize(connect(rows=example_rows())), [])
