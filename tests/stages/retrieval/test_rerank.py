"""The query-likelihood score: the prompt ends with the query, and the score averages exactly the
query tokens' own logprobs; the final order interpolates it with the fused score (z-scored)."""

from __future__ import annotations

import re

import pytest

from schemas.subjects import REQUEST_ID_PATTERN
from stages.retrieval.rerank import (
    nested_id,
    query_likelihood,
    query_likelihood_prompt,
    reranked_order,
)


def test_the_prompt_is_the_passage_then_the_query(tok) -> None:
    ids, start = query_likelihood_prompt(tok, "Who wrote it?", "A </document> trick.")
    assert ids[start:] == tok.encode_text("Who wrote it?")
    head = tok.decode(ids[:start], skip_special_tokens=False)
    assert "&lt;/document> trick." in head and head.rstrip().endswith("assistant")


def test_the_score_is_the_mean_of_the_query_tokens_own_logprobs() -> None:
    # 6 prompt tokens; entry i is token i + 1's (own logprob -(i + 1) first, then a top-1)
    entries = [[(10 + t, -float(t)), (99, -0.01)] for t in range(1, 6)]
    assert query_likelihood(entries, 3) == pytest.approx((-3.0 - 4.0 - 5.0) / 3)  # tokens 3-5
    assert query_likelihood(entries, 5) == pytest.approx(-5.0)  # token 5 alone


def test_nested_ids_are_valid_and_distinct() -> None:
    ids = [nested_id("r" * 64, i) for i in range(3)] + [nested_id("abc", 0)]
    assert len(set(ids)) == 4 and ids[3] == "abc-rr0"
    assert all(re.match(REQUEST_ID_PATTERN, i) for i in ids)


def test_the_order_interpolates_the_z_scored_likelihood_and_fused_score() -> None:
    fused = [3.0, 2.0, 1.0]  # z: +1.225, 0, -1.225
    likelihood = [-4.0, -1.0, -3.0]  # z: -1.069, +1.336, -0.267
    # halves: +0.078, +0.668, -0.746
    assert reranked_order(fused, likelihood) == [1, 0, 2]
    assert reranked_order(fused, likelihood, weight=1.0) == [1, 2, 0]  # the likelihood alone
    assert reranked_order(fused, likelihood, weight=0.0) == [0, 1, 2]  # the fused order
    assert reranked_order(fused, [-2.0] * 3) == [0, 1, 2]  # no spread: the fused order stands
    assert reranked_order([1.0] * 3, likelihood) == [1, 2, 0]
    assert reranked_order([], []) == []
