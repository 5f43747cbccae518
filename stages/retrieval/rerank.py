"""Reranking by the served model: each candidate's relevance is the mean log-probability of the
query's tokens after the passage (query likelihood, as in Sachan et al. 2022's UPR), read from
the engine's prompt logprobs of one run per candidate. No cross-encoder ships offline; asking the
model "does the passage answer the question, yes or no" was measured worse than no reranking
(docs/benchmarks.md), so the score is the likelihood of the question itself.

The final order interpolates the two evidences: each candidate's query likelihood and its
hybrid (reciprocal rank fusion) score, each z-scored over the candidates, at equal weight
(`RERANK_WEIGHT`, fixed a priori, not tuned on the benchmark's questions). The likelihood of
a 135M model alone demoted passages both retrievers ranked first (docs/benchmarks.md).

`BusReranker` runs the candidates as nested runs through the pipeline, as stages/summarize.py
does (an `authorized` event per candidate under an id derived from the parent's, so the engine
batches them and the log keeps them), and reads the first `tokens` event's prompt logprobs.
`query_likelihood_prompt` and `query_likelihood` are shared with the in-process bench
(tools/bench/rag.py).
"""

from __future__ import annotations

import hashlib
import statistics
import time
from collections.abc import Sequence

import anyio

from engine.tokenizer import Tokenizer
from schemas import subjects
from schemas.events import (
    CancelRequested,
    Request,
    RequestAuthorized,
    Sampling,
    TokensGenerated,
    decode_event,
)
from stages.retrieval.pack import quote
from stages.runtime.spec import StageContext

INSTRUCTION = "Read the passage, then write a question that it answers."
TERMINAL = ("finished", "completed", "failed", "cancelled")


def query_likelihood_prompt(tok: Tokenizer, query: str, passage: str) -> tuple[list[int], int]:
    """The prompt's token ids (the passage, then the query as the answer) and where the query
    starts."""
    head = tok.encode_chat(
        [
            {"role": "system", "content": INSTRUCTION},
            {"role": "user", "content": f"Passage:\n<document>\n{quote(passage)}\n</document>"},
        ],
        add_generation_prompt=True,
    )
    return head + tok.encode_text(query), len(head)


def query_likelihood(prompt_logprobs: Sequence[Sequence[tuple[int, float]]], start: int) -> float:
    """Mean log P(query token | passage, earlier query tokens); `prompt_logprobs[i]` is prompt
    token i + 1's entry, its own logprob first."""
    own = [entry[0][1] for entry in prompt_logprobs[start - 1 :]]
    assert own, f"no query tokens after position {start}"
    return sum(own) / len(own)


RERANK_WEIGHT = 0.5  # the likelihood's share of the final score; the hybrid score has the rest


def _z(values: Sequence[float]) -> list[float]:
    if not values:
        return []
    mean, std = statistics.fmean(values), statistics.pstdev(values)
    return [(v - mean) / std if std > 0 else 0.0 for v in values]


def reranked_order(
    fused: Sequence[float], likelihood: Sequence[float], weight: float = RERANK_WEIGHT
) -> list[int]:
    """Candidate indices best first by `weight * z(likelihood) + (1 - weight) * z(fused)`; ties
    keep the fused order (the candidates arrive best fused first)."""
    assert len(fused) == len(likelihood), (len(fused), len(likelihood))
    score = [weight * r + (1 - weight) * f for r, f in zip(_z(likelihood), _z(fused), strict=True)]
    return sorted(range(len(score)), key=lambda i: (-score[i], i))


def nested_id(parent: str, i: int) -> str:
    rid = f"{parent}-rr{i}"
    return rid if len(rid) <= 64 else f"rr{i}-" + hashlib.sha256(parent.encode()).hexdigest()[:40]


class RerankFailed(Exception):
    pass


class BusReranker:
    def __init__(self, ctx: StageContext, tok: Tokenizer, *, timeout_s: float) -> None:
        self.bus = ctx.bus
        self.tok = tok
        self.timeout_s = timeout_s

    async def scores(
        self, parent: RequestAuthorized, query: str, passages: list[str]
    ) -> list[float]:
        ids = [nested_id(parent.request_id, i) for i in range(len(passages))]
        prompts = [query_likelihood_prompt(self.tok, query, p) for p in passages]
        starts = {rid: start for rid, (_, start) in zip(ids, prompts, strict=True)}
        found: dict[str, float] = {}
        ended: dict[str, str] = {}
        done = anyio.Event()

        async def on_msg(msg) -> None:
            event = decode_event(msg.data)
            rid = event.request_id
            if isinstance(event, TokensGenerated) and event.seq == 0 and event.prompt_logprobs:
                entries = [[(t.token_id, t.logprob) for t in e] for e in event.prompt_logprobs]
                found[rid] = query_likelihood(entries, starts[rid])
            elif event.__struct_config__.tag in TERMINAL:
                ended.setdefault(rid, event.__struct_config__.tag)
            if all(r in found or r in ended for r in ids):
                done.set()

        subs = [await self.bus.nc.subscribe(subjects.request_events(r), cb=on_msg) for r in ids]
        deadline = time.monotonic() + self.timeout_s
        try:
            for rid, (prompt, _) in zip(ids, prompts, strict=True):
                request = Request(
                    messages=[],
                    raw_prompt=True,
                    prompt_token_ids=prompt,
                    model=parent.request.model,
                    priority=parent.request.priority,
                    sampling=Sampling(temperature=0.0, max_tokens=1, prompt_logprobs=0),
                )
                await self.bus.publish(
                    RequestAuthorized(
                        request_id=rid,
                        tenant=parent.tenant,
                        request=request,
                        priority=parent.priority,
                    )
                )
            with anyio.move_on_after(max(0.0, deadline - time.monotonic())):
                await done.wait()
        finally:
            for sub in subs:
                await sub.unsubscribe()
        missing = [r for r in ids if r not in found]
        if missing:
            for rid in missing:
                if rid not in ended:
                    await self.bus.publish(
                        CancelRequested(request_id=rid, tenant=parent.tenant, reason="timeout")
                    )
            why = {r: ended.get(r, "no answer in time") for r in missing[:3]}
            raise RerankFailed(
                f"{len(missing)} of {len(ids)} rerank runs gave no score within "
                f"{self.timeout_s:g} s: {why}"
            )
        return [found[r] for r in ids]
