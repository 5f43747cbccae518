import msgspec
import pytest

from schemas.events import Usage
from stages.edge.errors import RequestError
from stages.edge.openai_schema import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_chunk,
    decode_body,
    full_response,
    to_submit,
)


def _chat(**fields) -> ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return decode_body(msgspec.json.encode(body), ChatCompletionRequest)


def test_chat_body_maps_to_submit():
    req = _chat(
        messages=[
            {"role": "developer", "content": "be brief"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
        ],
        temperature=0.0,
        max_completion_tokens=7,
        stop="\n",
        seed=3,
        top_k=5,
        unknown_openai_field={"ignored": True},
    )
    submit = to_submit(req, request_id="r1", api_key="k")
    assert [(m.role, m.content) for m in submit.messages] == [
        ("system", "be brief"),
        ("user", "ab"),
    ]
    assert (submit.temperature, submit.max_tokens, submit.stop, submit.seed, submit.top_k) == (
        0.0,
        7,
        ["\n"],
        3,
        5,
    )
    assert (submit.request_id, submit.api_key, submit.model) == ("r1", "k", "m")


def test_completion_default_max_tokens_is_openais_16():
    req = decode_body(b'{"model": "m", "prompt": "Once"}', CompletionRequest)
    submit = to_submit(req)
    assert (submit.prompt, submit.max_tokens, submit.messages) == ("Once", 16, None)


@pytest.mark.parametrize(
    ("body", "field", "code"),
    [
        (b'{"model": "m", "messages": [], "top_p": 0.5}', "messages", "invalid_request"),
        (
            b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "top_p": 7}',
            "top_p",
            "invalid_request",
        ),
        (
            b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 2}',
            "n",
            "invalid_request",
        ),
        (
            b'{"model": "m", "messages": [{"role": "tool", "content": "x"}]}',
            "messages",
            "invalid_request",
        ),
        (b'{"model": "m", "messages": "hi"}', "messages", "invalid_request"),
        (b'{"messages": [{"role": "user", "content": "x"}]}', None, "invalid_request"),
        (b"{not json", None, "invalid_request"),
    ],
)
def test_bad_chat_bodies_name_the_field(body, field, code):
    with pytest.raises(RequestError) as info:
        to_submit(decode_body(body, ChatCompletionRequest))
    assert info.value.code == code
    assert info.value.field == field
    assert info.value.status == 400


def test_completion_refuses_lists_and_echo():
    with pytest.raises(RequestError, match="list of 2") as info:
        to_submit(decode_body(b'{"model": "m", "prompt": ["a", "b"]}', CompletionRequest))
    assert info.value.field == "prompt"
    with pytest.raises(RequestError) as info:
        to_submit(decode_body(b'{"model": "m", "prompt": "a", "echo": true}', CompletionRequest))
    assert info.value.field == "echo"


def test_response_bodies_follow_openai_shapes():
    usage = Usage(prompt_tokens=4, completion_tokens=2, cached_tokens=1)
    body = full_response(True, "r1", 10, "m", "hello", "stop", usage)
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
    text = full_response(False, "r1", 10, "m", "hello", "length", usage)
    assert (text["object"], text["choices"][0]["text"]) == ("text_completion", "hello")
    chunk = chat_chunk("r1", 10, "m", {"content": "he"}, None)
    assert chunk["id"] == "chatcmpl-r1" and chunk["choices"][0]["delta"] == {"content": "he"}
