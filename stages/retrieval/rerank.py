"""Reranking by the served model: each candidate's relevance is log P(yes) - log P(no) of one
greedy token after a yes/no question about the passage and the query (no cross-encoder ships
offline).

`BusReranker` runs the candidates as nested runs through the pipeline, as stages/summarize.py
does (an `authorized` event per candidate under an id derived from the parent's, so the engine
batches them and the log keeps them), and reads the first `tokens` event's top logprobs.
`score_logprobs` is shared with the in-process bench (tools/bench/rag.py).
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Sequence

import anyio

from engine.tokenizer import Tokenizer
from schemas import subjects
from schemas.events import (
    CancelRequested,
    Message,
    Request,
    RequestAuthorized,
    Sampling,
    TokensGenerated,
    decode_event,
)
from stages.retrieval.pack import quote
from stages.runtime.spec import StageContext

INSTRUCTION = "Answer with yes or no only: does the passage answer the question?"
NUM_LOGPROBS = 20
TERMINAL = ("finished", "completed", "failed", "cancelled")


def rerank_messages(query: str, passage: str) -> list[Message]:
    return [
        Message(role="system", content=INSTRUCTION),
        Message(
            role="user",
            content=f"Passage:\n<document>\n{quote(passage)}\n</document>\n\nQuestion: {query}\n"
            "Does the passage answer the question? Answer yes or no.",
        ),
    ]


def yes_no_ids(tok: Tokenizer) -> tuple[set[int], set[int]]:
    """Token ids that read "yes" / "no" (any case, any leading space)."""
    yes, no = set(), set()
    for word in ("yes", "Yes", "YES", " yes", " Yes", "no", "No", "NO", " no", " No"):
        ids = tok.encode_text(word)
        if len(ids) == 1:
            (yes if word.strip().lower() == "yes" else no).add(ids[0])
    assert yes and no, "the tokenizer has no single-token yes / no"
    return yes, no


def score_logprobs(top: Sequence[tuple[int, float]], yes: set[int], no: set[int]) -> float:
    """log P(yes) - log P(no) from one position's top logprobs; a side missing from the top
    counts as the smallest logprob seen (an upper bound on its probability)."""
    seen = dict(top)
    floor = min(seen.values())

    def side(ids: set[int]) -> float:
        found = [seen[i] for i in ids if i in seen]
        if not found:
            return floor
        m = max(found)
        return m + math.log(sum(math.exp(x - m) for x in found))

    return side(yes) - side(no)


def nested_id(parent: str, i: int) -> str:
    rid = f"{parent}-rr{i}"
    return rid if len(rid) <= 64 else f"rr{i}-" + hashlib.sha256(parent.encode()).hexdigest()[:40]


class RerankFailed(Exception):
    pass


class BusReranker:
    def __init__(self, ctx: StageContext, tok: Tokenizer, *, timeout_s: float) -> None:
        self.bus = ctx.bus
        self.yes, self.no = yes_no_ids(tok)
        self.timeout_s = timeout_s

    async def scores(
        self, parent: RequestAuthorized, query: str, passages: list[str]
    ) -> list[float]:
        ids = [nested_id(parent.request_id, i) for i in range(len(passages))]
        found: dict[str, float] = {}
        ended: dict[str, str] = {}
        done = anyio.Event()

        async def on_msg(msg) -> None:
            event = decode_event(msg.data)
            rid = event.request_id
            if isinstance(event, TokensGenerated) and event.seq == 0 and event.logprobs:
                found[rid] = score_logprobs(
                    [(t.token_id, t.logprob) for t in event.logprobs[0]], self.yes, self.no
                )
            elif event.__struct_config__.tag in TERMINAL:
                ended.setdefault(rid, event.__struct_config__.tag)
            if all(r in found or r in ended for r in ids):
                done.set()

        subs = [await self.bus.nc.subscribe(subjects.request_events(r), cb=on_msg) for r in ids]
        deadline = time.monotonic() + self.timeout_s
        try:
            for rid, passage in zip(ids, passages, strict=True):
                request = Request(
                    messages=rerank_messages(query, passage),
                    model=parent.request.model,
                    priority=parent.request.priority,
                    sampling=Sampling(temperature=0.0, max_tokens=1, logprobs=NUM_LOGPROBS),
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
