"""OpenAI HTTP schemas <-> Brigade: a chat or completions body becomes a `Submit`; a run's text
and usage become `chat.completion(.chunk)` / `text_completion` bodies (errors: errors.py).

Unknown OpenAI fields are ignored (as vLLM does); unsupported values are refused by name.
"""

from __future__ import annotations

import re
from typing import Any, Literal

import msgspec
from msgspec import Struct

from schemas.events import Submit, Usage
from stages.edge.errors import RequestError


class TextPart(Struct, frozen=True):
    type: Literal["text"]
    text: str


class ChatMessage(Struct, frozen=True):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None


class StreamOptions(Struct, frozen=True):
    include_usage: bool = False


class _Common(Struct, frozen=True, kw_only=True):
    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # vLLM-style extras, sent by the openai SDK through `extra_body`
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None


class ChatCompletionRequest(_Common, frozen=True, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None


class CompletionRequest(_Common, frozen=True, kw_only=True):
    prompt: str | list[str]
    echo: bool = False
    suffix: str | None = None


_FIELD_RE = re.compile(r"at `\$\.?([A-Za-z_][A-Za-z0-9_]*)")
_SAMPLING = (
    "temperature",
    "top_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "top_k",
    "min_p",
    "min_tokens",
    "repetition_penalty",
    "ignore_eos",
    "stop_token_ids",
)


def _field_of(err: msgspec.ValidationError) -> str | None:
    found = _FIELD_RE.search(str(err))
    return found.group(1) if found else None


def decode_body(body: bytes, kind: type[Struct]) -> Any:
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as err:
        raise RequestError(
            "invalid_request", f"invalid request body: {err}", _field_of(err)
        ) from None
    except msgspec.DecodeError as err:
        raise RequestError("invalid_request", f"request body is not valid JSON: {err}") from None


def _text_of(msg: ChatMessage) -> str:
    if msg.content is None:
        return ""
    if isinstance(msg.content, str):
        return msg.content
    return "".join(part.text for part in msg.content)


def to_submit(req: ChatCompletionRequest | CompletionRequest, **extra: Any) -> Submit:
    """Validate against the wire contract; `extra` carries request_id, api_key, idempotency_key."""
    if req.n != 1:
        raise RequestError("invalid_request", f"n={req.n} is not supported; only n=1", "n")
    fields: dict[str, Any] = {"model": req.model, **extra}
    if isinstance(req, ChatCompletionRequest):
        if not req.messages:
            raise RequestError("invalid_request", "messages must not be empty", "messages")
        fields["messages"] = [
            {"role": "system" if m.role == "developer" else m.role, "content": _text_of(m)}
            for m in req.messages
        ]
        max_tokens = req.max_completion_tokens or req.max_tokens
    else:
        if req.echo:
            raise RequestError("invalid_request", "echo=true is not supported", "echo")
        if req.suffix:
            raise RequestError("invalid_request", "suffix is not supported", "suffix")
        prompts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
        if len(prompts) != 1:
            raise RequestError(
                "invalid_request",
                f"prompt must be one string, got a list of {len(prompts)}",
                "prompt",
            )
        fields["prompt"] = prompts[0]
        max_tokens = req.max_tokens if req.max_tokens is not None else 16  # OpenAI's default
    if max_tokens is not None:
        fields["max_tokens"] = max_tokens
    if req.stop is not None:
        fields["stop"] = [req.stop] if isinstance(req.stop, str) else req.stop
    for name in _SAMPLING:
        value = getattr(req, name)
        if value is not None:
            fields[name] = value
    try:
        return msgspec.convert(fields, Submit)
    except msgspec.ValidationError as err:
        raise RequestError("invalid_request", f"invalid request: {err}", _field_of(err)) from None


def usage_body(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def chat_chunk(
    rid: str, created: int, model: str, delta: dict[str, Any], finish_reason: str | None
) -> dict[str, Any]:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    return {
        "id": f"chatcmpl-{rid}",
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [choice],
    }


def completion_chunk(
    rid: str, created: int, model: str, text: str, finish_reason: str | None
) -> dict[str, Any]:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
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


def full_response(
    chat: bool, rid: str, created: int, model: str, text: str, finish_reason: str, usage: Usage
) -> dict[str, Any]:
    if chat:
        body = chat_chunk(rid, created, model, {}, finish_reason)
        body["object"] = "chat.completion"
        body["choices"][0].pop("delta")
        body["choices"][0]["message"] = {"role": "assistant", "content": text}
    else:
        body = completion_chunk(rid, created, model, text, finish_reason)
    body["usage"] = usage_body(usage)
    return body
