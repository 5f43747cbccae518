"""Engine workers behind the real pipeline (a real nats-server, every other stage, the edge),
on SmolLM2 in the float32 batch-invariant mode: a chat's tokens and logprobs are the same bits
alone as among concurrent others, greedy and seeded; and two workers with small KV caches share
a burst, each pulling only what its cache can start, and answer with the one-worker texts."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import anyio
import openai
import pytest

from engine import Engine, EngineConfig
from schemas import models, settings, subjects
from schemas.events import Message, RunCompleted, Submit, TokensGenerated
from stages import engine as engine_stage
from stages.edge.keys import KeyRing
from stages.runtime import natsd
from stages.runtime import worker as runtime
from stages.runtime.bus import Bus, BusConfig
from stages.tenancy import tenants
from tests.stages.edge_harness import ACME_KEY, MODEL, running_edge
from tests.stages.pipeline_harness import start_stages

pytestmark = pytest.mark.anyio
LIGHT = ("gateway", "auth", "context", "tokenize", "detokenize", "ledger")
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Count from 1 to 10.",
    "Name three primary colors.",
    "What does a CPU do?",
    "Give me a list of fruits.",
    "Describe a sunset.",
    "Tell me a joke about cats.",
]
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def anyio_backend():
    return "asyncio", {"use_uvloop": True}


@pytest.fixture(scope="module")
async def light(tmp_path_factory) -> AsyncIterator[tuple[str, BusConfig]]:
    """Every stage but the engine, and the edge; yields (edge URL, bus config)."""
    data = tmp_path_factory.mktemp("engine-workers")
    path = data / "tenants.toml"
    tenants.add_key("acme", path=path, api_key=ACME_KEY)
    env = {settings.TENANTS.name: str(path), settings.LEDGER_DB.name: str(data / "ledger.duckdb")}
    server = natsd.start(data / "nats")
    config = BusConfig(servers=(server.url,), ack_wait_s=5.0, max_deliver=3)
    stop = anyio.Event()
    try:
        with pytest.MonkeyPatch.context() as patch:
            for name, value in env.items():
                patch.setenv(name, value)
            async with anyio.create_task_group() as tg:
                await start_stages(tg, LIGHT, config, stop, timeout_s=60)
                async with running_edge(config, KeyRing(path, (MODEL,))) as edge:
                    yield edge.url, config
                stop.set()
    finally:
        natsd.stop(server)


def invariant_engine(**kw) -> Engine:
    return Engine(EngineConfig(model=MODEL, batch_invariant=True, block_size=BLOCK_SIZE, **kw))


@dataclass
class Watch:
    """What each engine held, sampled every millisecond while requests run."""

    engines: list[Engine]
    served: list[set[str]] = field(default_factory=list)  # request ids each ever held
    max_held: list[int] = field(default_factory=list)  # most requests held at once

    def __post_init__(self) -> None:
        self.served = [set() for _ in self.engines]
        self.max_held = [0 for _ in self.engines]

    async def run(self, stop: anyio.Event) -> None:
        while not stop.is_set():
            for i, engine in enumerate(self.engines):
                held = engine.request_ids()
                self.served[i].update(held)
                self.max_held[i] = max(self.max_held[i], len(held))
            await anyio.sleep(0.001)


@asynccontextmanager
async def workers(config: BusConfig, engines: list[Engine]) -> AsyncIterator[Watch]:
    """One engine stage worker per engine on the bus, watched; stopped on exit."""
    stop, watch = anyio.Event(), Watch(engines)
    async with anyio.create_task_group() as tg:
        for engine in engines:
            ready = anyio.Event()
            spec = engine_stage.spec(engine=engine, model=models.default())
            tg.start_soon(lambda s=spec, r=ready: runtime.serve(
                s, config=config, stop=stop, ready=r, handle_signals=False))  # fmt: skip
            with anyio.fail_after(60):
                await ready.wait()
        tg.start_soon(watch.run, stop)
        yield watch
        stop.set()


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=ACME_KEY, max_retries=0, timeout=300)


async def chat(http: openai.AsyncOpenAI, question: str, **kw) -> tuple[str, list]:
    """-> (text, [(token, logprob, [(top token, logprob), ...]), ...])"""
    r = await http.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": question}], **kw
    )
    choice = r.choices[0]
    lps = choice.logprobs.content if choice.logprobs else []
    return choice.message.content, [
        (t.token, t.logprob, [(x.token, x.logprob) for x in t.top_logprobs]) for t in lps
    ]


async def concurrently(http, questions: list[str], kw_of) -> list[tuple[str, list]]:
    out: list = [None] * len(questions)

    async def one(i: int) -> None:
        out[i] = await chat(http, questions[i], **kw_of(i))

    async with anyio.create_task_group() as tg:
        for i in range(len(questions)):
            tg.start_soon(one, i)
    return out


async def submitted(config: BusConfig, questions: list[str], tag: str) -> list[list[int]]:
    """Greedy chats submitted on NATS all at once (the gateway's path: no edge admission in
    the way); -> each run's token ids, from its stored events, once every one completed."""
    bus = await Bus.connect(config)
    ids = [f"{tag}-{i}" for i in range(len(questions))]
    try:
        subs = [await bus.nc.subscribe(subjects.request_events(rid)) for rid in ids]
        for rid, question in zip(ids, questions, strict=True):
            submit = Submit(request_id=rid, messages=[Message(role="user", content=question)],
                            max_tokens=12, temperature=0.0, ignore_eos=True)  # fmt: skip
            assert (await bus.submit(submit, api_key=ACME_KEY)).accepted
        with anyio.fail_after(240):
            for sub in subs:  # until the run's end, whichever it is (checked below)
                ends = ("completed", "failed", "cancelled")
                while (await sub.next_msg(timeout=240)).subject.split(".")[3] not in ends:
                    pass
        out = []
        for rid in ids:
            events = await bus.replay(rid)
            assert sum(isinstance(e, RunCompleted) for e in events) == 1
            steps = sorted((e.seq, e.token_ids) for e in events if isinstance(e, TokensGenerated))
            out.append([t for _, token_ids in steps for t in token_ids])
        return out
    finally:
        await bus.close()


async def test_batch_invariant_chats_are_the_same_bits_alone_and_concurrent(light):
    """Six chats at once (prefill in 32-token chunks beside the others' decodes), three greedy
    and three seeded, against each one alone: text and every logprob equal."""
    url, config = light
    engine = await anyio.to_thread.run_sync(
        lambda: invariant_engine(num_kv_blocks=64, max_num_batched_tokens=32, max_num_seqs=8)
    )

    def kw_of(i: int) -> dict:
        sampled = {"temperature": 0.8, "top_p": 0.9, "seed": 100 + i} if i % 2 else {}
        return {"temperature": 0.0, "max_tokens": 12, "logprobs": True, "top_logprobs": 2} | sampled

    questions = QUESTIONS[:6]
    async with workers(config, [engine]) as watch:
        http = client(url)
        together = await concurrently(http, questions, kw_of)
        assert watch.max_held[0] >= 4  # they did share steps
        alone = [await chat(http, q, **kw_of(i)) for i, q in enumerate(questions)]
    for i, (a, t) in enumerate(zip(alone, together, strict=True)):
        assert a[1] and a == t, questions[i]


async def test_two_workers_share_a_burst_each_within_its_kv(light):
    """Each worker's cache holds 8 blocks of 16 tokens: two of these chats (34 to 39 prompt and
    12 output tokens: 3 blocks to start, up to 4 at the end) at once. Eight submitted together:
    both workers serve, neither ever holds more than two nor preempts one, no run starts on
    both, and every run's tokens are the one-worker run's."""
    _, config = light
    kv = {"num_kv_blocks": 8, "max_num_seqs": 4}
    first, second = await anyio.to_thread.run_sync(
        lambda: (invariant_engine(**kv), invariant_engine(**kv))
    )
    async with workers(config, [first]) as watch:
        alone = await submitted(config, QUESTIONS, "one")
    assert watch.max_held == [2]
    async with workers(config, [first, second]) as watch:
        shared = await submitted(config, QUESTIONS, "two")
    assert all(len(t) == 12 for t in alone) and shared == alone
    a, b = watch.served
    assert a and b and not a & b, (len(a), len(b))  # both served, no run started twice
    assert len(a) + len(b) == len(QUESTIONS)
    assert max(watch.max_held) <= 2, watch.max_held
    assert first.stats().num_preemptions == second.stats().num_preemptions == 0
