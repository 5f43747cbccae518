"""Tool calls: the Hermes rendering of tools and history, the grammar each tool_choice gets
(checked with llguidance over SmolLM2's own vocabulary), and the parser: a whole output and the
same output streamed in pieces of any size give the same calls, deltas in OpenAI's order."""

import json
import random

import msgspec
import pytest

from engine import load_tokenizer
from engine.grammar import GrammarCache
from engine.params import Constraint
from stages.edge.errors import RequestError
from stages.edge.openai_schema import ChatCompletionRequest, decode_body, to_submit
from stages.edge.tool_calls import (
    CLOSE,
    OPEN,
    NamedToolChoice,
    Tool,
    ToolCallStream,
    parse,
    tool_grammar,
)

MUL = {
    "type": "function",
    "function": {
        "name": "multiply",
        "description": "Multiply two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
NOW = {"type": "function", "function": {"name": "now"}}  # no parameters
TOOLS = [msgspec.convert(t, Tool) for t in (MUL, NOW)]


def call(name: str, args: dict) -> str:
    return (
        f"{OPEN}\n{json.dumps({'name': name, 'arguments': args}, separators=(',', ':'))}\n{CLOSE}"
    )


def _chat(**fields) -> ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return decode_body(msgspec.json.encode(body), ChatCompletionRequest)


@pytest.fixture(scope="module")
def grammars() -> GrammarCache:
    tok = load_tokenizer("smollm2-135m")
    return GrammarCache(tok, tok.vocab_size)


def _follows(cache: GrammarCache, lark: str, text: str) -> bool:
    """Whether `text` (as the tokenizer writes it) is a whole output the grammar allows."""
    matcher = cache.matcher(Constraint("grammar", lark)).llmatcher
    ids = load_tokenizer("smollm2-135m").encode(text)
    return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()


def test_each_tool_choice_allows_what_it_says(grammars):
    two = call("multiply", {"a": 2, "b": 3}) + "\n" + call("now", {})
    required = tool_grammar(TOOLS, "required", parallel=True)
    assert _follows(grammars, required, call("multiply", {"a": 2, "b": 3}))
    assert _follows(grammars, required, two)
    assert not _follows(grammars, required, "It is 6.")
    assert not _follows(grammars, required, call("multiply", {"a": "2", "b": 3}))  # a string
    assert not _follows(grammars, required, call("multiply", {"a": 2}))  # b is required
    assert not _follows(grammars, required, call("divide", {"a": 2, "b": 3}))
    single = tool_grammar(TOOLS, "required", parallel=False)
    assert _follows(grammars, single, call("now", {}))
    assert not _follows(grammars, single, two)
    now = msgspec.convert({"type": "function", "function": {"name": "now"}}, NamedToolChoice)
    named = tool_grammar(TOOLS, now, parallel=True)
    assert _follows(grammars, named, call("now", {}))
    assert not _follows(grammars, named, call("multiply", {"a": 2, "b": 3}))
    auto = tool_grammar(TOOLS, "auto", parallel=True)
    assert _follows(grammars, auto, "It is 6.")
    assert _follows(grammars, auto, two)
    assert not _follows(grammars, auto, OPEN + '\n{"name":"multiply","arguments":{"a":"x"}}')
    text_then_calls = "Let me compute.\n" + two
    assert _follows(grammars, auto, text_then_calls)
    assert not _follows(grammars, auto, "Done: " + OPEN + " is a tag.")  # a tag is a call
    assert not _follows(grammars, auto, call("now", {}) + " and then text")
    assert not _follows(grammars, required, text_then_calls)  # required: calls at once
    assert tool_grammar(TOOLS, "none", parallel=True) is None


def _assemble(deltas: list[dict]) -> tuple[str, list[dict]]:
    """Deltas -> (content, calls), as the openai SDK's stream helpers accumulate them."""
    content, calls = "", []
    for d in deltas:
        content += d.get("content", "")
        for part in d.get("tool_calls", ()):
            if "id" in part:
                assert part["index"] == len(calls) and part["function"]["arguments"] == ""
                calls.append({"id": part["id"], "type": part["type"],
                              "function": {"name": part["function"]["name"], "arguments": ""}})  # fmt: skip
            else:
                assert set(part) == {"index", "function"} and set(part["function"]) == {"arguments"}
            calls[part["index"]]["function"]["arguments"] += part["function"]["arguments"]
    return content, calls


OUTPUTS = [
    call("multiply", {"a": 12, "b": -3}),
    call("multiply", {"a": 1, "b": 2}) + "\n" + call("now", {}),
    call("note", {"text": 'a } and "</tool_call>" inside', "n": {"x": [1, {"y": "}"}]}}),
    "The answer is 6. <tool_ is not a tag.",
    "Let me multiply.\n" + call("multiply", {"a": 1, "b": 2}) + "\n" + call("now", {}),
    "First <tool_call\n",  # looked like a tag, then did not: held back, then given as text
    "<tool",
    "  ",
]


@pytest.mark.parametrize("text", OUTPUTS)
def test_a_streamed_output_gives_the_whole_outputs_calls(text):
    content, calls = parse("r1", text)
    rng = random.Random(7)
    for _ in range(20):
        stream, deltas, at = ToolCallStream("r1"), [], 0
        while at < len(text):
            step = rng.randint(1, 6)
            deltas += stream.feed(text[at : at + step])
            at += step
        deltas += stream.end()
        streamed_content, streamed_calls = _assemble(deltas)
        assert streamed_calls == calls
        assert streamed_content == (content or "")
        if calls:  # the arguments arrive in pieces, not only at the end
            pieces = [d for d in deltas if "tool_calls" in d]
            assert len(pieces) >= 2 * len(calls)
    for c in calls:
        assert (
            json.loads(c["function"]["arguments"])
            == json.loads(text.split(OPEN)[calls.index(c) + 1].split("\n" + CLOSE)[0])["arguments"]
        )


def test_parse_gives_content_or_calls():
    content, calls = parse("r1", OUTPUTS[1])
    assert content is None
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("multiply", '{"a":1,"b":2}'), ("now", "{}")]  # fmt: skip
    assert calls[0]["id"] != calls[1]["id"] and calls[0]["id"].startswith("call_")
    assert parse("r1", OUTPUTS[1])[1][0]["id"] == calls[0]["id"]  # fixed by run and place
    assert parse("r1", "hello") == ("hello", [])
    cut = OUTPUTS[1][: len(OUTPUTS[1]) - 5]  # max_tokens ended the second call
    assert [c["function"]["name"] for c in parse("r1", cut)[1]] == ["multiply"]
    assert parse("r1", OUTPUTS[0][:20]) == (OUTPUTS[0][:20], [])  # no complete call: the text
    content, calls = parse("r1", OUTPUTS[4])  # text, then two calls
    assert content == "Let me multiply."
    assert [c["function"]["name"] for c in calls] == ["multiply", "now"]


def test_tools_and_history_render_in_the_hermes_format():
    req = _chat(
        messages=[
            {"role": "system", "content": "Be exact."},
            {"role": "user", "content": "2 times 3?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1",
             "type": "function", "function": {"name": "multiply", "arguments": '{"a":2,"b":3}'}}]},
            {"role": "tool", "content": "6", "tool_call_id": "call_1"},
        ],
        tools=[MUL, NOW],
        tool_choice="required",
        parallel_tool_calls=False,
    )  # fmt: skip
    submit = to_submit(req, request_id="r1")
    roles = [m.role for m in submit.messages]
    assert roles == ["system", "system", "user", "assistant", "user"]
    assert submit.messages[0].content == "Be exact."
    tools = submit.messages[1].content
    assert tools.startswith("# Tools") and "<tools>\n" in tools
    listed = tools.split("<tools>\n")[1].split("\n</tools>")[0].splitlines()
    assert [json.loads(line)["function"]["name"] for line in listed] == ["multiply", "now"]
    assert json.loads(listed[1])["function"]["parameters"] == {
        "type": "object", "properties": {}, "additionalProperties": False}  # fmt: skip
    assert submit.messages[3].content == (
        '<tool_call>\n{"name": "multiply", "arguments": {"a": 2, "b": 3}}\n</tool_call>')  # fmt: skip
    assert submit.messages[4].content == "<tool_response>\n6\n</tool_response>"
    assert submit.guided_grammar == tool_grammar(req.tools, "required", parallel=False)
    assert to_submit(_chat(tools=[MUL], tool_choice="none")).guided_grammar is None
    assert [m.role for m in to_submit(_chat(tools=[MUL], tool_choice="none")).messages] == ["user"]
    assert to_submit(_chat(tools=[MUL])).guided_grammar == tool_grammar(
        req.tools[:1], "auto", parallel=True
    )  # auto by default with tools


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [MUL], "tool_choice": {"type": "function", "function": {"name": "now"}}},
         "tool_choice.function.name"),
        ({"tools": [MUL, MUL]}, "tools[1].function.name"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "objekt"}}}]}, "tools[0].function.parameters"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
        ({"tools": [NOW] * 129}, "tools"),
        ({"tools": [MUL], "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"tools": [MUL], "tool_choice": "sometimes"}, "tool_choice"),
        ({"messages": [{"role": "tool", "content": "6"}]}, "messages[0].tool_call_id"),
        ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]},
         "messages[0].tool_call_id"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": [{"id": "c",
          "function": {"name": "f", "arguments": "{}"}}]}]}, "messages[0].tool_calls"),
        ({"messages": [{"role": "assistant", "content": None}]}, "messages[0].content"),
        ({"messages": [{"role": "function", "content": "6", "name": "f"}]}, "messages[0].role"),
    ],
)  # fmt: skip
def test_bad_tool_fields_are_a_400_naming_the_field(fields, param):
    with pytest.raises(RequestError) as info:
        _chat(**fields)
    assert (info.value.status, info.value.field) == (400, param), info.value.message
