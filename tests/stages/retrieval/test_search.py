"""Reciprocal rank fusion by hand, and hybrid search over a small real index."""

from __future__ import annotations

import numpy as np
import pytest

from stages.retrieval.search import RRF_K, Index, reciprocal_rank_fusion
from stages.retrieval.store import StoredChunk


def test_fusion_sums_reciprocal_ranks() -> None:
    vector = [10, 20, 30]  # ranks 1, 2, 3
    keyword = [30, 40, 10]  # ranks 1, 2, 3
    fused = reciprocal_rank_fusion([vector, keyword], k=60)
    expected = {
        10: 1 / 61 + 1 / 63,  # 0.032266
        30: 1 / 63 + 1 / 61,  # the same: tie, 10 was first in the earliest ranking
        20: 1 / 62,
        40: 1 / 62,
    }
    assert [item for item, _ in fused] == [10, 30, 20, 40]
    for item, score in fused:
        assert score == pytest.approx(expected[item], abs=1e-15)


def test_fusion_with_k_one_and_a_missing_ranking() -> None:
    fused = reciprocal_rank_fusion([[1, 2, 3], [], [3]], k=1)
    # 3: 1/(1+3) + 1/(1+1) = 0.75; 1: 1/2 = 0.5; 2: 1/3
    assert fused == [(3, 0.75), (1, 0.5), (2, pytest.approx(1 / 3))]
    assert RRF_K == 60 and reciprocal_rank_fusion([]) == []


def chunk(i: int, text: str) -> StoredChunk:
    return StoredChunk(
        chunk_id=f"d:{i}", collection="c", doc_id="d", source="s", start=0, end=len(text),
        num_tokens=1, text=text,
    )  # fmt: skip


def test_hybrid_ranks_and_scores_each_candidate(embed) -> None:
    texts = [
        "The ledger bills every completed run exactly once into DuckDB.",
        "Captain Wentworth wrote a letter to Anne Elliot.",
        "Tokens are streamed to the client over server-sent events.",
        "Anne walked along the Cobb at Lyme with Louisa Musgrove.",
    ]
    index = Index.build([chunk(i, t) for i, t in enumerate(texts)], embed(texts))
    query = "Who wrote a letter to Anne?"
    found = index.hybrid(query, embed([query])[0], num_candidates=3)
    assert len(found) == 3 and found[0].chunk.text == texts[1]
    top = found[0]
    assert top.vector_rank == 1 and top.keyword_rank == 1
    assert top.fused_score == pytest.approx(2 / (RRF_K + 1))
    by_vector = index.vector_ranked(embed([query])[0], 4)
    assert [s for _, s in by_vector] == sorted((s for _, s in by_vector), reverse=True)
    for c in found:  # the scores are the retrievers' own
        if c.vector_rank is not None:
            assert by_vector[c.vector_rank - 1] == (texts.index(c.chunk.text), c.vector_score)
    assert index.keyword_ranked("the of and", 4) == []  # only stopwords
    assert index.keyword_ranked("zyxwvut", 4) == []  # no chunk has it


def test_an_empty_index_finds_nothing() -> None:
    index = Index.build([], np.zeros((0, 384), np.float32))
    assert index.hybrid("anything", np.ones(384, np.float32) / np.sqrt(384), 5) == []
