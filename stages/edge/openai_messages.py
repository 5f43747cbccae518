"""Chat messages in OpenAI's shape: their types, the checks that name a bad one by its path
(`messages[2].tool_call_id`), and the conversation as the wire's system / user / assistant
messages (tool turns and tools in the Hermes format, tool_calls.py)."""

from __future__ import annotations

from typing import Any, Literal

from msgspec import Struct

from stages.edge.errors import RequestError
from stages.edge.tool_calls import Tool, ToolCall, assistant_text, tool_result_text, tools_prompt

_REFUSED_PARTS = ("image_url", "input_audio", "file", "refusal")
_MESSAGE_FIELDS = ("role", "content", "tool_calls", "tool_call_id")


class TextPart(Struct, frozen=True, forbid_unknown_fields=True):
    type: Literal["text"]
    text: str


class ChatMessage(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn: the call it answers


def validate_messages(raw: Any) -> Any:
    """Refuse function turns, speaker names and non-text parts by their path; returns the
    messages without their no-op fields (null refusal and audio, empty tool_calls)."""
    if not isinstance(raw, list):
        return raw  # the struct names the type error
    kept: list[Any] = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            kept.append(m)
            continue
        at = f"messages[{i}]"
        if m.get("role") == "function":
            raise RequestError(
                "unsupported_parameter",
                f"{at}.role='function': the deprecated functions API is not supported; send "
                "`tools` and answer a call with a `tool` message; roles allowed: system, "
                "developer, user, assistant, tool",
                f"{at}.role",
            )
        for name, value in m.items():
            if name in _MESSAGE_FIELDS:
                continue
            if name == "name" and value is not None:
                raise RequestError(
                    "unsupported_parameter",
                    f"{at}.name: the served model's chat template has no place for a speaker "
                    "name; put it in the content",
                    f"{at}.name",
                )
            if name in ("function_call", "refusal", "audio", "name"):
                if value is None or value == []:
                    continue
                raise RequestError(
                    "unsupported_parameter",
                    f"{at}.{name} is not supported: the deprecated function calls and audio "
                    "are not supported (calls go in tool_calls); allowed: null",
                    f"{at}.{name}",
                )
            raise RequestError(
                "unknown_parameter",
                f"unknown field `{name}` in {at}; a message takes role, content, tool_calls "
                "(assistant) and tool_call_id (tool)",
                f"{at}.{name}",
            )
        content = m.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind in _REFUSED_PARTS:
                    raise RequestError(
                        "unsupported_parameter",
                        f"{at}.content[{j}].type={kind!r}: the served model reads text only; "
                        "allowed: text",
                        f"{at}.content[{j}].type",
                    )
        kept.append({k: v for k, v in m.items() if k in _MESSAGE_FIELDS and v != []})
    return kept


def check_message(i: int, m: ChatMessage) -> None:
    at = f"messages[{i}]"
    if m.content is None and not (m.role == "assistant" and m.tool_calls):
        raise RequestError(
            "invalid_request",
            f"{at}.content is null; a {m.role} message needs text content (an assistant "
            "message may have tool_calls instead)",
            f"{at}.content",
        )
    if m.tool_calls and m.role != "assistant":
        raise RequestError(
            "invalid_request", f"{at}.tool_calls: only an assistant message has tool_calls",
            f"{at}.tool_calls",
        )  # fmt: skip
    if (m.tool_call_id is None) == (m.role == "tool"):
        why = "a tool message needs the id of the call it answers" if m.role == "tool" else (
            "only a tool message answers a call")  # fmt: skip
        raise RequestError("invalid_request", f"{at}.tool_call_id: {why}", f"{at}.tool_call_id")


def wire_messages(
    messages: list[ChatMessage], tools: list[Tool] | None = None
) -> list[dict[str, str]]:
    """The conversation as the wire's system/user/assistant messages: developer as system,
    an assistant's tool calls written after its text, a tool result as a user turn in
    `<tool_response>`, and the tools (unless tool_choice is "none") in the system prompt,
    after the request's own leading system messages (tool_calls.py has the format); give
    `tools` only when they may be called."""
    out: list[dict[str, str]] = []
    for m in messages:
        if m.role == "tool":
            out.append({"role": "user", "content": tool_result_text(text_of(m))})
        elif m.role == "assistant" and m.tool_calls:
            out.append({"role": "assistant", "content": assistant_text(text_of(m), m.tool_calls)})
        else:
            out.append({"role": "system" if m.role == "developer" else m.role,
                        "content": text_of(m)})  # fmt: skip
    if tools:
        leading = next((i for i, m in enumerate(out) if m["role"] != "system"), len(out))
        out.insert(leading, {"role": "system", "content": tools_prompt(tools)})
    return out


def text_of(msg: ChatMessage) -> str:
    if msg.content is None:
        return ""
    if isinstance(msg.content, str):
        return msg.content
    return "".join(part.text for part in msg.content)
