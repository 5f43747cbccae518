"""Retrieval in the context stage's handler: the assembled event holds the supporting chunk and
a record of every candidate; another tenant's collection is unknown."""

from __future__ import annotations

from pathlib import Path

import pytest

from schemas.events import Message, Request, RequestAuthorized, Retrieval, Sampling
from stages import context
from stages.fit import Costs
from stages.retrieval.ingest import Chunking, add_text
from stages.retrieval.retrieve import Retriever
from stages.retrieval.store import Store
from stages.runtime.failures import StageError

pytestmark = pytest.mark.anyio

FACTS = [
    "The lighthouse keeper of Skerry Point is named Orla Finch.",
    "The ferry to the island leaves at seven in the morning.",
    "Bread in the village bakery costs two coins.",
    "The island's school has eleven pupils.",
]


@pytest.fixture
def state(tmp_path: Path, tok, embed) -> context.ContextState:
    store = Store(tmp_path / "r.duckdb")
    store.create_collection("acme", "island")
    for i, fact in enumerate(FACTS):
        add_text(
            store, embed, tok, Chunking(max_tokens=64, overlap=0),
            tenant="acme", collection="island", source=f"fact{i}.txt", text=fact,
        )  # fmt: skip
    retriever = Retriever(store, over_retrieve=2, reranker=None, embedder=embed)
    return context.ContextState(costs=Costs(tok), max_model_len=2048, retriever=retriever)


def authorized(tenant: str, **retrieval) -> RequestAuthorized:
    return RequestAuthorized(
        request_id="r1",
        tenant=tenant,
        request=Request(
            messages=[Message(role="user", content="Who keeps the lighthouse?")],
            retrieval=Retrieval(collections=["island"], **retrieval),
            sampling=Sampling(max_tokens=32),
        ),
    )


async def test_the_supporting_chunk_is_kept_and_every_candidate_recorded(state) -> None:
    (out,) = await context.handle(authorized("acme", top_k=1, rerank=False), state)
    trace = out.retrieval
    assert trace is not None and trace.collections == ["island"]
    assert trace.num_candidates == 2 and trace.num_kept == 1  # top_k x over_retrieve
    kept = [c for c in trace.chunks if c.kept]
    assert [c.source for c in kept] == ["fact0.txt"] and kept[0].reason == "kept"
    assert [c.reason for c in trace.chunks if not c.kept] == ["rank"]
    assert kept[0].vector_score is not None and kept[0].fused_score > 0
    assert kept[0].rerank_score is None and trace.rerank_fallback is None
    assert FACTS[0] in out.request.messages[0].content
    parts = {p.name: p for p in out.parts}
    assert parts["retrieved"].num_tokens == trace.num_tokens > 0
    assert sum(p.num_tokens for p in out.parts) == out.num_prompt_tokens
    assert trace.search_ns > 0


async def test_without_a_reranker_the_fused_order_stands_and_says_why(state) -> None:
    (out,) = await context.handle(authorized("acme", top_k=2), state)
    assert out.retrieval.rerank_fallback == "no reranker in this context stage"
    assert out.retrieval.num_kept == 2


async def test_another_tenant_cannot_retrieve_the_collection(state) -> None:
    with pytest.raises(StageError) as err:
        await context.handle(authorized("intruder", top_k=1, rerank=False), state)
    assert str(err.value) == "no collection named 'island'"
    assert err.value.field == "retrieval.collections"


def test_the_chat_api_carries_retrieval_into_the_submit() -> None:
    from stages.edge.openai_schema import ChatCompletionRequest, decode_body, to_submits

    body = (
        b'{"model": "m", "messages": [{"role": "user", "content": "hi"}],'
        b' "retrieval": {"collections": ["island"], "top_k": 3, "rerank": false}}'
    )
    (submit,) = to_submits(decode_body(body, ChatCompletionRequest), model="m")
    assert submit.retrieval == Retrieval(collections=["island"], top_k=3, rerank=False)


def test_the_websocket_carries_retrieval_into_the_submit() -> None:
    from stages.edge.realtime import ResponseCreate, submit_of

    response = {
        "messages": [{"role": "user", "content": "hi"}],
        "retrieval": {"collections": ["island"], "top_k": 2},
    }
    submit = submit_of(ResponseCreate(response=response), request_id="r1")
    assert submit.retrieval == Retrieval(collections=["island"], top_k=2)
