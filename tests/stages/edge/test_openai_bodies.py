"""The answers' shapes: the SDK's finish reasons only, a choice per run by index, usage summed."""

import pytest

from schemas.events import Usage
from stages.edge.openai_bodies import Choice, chat_chunk, full_response, total_usage


def test_only_the_sdks_finish_reasons():
    with pytest.raises(AssertionError):
        Choice(index=0, text="x", finish_reason="cancelled")


def test_response_bodies_follow_openai_shapes():
    usage = Usage(prompt_tokens=4, completion_tokens=2, cached_tokens=1)
    body = full_response(True, "r1", 10, "m", [Choice(index=0, text="hello", finish_reason="stop")],
                         usage)  # fmt: skip
    assert body["object"] == "chat.completion"
    assert body["choices"] == [
        {
            "index": 0,
            "logprobs": None,
            "finish_reason": "stop",
            "message": {"role": "assistant", "content": "hello"},
        }
    ]
    assert body["usage"]["total_tokens"] == 6
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 1}
    two = [Choice(index=1, text="b", finish_reason="length"),
           Choice(index=0, text="a", finish_reason="stop")]  # fmt: skip
    text = full_response(False, "r1", 10, "m", two, total_usage([usage, usage]))
    assert text["object"] == "text_completion"
    assert [(c["index"], c["text"]) for c in text["choices"]] == [(0, "a"), (1, "b")]
    assert text["usage"]["total_tokens"] == 12
    shared = total_usage([usage, usage, usage], [0, 0, 1])  # n = 2 for prompt 0: counted once
    assert (shared.prompt_tokens, shared.completion_tokens, shared.cached_tokens) == (8, 6, 2)
    chunk = chat_chunk("r1", 10, "m", {"content": "he"}, None, index=3)
    assert chunk["id"] == "chatcmpl-r1" and chunk["choices"][0]["delta"] == {"content": "he"}
    assert chunk["choices"][0]["index"] == 3
