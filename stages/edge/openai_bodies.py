"""The answers' OpenAI shapes: `chat.completion`, `text_completion` and their streamed chunks,
one choice per run (a completions request with several prompts has a choice for each, by
index), and the usage summed over them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from schemas.events import Usage
from stages.edge.openai_schema import usage_body

FINISH_REASONS = ("stop", "length", "tool_calls", "content_filter")  # what the SDK accepts


@dataclass(frozen=True, kw_only=True)
class Choice:
    """One run's whole answer."""

    index: int
    text: str | None
    finish_reason: str
    logprobs: dict[str, Any] | None = None
    tool_calls: list[dict[str, Any]] | None = None

    def __post_init__(self) -> None:
        assert self.finish_reason in FINISH_REASONS, (
            f"{self.finish_reason!r} is not an SDK finish_reason"
        )


def total_usage(usages: list[Usage], prompt_indices: list[int] | None = None) -> Usage:
    """The runs' usage together: every run's completion tokens, and each prompt's tokens once
    (`prompt_indices[r]`: the prompt run r answers; n and best_of runs share one)."""
    firsts = list(usages)
    if prompt_indices is not None:
        seen: dict[int, Usage] = {}
        for usage, prompt in zip(usages, prompt_indices, strict=True):
            seen.setdefault(prompt, usage)
        firsts = list(seen.values())
    return Usage(
        prompt_tokens=sum(u.prompt_tokens for u in firsts),
        completion_tokens=sum(u.completion_tokens for u in usages),
        cached_tokens=sum(u.cached_tokens for u in firsts),
    )


def chat_chunk(
    rid: str,
    created: int,
    model: str,
    delta: dict[str, Any],
    finish_reason: str | None,
    logprobs: dict[str, Any] | None = None,
    index: int = 0,
) -> dict[str, Any]:
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    return {
        "id": f"chatcmpl-{rid}",
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [choice],
    }


def completion_chunk(
    rid: str,
    created: int,
    model: str,
    text: str,
    finish_reason: str | None,
    logprobs: dict[str, Any] | None = None,
    index: int = 0,
) -> dict[str, Any]:
    choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    return {
        "id": f"cmpl-{rid}",
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
    }


def usage_chunk(chat: bool, rid: str, created: int, model: str, usage: Usage) -> dict[str, Any]:
    return {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{rid}",
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage_body(usage),
    }


def _choice_body(chat: bool, c: Choice) -> dict[str, Any]:
    if not chat:
        return {"index": c.index, "text": c.text, "logprobs": c.logprobs,
                "finish_reason": c.finish_reason}  # fmt: skip
    message: dict[str, Any] = {"role": "assistant", "content": c.text}
    if c.tool_calls:
        message["tool_calls"] = c.tool_calls
    return {"index": c.index, "message": message, "logprobs": c.logprobs,
            "finish_reason": c.finish_reason}  # fmt: skip


def full_response(
    chat: bool, rid: str, created: int, model: str, choices: list[Choice], usage: Usage
) -> dict[str, Any]:
    return {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{rid}",
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [_choice_body(chat, c) for c in sorted(choices, key=lambda c: c.index)],
        "usage": usage_body(usage),
    }
