"""Tool calls in the Hermes convention: the tools rendered into the system prompt, calls written
as `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, parsed back into OpenAI's
`tool_calls` (whole, or streamed as deltas), and the llguidance grammar that makes them parse.

Invariant: whenever tools may be called (tool_choice auto, required or a named function) the
output is grammar-constrained: free text with no `<tool_call>` in it (auto only), or one or more
calls whose arguments follow the function's parameter schema, after some text (auto) or at once
(required, named). So the parser never meets a malformed call; an unfinished one (max_tokens) is
left out.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Annotated, Any, Literal

from msgspec import Meta, Struct

from engine.errors import RequestRejected
from engine.grammar import check
from engine.params import Constraint
from schemas.events import MAX_CONSTRAINT_CHARS
from stages.edge.errors import RequestError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FunctionName = Annotated[str, Meta(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
MAX_TOOLS = 128
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


class FunctionDef(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: the function takes none
    strict: bool | None = None  # enforced either way


class Tool(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(Struct, frozen=True, forbid_unknown_fields=True):
    name: FunctionName


class NamedToolChoice(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice
Tools = Annotated[list[Tool], Meta(max_length=MAX_TOOLS)]


class CalledFunction(Struct, frozen=True, forbid_unknown_fields=True):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """An earlier assistant turn's call, in the history."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


def parameters_of(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters if tool.function.parameters is not None else NO_PARAMETERS


def tools_prompt(tools: list[Tool]) -> str:
    """The system prompt's tools section (Hermes / Qwen2.5's wording)."""
    signatures = "\n".join(
        json.dumps(
            {
                "type": "function",
                "function": {
                    "name": t.function.name,
                    "description": t.function.description or "",
                    "parameters": parameters_of(t),
                },
            },
            ensure_ascii=False,
        )
        for t in tools
    )
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{signatures}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments "
        f"within {OPEN}{CLOSE} XML tags:\n"
        f'{OPEN}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n{CLOSE}'
    )


def call_text(name: str, arguments: str) -> str:
    """One call as the model writes it (an earlier turn's, rendered into the history)."""
    try:
        args: Any = json.loads(arguments)
    except ValueError:
        args = arguments  # not JSON: kept as the string it was
    body = json.dumps({"name": name, "arguments": args}, ensure_ascii=False)
    return f"{OPEN}\n{body}\n{CLOSE}"


def assistant_text(content: str, calls: list[ToolCall]) -> str:
    """An earlier assistant turn: its text, then its calls."""
    parts = [call_text(c.function.name, c.function.arguments) for c in calls]
    return "\n".join([content, *parts] if content else parts)


def tool_result_text(content: str) -> str:
    """A `role: "tool"` message's content, as the user turn that carries it back."""
    return f"<tool_response>\n{content}\n</tool_response>"


def _call_schema(tool: Tool) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": tool.function.name}, "arguments": parameters_of(tool)},
        "required": ["name", "arguments"],
        "additionalProperties": False,
        "x-guidance": {"whitespace_flexible": False},  # compact, as response_format's JSON
    }


def schema_grammar(tool: Tool) -> str:
    """A Lark grammar of exactly one call of `tool` (for checking its schema on its own)."""
    return f'start: "{_esc(OPEN)}\\n" %json {json.dumps(_call_schema(tool))} "\\n{_esc(CLOSE)}"'


def _esc(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')


def tool_grammar(tools: list[Tool], choice: ToolChoice, parallel: bool) -> str | None:
    """The Lark grammar (llguidance) the output must follow; None: no tools may be called.

    auto: free text with no `<tool_call>` in it, or text and then calls (the text's end is a
    lazy lexeme: it stops at the first `<tool_call>`, so the model cannot write one that is not
    a call); required: calls of any tool, at once; a named function: calls of that one.
    `parallel`: one or more calls, else one."""
    if choice == "none" or not tools:
        return None
    if isinstance(choice, NamedToolChoice):
        tools = [t for t in tools if t.function.name == choice.function.name]
    bodies = " | ".join(f"%json {json.dumps(_call_schema(t))}" for t in tools)
    more = ' ("\\n" call)*' if parallel else ""
    lines = [
        f'call: "{_esc(OPEN)}\\n" body',
        f'body: ({bodies}) "\\n{_esc(CLOSE)}"',
    ]
    if choice == "auto":
        lines = [
            f"start: TEXT | head body{more}",
            f'head[lazy]: /(?s:.*)/ "{_esc(OPEN)}\\n"',
            *lines,
            f"TEXT: /(?s:.+)/ & ~/(?s:.*){OPEN}(?s:.*)/",
        ]
    else:
        lines = [f"start: call{more}", *lines]
    return "\n".join(lines) + "\n"


def check_tools(tools: list[Tool], choice: ToolChoice) -> None:
    """A 400 naming the field when tool_choice names no given tool, when tools are required
    but none is given, or when a tool's parameters are not a JSON schema the grammar takes."""
    names = [t.function.name for t in tools]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise RequestError(
                "invalid_request", f"tools[{i}].function.name {name!r} is given twice",
                f"tools[{i}].function.name",
            )  # fmt: skip
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise RequestError(
            "invalid_request",
            f"tool_choice names the function {choice.function.name!r}, which is not in tools "
            f"({', '.join(names) or 'none given'})",
            "tool_choice.function.name",
        )
    if choice == "required" and not tools:
        raise RequestError("invalid_request", 'tool_choice "required" needs tools', "tool_choice")
    for i, tool in enumerate(tools):
        field = f"tools[{i}].function.parameters"
        try:
            check(Constraint("grammar", schema_grammar(tool)))
        except RequestRejected as err:
            problem = err.message.split(": ", 2)[-1]  # past "guided_grammar: the grammar is ..."
            raise RequestError(
                "invalid_request", f"{field} is not a JSON schema Brigade can enforce: {problem}",
                field,
            ) from None  # fmt: skip
    lark = tool_grammar(tools, choice, parallel=True)
    if lark is not None and len(lark) > MAX_CONSTRAINT_CHARS:
        raise RequestError(
            "invalid_request",
            f"the tools' schemas make a grammar of {len(lark)} characters; at most "
            f"{MAX_CONSTRAINT_CHARS}: give fewer or smaller tools",
            "tools",
        )


def call_id(request_id: str, index: int) -> str:
    """A call's id, fixed by its run and place (a re-attached client reads the same ids)."""
    digest = hashlib.sha256(f"{request_id}:{index}".encode()).hexdigest()[:24]
    return f"call_{digest}"


def parse(request_id: str, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """A whole output's content and its complete calls (OpenAI's `tool_calls` items), read as
    the stream reads it, so whole and streamed answers agree. Text before the first call is
    content; an unfinished last call (max_tokens) is left out, and an output with
    no complete call is all content."""
    stream = ToolCallStream(request_id)
    deltas = stream.feed(text) + stream.end()
    content = "".join(d.get("content", "") for d in deltas)
    calls: list[dict[str, Any]] = []
    for d in deltas:
        for part in d.get("tool_calls", ()):
            if "id" in part:
                calls.append({k: part[k] for k in ("id", "type")} | {"function": {
                    "name": part["function"]["name"], "arguments": ""}})  # fmt: skip
            calls[part["index"]]["function"]["arguments"] += part["function"]["arguments"]
    calls = calls[: stream.num_complete]
    if not calls:
        return text, []
    return content or None, calls


def _parse_call(body: str) -> tuple[str, str] | None:
    """(name, arguments as compact JSON) of a call's body; None when it is not one."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    args = json.dumps(value.get("arguments", {}), ensure_ascii=False, separators=(",", ":"))
    return value["name"], args


_HEADER_RE = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


class ToolCallStream:
    """A streamed output -> OpenAI's chat deltas: `{"content": ...}` for text, and for each
    call `{"tool_calls": [{index, id, type, function: {name, arguments: ""}}]}` once its name
    is written, then `{"tool_calls": [{index, function: {arguments: chunk}}]}` as its arguments
    arrive. Text that might still become `<tool_call>` is held back until it cannot."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.mode: Literal["start", "text", "call", "between"] = "start"
        self.buffer = ""
        self.num_calls = 0  # calls begun
        self.num_complete = 0
        self._header_end: int | None = None  # in `buffer`, when the call's name was sent
        self._sent = 0  # characters of the call's arguments sent

    def feed(self, text: str) -> list[dict[str, Any]]:
        self.buffer += text
        out: list[dict[str, Any]] = []
        while True:
            step = self._step()
            if step is None:
                return out
            out.extend(step)

    def _step(self) -> list[dict[str, Any]] | None:
        """One move of the state machine; None when it must wait for more text."""
        if self.mode == "text":
            return self._text_step()
        if self.mode in ("start", "between"):
            head = self.buffer.lstrip()
            if head.startswith(OPEN):
                self.buffer = head[len(OPEN) :]
                self.mode, self._header_end, self._sent = "call", None, 0
                self.num_calls += 1
                return []
            if OPEN.startswith(head):
                return None  # it may still become a call
            self.mode = "text"
            return []
        return self._call_step()

    def _text_step(self) -> list[dict[str, Any]] | None:
        """Text until a `<tool_call>` (auto lets calls follow text): the content before it,
        less its trailing whitespace, and the call begins; a tail that may still become one
        (whitespace, then a start of `<tool_call>`) is held back."""
        at = self.buffer.find(OPEN)
        if at >= 0:
            text = self.buffer[:at].rstrip()
            self.buffer = self.buffer[at + len(OPEN) :]
            self.mode, self._header_end, self._sent = "call", None, 0
            self.num_calls += 1
            return [{"content": text}] if text else []
        keep = len(self.buffer)
        for k in range(min(len(OPEN) - 1, len(self.buffer)), 0, -1):
            if OPEN.startswith(self.buffer[-k:]):
                keep = len(self.buffer) - k
                break
        keep = len(self.buffer[:keep].rstrip())
        text, self.buffer = self.buffer[:keep], self.buffer[keep:]
        return [{"content": text}] if text else None

    def _call_step(self) -> list[dict[str, Any]] | None:
        index = self.num_calls - 1
        end = self._close_at()
        body = self.buffer if end is None else self.buffer[:end]
        out: list[dict[str, Any]] = []
        if self._header_end is None:
            header = _HEADER_RE.match(body)
            if header is None and end is None:
                return None
            if header is not None:
                self._header_end = header.end()
                out.append(self._delta(index, json.loads(f'"{header.group(1)}"')))
        if end is None:
            chunk = self._arguments_so_far(body)
            if chunk:
                out.append(self._args_delta(index, chunk))
            return out or None
        name, arguments = _parse_call(body) or ("", "")
        self.buffer = self.buffer[end + len(CLOSE) :]
        self.mode = "between"
        self.num_complete += 1
        if self._header_end is None:  # written in another shape: name and arguments at once
            return [self._delta(index, name), self._args_delta(index, arguments)]
        written = body[self._header_end :].rstrip()
        rest = written[:-1].rstrip() if written.endswith("}") else written  # the object's }
        if rest[self._sent :]:
            out.append(self._args_delta(index, rest[self._sent :]))
        return out

    def _close_at(self) -> int | None:
        """Where the `</tool_call>` that ends this call starts: the first one after a whole
        call object (one inside an argument's string does not end it); None: not yet."""
        at = self.buffer.find(CLOSE)
        while at >= 0:
            if _parse_call(self.buffer[:at]) is not None:
                return at
            at = self.buffer.find(CLOSE, at + 1)
        return None

    def _arguments_so_far(self, body: str) -> str:
        """The arguments written and not yet sent, less a tail that may be the call object's
        closing brace (a `}` followed only by whitespace and the start of `</tool_call>`)."""
        assert self._header_end is not None, "arguments come after the name"
        written = body[self._header_end :]
        cut = len(written)
        brace = written.rfind("}")
        if brace >= 0 and CLOSE.startswith(written[brace + 1 :].lstrip()):
            cut = brace
        else:
            cut = len(written.rstrip())
        chunk = written[self._sent : cut]
        self._sent = max(self._sent, cut)
        return chunk

    def _delta(self, index: int, name: str) -> dict[str, Any]:
        call = {
            "index": index,
            "id": call_id(self.request_id, index),
            "type": "function",
            "function": {"name": name, "arguments": ""},
        }
        return {"tool_calls": [call]}

    @staticmethod
    def _args_delta(index: int, chunk: str) -> dict[str, Any]:
        return {"tool_calls": [{"index": index, "function": {"arguments": chunk}}]}

    def end(self) -> list[dict[str, Any]]:
        """What is held back when the output ends: text that only looked like a call's start
        (an unfinished call's rest is dropped, as parse() does)."""
        text, self.buffer = self.buffer, ""
        if self.mode in ("start", "text") and text:
            return [{"content": text}]
        return []
