"""Two models served together through the real pipeline (a real nats-server, every stage, the
edge): SmolLM2 (the GGUF) and a tiny random Llama written here as a Hugging Face directory with
SmolLM2's tokenizer, so both turn a prompt into the same ids and only the weights differ. Each
engine worker is bound to one model and consumes only the `tokenized` events routed to it."""

from __future__ import annotations

import json
import re
import uuid

import anyio
import httpx
import openai
import pytest
import websockets

from engine import Engine, EngineConfig, SamplingParams
from schemas import models, settings, subjects
from schemas.events import (
    PromptTokenized,
    RunFinished,
    Submit,
    TokensGenerated,
)
from stages import engine as engine_stage
from stages.edge.keys import KeyRing
from stages.runtime import natsd
from stages.runtime import worker as runtime
from stages.runtime.bus import Bus, BusConfig
from stages.tenancy import tenants
from tests.engine.tiny_llama import write_tiny_llama_with_tokenizer
from tests.stages.edge_harness import ACME_KEY, running_edge
from tests.stages.pipeline_harness import start_stages

pytestmark = pytest.mark.anyio
SMOL = "smollm2-135m"
TINY = "tiny"
LIGHT = ("gateway", "auth", "context", "tokenize", "detokenize", "ledger")
PROMPT = [{"role": "user", "content": "Name three colors."}]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def anyio_backend():
    return "asyncio", {"use_uvloop": True}


def _engine(artifact: str) -> Engine:
    config = EngineConfig(model=artifact, num_kv_blocks=256, enable_prefix_caching=True)
    return Engine(config)


@pytest.fixture(scope="module")
async def served(tmp_path_factory):
    """The light stages and the edge first (so /health is seen 503 with no engine), then one
    engine worker per model; yields (edge, bus config, tiny dir, health before engines)."""
    data = tmp_path_factory.mktemp("models")
    tiny_dir = write_tiny_llama_with_tokenizer(data / "tiny-llama", SMOL, seed=3)
    path = data / "tenants.toml"
    tenants.add_key("acme", path=path, api_key=ACME_KEY)
    served_models = f"{SMOL},{TINY}={tiny_dir}"
    env = {
        settings.TENANTS.name: str(path),
        settings.LEDGER_DB.name: str(data / "ledger.duckdb"),
        settings.MODEL.name: served_models,
    }
    server = natsd.start(data / "nats")
    config = BusConfig(servers=(server.url,), ack_wait_s=5.0, max_deliver=3)
    stop = anyio.Event()
    try:
        with pytest.MonkeyPatch.context() as patch:
            for name, value in env.items():
                patch.setenv(name, value)
            async with anyio.create_task_group() as tg:
                await start_stages(tg, LIGHT, config, stop, timeout_s=60)
                keys = KeyRing(path, (SMOL,))
                async with running_edge(config, keys, model=served_models) as edge:
                    async with httpx.AsyncClient(base_url=edge.url) as http:
                        before = await http.get("/health")
                    for model in models.served():
                        engine = await anyio.to_thread.run_sync(_engine, model.artifact)
                        spec = engine_stage.spec(engine=engine, model=model)
                        ready = anyio.Event()
                        tg.start_soon(lambda s=spec, r=ready: runtime.serve(
                            s, config=config, stop=stop, ready=r, handle_signals=False))  # fmt: skip
                        with anyio.fail_after(60):
                            await ready.wait()
                    yield edge, config, tiny_dir, before
                stop.set()
    finally:
        natsd.stop(server)


async def _run(config: BusConfig, model: str | None, request_id: str, prompt=None) -> list:
    """Submit on NATS (the gateway's path), wait for the run's end; its stored events. With
    `prompt`, a raw prompt (no template) instead of PROMPT's chat."""
    bus = await Bus.connect(config)
    try:
        sub = await bus.nc.subscribe(subjects.request_events(request_id))
        submit = Submit(request_id=request_id, model=model, messages=None if prompt else PROMPT,
                        prompt=prompt,
                        max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)  # fmt: skip
        reply = await bus.submit(submit, api_key=ACME_KEY)
        assert reply.accepted, reply
        with anyio.fail_after(120):
            while True:
                msg = await sub.next_msg(timeout=120)
                if msg.subject.split(".")[3] in ("completed", "failed", "cancelled"):
                    break
        return await bus.replay(request_id)
    finally:
        await bus.close()


def _one(events: list, kind: type):
    (found,) = [e for e in events if isinstance(e, kind)]
    return found


async def test_health_is_503_until_every_model_has_an_engine(served):
    _, _, _, before = served
    assert before.status_code == 503
    assert "no engine durable 'brigade-engine-smollm2-135m'" in before.json()["error"]["message"]


async def test_each_request_is_answered_by_its_own_models_engine(served):
    """The tiny model's run: routed on its model's subject, its tokens and `finished` name it,
    and its greedy tokens are that model's, run directly through the engine; the same prompt
    for SmolLM2 is answered by SmolLM2."""
    _, config, tiny_dir, _ = served
    tiny_events = await _run(config, TINY, f"tiny-{uuid.uuid4().hex[:8]}")
    smol_events = await _run(config, None, f"smol-{uuid.uuid4().hex[:8]}")  # the default
    tiny_prompt, smol_prompt = (
        _one(tiny_events, PromptTokenized),
        _one(smol_events, PromptTokenized),
    )
    assert (tiny_prompt.model, smol_prompt.model) == (TINY, SMOL)
    assert (
        tiny_prompt.prompt_token_ids == smol_prompt.prompt_token_ids
    )  # one tokenizer, one template
    for events, model in ((tiny_events, TINY), (smol_events, SMOL)):
        tokens = [e for e in events if isinstance(e, TokensGenerated)]
        assert tokens and {e.model for e in tokens} == {model}
        assert _one(events, RunFinished).model == model
    tiny_ids = [t for e in tiny_events if isinstance(e, TokensGenerated) for t in e.token_ids]
    smol_ids = [t for e in smol_events if isinstance(e, TokensGenerated) for t in e.token_ids]

    reference = Engine(EngineConfig(model=str(tiny_dir), num_kv_blocks=64))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    reference.add_request("ref", list(tiny_prompt.prompt_token_ids), params)
    direct = []
    while reference.has_unfinished_requests():
        direct += [t for out in reference.step() for t in out.new_token_ids]
    assert tiny_ids == direct and len(direct) == MAX_TOKENS
    assert smol_ids != tiny_ids  # the same ids, another model's answer

    # submitted straight on NATS, no edge watched them: their steps count all the same (each
    # engine's own histogram, from its heartbeat), a prefill and a decode step per token after
    edge = served[0]
    count = re.compile(r'^brigade:iteration_tokens_total_count\{engine="[^"]+",model_name="(\S+)"\} (\S+)$')  # fmt: skip
    with anyio.fail_after(10):
        while True:
            async with httpx.AsyncClient(base_url=edge.url) as http:
                text = (await http.get("/metrics")).text
            steps = {m[1]: float(m[2]) for line in text.splitlines() if (m := count.match(line))}
            if steps.get(TINY, 0) >= MAX_TOKENS and steps.get(SMOL, 0) >= MAX_TOKENS:
                break
            await anyio.sleep(0.2)


async def test_the_prefix_cache_is_never_shared_across_models(served):
    """SmolLM2 caches the prompt's full blocks for the tenant; the tiny model, given the very
    same prompt ids by the same tenant, computes them all (its engine holds only its blocks)."""
    _, config, _, _ = served
    # asked only here, raw (no template, whose system prompt the other tests' runs share)
    asked = "The sea is home to whales, sharks, octopuses, jellyfish, seals and crabs. " * 2

    async def finished(model: str) -> RunFinished:
        return _one(await _run(config, model, uuid.uuid4().hex, asked), RunFinished)

    first = await finished(SMOL)
    again = await finished(SMOL)
    assert first.usage.cached_tokens == 0
    assert again.usage.cached_tokens >= 16  # at least one full block from the run before
    tiny = await finished(TINY)
    tiny_again = await finished(TINY)
    assert tiny.usage.prompt_tokens == again.usage.prompt_tokens
    # its first run found nothing of SmolLM2's; its second finds its own
    assert (tiny.usage.cached_tokens, tiny_again.usage.cached_tokens) == (
        0,
        again.usage.cached_tokens,
    )


async def test_models_listed_with_their_window_and_engines(served):
    edge, _, tiny_dir, _ = served
    async with httpx.AsyncClient(base_url=edge.url) as http:
        auth = {"Authorization": f"Bearer {ACME_KEY}"}
        listed = (await http.get("/v1/models", headers=auth)).json()["data"]
        health = await http.get("/health")
        one = (await http.get(f"/v1/models/{TINY}", headers=auth)).json()
        missing = await http.get("/v1/models/gpt-4o", headers=auth)
    cards = {card["id"]: card for card in listed}
    assert list(cards) == [SMOL, TINY]
    assert (cards[SMOL]["max_model_len"], cards[TINY]["max_model_len"]) == (8192, 2048)
    assert one == cards[TINY] and one["root"] == str(tiny_dir)
    (smol_engine,), (tiny_engine,) = cards[SMOL]["engines"], cards[TINY]["engines"]
    assert (smol_engine["format"], tiny_engine["format"]) == ("gguf", "hf")
    assert (smol_engine["max_model_len"], tiny_engine["max_model_len"]) == (8192, 2048)
    assert smol_engine["tokenizer"] == tiny_engine["tokenizer"]  # the same vocabulary and template
    assert (missing.status_code, missing.json()["error"]["code"]) == (404, "model_not_found")
    assert health.status_code == 200
    assert {d["model"] for d in health.json()["engine"]} == {SMOL, TINY}


async def test_the_sdk_reaches_each_model_and_an_unknown_one_is_a_404(served):
    edge, config, _, _ = served
    client = openai.AsyncOpenAI(base_url=f"{edge.url}/v1", api_key=ACME_KEY, max_retries=0)
    answers = {}
    for model in (SMOL, TINY):
        reply = await client.chat.completions.create(
            model=model, messages=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0
        )
        assert reply.model == model and reply.choices[0].message.content
        answers[model] = reply.choices[0].message.content
    assert answers[SMOL] != answers[TINY]
    async with httpx.AsyncClient(base_url=edge.url) as http:
        metrics = (await http.get("/metrics")).text
    for model in (SMOL, TINY):  # each model's runs on its own series
        assert f'brigade:time_to_first_token_seconds_count{{model_name="{model}"}} 1.0' in metrics
        assert f'brigade:generation_tokens_total{{model_name="{model}"}} {MAX_TOKENS}.0' in metrics
    with pytest.raises(openai.NotFoundError) as info:
        await client.chat.completions.create(model="gpt-4o", messages=PROMPT, max_tokens=2)
    assert info.value.body["code"] == "model_not_found"
    bus = await Bus.connect(config)  # straight on NATS: the gateway refuses it, nothing waits
    try:
        reply = await bus.submit(Submit(model="gpt-4o", messages=PROMPT), api_key=ACME_KEY)
    finally:
        await bus.close()
    assert (reply.accepted, reply.code, reply.field) == (False, "model_not_found", "model")


async def test_a_websocket_run_counts_for_its_model(served):
    """A websocket run names no request id: its end (`completed`, which names no model) and its
    time to first token still count on the tiny model's series."""
    edge, _, _, _ = served
    metric = 'brigade:request_success_total{finished_reason="length",model_name="tiny"}'

    async def count() -> float:
        async with httpx.AsyncClient(base_url=edge.url) as http:
            text = (await http.get("/metrics")).text
        found = [line for line in text.splitlines() if line.startswith(metric)]
        return float(found[0].split()[-1]) if found else 0.0

    before = await count()
    auth = {"Authorization": f"Bearer {ACME_KEY}"}
    async with websockets.connect(edge.ws_url, additional_headers=auth) as ws:
        await ws.send(json.dumps({"type": "response.create", "response": {
            "model": TINY, "messages": PROMPT, "max_tokens": 3, "temperature": 0,
            "ignore_eos": True}}))  # fmt: skip
        while (event := json.loads(await ws.recv()))["type"] != "response.done":
            assert event["type"] != "error", event
    assert (event["status"], event["finish_reason"]) == ("incomplete", "length")  # max_tokens
    assert await count() == before + 1
