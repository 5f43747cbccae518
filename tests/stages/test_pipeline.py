"""The whole pipeline on a real nats-server: two `brigade stage NAME` processes per stage.

Checks what only the assembled pipeline can show: the engine's exact token ids come through,
50 concurrent requests complete exactly once, a SIGKILLed engine worker's request completes
after redelivery with nothing missing or repeated, bad submits fail clearly while every stage
keeps serving, and a request's events replay from the stream in causal order.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import pytest

from schemas import models, subjects
from schemas.events import (
    AnyEvent,
    CancelRequested,
    ContextAssembled,
    Message,
    PromptTokenized,
    RequestFailed,
    RunCancelled,
    RunCompleted,
    Submit,
    TextGenerated,
    TokensGenerated,
    decode_event,
)
from stages.ledger import connect as ledger_connect
from stages.runtime import natsd
from stages.runtime.bus import Bus, BusConfig
from stages.tenancy import tenants

pytestmark = [pytest.mark.nats, pytest.mark.anyio]

REPO = Path(__file__).resolve().parents[2]
STAGES = ("gateway", "auth", "context", "tokenize", "engine", "detokenize", "ledger")
KEY = "brg-pipeline-test-key"
MODEL_ENV = {
    "BRIGADE_MODEL": "smollm2-135m",
    "BRIGADE_DTYPE": "bfloat16",
    "BRIGADE_MAX_MODEL_LEN": "512",
    "BRIGADE_KV_CACHE_BYTES": str(48 * 1024 * 1024),
    "OMP_NUM_THREADS": "1",  # two engine workers share 2 cores: no oversubscription
}


@dataclass
class Pipeline:
    server: natsd.NatsServer
    data_dir: Path
    env: dict[str, str]
    workers: dict[str, list[subprocess.Popen]] = field(default_factory=dict)

    @property
    def config(self) -> BusConfig:
        return BusConfig(servers=(self.server.url,))

    def start(self, name: str) -> subprocess.Popen:
        log = open(self.data_dir / f"{name}-{len(self.workers.get(name, []))}.log", "wb")  # noqa: SIM115
        proc = subprocess.Popen(
            [sys.executable, "-m", "tools.cli", "stage", name],
            cwd=REPO,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        self.workers.setdefault(name, []).append(proc)
        return proc

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n" + p.read_text(errors="replace")[-3000:]
            for p in sorted(self.data_dir.glob("*.log"))
        )


async def wait_consuming(config: BusConfig, workers: dict[str, int], timeout_s: float) -> None:
    """Until every stage's durable has seen `n` pull requests waiting at once (n workers up)."""
    bus = await Bus.connect(config)
    try:
        left = dict(workers)
        with anyio.fail_after(timeout_s):
            while left:
                for name in list(left):
                    stream = subjects.SUBMIT_STREAM if name == "gateway" else subjects.EVENTS_STREAM
                    # the engine's workers share their model's durable
                    route = models.default().token if name == "engine" else None
                    try:
                        info = await bus.js.consumer_info(
                            stream, subjects.durable_name(name, route)
                        )
                    except Exception:  # noqa: BLE001 - not created yet
                        continue
                    if info.num_waiting >= left[name]:
                        del left[name]
                await anyio.sleep(0.05)
    finally:
        await bus.close()


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pipeline]:
    data_dir = tmp_path_factory.mktemp("pipeline")
    server = natsd.start(data_dir / "nats")
    tenants.add_key("acme", path=data_dir / "tenants.toml", api_key=KEY)
    env = {
        **os.environ,
        **MODEL_ENV,
        "NATS_URL": server.url,
        "BRIGADE_DATA_DIR": str(data_dir),
        "BRIGADE_TENANTS": str(data_dir / "tenants.toml"),
        "BRIGADE_LEDGER_DB": str(data_dir / "ledger.duckdb"),
        "BRIGADE_ACK_WAIT_S": "3",
        "BRIGADE_SUMMARY_MAX_TOKENS": "12",
        "PYTHONUNBUFFERED": "1",
    }
    env.pop("BRIGADE_API_KEY", None)
    p = Pipeline(server=server, data_dir=data_dir, env=env)
    try:
        for name in STAGES:
            for _ in range(2):
                p.start(name)
        anyio.run(wait_consuming, p.config, {name: 2 for name in STAGES}, 240.0)
        yield p
    except BaseException:
        print(p.logs(), file=sys.stderr)
        raise
    finally:
        procs = [w for ws in p.workers.values() for w in ws]
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        natsd.stop(server)


@pytest.fixture(scope="module")
def engine_alone():
    """The engine core in this process, configured as the engine stage is."""
    from engine import Engine
    from stages.engine import engine_config_from_env

    saved = {k: os.environ.get(k) for k in MODEL_ENV}
    os.environ.update(MODEL_ENV)
    try:
        return Engine(engine_config_from_env())
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v


def generate_alone(engine, event: PromptTokenized) -> list[int]:
    """The same request on the engine core alone, with the workers' thread count (bf16 GEMM
    reductions, and so greedy ties, depend on it)."""
    import torch

    from stages.engine import sampling_params

    params = sampling_params(event.sampling, event.request_id)
    threads = torch.get_num_threads()
    torch.set_num_threads(int(MODEL_ENV["OMP_NUM_THREADS"]))
    try:
        engine.add_request(event.request_id, list(event.prompt_token_ids), params)
        ids: list[int] = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                ids.extend(out.new_token_ids)
    finally:
        torch.set_num_threads(threads)
    return ids


async def wait_terminal(
    bus: Bus,
    request_ids: list[str],
    timeout_s: float = 60.0,
    kinds: tuple[str, ...] = ("completed", "failed", "cancelled"),
) -> None:
    """Until each request has one of `kinds` (by default a terminal event) in the log."""
    wanted = set(request_ids)
    with anyio.fail_after(timeout_s):
        while True:
            done: set[str] = set()
            for kind in kinds:
                info = await bus.js.stream_info(
                    subjects.EVENTS_STREAM, subjects_filter=subjects.all_events(kind)
                )
                done |= {s.split(".")[2] for s in (info.state.subjects or {})}
            if wanted <= done:
                return
            await anyio.sleep(0.05)


async def settled(bus: Bus, request_id: str, timeout_s: float = 10.0) -> list[AnyEvent]:
    """The request's events once every text delta up to `completed.last_seq` is stored (two
    detokenize workers may store the last deltas after the flush worker's `completed`)."""
    with anyio.fail_after(timeout_s):
        while True:
            events = await bus.replay(request_id)
            done = of(events, RunCompleted)
            seqs = {e.seq for e in of(events, TextGenerated)}
            if done and seqs >= set(range(done[0].last_seq + 1)):
                return events
            await anyio.sleep(0.05)


async def counts(bus: Bus, request_id: str) -> dict[str, int]:
    info = await bus.js.stream_info(
        subjects.EVENTS_STREAM, subjects_filter=subjects.request_events(request_id)
    )
    return {s.split(".")[3]: n for s, n in (info.state.subjects or {}).items()}  # event, not model


def of(events: list[AnyEvent], cls: type) -> list:
    return [e for e in events if isinstance(e, cls)]


def text_of(events: list[AnyEvent]) -> str:
    deltas = sorted(of(events, TextGenerated), key=lambda e: e.seq)
    assert [d.seq for d in deltas] == list(range(len(deltas))), "a text delta is missing or doubled"
    return "".join(d.text for d in deltas)


def token_ids_of(events: list[AnyEvent]) -> list[int]:
    deltas = sorted(of(events, TokensGenerated), key=lambda e: e.seq)
    assert [d.seq for d in deltas] == list(range(len(deltas)))
    return [t for d in deltas for t in d.token_ids]


async def test_through_every_stage_equals_engine_alone(pipeline: Pipeline, engine_alone) -> None:
    bus = await Bus.connect(pipeline.config)
    reply = await bus.submit(
        Submit(
            api_key=KEY,
            system="Answer in one short sentence.",
            messages=[Message(role="user", content="What is the capital of France?")],
            temperature=0.0,
            max_tokens=12,
        )
    )
    assert reply.accepted
    await wait_terminal(bus, [reply.request_id])
    events = await settled(bus, reply.request_id)
    (tokenized,) = of(events, PromptTokenized)
    tok = engine_alone.tokenizer
    assert tokenized.prompt_token_ids == tok.encode_chat(
        [
            {"role": "system", "content": "Answer in one short sentence."},
            {"role": "user", "content": "What is the capital of France?"},
        ]
    )
    ids = token_ids_of(events)
    assert ids == generate_alone(engine_alone, tokenized)
    assert len(ids) == 12 or ids[-1] == tok.eos_token_id
    assert text_of(events) == tok.decode(ids)
    assert tokenized.tenant == "acme" and events[-1].tenant == "acme"
    await bus.close()


async def test_fifty_concurrent_requests_complete_exactly_once(pipeline: Pipeline) -> None:
    bus = await Bus.connect(pipeline.config)
    ids: list[str] = []

    async def one(i: int) -> None:
        reply = await bus.submit(
            Submit(api_key=KEY, request_id=f"many-{i}", prompt=f"{i} + {i} =", max_tokens=3, seed=i)
        )
        assert reply.accepted, reply
        ids.append(reply.request_id)

    async with anyio.create_task_group() as tg:
        for i in range(50):
            tg.start_soon(one, i)
    await wait_terminal(bus, ids, timeout_s=90)
    for rid in ids:
        await settled(bus, rid)
    await wait_terminal(bus, ids, kinds=("billed",))
    for rid in ids:
        n = await counts(bus, rid)
        assert "completed" in n, of(await bus.replay(rid), RequestFailed)
        assert (n["completed"], n.get("failed", 0), n["tokens"], n["text"]) == (
            1,
            0,
            n["tokens"],
            n["tokens"] + 1,
        ), (rid, n)
        assert n["billed"] == 1 and n["accepted"] == n["authorized"] == n["tokenized"] == 1
    con = await anyio.to_thread.run_sync(
        lambda: ledger_connect(Path(pipeline.env["BRIGADE_LEDGER_DB"]), read_only=True)
    )
    try:
        rows = con.execute(
            "SELECT count(*), count(DISTINCT request_id) FROM billing WHERE request_id LIKE 'many-%'"
        ).fetchone()
    finally:
        con.close()
    assert rows == (50, 50)
    await bus.close()


BAD_SUBMITS = [
    (
        b'{"prompt": "hi", ',
        None,
        "the submit is not valid JSON: Input data was truncated",
    ),
    (
        b'{"prompt": "hi", "max_tokens": "ten"}',
        "max_tokens",
        "invalid submit field `max_tokens`: Expected `int`, got `str`",
    ),
    (
        b'{"api_key": "k", "system": "s"}',
        "messages",
        "give `messages` (a list of {role, content}), `prompt` (a string) or "
        "`prompt_token_ids`; none was sent",
    ),
    (
        b'{"prompt": "hi", "top_p": 7}',
        "top_p",
        "invalid submit field `top_p`: Expected `float` <= 1.0",
    ),
]


async def test_bad_submits_fail_clearly_and_every_stage_keeps_serving(pipeline: Pipeline) -> None:
    bus = await Bus.connect(pipeline.config)
    failed_ids = []
    for payload, field_name, message in BAD_SUBMITS:
        reply = await bus.submit(payload)
        assert (reply.accepted, reply.code, reply.field, reply.message) == (
            False,
            "invalid_request",
            field_name,
            message,
        )
        failed_ids.append(reply.request_id)
    big = await bus.submit(
        b'{"api_key": "' + KEY.encode() + b'", "prompt": "' + b"x" * (10 * 1024 * 1024) + b'"}'
    )
    assert (big.accepted, big.field) == (False, "prompt")
    assert (
        big.message
        == "invalid submit field `prompt`: Expected `str` of length <= 1000000 (the submit was 10485810 bytes)"
    )
    stranger = await bus.submit(Submit(api_key="brg-not-a-key", prompt="hi", max_tokens=2))
    assert stranger.accepted  # the gateway validates; auth refuses
    good = await bus.submit(Submit(api_key=KEY, prompt="The sky is", max_tokens=3))
    await wait_terminal(bus, [*failed_ids, big.request_id, stranger.request_id, good.request_id])
    for rid in [*failed_ids, big.request_id]:
        (failed,) = of(await bus.replay(rid), RequestFailed)
        assert (failed.stage, failed.code) == ("gateway", "invalid_request")
    (refused,) = of(await bus.replay(stranger.request_id), RequestFailed)
    assert (refused.stage, refused.code, refused.field) == ("auth", "unauthorized", "api_key")
    assert "brg-not-a-key" not in refused.message
    assert (await counts(bus, good.request_id))["completed"] == 1
    for name, procs in pipeline.workers.items():
        assert all(p.poll() is None for p in procs), f"a {name} worker died"
    await bus.close()


async def test_summarize_asks_the_engine_through_the_bus(pipeline: Pipeline) -> None:
    bus = await Bus.connect(pipeline.config)
    history = [
        Message(
            role="user" if i % 2 == 0 else "assistant",
            content=f"Note {i}: the blue box holds {i * 7} marbles. " * 4,
        )
        for i in range(12)
    ]
    reply = await bus.submit(
        Submit(
            api_key=KEY,
            messages=[*history, Message(role="user", content="How many marbles in total?")],
            truncation="summarize",
            max_tokens=8,
            temperature=0.0,
        )
    )
    await wait_terminal(bus, [reply.request_id], timeout_s=90)
    (assembled,) = of(await bus.replay(reply.request_id), ContextAssembled)
    assert assembled.fallback is None and assembled.truncated
    parts = {p.name: p for p in assembled.parts}
    assert parts["summary"].num_tokens > 0 and parts["history"].num_dropped_items > 0
    assert assembled.num_prompt_tokens <= assembled.max_prompt_tokens == 512 - 8
    summary = await settled(bus, f"{reply.request_id}-sum")
    assert (await counts(bus, f"{reply.request_id}-sum"))["completed"] == 1
    assert assembled.request.messages[0].content.endswith(text_of(summary).strip())
    await bus.close()


async def test_events_replay_from_the_stream_in_causal_order(pipeline: Pipeline) -> None:
    bus = await Bus.connect(pipeline.config)
    reply = await bus.submit(Submit(api_key=KEY, prompt="Once upon a time", max_tokens=6, seed=3))
    await wait_terminal(bus, [reply.request_id], kinds=("billed",))
    events = await settled(bus, reply.request_id)
    kinds = [e.__struct_config__.tag for e in events]
    first = {k: kinds.index(k) for k in set(kinds)}
    last = {k: len(kinds) - 1 - kinds[::-1].index(k) for k in set(kinds)}
    assert (
        first["accepted"]
        < first["authorized"]
        < first["assembled"]
        < first["tokenized"]
        < first["tokens"]
    )
    assert last["tokens"] < first["finished"] < first["completed"] < first["billed"]
    assert [e.seq for e in of(events, TokensGenerated)] == sorted(
        e.seq for e in of(events, TokensGenerated)
    )
    at = {(e.__struct_config__.tag, getattr(e, "seq", None)): i for i, e in enumerate(events)}
    for (kind, seq), i in at.items():  # every text delta after the tokens it decodes
        if kind == "text" and ("tokens", seq) in at:
            assert i > at[("tokens", seq)]
    assert all(e.ts_ns > 0 for e in events) and events == await bus.replay(reply.request_id)
    await bus.close()


async def test_a_cancel_at_any_point_ends_the_run_once_and_bills_it(pipeline: Pipeline) -> None:
    """Before it was accepted (the gateway ends it), in the engine (the abort ends it with its
    usage) and after its end (nothing changes): one terminal event each, one bill each."""
    bus = await Bus.connect(pipeline.config)
    try:
        early = "cancel-before-accept"
        await bus.publish(CancelRequested(request_id=early, tenant="acme"))
        await bus.nc.flush()
        await anyio.sleep(0.3)  # both gateway workers have heard it
        reply = await bus.submit(Submit(request_id=early, api_key=KEY, prompt="Hi", max_tokens=4))
        assert not reply.accepted and "cancelled" in reply.message

        mid = "cancel-in-engine"
        live = await bus.nc.subscribe(subjects.event_subject(mid, "tokens"))
        reply = await bus.submit(
            Submit(request_id=mid, api_key=KEY, prompt="Once upon a time", max_tokens=200,
                   ignore_eos=True, temperature=0.0)
        )  # fmt: skip
        assert reply.accepted
        await live.next_msg(timeout=60)
        await live.unsubscribe()
        await bus.publish(CancelRequested(request_id=mid, tenant="acme"))

        late = "cancel-after-end"
        reply = await bus.submit(Submit(request_id=late, api_key=KEY, prompt="Hi", max_tokens=2))
        await wait_terminal(bus, [late])
        await bus.publish(CancelRequested(request_id=late, tenant="acme"))

        await wait_terminal(bus, [early, mid, late, early], kinds=("billed",))
        await anyio.sleep(1.0)  # anything late would be stored by now
        terminal = ("completed", "failed", "cancelled")
        for rid, end in ((early, "cancelled"), (mid, "cancelled"), (late, "completed")):
            n = await counts(bus, rid)
            assert {k: v for k, v in n.items() if k in terminal} == {end: 1}, (rid, n)
            assert n["billed"] == 1
        assert "accepted" not in await counts(bus, early)
        (ended,) = of(await bus.replay(mid), RunCancelled)
        assert ended.stage is None and ended.usage.completion_tokens >= 1  # the engine's abort
        con = ledger_connect(pipeline.data_dir / "ledger.duckdb", read_only=True)
        try:
            rows = con.execute(
                "SELECT request_id, status FROM billing WHERE request_id IN (?, ?, ?) ORDER BY 1",
                [early, mid, late],
            ).fetchall()
        finally:
            con.close()
        assert rows == sorted([(early, "cancelled"), (mid, "cancelled"), (late, "completed")])
    finally:
        await bus.close()


async def test_engine_worker_killed_mid_request_completes_after_redelivery(
    pipeline: Pipeline, engine_alone
) -> None:
    """Worker B is paused so A takes the request; A is SIGKILLed mid-stream; B gets it again."""
    a, b = pipeline.workers["engine"]
    b.send_signal(signal.SIGSTOP)
    await anyio.sleep(1.0)  # B's open pull requests expire: only A can take new work
    bus = await Bus.connect(pipeline.config)
    rid = "killed-1"
    live = await bus.nc.subscribe(subjects.event_subject(rid, "tokens"))
    reply = await bus.submit(
        Submit(
            api_key=KEY,
            request_id=rid,
            prompt="Here is a long story about a dragon:",
            max_tokens=24,
            temperature=0.0,
        )
    )
    assert reply.accepted
    with anyio.fail_after(60):
        while decode_event((await live.next_msg(timeout=60)).data).seq < 2:
            pass
    a.send_signal(signal.SIGKILL)
    a.wait()
    killed_at = time.monotonic()
    b.send_signal(signal.SIGCONT)
    await live.unsubscribe()
    await wait_terminal(bus, [rid], timeout_s=60)
    assert time.monotonic() - killed_at >= 1.5  # it came back only after the ack wait
    events = await settled(bus, rid)
    n = await counts(bus, rid)
    assert (n["tokenized"], n["finished"], n["completed"]) == (1, 1, 1)
    ids = token_ids_of(events)  # no seq twice, none missing
    assert len(ids) == 24
    before: list[int] = []
    for delta in sorted(of(events, TokensGenerated), key=lambda e: e.seq):
        # one coherent generation, not the killed worker's start glued to another's rest
        context = list(delta.context_token_ids)
        assert context == before[len(before) - len(context) :], delta.seq
        before += delta.token_ids
    assert text_of(events) == engine_alone.tokenizer.decode(ids)
    await bus.close()
