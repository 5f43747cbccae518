"""Context: `authorized` -> `assembled`. The request fitted into the context window (fit.py);
with truncation `summarize`, the dropped history summarized by the engine (summarize.py); with
`retrieval`, chunks of the tenant's collections packed into the room left (stages/retrieval).
"""

from __future__ import annotations

from dataclasses import dataclass

from schemas import settings
from schemas.events import Event, RequestAuthorized, decoder_for
from stages.fit import Costs, assembled, budget_for, fit, fit_raw_prompt
from stages.retrieval.rerank import BusReranker
from stages.retrieval.retrieve import Retriever
from stages.retrieval.store import Store, default_path
from stages.runtime.failures import StageError
from stages.runtime.spec import StageContext, StageSpec
from stages.summarize import Summarizer
from stages.tokenize import served_model, tokenizer_for

STAGE = "context"


@dataclass
class ContextState:
    costs: Costs
    max_model_len: int
    summarizer: Summarizer | None = None  # None: `summarize` falls back to drop_oldest
    retriever: Retriever | None = None


async def handle(event: RequestAuthorized, state: ContextState) -> list[Event]:
    request = event.request
    budget = budget_for(request, state.max_model_len)
    if request.raw_prompt:
        return [assembled(event, fit_raw_prompt(request, state.costs, budget), budget)]
    if request.retrieval is not None:
        if state.retriever is None:
            raise StageError("invalid_request", "this context stage has no retrieval store", field="retrieval")  # fmt: skip
        return [await state.retriever.assemble(event, state.costs, budget)]
    if request.truncation != "summarize" or state.summarizer is None:
        return [assembled(event, fit(request, state.costs, budget), budget)]
    return [await state.summarizer.assemble(event, state, budget)]


async def setup(ctx: StageContext) -> ContextState:
    tokenizer = tokenizer_for(served_model())
    max_len = settings.MAX_MODEL_LEN.get() or tokenizer.max_model_len  # the engine's, if smaller
    retriever = Retriever(
        Store(default_path()),
        over_retrieve=settings.RETRIEVAL_OVER_RETRIEVE.get(),
        reranker=BusReranker(ctx, tokenizer, timeout_s=settings.RERANK_TIMEOUT_S.get()),
    )
    return ContextState(
        costs=Costs(tokenizer),
        max_model_len=max_len,
        summarizer=Summarizer(ctx),
        retriever=retriever,
    )


SPEC = StageSpec(
    name=STAGE,
    input_event="authorized",
    decoder=decoder_for(RequestAuthorized),
    handle=handle,
    setup=setup,
)
