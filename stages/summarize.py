"""The `summarize` truncation: the engine itself, through the bus, summarizes the dropped history.

The context stage publishes a nested run's `authorized` event (same tenant, already authorized;
no stage holds the client's key to resubmit it) under a request id derived from the parent's,
so a redelivered parent finds the same run. It waits for the run's `completed` event and reads
the text deltas from the log. On timeout or failure it cancels the nested run and falls back to
plain dropping; `assembled.fallback` records why.
"""

from __future__ import annotations

import hashlib
import time

import anyio

from schemas import settings, subjects
from schemas.events import (
    CancelRequested,
    ContextAssembled,
    Message,
    Request,
    RequestAuthorized,
    RunCompleted,
    Sampling,
    TextGenerated,
)
from stages.fit import SUMMARY_HEADER, assembled, fit
from stages.runtime.failures import StageError
from stages.runtime.spec import StageContext

INSTRUCTION = (
    "Summarize the conversation below in a few sentences. Keep names, numbers, facts and "
    "decisions; write only the summary."
)
MIN_SUMMARY_TOKENS = 8
TERMINAL = ("completed", "failed", "cancelled")


class SummaryFailed(Exception):
    pass


def nested_request_id(parent: str) -> str:
    """Deterministic, so a redelivered parent re-attaches to the same summary run."""
    rid = f"{parent}-sum"
    return rid if len(rid) <= 64 else "sum-" + hashlib.sha256(parent.encode()).hexdigest()[:40]


def transcript(messages: list[Message]) -> str:
    return "\n".join(f"{m.role}: {m.content}" for m in messages)


class Summarizer:
    def __init__(self, ctx: StageContext) -> None:
        self.bus = ctx.bus
        self.timeout_s = settings.SUMMARY_TIMEOUT_S.get()
        self.max_tokens = settings.SUMMARY_MAX_TOKENS.get()

    async def assemble(self, event: RequestAuthorized, state, budget: int) -> ContextAssembled:
        request = event.request
        plain = fit(request, state.costs, budget)
        if not plain.dropped_history:
            return assembled(event, plain, budget)
        header = len(state.costs.tok.encode(f"\n\n{SUMMARY_HEADER}\n"))
        history = next(p.num_tokens for p in plain.parts if p.name == "history")
        free = budget - (plain.num_prompt_tokens - history)  # room beside the history
        max_tokens = min(self.max_tokens, (free - header - 2) // 2)  # at most half the room
        if max_tokens < MIN_SUMMARY_TOKENS:
            reason = f"no room for a summary: {free} tokens left beside the fixed parts"
            return assembled(event, plain, budget, fallback=reason)
        reserved = fit(request, state.costs, budget, reserve=header + max_tokens + 2)
        try:
            summary = await self.generate(event, reserved.dropped_history, max_tokens, state)
        except SummaryFailed as err:
            return assembled(event, plain, budget, fallback=str(err))
        try:
            final = fit(request, state.costs, budget, summary=summary)
        except StageError:
            return assembled(event, plain, budget, fallback="the summary did not fit")
        return assembled(event, final, budget)

    async def generate(
        self, parent: RequestAuthorized, dropped: list[Message], max_tokens: int, state
    ) -> str:
        costs = state.costs
        text = transcript(dropped)
        ids = costs.tok.encode(text)
        framing = costs.framing(True) + costs.message("system", INSTRUCTION, first=True)
        limit = state.max_model_len - max_tokens - framing - costs.message("user", "")
        if limit < MIN_SUMMARY_TOKENS:
            raise SummaryFailed(
                f"the {state.max_model_len}-token context window has no room for a summary run"
            )
        if len(ids) > limit:
            text = costs.tok.decode(ids[-limit:]).lstrip("\ufffd")
        nested = nested_request_id(parent.request_id)
        request = Request(
            messages=[
                Message(role="system", content=INSTRUCTION),
                Message(role="user", content=text),
            ],
            model=parent.request.model,
            priority=parent.request.priority,
            sampling=Sampling(temperature=0.0, max_tokens=max_tokens),
        )
        sub = await self.bus.nc.subscribe(subjects.request_events(nested))
        deadline = time.monotonic() + self.timeout_s
        try:
            await self.bus.publish(
                RequestAuthorized(
                    request_id=nested,
                    tenant=parent.tenant,
                    request=request,
                    priority=parent.priority,
                )
            )
            ended = await self._already_ended(nested)
            while ended is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                msg = await sub.next_msg(timeout=left)
                if msg.subject.rsplit(".", 1)[-1] in TERMINAL:
                    ended = await self._already_ended(nested)
            if not isinstance(ended, RunCompleted):
                why = getattr(ended, "message", None) or getattr(ended, "reason", "")
                raise SummaryFailed(
                    f"summary run {nested} ended {ended.__struct_config__.tag}: {why}"
                )
            summary = await self._text(nested, ended.last_seq, deadline)
            if not summary:
                raise SummaryFailed(f"summary run {nested} wrote no text")
            return summary
        except TimeoutError:
            await self.bus.publish(
                CancelRequested(request_id=nested, tenant=parent.tenant, reason="timeout")
            )
            raise SummaryFailed(
                f"no summary from run {nested} within {self.timeout_s:g} s ({settings.SUMMARY_TIMEOUT_S.name})"
            ) from None
        finally:
            await sub.unsubscribe()

    async def _already_ended(self, nested: str):
        for e in await self.bus.replay(nested):
            if e.__struct_config__.tag in TERMINAL:
                return e
        return None

    async def _text(self, nested: str, last_seq: int, deadline: float) -> str:
        """The run's text from the log, once every delta up to `last_seq` is stored."""
        while True:
            deltas = {
                e.seq: e.text for e in await self.bus.replay(nested) if isinstance(e, TextGenerated)
            }
            if all(s in deltas for s in range(last_seq + 1)):
                return "".join(deltas[s] for s in range(last_seq + 1)).strip()
            if time.monotonic() > deadline:
                raise TimeoutError
            await anyio.sleep(0.02)
