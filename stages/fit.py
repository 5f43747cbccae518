"""Fitting a request into its context window, pure (no I/O): system prompt + documents +
history + user message, within the window minus the output reserve (max_tokens).

Token counts are exact under the model's chat template: a message's cost is the token count of
the text the template renders for it, and the template's own framing is a separate `template`
part, so the parts add up to the prompt's length. Truncation (per request): `drop_oldest` drops
whole history messages oldest first; `sliding_window` keeps the newest history tokens, cutting
the oldest kept message at a token boundary; `summarize` fits a summary of the dropped history
in the system message (written by stages/summarize.py). Documents go only after all history.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.tokenizer import Tokenizer
from schemas.events import (
    ContextAssembled,
    ContextPart,
    Document,
    Message,
    Request,
    RequestAuthorized,
)
from stages.runtime.failures import StageError

SUMMARY_HEADER = "Summary of the earlier conversation:"
DOCUMENTS_HEADER = "Documents:"


class Costs:
    """Token costs of messages as the chat template renders them (cached per content)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tok = tokenizer
        self._probe = {"role": "system", "content": "."}
        self._probe_text = tokenizer.apply_chat_template([self._probe], False)
        self._probe_tokens = len(tokenizer.encode_chat([self._probe], add_generation_prompt=False))
        self._framing: dict[bool, int] = {}

    def message(self, role: str, content: str, *, first: bool = False) -> int:
        """Tokens of one rendered message; `first` for the leading system message."""
        m = {"role": role, "content": content}
        if first:
            return len(self.tok.encode_chat([m], add_generation_prompt=False))
        text = self.tok.apply_chat_template([self._probe, m], False)
        assert text.startswith(self._probe_text), "chat template is not additive per message"
        # encoded as the tokenize stage will: control-token text in content is ordinary text
        both = self.tok.encode_chat([self._probe, m], add_generation_prompt=False)
        return len(both) - self._probe_tokens

    def framing(self, has_system: bool) -> int:
        """Tokens the template adds beyond its messages (default system prompt, generation prompt)."""
        if has_system not in self._framing:
            convo = [{"role": "user", "content": "."}]
            if has_system:
                convo.insert(0, {"role": "system", "content": "."})
            total = len(self.tok.encode_chat(convo, add_generation_prompt=True))
            # only a leading system message costs what it renders alone: a first user message
            # alone would render the template's default system prompt, which is framing here
            own = sum(
                self.message(m["role"], m["content"], first=i == 0 and m["role"] == "system")
                for i, m in enumerate(convo)
            )
            self._framing[has_system] = total - own
        return self._framing[has_system]

    def cut_to(self, role: str, content: str, budget: int) -> tuple[str, int] | None:
        """The longest token suffix of `content` whose message costs <= budget, and its cost."""
        ids = self.tok.encode_text(content)
        wrapper = self.message(role, "")
        keep = budget - wrapper
        while keep > 0:
            text = self.tok.decode(ids[-keep:]).lstrip("\ufffd")
            cost = self.message(role, text)
            if cost <= budget:
                return text, cost
            keep -= cost - budget
        return None


def documents_text(documents: list[Document]) -> str:
    blocks = []
    for i, d in enumerate(documents, 1):
        head = f"[{i}] {d.title}" if d.title else f"[{i}]"
        blocks.append(f"{head}\n{d.content}")
    return DOCUMENTS_HEADER + "\n\n" + "\n\n".join(blocks) if blocks else ""


def system_text(system: str | None, documents: list[Document], summary: str | None) -> str:
    summary_text = f"{SUMMARY_HEADER}\n{summary}" if summary else ""
    return "\n\n".join(p for p in (system or "", documents_text(documents), summary_text) if p)


@dataclass(frozen=True, kw_only=True)
class Split:
    """A request's messages split into the parts that are fitted."""

    system: str | None
    documents: list[Document]
    history: list[Message]
    user: Message


def split(request: Request) -> Split:
    messages = list(request.messages)
    leading = 0
    while leading < len(messages) - 1 and messages[leading].role == "system":
        leading += 1
    systems = [request.system] if request.system else []
    systems += [m.content for m in messages[:leading]]
    return Split(
        system="\n\n".join(systems) if systems else None,
        documents=list(request.documents),
        history=messages[leading:-1],
        user=messages[-1],
    )


@dataclass(frozen=True, kw_only=True)
class Fit:
    """The fitted prompt: messages, parts and what the summary must cover."""

    messages: list[Message]
    parts: list[ContextPart]
    num_prompt_tokens: int
    truncated: bool
    dropped_history: list[Message]
    prompt_token_ids: list[int] | None = None  # a raw prompt given as ids, as fitted


def fit(
    request: Request,
    costs: Costs,
    budget: int,
    *,
    summary: str | None = None,
    reserve: int = 0,
) -> Fit:
    """Fit `request` into `budget` tokens (minus `reserve`, room kept for a future summary)."""
    s = split(request)
    strategy = request.truncation
    user_cost = costs.message(s.user.role, s.user.content)
    history_costs = [costs.message(m.role, m.content) for m in s.history]

    def system_cost(docs: list[Document], with_summary: bool) -> int:
        text = system_text(s.system, docs, summary if with_summary else None)
        return costs.message("system", text, first=True) if text else 0

    docs = list(s.documents)
    sys_full = system_cost(docs, True)
    fixed = costs.framing(bool(sys_full)) + sys_full + user_cost
    room = budget - reserve - fixed
    kept = len(s.history)
    while kept and sum(history_costs[len(s.history) - kept :]) > room:
        kept -= 1
    history = list(s.history[len(s.history) - kept :])
    kept_costs = history_costs[len(s.history) - kept :]
    dropped = list(s.history[: len(s.history) - kept])
    cut_tokens = 0
    if strategy == "sliding_window" and dropped:
        left = room - sum(kept_costs)
        boundary = dropped[-1]
        cut = costs.cut_to(boundary.role, boundary.content, left) if left > 0 else None
        if cut is not None:
            text, cost = cut
            history.insert(0, Message(role=boundary.role, content=text))
            kept_costs.insert(0, cost)
            cut_tokens = history_costs[len(dropped) - 1] - cost
            dropped = dropped[:-1]
    while docs and fixed + sum(kept_costs) > budget - reserve:
        docs.pop()
        sys_full = system_cost(docs, True)
        fixed = costs.framing(bool(sys_full)) + sys_full + user_cost
    total = fixed + sum(kept_costs)
    if total > budget:
        raise StageError(
            "context_length",
            f"the system prompt, documents and last message need {total} tokens but the "
            f"context window leaves {budget} after max_tokens={request.sampling.max_tokens}; "
            "shorten them or lower max_tokens",
            field="messages",
        )
    sys_only = system_cost([], False)
    sys_docs = system_cost(docs, False)
    all_docs = system_cost(s.documents, False)
    parts = [
        ContextPart(name="system", num_tokens=sys_only),
        ContextPart(
            name="documents",
            num_tokens=sys_docs - sys_only,
            num_dropped_tokens=all_docs - sys_docs,
            num_dropped_items=len(s.documents) - len(docs),
        ),
        ContextPart(
            name="history",
            num_tokens=sum(kept_costs),
            num_dropped_tokens=sum(history_costs[: len(dropped)]) + cut_tokens,
            num_dropped_items=len(dropped),
        ),
        ContextPart(name="user", num_tokens=user_cost),
    ]
    if summary:
        parts.append(ContextPart(name="summary", num_tokens=sys_full - sys_docs))
    parts.append(ContextPart(name="template", num_tokens=costs.framing(bool(sys_full))))
    text = system_text(s.system, docs, summary)
    messages = ([Message(role="system", content=text)] if text else []) + history + [s.user]
    return Fit(
        messages=messages,
        parts=parts,
        num_prompt_tokens=total,
        truncated=bool(dropped or cut_tokens or len(docs) < len(s.documents)),
        dropped_history=list(s.history[: len(s.history) - kept]),
    )


def fit_raw_prompt(request: Request, costs: Costs, budget: int) -> Fit:
    """A raw prompt has no template: it fits as is, or (sliding_window) keeps its newest tokens
    (a prompt given as token ids: its newest ids)."""
    if request.prompt_token_ids is not None:
        return _fit_token_ids(request, budget)
    prompt = request.messages[0].content
    ids = costs.tok.encode(prompt)
    if len(ids) > budget and request.truncation == "sliding_window" and budget > 0:
        kept = costs.tok.decode(ids[-budget:]).lstrip("\ufffd")
        n = len(costs.tok.encode(kept))
        part = ContextPart(name="user", num_tokens=n, num_dropped_tokens=len(ids) - n)
        return Fit(
            messages=[Message(role="user", content=kept)],
            parts=[part],
            num_prompt_tokens=n,
            truncated=True,
            dropped_history=[],
        )
    if len(ids) > budget:
        raise StageError(
            "context_length",
            f"the prompt has {len(ids)} tokens but the context window leaves {budget} after "
            f"max_tokens={request.sampling.max_tokens}; shorten it, lower max_tokens or use "
            "truncation=sliding_window",
            field="prompt",
        )
    return Fit(
        messages=list(request.messages),
        parts=[ContextPart(name="user", num_tokens=len(ids))],
        num_prompt_tokens=len(ids),
        truncated=False,
        dropped_history=[],
    )


def _fit_token_ids(request: Request, budget: int) -> Fit:
    ids = request.prompt_token_ids or []
    if len(ids) > budget and request.truncation != "sliding_window":
        raise StageError(
            "context_length",
            f"prompt_token_ids has {len(ids)} tokens but the context window leaves {budget} "
            f"after max_tokens={request.sampling.max_tokens}; shorten it or lower max_tokens",
            field="prompt_token_ids",
        )
    kept = ids[-budget:] if len(ids) > budget else ids
    return Fit(
        messages=[],
        parts=[
            ContextPart(name="user", num_tokens=len(kept), num_dropped_tokens=len(ids) - len(kept))
        ],
        num_prompt_tokens=len(kept),
        truncated=len(kept) < len(ids),
        dropped_history=[],
        prompt_token_ids=list(kept),
    )


def budget_for(request: Request, max_model_len: int) -> int:
    budget = max_model_len - request.sampling.max_tokens
    if budget <= 0:
        raise StageError(
            "context_length",
            f"max_tokens={request.sampling.max_tokens} leaves no room for a prompt in the "
            f"{max_model_len}-token context window; lower max_tokens",
            field="max_tokens",
        )
    return budget


def assembled(
    event: RequestAuthorized, result: Fit, budget: int, fallback: str | None = None
) -> ContextAssembled:
    """The `assembled` event of a fitted request; `fallback` says why a summary was not used."""
    request = event.request
    fitted = Request(
        messages=result.messages,
        raw_prompt=request.raw_prompt,
        prompt_token_ids=result.prompt_token_ids,
        model=request.model,
        truncation=request.truncation,
        priority=request.priority,
        idempotency_key=request.idempotency_key,
        sampling=request.sampling,
    )
    return ContextAssembled(
        request_id=event.request_id,
        tenant=event.tenant,
        request=fitted,
        priority=event.priority,
        parts=result.parts,
        num_prompt_tokens=result.num_prompt_tokens,
        max_prompt_tokens=budget,
        truncated=result.truncated,
        fallback=fallback,
    )
