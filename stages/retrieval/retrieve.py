"""Retrieval for one request, in the context stage: embed the query, hybrid search over the
tenant's collections for top_k x over_retrieve candidates, rerank them with the served model
(its query likelihood interpolated with the hybrid score: rerank.py), then pack whole chunks
into the room the fitted request leaves. The `assembled` event's `retrieval` records every
candidate's scores and fate, in the reranked order.

The embedding model (torch) loads on the first request that asks for retrieval, so a context
stage that never retrieves stays light.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import anyio
import msgspec
import numpy as np

from schemas.events import (
    ContextAssembled,
    RequestAuthorized,
    RetrievalTrace,
    RetrievedChunk,
)
from stages.fit import Costs, assembled, fit
from stages.retrieval.pack import BlockCounts, Packed, pack
from stages.retrieval.rerank import BusReranker, RerankFailed, reranked_order
from stages.retrieval.search import Candidate, Indexes
from stages.retrieval.store import Store

QueryEmbedder = Callable[[list[str]], np.ndarray]  # texts -> unit vectors [n, 384]


def load_embedder() -> QueryEmbedder:
    from engine.embedding import Embedder  # torch: only once retrieval is used

    return Embedder().embed


def query_of(event: RequestAuthorized) -> str:
    retrieval = event.request.retrieval
    assert retrieval is not None, "query_of needs a request with retrieval"
    return retrieval.query or event.request.messages[-1].content


def trace(
    collections: list[str],
    candidates: list[Candidate],
    packed: Packed,
    *,
    search_ns: int,
    rerank_ns: int,
    rerank_fallback: str | None,
) -> RetrievalTrace:
    chunks = [
        RetrievedChunk(
            chunk_id=c.chunk.chunk_id,
            collection=c.chunk.collection,
            source=c.chunk.source,
            num_tokens=c.chunk.num_tokens,
            fused_score=c.fused_score,
            vector_score=c.vector_score,
            keyword_score=c.keyword_score,
            rerank_score=c.rerank_score,
            kept=reason == "kept",
            reason=reason,
        )
        for c, reason in zip(candidates, packed.reasons, strict=True)
    ]
    return RetrievalTrace(
        collections=collections,
        num_candidates=len(candidates),
        num_kept=len(packed.kept),
        num_tokens=packed.num_tokens,
        search_ns=search_ns,
        rerank_ns=rerank_ns,
        rerank_fallback=rerank_fallback,
        chunks=chunks,
    )


class Retriever:
    def __init__(
        self,
        store: Store,
        *,
        over_retrieve: int,
        reranker: BusReranker | None,
        embedder: QueryEmbedder | None = None,
    ) -> None:
        self.indexes = Indexes(store)
        self.over_retrieve = over_retrieve
        self.reranker = reranker
        self._embedder = embedder
        self._loading = anyio.Lock()
        self._counts: BlockCounts | None = None  # the chunks' block counts, for one Costs

    async def embedder(self) -> QueryEmbedder:
        async with self._loading:
            if self._embedder is None:
                self._embedder = await anyio.to_thread.run_sync(load_embedder)
        return self._embedder

    async def candidates(self, event: RequestAuthorized) -> tuple[list[Candidate], int]:
        """The fused candidates, best first, and the time searching took (ns)."""
        retrieval = event.request.retrieval
        assert retrieval is not None
        embed = await self.embedder()
        start = time.perf_counter_ns()
        index = self.indexes.get(event.tenant or "", retrieval.collections)
        query = query_of(event)
        vector = embed([query])[0]
        num = retrieval.top_k * (retrieval.over_retrieve or self.over_retrieve)
        found = index.hybrid(query, vector, num)
        return found, time.perf_counter_ns() - start

    async def rerank(
        self, event: RequestAuthorized, found: list[Candidate]
    ) -> tuple[list[Candidate], int, str | None]:
        retrieval = event.request.retrieval
        assert retrieval is not None
        if not retrieval.rerank or not found:
            return found, 0, None
        if self.reranker is None:
            return found, 0, "no reranker in this context stage"
        start = time.perf_counter_ns()
        try:
            scores = await self.reranker.scores(
                event, query_of(event), [c.chunk.text for c in found]
            )
        except RerankFailed as err:
            return found, time.perf_counter_ns() - start, str(err)
        for c, s in zip(found, scores, strict=True):
            c.rerank_score = s
        order = reranked_order([c.fused_score for c in found], scores)
        return [found[i] for i in order], time.perf_counter_ns() - start, None

    async def assemble(
        self, event: RequestAuthorized, costs: Costs, budget: int
    ) -> ContextAssembled:
        retrieval = event.request.retrieval
        assert retrieval is not None
        plain = fit(event.request, costs, budget)
        found, search_ns = await self.candidates(event)
        ranked, rerank_ns, fallback = await self.rerank(event, found)
        if self._counts is None or self._counts.costs is not costs:
            self._counts = BlockCounts(costs)
        packed = pack(plain, ranked, costs, budget, retrieval.top_k, self._counts)
        out = assembled(event, packed.fit, budget)
        record = trace(
            list(retrieval.collections),
            ranked,
            packed,
            search_ns=search_ns,
            rerank_ns=rerank_ns,
            rerank_fallback=fallback,
        )
        return _with_trace(out, record)


def _with_trace(event: ContextAssembled, record: RetrievalTrace) -> ContextAssembled:
    return msgspec.structs.replace(event, retrieval=record)
