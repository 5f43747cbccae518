"""The one table of parameters: docs/api.md prints it as generated, every refused parameter
takes its no-op values, and the table covers what the chat and completions structs accept."""

from pathlib import Path

import msgspec
import pytest

from stages.edge.openai_params import BEGIN, BY_ENDPOINT, CHAT, COMPLETIONS, PARAMS, markdown_table
from stages.edge.openai_schema import ChatCompletionRequest, CompletionRequest, decode_body

ROOT = Path(__file__).resolve().parents[3]
BASE = {
    CHAT: {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    COMPLETIONS: {"model": "m", "prompt": "Once"},
}
KINDS = {CHAT: ChatCompletionRequest, COMPLETIONS: CompletionRequest}
NO_OPS = {
    "n": 1, "best_of": 1, "echo": False, "suffix": "", "tools": [],
    "response_format": {"type": "text"}, "tool_choice": "none", "functions": [],
    "function_call": "none", "store": False, "service_tier": "auto", "modalities": ["text"],
    "skip_special_tokens": True, "include_stop_str_in_output": False,
    "add_generation_prompt": True, "continue_final_message": False, "use_beam_search": False,
}  # fmt: skip


def test_docs_api_md_holds_the_generated_table():
    text = (ROOT / "docs" / "api.md").read_text()
    start = text.index(BEGIN)
    assert text[start : start + len(markdown_table())] == markdown_table(), (
        "docs/api.md's parameter table is out of date: paste openai_params.markdown_table()"
    )


@pytest.mark.parametrize("endpoint", [CHAT, COMPLETIONS])
def test_refused_parameters_take_their_no_op_values(endpoint):
    for param in BY_ENDPOINT[endpoint].values():
        if param.status != "refused":
            continue
        for value in (None, NO_OPS.get(param.name)):
            decode_body(msgspec.json.encode({**BASE[endpoint], param.name: value}), KINDS[endpoint])


@pytest.mark.parametrize("endpoint", [CHAT, COMPLETIONS])
def test_the_table_and_the_request_structs_agree(endpoint):
    """What the struct types is exactly what the table honours or ignores there."""
    typed = set(KINDS[endpoint].__struct_fields__)
    taken = {p.name for p in BY_ENDPOINT[endpoint].values() if p.status != "refused"}
    assert typed == taken
    assert len({p.name for p in PARAMS}) == len(PARAMS)  # one row per parameter
