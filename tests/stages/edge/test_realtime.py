"""The websocket's `response.create`: Brigade's submit fields, identity from the edge, and no
field taken without effect (logprobs are served on the HTTP routes only)."""

import pytest

from stages.edge.errors import RequestError
from stages.edge.realtime import ResponseCreate, submit_of


def test_response_create_is_a_submit():
    submit = submit_of(
        ResponseCreate(response={"prompt": "x", "max_tokens": 3, "logprobs": None}),
        request_id="r1",
    )
    assert (submit.prompt, submit.max_tokens, submit.request_id, submit.logprobs) == (
        "x", 3, "r1", None)  # fmt: skip
    ids = submit_of(ResponseCreate(response={"prompt_token_ids": [5, 6], "logit_bias": {"5": 1}}))
    assert (ids.prompt_token_ids, ids.logit_bias) == ([5, 6], {5: 1.0})


@pytest.mark.parametrize(
    ("response", "field", "code"),
    [
        ({"prompt": "x", "logprobs": 2}, "response.logprobs", "unsupported_parameter"),
        ({"prompt": "x", "api_key": "k"}, "response.api_key", "invalid_request"),
        ({"prompt": "x", "priority": "batch"}, "response.priority", "invalid_request"),
        ({"prompt": "x", "top_p": 7}, "top_p", "invalid_request"),
        (
            {"prompt": "x", "prompt_logprobs": 1},
            "response.prompt_logprobs",
            "unsupported_parameter",
        ),
        ({"prompt": "x", "prompt_token_ids": [5]}, "messages", "invalid_request"),
    ],
)
def test_refused_fields_are_named(response, field, code):
    with pytest.raises(RequestError) as info:
        submit_of(ResponseCreate(response=response))
    assert (info.value.field, info.value.code, info.value.status) == (field, code, 400)
