"""Hybrid search over a tenant's collections: cosine similarity on MiniLM vectors and BM25
(bm25s, English stopwords and Snowball stems), each ranking its top `num_candidates`, fused by reciprocal rank.

`Index` holds one set of collections in memory (a [n, 384] matrix and a BM25 index), built
from the store and rebuilt only when the store's file changed and a collection's version
moved, so a request costs one stat of the file, not a read of it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import bm25s
import numpy as np
import Stemmer

from stages.retrieval.store import CollectionNotFound, Store, StoredChunk

RRF_K = 60  # the constant of Cormack et al.'s reciprocal rank fusion: 1 / (RRF_K + rank)


def reciprocal_rank_fusion(
    rankings: Sequence[Sequence[int]], k: int = RRF_K
) -> list[tuple[int, float]]:
    """Items of several rankings (best first, ranks from 1) by sum of 1 / (k + rank), best
    first; ties go to the item ranked first in the earliest ranking."""
    scores: dict[int, float] = {}
    for ranking in rankings:
        for rank, item in enumerate(ranking, 1):
            scores[item] = scores.get(item, 0.0) + 1.0 / (k + rank)
    return sorted(scores.items(), key=lambda kv: -kv[1])


@dataclass
class Candidate:
    """One chunk that either retriever ranked, with its scores (None: that one did not rank it)."""

    chunk: StoredChunk
    vector_score: float | None = None
    vector_rank: int | None = None
    keyword_score: float | None = None
    keyword_rank: int | None = None
    fused_score: float = 0.0
    rerank_score: float | None = None


_STEMMER = Stemmer.Stemmer("english")  # Snowball: "played" and "playing" match "play"


def _bm25_tokens(texts: list[str], *, return_ids: bool = True):
    return bm25s.tokenize(
        texts, lower=True, stopwords="en", stemmer=_STEMMER, return_ids=return_ids,
        show_progress=False,
    )  # fmt: skip


@dataclass
class Index:
    chunks: list[StoredChunk]
    vectors: np.ndarray  # [n, 384] float32, unit rows
    bm25: bm25s.BM25 | None = field(default=None)

    @classmethod
    def build(cls, chunks: list[StoredChunk], vectors: np.ndarray) -> Index:
        assert len(chunks) == len(vectors), (len(chunks), vectors.shape)
        bm25 = None
        if chunks:
            bm25 = bm25s.BM25()
            bm25.index(_bm25_tokens([c.text for c in chunks]), show_progress=False)
        return cls(chunks=chunks, vectors=np.ascontiguousarray(vectors, np.float32), bm25=bm25)

    @property
    def _vocab(self) -> dict[str, int]:
        return self.bm25.vocab_dict if self.bm25 is not None else {}

    def vector_ranked(self, query_vector: np.ndarray, k: int) -> list[tuple[int, float]]:
        if not self.chunks:
            return []
        # [n]: cosine, both sides unit length. einsum, not BLAS's gemv: BLAS threads waiting on a
        # busy machine put a 10-50x tail on a 0.2 ms product (docs/benchmarks.md)
        scores = np.einsum("ij,j->i", self.vectors, query_vector)
        k = min(k, len(scores))
        top = np.argpartition(-scores, k - 1)[:k]
        top = top[np.argsort(-scores[top], kind="stable")]
        return [(int(i), float(scores[i])) for i in top]

    def keyword_ranked(self, query: str, k: int) -> list[tuple[int, float]]:
        if self.bm25 is None:
            return []
        tokens = _bm25_tokens([query], return_ids=False)
        tokens = [[t for t in tokens[0] if t in self._vocab]]
        if not tokens[0]:  # only stopwords or words no chunk has
            return []
        k = min(k, len(self.chunks))
        docs, scores = self.bm25.retrieve(tokens, k=k, show_progress=False, n_threads=0)
        return [(int(d), float(s)) for d, s in zip(docs[0], scores[0], strict=True) if s > 0]

    def hybrid(self, query: str, query_vector: np.ndarray, num_candidates: int) -> list[Candidate]:
        """The top `num_candidates` of the fused ranking, best first."""
        by_vector = self.vector_ranked(query_vector, num_candidates)
        by_keyword = self.keyword_ranked(query, num_candidates)
        fused = reciprocal_rank_fusion([[i for i, _ in by_vector], [i for i, _ in by_keyword]])
        found = {i: Candidate(chunk=self.chunks[i]) for i, _ in fused[:num_candidates]}
        for rank, (i, score) in enumerate(by_vector, 1):
            if i in found:
                found[i].vector_score, found[i].vector_rank = score, rank
        for rank, (i, score) in enumerate(by_keyword, 1):
            if i in found:
                found[i].keyword_score, found[i].keyword_rank = score, rank
        for i, score in fused[:num_candidates]:
            found[i].fused_score = score
        return list(found.values())


class Indexes:
    """In-memory indexes of (tenant, collections), rebuilt when a collection changes."""

    def __init__(self, store: Store, *, max_entries: int = 64) -> None:
        self.store = store
        self.max_entries = max_entries
        # (tenant, collections) -> (the store's stamp when checked, their versions, the index)
        self._cache: dict[tuple[str, tuple[str, ...]], tuple[tuple, dict[str, int], Index]] = {}

    def get(self, tenant: str, collections: Sequence[str]) -> Index:
        key = (tenant, tuple(sorted(set(collections))))
        stamp = self.store.stamp()
        cached = self._cache.get(key)
        if cached is not None and cached[0] == stamp:
            return cached[2]
        versions = self.store.versions(tenant, list(key[1]))
        for name in key[1]:
            if name not in versions:
                raise CollectionNotFound(name, field="retrieval.collections")
        if cached is not None and cached[1] == versions:
            self._cache[key] = (stamp, versions, cached[2])
            return cached[2]
        parts = [self.store.chunks(tenant, name) for name in key[1]]
        chunks = [c for found, _ in parts for c in found]
        vectors = np.concatenate([v for _, v in parts])
        index = Index.build(chunks, vectors)
        if key not in self._cache and len(self._cache) >= self.max_entries:
            self._cache.pop(next(iter(self._cache)))
        self._cache[key] = (stamp, versions, index)
        return index


QueryEmbedder = Callable[[str], np.ndarray]  # a query -> its unit vector [384]
