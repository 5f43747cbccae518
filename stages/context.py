"""Context: `authorized` -> `assembled`. The request fitted into the context window (fit.py);
with truncation `summarize`, the dropped history summarized by the engine (summarize.py); with
`retrieval`, chunks of the tenant's collections packed into the room left (stages/retrieval).
"""

from __future__ import annotations

from dataclasses import dataclass

from schemas import models, settings
from schemas.events import Event, RequestAuthorized, decoder_for
from stages.fit import Costs, assembled, budget_for, fit, fit_raw_prompt
from stages.retrieval.rerank import BusReranker
from stages.retrieval.retrieve import Retriever
from stages.retrieval.store import Store, default_path
from stages.runtime.failures import StageError
from stages.runtime.spec import StageContext, StageSpec
from stages.summarize import Summarizer
from stages.tokenize import tokenizer_for

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


async def _by_model(
    event: RequestAuthorized, states: dict[str | None, ContextState]
) -> list[Event]:
    """Each request is fitted with its own model's template, tokens and window."""
    state = states.get(event.request.model)
    if state is None:
        why = models.not_served(event.request.model, models.served())
        raise StageError("model_not_found", why, field="model")
    return await handle(event, state)


async def setup(ctx: StageContext) -> dict[str | None, ContextState]:
    """One state per served model (None: the default's, for a request that names none); they
    share the retrieval store."""
    store = Store(default_path())
    limit = settings.MAX_MODEL_LEN.get()
    states: dict[str | None, ContextState] = {}
    for model in models.served():
        tokenizer = tokenizer_for(model.artifact)
        retriever = Retriever(
            store,
            over_retrieve=settings.RETRIEVAL_OVER_RETRIEVE.get(),
            reranker=BusReranker(ctx, tokenizer, timeout_s=settings.RERANK_TIMEOUT_S.get()),
        )
        states[model.id] = ContextState(
            costs=Costs(tokenizer),
            # the engine's window: BRIGADE_MAX_MODEL_LEN, where the model's own is not smaller
            max_model_len=min(limit or tokenizer.max_model_len, tokenizer.max_model_len),
            summarizer=Summarizer(ctx),
            retriever=retriever,
        )
        states.setdefault(None, states[model.id])
    return states


SPEC = StageSpec(
    name=STAGE,
    input_event="authorized",
    decoder=decoder_for(RequestAuthorized),
    handle=_by_model,
    setup=setup,
)
