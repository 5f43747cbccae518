"""The OpenAI API's parameters through the real pipeline (every stage, the real model, a real
nats-server), driven by the official `openai` SDK and langchain-openai: tool calls, logit_bias,
echo with logprobs and prompt lists."""

from __future__ import annotations

import json

import anyio
import httpx
import openai
import pytest

from tests.stages.edge_harness import ACME_KEY, MODEL
from tests.stages.pipeline_harness import acme_pipeline

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def anyio_backend():
    return "asyncio", {"use_uvloop": True}


@pytest.fixture(scope="module")
async def pipeline(tmp_path_factory):
    async with acme_pipeline(tmp_path_factory.mktemp("openai")) as running:
        yield running


def _client(edge) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{edge.url}/v1", api_key=ACME_KEY, max_retries=0)


MULTIPLY = {
    "type": "function",
    "function": {
        "name": "multiply",
        "description": "Multiply two integers a and b.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}},
            "required": ["city"],
        },
    },
}
ASK_MUL = [{"role": "user", "content": "What is 6 times 7?"}]


def _calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


async def test_tool_calls_through_the_sdk_whole_and_streamed(pipeline):
    """A named function and "required": the arguments always parse and follow the schema, the
    answer is finish_reason tool_calls with content null; streamed, the deltas (id, type and
    name first, then argument pieces) add up to the whole answer's calls; a tool result in the
    history is answered."""
    edge, _ = pipeline
    client = _client(edge)
    args = {"model": MODEL, "messages": ASK_MUL, "max_tokens": 60, "temperature": 0.0,
            "tools": [MULTIPLY, WEATHER]}  # fmt: skip
    named = {"type": "function", "function": {"name": "multiply"}}
    whole = await client.chat.completions.create(
        **args, tool_choice=named, parallel_tool_calls=False
    )
    choice = whole.choices[0]
    assert (choice.finish_reason, choice.message.content) == ("tool_calls", None)
    calls = _calls(choice.message)
    assert len(calls) == 1 and calls[0][0] == "multiply"
    assert all(set(a) == {"a", "b"} and all(isinstance(v, int) for v in a.values())
               for _, a in calls)  # fmt: skip
    assert choice.message.tool_calls[0].id.startswith("call_")

    stream = await client.chat.completions.create(
        **args, tool_choice=named, parallel_tool_calls=False, stream=True
    )
    pieces: dict[int, dict] = {}
    reasons = []
    async for chunk in stream:
        for c in chunk.choices:
            reasons.append(c.finish_reason)
            for part in c.delta.tool_calls or []:
                got = pieces.setdefault(part.index, {"id": part.id, "name": None, "args": []})
                if part.function.name:
                    got["name"] = part.function.name
                got["args"].append(part.function.arguments or "")
    assert [(p["name"], json.loads("".join(p["args"]))) for p in pieces.values()] == calls
    assert all(len(p["args"]) >= 2 for p in pieces.values())  # arguments arrive in pieces
    assert reasons[-1] == "tool_calls"

    several = await client.chat.completions.create(**{**args, "max_tokens": 40},
                                                   tool_choice="required")  # fmt: skip
    assert several.choices[0].message.tool_calls  # one or more (40 tokens may cut the last)
    assert all(name in ("multiply", "weather") for name, _ in _calls(several.choices[0].message))
    auto = await client.chat.completions.create(**args)  # auto: text or calls, whichever
    message = auto.choices[0].message
    assert message.tool_calls or message.content

    call = choice.message.tool_calls[0]
    history = [*ASK_MUL, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": "42"}]  # fmt: skip
    answer = await client.chat.completions.create(
        model=MODEL, messages=history, tools=[MULTIPLY], tool_choice="none", max_tokens=12,
        temperature=0.0,
    )  # fmt: skip
    assert answer.choices[0].message.content and answer.choices[0].message.tool_calls is None
    auth = {"Authorization": f"Bearer {ACME_KEY}"}
    async with httpx.AsyncClient(base_url=edge.url, headers=auth) as http:
        counted = await http.post(
            "/tokenize", json={"messages": ASK_MUL, "tools": [MULTIPLY, WEATHER]}
        )
        history_count = await http.post("/tokenize", json={"messages": history})
    assert counted.json()["count"] == whole.usage.prompt_tokens  # the prompt the engine got
    assert history_count.json()["count"] == answer.usage.prompt_tokens


async def test_langchain_bind_tools_and_with_structured_output(pipeline):
    """langchain-openai's ChatOpenAI, unmodified, against the edge: bind_tools (a named tool and
    auto) and with_structured_output by json_schema, json_mode and function_calling."""
    from langchain_core.messages import HumanMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    edge, _ = pipeline

    @tool
    def multiply(a: int, b: int) -> int:
        """Multiply two integers a and b."""
        return a * b

    class City(BaseModel):
        """A city and its country."""

        name: str = Field(max_length=20)
        country: str = Field(max_length=20)

    llm = ChatOpenAI(
        model=MODEL, base_url=f"{edge.url}/v1", api_key=ACME_KEY, temperature=0, max_tokens=48,
        max_retries=0,
    )  # fmt: skip
    question = [HumanMessage("What is 6 times 7? Use the tool.")]
    named = llm.bind_tools([multiply], tool_choice="multiply", parallel_tool_calls=False)
    called = await named.ainvoke(question)
    assert called.tool_calls and called.tool_calls[0]["name"] == "multiply"
    assert set(called.tool_calls[0]["args"]) == {"a", "b"}
    assert multiply.invoke(called.tool_calls[0]["args"]) == (
        called.tool_calls[0]["args"]["a"] * called.tool_calls[0]["args"]["b"])  # fmt: skip
    free = await llm.bind_tools([multiply], max_tokens=16).ainvoke(question)
    assert free.tool_calls or free.content
    streamed = None
    required = llm.bind_tools([multiply], tool_choice="any", parallel_tool_calls=False)
    async for piece in required.astream(question):
        streamed = piece if streamed is None else streamed + piece
    assert streamed.tool_calls and streamed.tool_calls[0]["name"] == "multiply"

    ask = "Name a city in France as JSON with keys name and country."
    for method in ("json_schema", "function_calling"):
        city = await llm.with_structured_output(City, method=method).ainvoke(ask)
        assert isinstance(city, City), method
    anyjson = await llm.with_structured_output(method="json_mode").ainvoke(ask)
    assert isinstance(anyjson, dict)


async def test_logit_bias_forces_and_bans_through_every_stage(pipeline):
    """+100 on " blue" makes it every greedy token; -100 on the greedy answer's tokens bans
    them; an id past the served vocabulary is a 400 naming it."""
    edge, _ = pipeline
    client = _client(edge)
    auth = {"Authorization": f"Bearer {ACME_KEY}"}
    async with httpx.AsyncClient(base_url=edge.url, headers=auth) as http:
        (blue,) = (await http.post("/tokenize", json={"prompt": " blue"})).json()["tokens"]
        args = {"model": MODEL, "prompt": "The sky is", "max_tokens": 3, "temperature": 0}
        forced = await client.completions.create(**args, logit_bias={str(blue): 100})
        assert forced.choices[0].text == " blue" * 3
        free = await client.completions.create(**args, logprobs=1)
        ids = (await http.post("/tokenize", json={"prompt": free.choices[0].text})).json()
    ban = {str(t): -100 for t in ids["tokens"]}
    banned = await client.completions.create(**args, logprobs=1, logit_bias=ban)
    assert not set(banned.choices[0].logprobs.tokens) & set(free.choices[0].logprobs.tokens)
    assert banned.choices[0].text != free.choices[0].text
    with pytest.raises(openai.BadRequestError) as info:
        await client.completions.create(**args, logit_bias={"49152": 5})
    assert info.value.body["param"] == "logit_bias.49152"


async def test_echo_logprobs_and_prompt_lists_as_lm_eval_reads_them(pipeline):
    """lm-evaluation-harness's loglikelihood request (echo, logprobs, max_tokens 1, prompts as
    token ids): the prompt's tokens come first, the first with a null logprob, and a token's
    logprob there is the one the model gives it as a continuation; several prompts are choices
    by index, whole and streamed."""
    edge, _ = pipeline
    client = _client(edge)
    auth = {"Authorization": f"Bearer {ACME_KEY}"}
    async with httpx.AsyncClient(base_url=edge.url, headers=auth) as http:
        context = (await http.post("/tokenize", json={"prompt": "The sky is"})).json()["tokens"]
        (blue,) = (await http.post("/tokenize", json={"prompt": " blue"})).json()["tokens"]
    args = {"model": MODEL, "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True}
    scored = await client.completions.create(**args, prompt=[context + [blue], context])
    assert [c.index for c in scored.choices] == [0, 1]
    full, short = (c.logprobs for c in scored.choices)
    assert full.tokens[:4] == ["The", " sky", " is", " blue"] and len(full.tokens) == 5
    assert full.token_logprobs[0] is None and full.top_logprobs[0] is None
    assert all(lp <= 0 for lp in full.token_logprobs[1:])
    assert scored.choices[0].text.startswith("The sky is blue")
    assert short.token_logprobs[:3] == pytest.approx(full.token_logprobs[:3], abs=1e-4)
    forced = await client.completions.create(
        model=MODEL, prompt=context, max_tokens=1, temperature=0, logprobs=1,
        logit_bias={str(blue): 100},
    )  # fmt: skip
    assert forced.choices[0].logprobs.tokens == [" blue"]
    assert forced.choices[0].logprobs.token_logprobs[0] == pytest.approx(
        full.token_logprobs[3], abs=1e-4)  # fmt: skip
    assert scored.usage.prompt_tokens == 2 * len(context) + 1
    tokens, logprobs, text = [], [], ""
    async for chunk in await client.completions.create(
        **args, prompt=context + [blue], stream=True
    ):
        for c in chunk.choices:
            text += c.text
            if c.logprobs is not None:
                tokens += c.logprobs.tokens
                logprobs += c.logprobs.token_logprobs
    assert (tokens, text) == (full.tokens, scored.choices[0].text)  # streamed: the same
    assert logprobs[0] is None and logprobs[1:] == pytest.approx(full.token_logprobs[1:], abs=1e-4)

    prompts = ["The sky is", "1, 2, 3,"]
    whole = await client.completions.create(model=MODEL, prompt=prompts, max_tokens=4, temperature=0,
                                            echo=True)  # fmt: skip
    texts = {c.index: c.text for c in whole.choices}
    assert texts[0].startswith(prompts[0]) and texts[1].startswith(prompts[1])
    streamed: dict[int, str] = {0: "", 1: ""}
    async for chunk in await client.completions.create(
        model=MODEL, prompt=prompts, max_tokens=4, temperature=0, echo=True, stream=True
    ):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == texts
    with pytest.raises(openai.BadRequestError) as info:  # refused before any run starts
        await client.completions.create(model=MODEL, prompt=["fine", ""], max_tokens=2)
    assert info.value.body["param"] == "prompt"


async def test_n_and_best_of_through_every_stage(pipeline):
    """n = 3 choices, each the text its seed gives alone (seed + j); streamed, each index's
    chunks add up to its whole choice; best_of answers the candidate of highest cumulative
    logprob."""
    edge, _ = pipeline
    client = _client(edge)
    args = {"model": MODEL, "messages": ASK_MUL, "max_tokens": 6, "temperature": 1.0, "seed": 11}
    three = await client.chat.completions.create(**args, n=3)
    assert [c.index for c in three.choices] == [0, 1, 2]
    texts = [c.message.content for c in three.choices]
    alone = await client.chat.completions.create(**{**args, "seed": 12})
    assert alone.choices[0].message.content == texts[1]
    assert three.usage.prompt_tokens == alone.usage.prompt_tokens  # the prompt counts once
    assert alone.usage.completion_tokens < three.usage.completion_tokens <= 18
    streamed = {0: "", 1: "", 2: ""}
    async for chunk in await client.chat.completions.create(**args, n=3, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
    assert [streamed[i] for i in range(3)] == texts

    plain = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4, "temperature": 1.0,
             "seed": 5, "extra_body": {"ignore_eos": True}}  # fmt: skip
    candidates = await client.completions.create(**plain, n=3, logprobs=0)
    scores = [sum(c.logprobs.token_logprobs) for c in candidates.choices]
    best = await client.completions.create(**plain, n=1, best_of=3)
    assert len(best.choices) == 1 and best.choices[0].index == 0
    assert best.choices[0].text == candidates.choices[scores.index(max(scores))].text
    assert best.choices[0].logprobs is None  # not asked for: used only to rank


def _engine_steps(samples: dict[str, float]) -> tuple[float, float]:
    """(steps, tokens) of MODEL's iteration_tokens_total, summed over its engine workers."""

    def total(kind: str) -> float:
        name = f"brigade:iteration_tokens_total_{kind}{{"
        return sum(v for k, v in samples.items()
                   if k.startswith(name) and f'model_name="{MODEL}"' in k)  # fmt: skip

    return total("count"), total("sum")


async def test_cached_tokens_forks_and_the_prefix_cache_metrics(pipeline):
    """A prompt sent twice: the second answer's usage counts the prefix cache's tokens; n = 2:
    the second run's prompt K/V are the first's (its run record counts them cached); the
    metrics count the lookups and hits."""
    edge, _ = pipeline
    client = _client(edge)
    long = [{"role": "user", "content": "Describe the sea. " * 30}]
    args = {"model": MODEL, "messages": long, "max_tokens": 2, "temperature": 0}
    first = await client.chat.completions.create(**args)
    again = await client.chat.completions.create(**args)
    before = first.usage.prompt_tokens_details.cached_tokens  # the template's framing, at most
    assert before <= 16
    assert again.usage.prompt_tokens_details.cached_tokens >= again.usage.prompt_tokens - 16
    fresh = [{"role": "user", "content": "Describe the mountains. " * 30}]
    pair = await client.chat.completions.create(**{**args, "messages": fresh}, n=2)
    rid = pair.id.removeprefix("chatcmpl-")
    auth = {"Authorization": f"Bearer {ACME_KEY}"}
    async with httpx.AsyncClient(base_url=edge.url, headers=auth) as http:
        runs = [(await http.get(f"/v1/runs/{rid}-{i}")).json() for i in (0, 1)]
        text = (await http.get("/metrics")).text
    cached = [run["usage"]["prompt_tokens_details"]["cached_tokens"] for run in runs]
    assert cached[0] <= 16  # the first computes the prompt (but the template's framing) ...
    assert cached[1] >= pair.usage.prompt_tokens - 16  # ... once: the second shares its blocks
    samples = {line.split(" ")[0]: float(line.split(" ")[1])
               for line in text.splitlines() if line and not line.startswith("#")}  # fmt: skip
    hits = samples[f'brigade:prefix_cache_hits_total{{model_name="{MODEL}"}}']
    queries = samples[f'brigade:prefix_cache_queries_total{{model_name="{MODEL}"}}']
    assert 0 < hits < queries
    assert f'brigade:num_preemptions_total{{model_name="{MODEL}"}}' in samples
    # the engine's own step histogram, from its heartbeat (one series per engine worker): the
    # beat after these runs may be a second away
    with anyio.fail_after(10):
        while True:
            steps, step_tokens = _engine_steps(samples)
            if steps >= 4:
                break
            await anyio.sleep(0.25)
            async with httpx.AsyncClient(base_url=edge.url, headers=auth) as http:
                text = (await http.get("/metrics")).text
            samples = {line.split(" ")[0]: float(line.split(" ")[1])
                       for line in text.splitlines() if line and not line.startswith("#")}  # fmt: skip
    assert step_tokens >= steps  # the prefills counted whole, decodes as 1+
