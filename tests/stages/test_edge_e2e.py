"""The edge with the real pipeline behind it (every stage, the real model, a real nats-server),
driven by the official `openai` SDK, a plain `websockets` client and httpx."""

from __future__ import annotations

import json
import time
import uuid

import anyio
import httpx
import msgspec
import openai
import pytest
import websockets
from nats.js.errors import NotFoundError

from schemas import settings, subjects
from schemas.events import CancelRequested, Submit, TextGenerated, decode_event
from stages import gateway, ledger
from stages.edge.admission import AdmissionConfig
from stages.edge.keys import KeyRing
from stages.runtime.bus import Bus
from stages.tenancy import tenants
from stages.tenancy.idempotency import IdempotencyStore, request_hash
from tests.stages.edge_harness import ACME_KEY, GLOBEX_KEY, MODEL
from tests.stages.pipeline_harness import running_pipeline

pytestmark = pytest.mark.anyio
SLOW_KEY = "brg-slow-tenant-key-0000000000000"
PROMPT = [{"role": "user", "content": "Name three colors."}]
ALIAS = "gpt-4o"


@pytest.fixture(scope="module")
def anyio_backend():
    return "asyncio", {"use_uvloop": True}


@pytest.fixture(scope="module")
async def pipeline(tmp_path_factory):
    data = tmp_path_factory.mktemp("pipeline")
    path = data / "tenants.toml"
    tenants.add_key("acme", path=path, api_key=ACME_KEY)
    tenants.add_key("globex", path=path, api_key=GLOBEX_KEY)
    tenants.add_key("slow", path=path, api_key=SLOW_KEY)
    file = tenants.read_file(path)
    file.tenants["globex"] = msgspec.structs.replace(file.tenants["globex"], allowed_models=[MODEL])
    file.tenants["slow"] = msgspec.structs.replace(file.tenants["slow"], requests_per_min=1)
    tenants.write_file(path, file)
    env = {settings.TENANTS.name: str(path), settings.LEDGER_DB.name: str(data / "ledger.duckdb")}
    # a run waiting for a first token: 503, burst or not
    admission = AdmissionConfig(max_wait_s=0.001, burst_wait_s=0.001)
    keys = KeyRing(path, (MODEL,))
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        async with running_pipeline(
            data, keys, admission=admission, model_aliases=(ALIAS,)
        ) as running:
            yield running


def _client(edge, key: str = ACME_KEY) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{edge.url}/v1", api_key=key, max_retries=0)


async def test_openai_sdk_streamed_and_not_agree(pipeline):
    edge, _ = pipeline
    client = _client(edge)
    whole = await client.chat.completions.create(
        model=MODEL, messages=PROMPT, max_tokens=8, temperature=0.0
    )
    assert whole.choices[0].finish_reason == "length"
    assert (whole.usage.completion_tokens, whole.usage.total_tokens > 8) == (8, True)
    text = whole.choices[0].message.content
    assert text
    stream = await client.chat.completions.create(
        model=MODEL, messages=PROMPT, max_tokens=8, temperature=0.0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    pieces, reasons, usage = [], [], None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            reasons.append(choice.finish_reason)
    assert "".join(pieces) == text  # greedy: the same 8 tokens, in order, none twice
    assert reasons[-1] == "length" and set(reasons[:-1]) == {None}
    assert usage.completion_tokens == 8

    done = await client.completions.create(
        model=MODEL, prompt="The sky is", max_tokens=5, temperature=0
    )
    assert (done.choices[0].finish_reason, done.usage.completion_tokens) == ("length", 5)
    pieces = [c.choices[0].text async for c in await client.completions.create(
        model=MODEL, prompt="The sky is", max_tokens=5, temperature=0, stream=True)]  # fmt: skip
    assert "".join(pieces) == done.choices[0].text


async def test_logprobs_through_the_sdk_streamed_and_not(pipeline):
    """Greedy decoding: each sampled token is its own top alternative, with the same logprob;
    the tokens' bytes are the text; streamed and whole answers carry the same tokens."""
    edge, _ = pipeline
    client = _client(edge)
    args = {"model": MODEL, "messages": PROMPT, "max_tokens": 6, "temperature": 0.0}
    whole = await client.chat.completions.create(**args, logprobs=True, top_logprobs=3)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens == 6
    assert b"".join(bytes(t.bytes) for t in content).decode() == whole.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 3 and t.logprob <= 0.0
        assert t.top_logprobs[0].token == t.token
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob, abs=1e-4)
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob >= t.top_logprobs[2].logprob
    plain = await client.chat.completions.create(**args, logprobs=True)
    assert [t.top_logprobs for t in plain.choices[0].logprobs.content] == [[]] * 6
    assert (await client.chat.completions.create(**args)).choices[0].logprobs is None

    stream = await client.chat.completions.create(
        **args, logprobs=True, top_logprobs=2, stream=True
    )
    streamed = []
    async for chunk in stream:
        for choice in chunk.choices:
            if choice.logprobs is not None:
                streamed.extend(choice.logprobs.content)
    assert [t.token for t in streamed] == [t.token for t in content]
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in content], abs=1e-3)

    done = await client.completions.create(
        model=MODEL, prompt="The sky is", max_tokens=5, temperature=0, logprobs=2
    )
    legacy = done.choices[0].logprobs
    assert "".join(legacy.tokens) == done.choices[0].text
    assert len(legacy.token_logprobs) == len(legacy.top_logprobs) == len(legacy.text_offset) == 5
    assert legacy.text_offset == [sum(len(t) for t in legacy.tokens[:i]) for i in range(5)]
    for token, top in zip(legacy.tokens, legacy.top_logprobs, strict=True):
        assert token in top and len(top) == 2  # greedy: the sampled token is one of the top 2
    pieces = []
    async for chunk in await client.completions.create(
        model=MODEL, prompt="The sky is", max_tokens=5, temperature=0, logprobs=2, stream=True
    ):
        if chunk.choices[0].logprobs is not None:
            pieces.extend(chunk.choices[0].logprobs.tokens)
    assert pieces == legacy.tokens


async def test_models_aliases_and_finish_reasons(pipeline):
    """The alias is served by the served model and answered under its id; an unknown model is
    a 404; finish_reason is length, stop (a stop string) and stop for a cancelled run, whose
    state stays `cancelled` in GET /v1/runs/{id}."""
    edge, _ = pipeline
    client = _client(edge)
    listed = await client.models.list()
    assert [m.id for m in listed.data] == [MODEL, ALIAS]
    assert {m.model_extra["max_model_len"] for m in listed.data} == {8192}
    assert (await client.models.retrieve(ALIAS)).model_extra["root"] == MODEL
    reply = await client.chat.completions.create(model=ALIAS, messages=PROMPT, max_tokens=2)
    assert (reply.model, reply.choices[0].finish_reason) == (MODEL, "length")
    with pytest.raises(openai.NotFoundError) as info:
        await client.chat.completions.create(model="gpt-5", messages=PROMPT, max_tokens=2)
    assert info.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(
            model=MODEL, messages=PROMPT, tools=[{"type": "function", "function": {"name": "f"}}],
            tool_choice={"type": "function", "function": {"name": "g"}},
        )  # fmt: skip
    assert info.value.body["param"] == "tool_choice.function.name"
    stopped = await client.completions.create(
        model=MODEL, prompt="1, 2, 3, 4,", max_tokens=20, temperature=0, stop=[","]
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert "," not in stopped.choices[0].text

    stream = await client.chat.completions.create(
        model=MODEL, messages=PROMPT, max_tokens=200, stream=True
    )
    reasons, rid = [], None
    auth = {"Authorization": f"Bearer {ACME_KEY}"}
    async with websockets.connect(edge.ws_url, additional_headers=auth) as ws:
        async for chunk in stream:
            if rid is None:
                rid = chunk.id.removeprefix("chatcmpl-")
                await ws.send(json.dumps({"type": "response.cancel", "request_id": rid}))
            reasons.extend(c.finish_reason for c in chunk.choices if c.finish_reason)
    assert reasons == ["stop"]
    async with httpx.AsyncClient(base_url=edge.url, headers=auth) as http:
        deadline = time.monotonic() + 10
        while (run := (await http.get(f"/v1/runs/{rid}")).json())["state"] != "billed":
            assert time.monotonic() < deadline, run
            await anyio.sleep(0.05)
        assert run["finish_reason"] == "cancelled"
        assert run["usage"]["completion_tokens"] < 200
        health = await http.get("/health")
        assert (health.status_code, health.json()["status"]) == (200, "ok")
        stages = health.json()["stages"]  # every stage's workers beat, the engine its KV room
        assert all(stages[name]["ready"] >= 1 for name in ("gateway", "engine", "ledger"))
        (engine,) = health.json()["engine"]
        assert engine["model_loaded"]
        assert 0 < engine["num_free_blocks"] <= engine["num_total_blocks"]
        tokens = (await http.post("/tokenize", json={"model": ALIAS, "messages": PROMPT})).json()
        assert tokens["count"] == len(tokens["tokens"]) > 5


async def test_websocket_stream_resume_and_run_state(pipeline):
    edge, _ = pipeline
    auth = {"Authorization": f"Bearer {ACME_KEY}"}
    async with websockets.connect(edge.ws_url, additional_headers=auth) as ws:
        await ws.send(json.dumps({"type": "response.create", "response": {
            "messages": PROMPT, "max_tokens": 6, "temperature": 0}}))  # fmt: skip
        created = json.loads(await ws.recv())
        assert created["type"] == "response.created"
        rid = created["request_id"]
        deltas, done = [], None
        while done is None:
            event = json.loads(await ws.recv())
            assert event["type"] != "error", event
            if event["type"] == "response.output_text.delta":
                deltas.append(event)
            else:
                done = event
    seqs = [d["seq"] for d in deltas]
    assert seqs == list(range(len(seqs)))  # in order, no gap, none twice
    assert (done["status"], done["finish_reason"], done["usage"]["completion_tokens"]) == (
        "incomplete", "length", 6)  # fmt: skip
    assert done["last_seq"] == seqs[-1]
    text = "".join(d["text"] for d in deltas)

    resume_url = f"{edge.ws_url}?request_id={rid}&starting_after=2"  # reconnect and resume
    async with websockets.connect(resume_url, additional_headers=auth) as ws:
        assert json.loads(await ws.recv())["type"] == "response.created"
        rest = []
        while (event := json.loads(await ws.recv()))["type"] == "response.output_text.delta":
            rest.append(event)
        assert [d["seq"] for d in rest] == seqs[3:]
        assert "".join(d["text"] for d in deltas[:3] + rest) == text
        assert event["status"] == "incomplete"

    async with httpx.AsyncClient(base_url=edge.url, headers=auth) as http:
        r = await http.get(f"/v1/runs/{rid}/stream", params={"starting_after": 4})
        lines = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert lines[-1] == "[DONE]"
        events = [json.loads(x) for x in lines[:-1]]
        assert [e["seq"] for e in events if "seq" in e] == seqs[5:]
        assert events[-1]["type"] == "response.done"
        deadline = time.monotonic() + 10
        while (run := (await http.get(f"/v1/runs/{rid}")).json())["state"] != "billed":
            assert time.monotonic() < deadline, run
        assert (run["last_seq"], run["usage"]["completion_tokens"]) == (seqs[-1], 6)
        theirs = await http.get(
            f"/v1/runs/{rid}", headers={"Authorization": f"Bearer {GLOBEX_KEY}"}
        )
        assert theirs.status_code == 404


async def test_idempotency_key_runs_once(pipeline):
    edge, config = pipeline
    body = {"model": MODEL, "messages": PROMPT, "max_tokens": 4, "temperature": 0}
    headers = {"Authorization": f"Bearer {ACME_KEY}", "Idempotency-Key": "order-42"}
    async with httpx.AsyncClient(base_url=edge.url, headers=headers, timeout=60) as http:
        first = await http.post("/v1/chat/completions", json=body)
        again = await http.post("/v1/chat/completions", json=body)
        other = await http.post("/v1/chat/completions", json={**body, "max_tokens": 5})
    assert first.status_code == again.status_code == 200
    assert first.json()["id"] == again.json()["id"]
    assert first.json()["choices"] == again.json()["choices"]
    assert other.status_code == 409
    assert other.json()["error"]["param"] == "idempotency_key"
    rid = first.headers["X-Request-Id"]
    bus = await Bus.connect(config)
    try:
        info = await bus.js.stream_info(subjects.EVENTS_STREAM, subjects_filter=f"llm.ev.{rid}.>")
        counts = info.state.subjects or {}
        for event in ("accepted", "tokenized", "completed"):
            route = subjects.model_token(MODEL) if event in subjects.ROUTED_EVENTS else None
            assert counts[subjects.event_subject(rid, event, route)] == 1, event
    finally:
        await bus.close()


async def test_a_key_claimed_by_a_run_that_never_started_is_taken_over(pipeline):
    """An edge died between claiming a key and submitting: a retry 10+ s later runs the request."""
    edge, config = pipeline
    body = {"model": MODEL, "messages": PROMPT, "max_tokens": 3, "temperature": 0}
    bus = await Bus.connect(config)
    try:
        past = time.time_ns() - 20 * 10**9
        store = IdempotencyStore(await bus.kv(subjects.IDEMPOTENCY_BUCKET), clock=lambda: past)
        ghost = msgspec.convert({**body, "request_id": "ghost1"}, Submit)
        digest = request_hash(gateway.normalize(ghost, limit_chars=10**6))
        assert (await store.claim("acme", "order-ghost", digest, "ghost1")).new
        headers = {"Authorization": f"Bearer {ACME_KEY}", "Idempotency-Key": "order-ghost"}
        async with httpx.AsyncClient(base_url=edge.url, headers=headers, timeout=60) as http:
            r = await http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 3
        assert (await store.lookup("acme", "order-ghost")).request_id == r.headers["X-Request-Id"]
    finally:
        await bus.close()


async def test_a_dropped_keyed_stream_is_reattached_not_cancelled(pipeline):
    edge, config = pipeline
    client = _client(edge)
    args = {"model": MODEL, "messages": PROMPT, "max_tokens": 12, "temperature": 0.0}
    key = {"Idempotency-Key": "chat-reconnect-1"}
    stream = await client.chat.completions.create(**args, stream=True, extra_headers=key)
    got = []
    async for chunk in stream:
        got.append(chunk)
        if len(got) == 3:
            break
    await stream.close()  # the connection drops mid-run
    again = await client.chat.completions.create(**args, extra_headers=key)
    assert again.id == got[0].id  # the same run
    fresh = await client.chat.completions.create(**args)  # greedy: the same text, a new run
    assert fresh.id != again.id
    assert again.choices[0].message.content == fresh.choices[0].message.content
    assert again.usage.completion_tokens == fresh.usage.completion_tokens
    early = "".join(c.choices[0].delta.content or "" for c in got)
    assert again.choices[0].message.content.startswith(early)
    rid = again.id.removeprefix("chatcmpl-")
    bus = await Bus.connect(config)
    try:
        info = await bus.js.stream_info(subjects.EVENTS_STREAM, subjects_filter=f"llm.ev.{rid}.>")
        counts = info.state.subjects or {}
        assert counts[subjects.event_subject(rid, "accepted")] == 1
        assert counts[subjects.event_subject(rid, "completed")] == 1
        assert subjects.event_subject(rid, "cancel") not in counts
    finally:
        await bus.close()


async def test_rate_limit_and_overload_answers(pipeline):
    edge, _ = pipeline
    slow = _client(edge, SLOW_KEY)
    await slow.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=1)
    with pytest.raises(openai.RateLimitError) as info:
        await slow.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=1)
    retry_after = int(info.value.response.headers["Retry-After"])
    assert 55 <= retry_after <= 60
    assert SLOW_KEY not in info.value.response.text

    acme = _client(edge)
    refused: list[float] = []

    # a prompt no earlier request shared: its prefill is not in the prefix cache, so it waits
    long_prompt = [{"role": "user", "content": f"Tell a long story about a {uuid.uuid4().hex}."}]

    async def long_run() -> None:
        await acme.chat.completions.create(model=MODEL, messages=long_prompt, max_tokens=300)

    async with anyio.create_task_group() as tg:
        tg.start_soon(long_run)  # waits for its first token for a while: 300+ tokens reserved
        await anyio.sleep(0.05)
        started = time.monotonic()
        with pytest.raises(openai.APIStatusError) as info:
            await acme.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=300)
        refused.append(time.monotonic() - started)
        tg.cancel_scope.cancel()  # the first client leaves: its run is cancelled
    assert info.value.status_code == 503
    assert refused[0] < 0.5
    assert "BRIGADE_EDGE_MAX_WAIT_S" in info.value.response.json()["error"]["message"]


async def test_disconnect_cancels_the_run(pipeline):
    edge, config = pipeline
    bus = await Bus.connect(config)
    try:
        sub = await bus.nc.subscribe(subjects.all_events("cancelled"))
        client = _client(edge)
        stream = await client.chat.completions.create(
            model=MODEL, messages=PROMPT, max_tokens=200, stream=True)  # fmt: skip
        async for _chunk in stream:
            break
        await stream.close()
        msg = await sub.next_msg(timeout=30)
        cancelled = decode_event(msg.data)
        assert cancelled.reason == "disconnect"
        assert cancelled.tenant == "acme"
        assert cancelled.usage.completion_tokens < 200
    finally:
        await bus.close()


async def test_response_cancel_reaches_the_engine_and_the_ledger(pipeline):
    """Cancel mid-stream: the engine stops within two steps and frees every KV block (it is the
    only run), the ledger bills the partial usage as cancelled, and a late event changes nothing."""
    edge, config = pipeline
    auth = {"Authorization": f"Bearer {ACME_KEY}"}
    async with websockets.connect(edge.ws_url, additional_headers=auth) as ws:
        await ws.send(json.dumps({"type": "response.create", "response": {
            "messages": PROMPT, "max_tokens": 200, "temperature": 0}}))  # fmt: skip
        rid = json.loads(await ws.recv())["request_id"]
        seen = []
        while len(seen) < 3:
            event = json.loads(await ws.recv())
            assert event["type"] != "error", event
            if event["type"] == "response.output_text.delta":
                seen.append(event["seq"])
        await ws.send(json.dumps({"type": "response.cancel"}))
        while (event := json.loads(await ws.recv()))["type"] == "response.output_text.delta":
            seen.append(event["seq"])
    assert event["type"] == "response.done"
    assert event["status"] == "cancelled"
    assert seen == list(range(len(seen)))
    assert 3 <= event["usage"]["completion_tokens"] < 200

    bus = await Bus.connect(config)
    try:
        log = await bus.js.subscribe(
            f"llm.ev.{rid}.>", stream=subjects.EVENTS_STREAM, ordered_consumer=True
        )
        events, billed = [], None
        with anyio.fail_after(20):
            while billed is None:
                msg = await log.next_msg(timeout=10)
                events.append(decode_event(msg.data))
                if events[-1].__struct_config__.tag == "billed":
                    billed = events[-1]
        await log.unsubscribe()
        tags = [e.__struct_config__.tag for e in events]
        after_cancel = tags[tags.index("cancel") :]
        assert after_cancel.count("tokens") <= 2  # the engine stopped within two steps
        finished = events[tags.index("finished")]
        assert finished.finish_reason == "abort"
        assert finished.kv_usage == 0.0  # the only run: every block is back in the pool
        assert (billed.status, billed.usage.completion_tokens) == (
            "cancelled", event["usage"]["completion_tokens"])  # fmt: skip
        await bus.publish(TextGenerated(request_id=rid, tenant="acme", seq=9999, text="late"))
        async with httpx.AsyncClient(base_url=edge.url, headers=auth) as http:
            await anyio.sleep(0.3)
            run = (await http.get(f"/v1/runs/{rid}")).json()
        assert run["state"] == "billed"
    finally:
        await bus.close()


async def test_no_key_in_the_log_and_metrics_filled(pipeline):
    """Runs: after every test above. No API key in any stored event or KV entry; the edge's
    Prometheus metrics saw the runs; `brigade usage` reads the same ledger."""
    edge, config = pipeline
    bus = await Bus.connect(config)
    try:
        for stream in (subjects.EVENTS_STREAM, "KV_" + subjects.IDEMPOTENCY_BUCKET,
                       "KV_" + subjects.RUNS_BUCKET, "KV_" + subjects.RATES_BUCKET):  # fmt: skip
            info = await bus.js.stream_info(stream)
            assert info.state.messages > 0, stream
            for seq in range(info.state.first_seq, info.state.last_seq + 1):
                try:
                    data = (await bus.js.get_msg(stream, seq)).data or b""
                except NotFoundError:
                    continue
                for key in (ACME_KEY, SLOW_KEY, GLOBEX_KEY):
                    assert key.encode() not in data, (stream, seq)
    finally:
        await bus.close()
    async with httpx.AsyncClient(base_url=edge.url) as http:
        text = (await http.get("/metrics")).text
    lines = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert all(f'model_name="{MODEL}"' in line for line in lines)  # every series
    samples = {_without_model(line.split(" ")[0]): float(line.split(" ")[1]) for line in lines}
    assert samples["brigade:time_to_first_token_seconds_count"] >= 6
    assert samples["brigade:e2e_request_latency_seconds_count"] >= 5
    assert samples['brigade:request_success_total{finished_reason="length"}'] >= 4
    assert samples['brigade:request_success_total{finished_reason="abort"}'] >= 1
    assert samples['brigade:stage_duration_seconds_count{stage="gateway"}'] >= 6
    assert samples['brigade:stage_duration_seconds_count{stage="engine"}'] >= 5  # a run each
    assert samples['brigade:request_failure_total{code="rate_limited"}'] == 1
    assert 0.0 <= samples["brigade:kv_cache_usage_perc"] <= 1.0
    assert samples["brigade:time_per_output_token_seconds_count"] >= 4
    assert samples['brigade:time_to_first_token_seconds_bucket{le="80.0"}'] >= 6
    assert samples["brigade:request_prompt_tokens_count"] >= 5
    assert samples["brigade:request_generation_tokens_sum"] >= 20
    rows = ledger.usage_by_tenant(tenant="slow")
    assert [(r[0], r[1], r[2]) for r in rows] == [("slow", "completed", 1), ("slow", "failed", 1)]


def _without_model(series: str) -> str:
    """`name{le="1.0",model_name="m"}` -> `name{le="1.0"}`; `name{model_name="m"}` -> `name`."""
    series = series.replace(f'model_name="{MODEL}"', "")
    return series.replace("{,", "{").replace(",}", "}").replace("{}", "")


async def test_structured_outputs_through_every_stage(pipeline):
    """response_format json_object and json_schema, and vLLM's guided_choice, come back as text
    that parses and validates; an invalid schema is a 400 naming response_format."""
    edge, _ = pipeline
    client = _client(edge)
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}, "rank": {"enum": [1, 2, 3]}},
        "required": ["city", "rank"],
        "additionalProperties": False,
    }
    ask = [{"role": "user", "content": "Give a city and its rank as JSON."}]
    reply = await client.chat.completions.create(
        model=MODEL,
        messages=ask,
        max_tokens=40,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
    )
    got = json.loads(reply.choices[0].message.content)
    assert set(got) == {"city", "rank"} and got["rank"] in (1, 2, 3) and len(got["city"]) <= 20
    assert reply.choices[0].finish_reason == "stop"
    anyjson = await client.chat.completions.create(
        model=MODEL, messages=ask, max_tokens=60, response_format={"type": "json_object"}, seed=3
    )
    if anyjson.choices[0].finish_reason == "stop":  # a whole object (60 tokens may cut it)
        assert isinstance(json.loads(anyjson.choices[0].message.content), dict)
    picked = await client.completions.create(
        model=MODEL,
        prompt="The sky is",
        max_tokens=8,
        extra_body={"guided_choice": ["blue", "red"]},
    )
    assert picked.choices[0].text in ("blue", "red")
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(
            model=MODEL,
            messages=ask,
            response_format={"type": "json_schema", "json_schema": {"schema": {"type": "objekt"}}},
        )
    assert info.value.body["param"].startswith("response_format")


async def test_a_keyed_retry_of_a_run_cancelled_before_the_engine_gets_its_end(pipeline):
    """The key's first run was cancelled before the gateway took it (it used to be dropped
    there and never end): a retry with the key answers with that run's end at once, no hang."""
    edge, config = pipeline
    body = {"model": MODEL, "messages": PROMPT, "max_tokens": 3, "temperature": 0}
    bus = await Bus.connect(config)
    try:
        first = msgspec.convert(
            {**body, "request_id": "idem-cancelled-1", "api_key": ACME_KEY}, Submit
        )
        first = msgspec.structs.replace(first, idempotency_key="order-cancelled")
        digest = request_hash(gateway.normalize(first, limit_chars=10**6))
        store = IdempotencyStore(await bus.kv(subjects.IDEMPOTENCY_BUCKET))
        assert (await store.claim("acme", "order-cancelled", digest, "idem-cancelled-1")).new
        await bus.publish(CancelRequested(request_id="idem-cancelled-1", tenant="acme"))
        await bus.nc.flush()
        await anyio.sleep(0.3)
        assert not (await bus.submit(first)).accepted  # the gateway ended it: cancelled
        headers = {"Authorization": f"Bearer {ACME_KEY}", "Idempotency-Key": "order-cancelled"}
        async with httpx.AsyncClient(base_url=edge.url, headers=headers, timeout=20) as http:
            with anyio.fail_after(20):
                r = await http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.headers["X-Request-Id"] == "idem-cancelled-1"
        assert r.headers["X-Brigade-Run-State"] == "cancelled"
        with anyio.fail_after(10):
            while True:
                try:
                    msg = await bus.js.get_last_msg(
                        subjects.EVENTS_STREAM, "llm.ev.idem-cancelled-1.billed"
                    )
                    break
                except NotFoundError:
                    await anyio.sleep(0.05)
        assert decode_event(msg.data).status == "cancelled"
    finally:
        await bus.close()
