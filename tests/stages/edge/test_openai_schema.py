"""OpenAI bodies -> submits and back: every parameter honoured, refused by name or ignored; a
fuzzer sends every parameter wrong types and out-of-range values and expects a 400 naming it,
never another exception; response bodies keep the SDK's shapes and finish reasons."""

import msgspec
import pytest

from schemas.events import RunCancelled, RunCompleted
from stages import gateway
from stages.edge.errors import RequestError
from stages.edge.openai_params import BY_ENDPOINT, CHAT, COMPLETIONS, PARAMS
from stages.edge.openai_schema import (
    ChatCompletionRequest,
    CompletionRequest,
    decode_body,
    finish_reason,
    to_submit,
    to_submits,
)
from stages.runtime.failures import StageError

KINDS = {CHAT: ChatCompletionRequest, COMPLETIONS: CompletionRequest}
BASE = {
    CHAT: {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    COMPLETIONS: {"model": "m", "prompt": "Once"},
}


def _edge_path(endpoint: str, body: dict) -> object:
    """What the edge does with a body before it submits (routes + Edge.open_run's checks)."""
    req = decode_body(msgspec.json.encode(body), KINDS[endpoint])
    submits = to_submits(req, request_id="r1")
    for submit in submits:
        try:
            gateway.normalize(submit, limit_chars=10**6)
        except StageError as err:
            raise RequestError("invalid_request", err.message, err.field) from None
    return submits[0]


def _chat(**fields) -> ChatCompletionRequest:
    return decode_body(msgspec.json.encode({**BASE[CHAT], **fields}), ChatCompletionRequest)


def test_chat_body_maps_to_submit():
    req = _chat(
        messages=[
            {"role": "developer", "content": "be brief"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                "name": None,
            },
            {"role": "assistant", "content": "ok", "tool_calls": []},
        ],
        temperature=0.0,
        max_completion_tokens=7,
        stop="\n",
        seed=3,
        top_k=5,
        logprobs=True,
        top_logprobs=4,
        user="someone",
        n=1,
        tools=[],
        tool_choice="none",
        response_format={"type": "text"},
    )
    submit = to_submit(req, request_id="r1", api_key="k")
    assert [(m.role, m.content) for m in submit.messages] == [
        ("system", "be brief"),
        ("user", "ab"),
        ("assistant", "ok"),
    ]
    assert (submit.temperature, submit.max_tokens, submit.stop, submit.seed, submit.top_k) == (
        0.0,
        7,
        ["\n"],
        3,
        5,
    )
    assert submit.logprobs == 4
    assert (submit.request_id, submit.api_key, submit.model) == ("r1", "k", "m")
    assert to_submit(_chat(logprobs=True)).logprobs == 0  # the sampled token's logprob only
    assert to_submit(_chat(logprobs=False)).logprobs is None
    assert to_submit(_chat(top_k=-1)).top_k is None  # vLLM's "off"


def test_prompts_as_strings_ids_and_id_lists_are_a_submit_each():
    def submits(prompt, **fields):
        body = {"model": "m", "prompt": prompt, **fields}
        req = decode_body(msgspec.json.encode(body), CompletionRequest)
        return to_submits(req, request_id="r1", idempotency_key="k")

    (one,) = submits("Once")
    assert (one.prompt, one.prompt_token_ids, one.request_id, one.idempotency_key) == (
        "Once", None, "r1", "k")  # fmt: skip
    (ids,) = submits([5, 6, 7])
    assert (ids.prompt, ids.prompt_token_ids) == (None, [5, 6, 7])
    many = submits(["a", "b"], logprobs=2, echo=True)
    assert [(s.prompt, s.request_id, s.idempotency_key) for s in many] == [
        ("a", "r1-0", "k#0"), ("b", "r1-1", "k#1")]  # fmt: skip
    assert [(s.logprobs, s.prompt_logprobs) for s in many] == [(2, 2), (2, 2)]
    lists = submits([[1, 2], [3]])
    assert [s.prompt_token_ids for s in lists] == [[1, 2], [3]]
    assert submits("x", echo=True)[0].prompt_logprobs is None  # echo without logprobs: text only


def test_n_and_best_of_are_runs_that_fork_their_prompts_first():
    def submits(**fields):
        body = {"model": "m", "prompt": ["a", "b"], **fields}
        req = decode_body(msgspec.json.encode(body), CompletionRequest)
        return to_submits(req, request_id="r1")

    runs = submits(n=2, seed=7)
    assert [(s.prompt, s.request_id, s.fork_of, s.seed) for s in runs] == [
        ("a", "r1-0", None, 7), ("a", "r1-1", "r1-0", 8),
        ("b", "r1-2", None, 7), ("b", "r1-3", "r1-2", 8),
    ]  # fmt: skip
    assert all(s.logprobs is None for s in runs)
    best = submits(n=1, best_of=3)
    assert [s.fork_of for s in best] == [None, "r1-0", "r1-0", None, "r1-3", "r1-3"]
    assert all(s.logprobs == 0 for s in best)  # the sampled tokens' logprobs rank them
    chat = to_submits(_chat(n=3), request_id="c")
    assert [(s.request_id, s.fork_of) for s in chat] == [
        ("c-0", None),
        ("c-1", "c-0"),
        ("c-2", "c-0"),
    ]
    for fields, param in (({"n": 3, "best_of": 2}, "best_of"),
                          ({"best_of": 2, "stream": True}, "best_of"),
                          ({"n": 16, "prompt": ["a"] * 9}, "prompt")):  # fmt: skip
        with pytest.raises(RequestError) as info:
            decode_body(
                msgspec.json.encode({"model": "m", "prompt": "x", **fields}), CompletionRequest
            )
        assert info.value.field == param


def test_completion_defaults_and_logprobs():
    req = decode_body(b'{"model": "m", "prompt": ["Once"], "logprobs": 3}', CompletionRequest)
    submit = to_submit(req)
    assert (submit.prompt, submit.max_tokens, submit.messages, submit.logprobs) == (
        "Once",
        16,  # OpenAI's default for completions
        None,
        3,
    )


# Every parameter of the table, with values it must refuse (wrong types, out of range, or not
# supported): each is a 400 whose `param` is the parameter (or a path inside it).
BAD: dict[str, list] = {
    "model": [1, None, [], {}],
    "messages": [
        "hi",
        [],
        [1],
        [{"role": "user"}],
        [{"role": "tool", "content": "x"}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
        [{"role": "user", "content": "x", "name": "bob"}],
        [{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}],
        [{"role": "user", "content": "x", "extra": 1}],
        None,
    ],  # fmt: skip
    "prompt": [
        1,
        [],
        None,
        "",
        [[]],
        [-1],
        [2**20],
        [1.5],
        ["a", 1],
        [[1, "x"]],
        [True],
        [["a"]],
        ["x"] * 129,
        ["a", ""],
        {"a": 1},
    ],  # fmt: skip
    "max_tokens": ["x", 0, -1, 8193, 1.5, True, 10**30],
    "max_completion_tokens": ["x", 0, 8193, 1.5],
    "temperature": ["x", -0.1, 2.1, True, []],
    "top_p": [0, 1.1, "x", -1],
    "n": [17, 0, "x", True, 1.5, -1],
    "stream": ["yes", 1, {}],
    "stream_options": ["x", {"include_usage": "x"}, {"bogus": True}, {"include_usage": True}],
    "stop": [1, [1], [""], ["x"] * 17, ["x" * 257], {}],
    "presence_penalty": [3, -3, "x"],
    "frequency_penalty": [2.5, -2.5, []],
    "seed": [-1, "x", 1.5, 2**64],
    "logprobs": {CHAT: ["x", 1, 2], COMPLETIONS: [6, -1, True, "x", 1.5]},
    "top_logprobs": [21, -1, "x", 5],  # 5 without logprobs: true
    "best_of": [17, "x", 0, True],
    "echo": ["x", 1],
    "suffix": ["x", 1],
    "logit_bias": [
        {"x": 5},
        {"-1": 5},
        {"1.5": 5},
        {"1": 101},
        {"1": -100.5},
        {"1": "x"},
        {str(2**20): 1},  # past any model's vocabulary (the served one's: the tokenize stage)
        {str(i): 1 for i in range(1025)},
        "x",
        [1],
    ],
    "response_format": [
        {"type": "bogus"},
        "x",
        {"type": "json_schema", "json_schema": {"name": ""}},
        {"type": "json_schema", "json_schema": {"schema": "x"}},
    ],  # fmt: skip
    "tools": [
        [{"type": "function", "function": {"name": "bad name"}}],
        [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}],
        [{"type": "function", "function": {"name": "f", "parameters": "x"}}],
        [{"type": "function", "function": {"name": "f"}}] * 2,
        [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)],
        [{"function": {"name": "f"}}],
        [{"type": "function", "function": {"name": "f", "bogus": 1}}],
        "x",
        {},
    ],
    "tool_choice": [
        "required",  # without tools
        "sometimes",
        {"type": "function"},
        {"type": "function", "function": {"name": "f"}},  # not among the tools
        1,
    ],
    "functions": [[{"name": "f"}], "x"],
    "function_call": ["auto", {"name": "f"}],
    "parallel_tool_calls": ["x", 1],
    "user": [1, [], {}],
    "metadata": ["x", {"a": 1}, [1]],
    "store": [True, "x"],
    "service_tier": ["flex", "priority", 1],
    "modalities": [["audio"], ["text", "audio"], "x"],
    "audio": [{"voice": "alloy", "format": "wav"}, "x"],
    "prediction": [{"type": "content", "content": "x"}],
    "reasoning_effort": ["low", "high"],
    "web_search_options": [{}, "x"],
    "top_k": ["x", -2, 1.5],
    "min_p": [1.5, -0.1, "x"],
    "min_tokens": [-1, 9000, "x", 300],  # 300 > max_tokens (the default 256 / 16)
    "repetition_penalty": [0, 2.5, "x"],
    "ignore_eos": ["x", 1],
    "stop_token_ids": ["x", [-1], [1] * 65, ["a"]],
    "skip_special_tokens": [False, "x"],
    "include_stop_str_in_output": [True],
    "add_generation_prompt": [False],
    "continue_final_message": [True],
    "chat_template": ["{{ messages }}"],
    "chat_template_kwargs": [{"enable_thinking": False}],
    "prompt_logprobs": [1, 0],
    "use_beam_search": [True],
    "guided_json": [1, ["x"], True],
    "guided_regex": ["", 1, ["a"]],
    "guided_choice": [[], "x", [""], [1]],
    "guided_grammar": ["", 1, {}],
    "retrieval": [
        "x",
        {},
        {"collections": []},
        {"collections": ["a b"]},
        {"collections": ["docs"], "top_k": 0},
        {"collections": ["docs"], "over_retrieve": 17},
        {"collections": ["docs"], "bogus": 1},
        {"collections": ["x"] * 9},
    ],
    "deadline_s": [0, -1, 86_401, "x", [1]],
}
GENERIC = [None, True, False, 0, -1, 1, 1.5, 10**20, "", "x", [], [1], ["x"], {}, {"a": 1}]


def _cases():
    for endpoint, table in BY_ENDPOINT.items():
        for name in table:
            values = BAD[name]
            if isinstance(values, dict):
                values = values[endpoint]
            for value in values:
                yield endpoint, name, value


def _names_it(field: str | None, name: str) -> bool:
    return field is not None and (field == name or field.startswith((f"{name}[", f"{name}.")))


def test_every_parameter_has_bad_values():
    assert set(BAD) == {p.name for p in PARAMS}


@pytest.mark.parametrize(("endpoint", "name", "value"), list(_cases()))
def test_a_bad_value_is_a_400_naming_its_parameter(endpoint, name, value):
    with pytest.raises(RequestError) as info:
        _edge_path(endpoint, {**BASE[endpoint], name: value})
    assert info.value.status == 400, info.value.message
    assert _names_it(info.value.field, name), (info.value.field, info.value.message)


@pytest.mark.parametrize("endpoint", [CHAT, COMPLETIONS])
def test_any_value_of_any_parameter_is_taken_or_a_400_naming_it(endpoint):
    """Never a 500: every parameter with every JSON type is either taken or named."""
    for name in BY_ENDPOINT[endpoint]:
        for value in GENERIC:
            try:
                _edge_path(endpoint, {**BASE[endpoint], name: value})
            except RequestError as err:
                assert err.status == 400, (name, value, err.message)
                assert _names_it(err.field, name), (name, value, err.field, err.message)


@pytest.mark.parametrize("endpoint", [CHAT, COMPLETIONS])
def test_unknown_and_missing_parameters_are_named(endpoint):
    with pytest.raises(RequestError) as info:
        _edge_path(endpoint, {**BASE[endpoint], "frobnicate": 1})
    assert (info.value.code, info.value.field) == ("unknown_parameter", "frobnicate")
    assert "docs/api.md" in info.value.message
    other = "prompt" if endpoint == CHAT else "messages"
    with pytest.raises(RequestError) as info:
        _edge_path(endpoint, {**BASE[endpoint], other: "x"})
    assert info.value.field == other and "belongs to" in info.value.message
    for required in BASE[endpoint]:
        body = {k: v for k, v in BASE[endpoint].items() if k != required}
        with pytest.raises(RequestError) as info:
            _edge_path(endpoint, body)
        assert info.value.field == required
        assert info.value.message == f"missing required parameter `{required}`"


def test_refusals_say_why_and_what_is_allowed():
    with pytest.raises(RequestError) as info:
        _chat(functions=[{"name": "f"}])
    assert (info.value.code, info.value.field) == ("unsupported_parameter", "functions")
    assert "use tools" in info.value.message and "allowed: null or []" in info.value.message
    with pytest.raises(RequestError) as info:
        _chat(messages=[{"role": "function", "content": "42", "name": "f"}])
    assert info.value.field == "messages[0].role"
    assert "tool` message" in info.value.message
    with pytest.raises(RequestError) as info:
        _chat(logprobs=True, top_logprobs=21)
    assert info.value.field == "top_logprobs" and "<= 20" in info.value.message


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (b"[1, 2]", None),
        (b"{not json", None),
        (b'"text"', None),
    ],
)
def test_bodies_that_are_not_objects(body, field):
    with pytest.raises(RequestError) as info:
        decode_body(body, ChatCompletionRequest)
    assert (info.value.status, info.value.field) == (400, field)


def test_finish_reason_takes_only_the_sdks_values():
    done = RunCompleted(request_id="r", finish_reason="length")
    assert finish_reason(done) == "length"
    assert finish_reason(RunCancelled(request_id="r", reason="timeout")) == "stop"
