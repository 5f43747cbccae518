"""Context: `authorized` -> `assembled`. The request fitted into the context window (fit.py);
with truncation `summarize`, the dropped history summarized by the engine (summarize.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from schemas import settings
from schemas.events import Event, RequestAuthorized, decoder_for
from stages.fit import Costs, assembled, budget_for, fit, fit_raw_prompt
from stages.runtime.spec import StageContext, StageSpec
from stages.summarize import Summarizer
from stages.tokenize import served_model, tokenizer_for

STAGE = "context"


@dataclass
class ContextState:
    costs: Costs
    max_model_len: int
    summarizer: Summarizer | None = None  # None: `summarize` falls back to drop_oldest


async def handle(event: RequestAuthorized, state: ContextState) -> list[Event]:
    request = event.request
    budget = budget_for(request, state.max_model_len)
    if request.raw_prompt:
        return [assembled(event, fit_raw_prompt(request, state.costs, budget), budget)]
    if request.truncation != "summarize" or state.summarizer is None:
        return [assembled(event, fit(request, state.costs, budget), budget)]
    return [await state.summarizer.assemble(event, state, budget)]


async def setup(ctx: StageContext) -> ContextState:
    tokenizer = tokenizer_for(served_model())
    max_len = settings.MAX_MODEL_LEN.get() or tokenizer.max_model_len  # the engine's, if smaller
    return ContextState(costs=Costs(tokenizer), max_model_len=max_len, summarizer=Summarizer(ctx))


SPEC = StageSpec(
    name=STAGE,
    input_event="authorized",
    decoder=decoder_for(RequestAuthorized),
    handle=handle,
    setup=setup,
)
