"""Engine stage on a real nats-server with the real SmolLM2 engine: ids, seeds, cancel, refusal."""

from __future__ import annotations

from contextlib import asynccontextmanager

import anyio
import pytest

from schemas import subjects
from schemas.events import (
    CancelRequested,
    PromptTokenized,
    RequestFailed,
    RunFinished,
    RunStarted,
    Sampling,
    TokensGenerated,
    decode_event,
)
from stages import engine as engine_stage
from stages.detokenize import context_window
from stages.engine_params import AdmissionConfig, derived_seed, sampling_params
from stages.runtime import worker as runtime
from stages.runtime.bus import Bus

EVENTS = subjects.EVENTS_STREAM
NUM_BLOCKS = 64  # 1024 tokens of KV at block_size 16


@pytest.fixture(scope="module")
def engine():
    from engine import Engine, EngineConfig

    return Engine(EngineConfig(num_kv_blocks=NUM_BLOCKS, max_num_seqs=8))


@pytest.fixture(scope="module")
def prompt(engine) -> list[int]:
    return engine.tokenizer.encode_chat([{"role": "user", "content": "Name a colour."}])


def alone(engine, prompt: list[int], seed: int, max_tokens: int) -> list[int]:
    """The engine core with no bus: the ids the stage must reproduce."""
    from engine import SamplingParams

    engine.add_request(
        "alone", prompt, SamplingParams(temperature=0.8, seed=seed, max_tokens=max_tokens)
    )
    ids: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            ids += out.new_token_ids
    return ids


@asynccontextmanager
async def running_stage(bus_config, engine):
    bus = await Bus.connect(bus_config)
    await bus.ensure_streams()
    stop, ready = anyio.Event(), anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(
            lambda: runtime.serve(
                engine_stage.spec(engine=engine),
                config=bus_config,
                stop=stop,
                ready=ready,
                handle_signals=False,
            )
        )
        await ready.wait()
        yield bus
        stop.set()
    await bus.close()


def tokenized(rid: str, prompt: list[int], **sampling) -> PromptTokenized:
    return PromptTokenized(
        request_id=rid, tenant="t", prompt_token_ids=prompt, sampling=Sampling(**sampling)
    )


async def events_until_end(sub, ends: set[str], *, on_tokens=None) -> dict[str, list]:
    """Events of the watched requests until each has a `finished` or `failed`."""
    got: dict[str, list] = {}
    with anyio.fail_after(240):
        while ends:
            event = decode_event((await sub.next_msg(timeout=240)).data)
            got.setdefault(event.request_id, []).append(event)
            if isinstance(event, TokensGenerated) and on_tokens is not None:
                await on_tokens(event)
            if isinstance(event, RunFinished | RequestFailed):
                ends.discard(event.request_id)
    return got


@pytest.mark.anyio
async def test_tokens_match_the_engine_alone_with_seeds_and_context(bus_config, engine, prompt):
    expected = alone(engine, prompt, seed=11, max_tokens=4)
    async with running_stage(bus_config, engine) as bus:
        sub = await bus.nc.subscribe("llm.ev.*.>")
        # One at a time: the engine's numerics depend on how many rows share a step.
        await bus.publish(tokenized("seeded", prompt, temperature=0.8, seed=11, max_tokens=4))
        got = await events_until_end(sub, {"seeded"})
        await bus.publish(tokenized("noseed", prompt, temperature=0.8, max_tokens=2, stop=["xyz"]))
        got |= await events_until_end(sub, {"noseed"})
        with anyio.fail_after(10):  # the ack follows the stored `finished`
            while (
                info := await bus.js.consumer_info(EVENTS, "brigade-engine-smollm2-135m")
            ).num_ack_pending:
                await anyio.sleep(0.02)
    tokens = [e for e in got["seeded"] if isinstance(e, TokensGenerated)]
    assert [e.seq for e in tokens] == [0, 1, 2, 3]
    # one `started` a run, ahead of its first tokens: what projects run states reads no deltas
    kinds = [type(e).__name__ for e in got["seeded"] if isinstance(e, RunStarted | TokensGenerated)]
    assert kinds == ["RunStarted"] + ["TokensGenerated"] * 4
    (started,) = [e for e in got["seeded"] if isinstance(e, RunStarted)]
    assert (started.model, started.tenant) == (tokens[0].model, tokens[0].tenant)
    assert [t for e in tokens for t in e.token_ids] == expected
    assert [e.context_token_ids for e in tokens] == [expected[:i] for i in range(4)]
    assert all(e.service_ns > 0 and e.kv_usage is not None for e in tokens)
    # the compute rate after the prompt's step alone: its tokens over its time
    rate = len(prompt) / (tokens[0].service_ns / 1e9)
    assert tokens[0].compute_tok_s == pytest.approx(rate, abs=0.06)
    assert all(e.compute_tok_s is not None and e.compute_tok_s > 0 for e in tokens)
    (fin,) = [e for e in got["seeded"] if isinstance(e, RunFinished)]
    assert (fin.finish_reason, fin.last_seq, fin.seed) == ("length", 3, 11)
    assert (fin.usage.prompt_tokens, fin.usage.completion_tokens) == (len(prompt), 4)
    assert fin.context_token_ids == expected
    assert fin.prefill_ns > 0 and fin.decode_ns > 0
    assert fin.compute_tok_s is not None and fin.compute_tok_s > 0
    (fin2,) = [e for e in got["noseed"] if isinstance(e, RunFinished)]
    assert fin2.seed == derived_seed("noseed") and fin2.stop == ["xyz"]
    assert context_window(["xyz"]) == 8 + 3 + 32
    assert info.num_pending == 0 and info.num_redelivered == 0


@pytest.mark.anyio
async def test_client_cancel_and_stop_string_cancel(bus_config, engine, prompt):
    async def cancel_when(event: TokensGenerated) -> None:
        if event.request_id == "client" and event.seq == 0:
            await bus.publish(CancelRequested(request_id="client", reason="client"))
        if event.request_id == "stopped" and event.seq == 1:
            cancel = CancelRequested(request_id="stopped", reason="stop_string", seq=1)
            await bus.publish(cancel)

    async with running_stage(bus_config, engine) as bus:
        sub = await bus.nc.subscribe("llm.ev.*.>")
        for rid in ("client", "stopped"):
            await bus.publish(tokenized(rid, prompt, max_tokens=200, ignore_eos=True, seed=3))
        got = await events_until_end(sub, {"client", "stopped"}, on_tokens=cancel_when)
        stats = engine.stats()
    (fin,) = [e for e in got["client"] if isinstance(e, RunFinished)]
    assert (fin.finish_reason, fin.cancel_reason) == ("abort", "client")
    assert fin.usage.completion_tokens < 200
    (fin,) = [e for e in got["stopped"] if isinstance(e, RunFinished)]
    assert (fin.finish_reason, fin.last_seq, fin.usage.completion_tokens) == ("stop", 1, 2)
    first_two = [t for e in got["stopped"] if isinstance(e, TokensGenerated) for t in e.token_ids]
    assert fin.context_token_ids == first_two[:2]
    assert stats.num_free_blocks == NUM_BLOCKS and stats.num_running == 0


@pytest.mark.anyio
async def test_requests_the_engine_cannot_serve_fail_with_the_reason(bus_config, engine, prompt):
    async with running_stage(bus_config, engine) as bus:
        sub = await bus.nc.subscribe("llm.ev.*.>")
        await bus.publish(tokenized("minmax", prompt, max_tokens=4, min_tokens=9))
        await bus.publish(tokenized("huge", prompt, max_tokens=2000))
        await bus.publish(tokenized("oov", [*prompt, 10**6], max_tokens=2))
        got = await events_until_end(sub, {"minmax", "huge", "oov"})
    (bad,) = [e for e in got["minmax"] if isinstance(e, RequestFailed)]
    assert (bad.stage, bad.code, bad.field) == ("engine", "invalid_request", "min_tokens")
    (huge,) = [e for e in got["huge"] if isinstance(e, RequestFailed)]
    assert (huge.code, huge.field) == ("context_length", "prompt_token_ids")
    assert f"{len(prompt) + 2000}" in huge.message and "KV blocks" in huge.message
    (oov,) = [e for e in got["oov"] if isinstance(e, RequestFailed)]
    assert (oov.code, oov.field) == ("invalid_request", "prompt_token_ids")
    assert "[1000000]" in oov.message


@pytest.mark.anyio
async def test_a_dead_workers_request_is_resumed_after_its_stored_tokens(
    bus_config, engine, prompt, monkeypatch
):
    """Worker 1 dies (connection gone, nothing acked) after 3 tokens; worker 2 gets the
    redelivery and continues at seq 3: every seq stored once, one `finished`, 6 tokens, and
    (sampled at temperature 1, seeded) the very tokens of the same request run uninterrupted."""
    monkeypatch.setenv("BRIGADE_ACK_WAIT_S", "2")
    client = await Bus.connect(bus_config)
    await client.ensure_streams()
    sub = await client.nc.subscribe("llm.ev.crash.>")
    dead = await Bus.connect(bus_config)
    worker = runtime.StageWorker(
        engine_stage.spec(engine=engine, admission=AdmissionConfig()), dead
    )
    ready = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(worker.run, anyio.Event(), ready)
        await ready.wait()
        await client.publish(tokenized("crash", prompt, max_tokens=6, ignore_eos=True, seed=9))
        with anyio.fail_after(120):
            while True:
                event = decode_event((await sub.next_msg(timeout=120)).data)
                if isinstance(event, TokensGenerated) and event.seq == 2:
                    break
        tg.cancel_scope.cancel()  # the worker dies mid-request: nothing settled, nothing naked
    await dead.nc.close()  # ... and its connection with it
    assert not engine.abort_request(
        "crash"
    )  # its stage aborted it: a new process would not know it
    while engine.has_unfinished_requests():
        engine.step()
    async with running_stage(bus_config, engine):
        got = await events_until_end(sub, {"crash"})
    stored = await client.replay("crash")
    await client.close()
    tokens = [e for e in stored if isinstance(e, TokensGenerated)]
    assert [e.seq for e in tokens] == [0, 1, 2, 3, 4, 5]
    assert sum(isinstance(e, RunStarted) for e in stored) == 1  # the first worker's only
    ids = [t for e in tokens for t in e.token_ids]
    assert [e.context_token_ids for e in tokens] == [ids[:i] for i in range(6)]
    (fin,) = [e for e in stored if isinstance(e, RunFinished)]
    assert (fin.finish_reason, fin.last_seq, fin.usage.completion_tokens) == ("length", 5, 6)
    assert fin.usage.prompt_tokens == len(prompt) and fin.context_token_ids == ids
    assert any(isinstance(e, RunFinished) for e in got["crash"])
    event = tokenized("crash", prompt, max_tokens=6, ignore_eos=True, seed=9)
    engine.add_request("whole", prompt, sampling_params(event.sampling, "crash"))
    whole = []
    while engine.has_unfinished_requests():
        whole += [t for o in engine.step() for t in o.new_token_ids]
    assert ids == whole


@pytest.mark.anyio
async def test_a_rerun_that_samples_otherwise_continues_after_the_stored_tokens(
    bus_config, engine, prompt, monkeypatch
):
    """The dead worker stored 3 steps this engine would not sample (other numerics): the re-run
    keeps them, continues after them at seq 3, and stores each seq once."""
    monkeypatch.setenv("BRIGADE_ACK_WAIT_S", "2")
    stored = engine.tokenizer.encode(" Blue, green and red")[:3]
    assert len(stored) == 3
    client = await Bus.connect(bus_config)
    await client.ensure_streams()
    dead = await Bus.connect(bus_config)
    taker = await dead.pull(runtime.with_env_overrides(engine_stage.SPEC).consumer())
    await client.publish(tokenized("other", prompt, max_tokens=6, ignore_eos=True, seed=4))
    (msg,) = await taker.fetch(1, timeout=5)  # taken, never acked: the worker dies after 3 steps
    for seq, token in enumerate(stored):
        await dead.publish(
            TokensGenerated(
                request_id="other", seq=seq, token_ids=[token], context_token_ids=stored[:seq]
            )
        )
    await dead.nc.close()
    async with running_stage(bus_config, engine):
        sub = await client.nc.subscribe("llm.ev.other.finished")
        await sub.next_msg(timeout=120)
    events = await client.replay("other")
    await client.close()
    tokens = [e for e in events if isinstance(e, TokensGenerated)]
    assert [e.seq for e in tokens] == [0, 1, 2, 3, 4, 5]
    ids = [t for e in tokens for t in e.token_ids]
    assert ids[:3] == stored
    assert [e.context_token_ids for e in tokens] == [ids[:i] for i in range(6)]
    (fin,) = [e for e in events if isinstance(e, RunFinished)]
    assert (fin.finish_reason, fin.last_seq, fin.usage.completion_tokens) == ("length", 5, 6)
    assert fin.context_token_ids == ids and engine.stats().num_free_blocks == NUM_BLOCKS


@pytest.mark.anyio
async def test_a_constrained_rerun_continues_its_grammar_after_the_stored_tokens(
    bus_config, engine, prompt, monkeypatch
):
    """The dead worker stored " Bl" + "ue" (a spelling this engine would not pick): the re-run
    keeps them and its grammar goes on from there, so the choice is completed, not restarted."""
    monkeypatch.setenv("BRIGADE_ACK_WAIT_S", "2")
    tok = engine.tokenizer
    stored = [tok.token_to_id("ĠBl"), tok.token_to_id("ue")]
    assert None not in stored and tok.decode(stored) == " Bl" + "ue"
    choices = [" Blue, green and red", " Yellow"]
    client = await Bus.connect(bus_config)
    await client.ensure_streams()
    dead = await Bus.connect(bus_config)
    taker = await dead.pull(runtime.with_env_overrides(engine_stage.SPEC).consumer())
    await client.publish(tokenized("chosen", prompt, max_tokens=16, seed=4, guided_choice=choices))
    (msg,) = await taker.fetch(1, timeout=5)  # taken, never acked: the worker dies after 2 steps
    for seq, token in enumerate(stored):
        await dead.publish(
            TokensGenerated(
                request_id="chosen", seq=seq, token_ids=[token], context_token_ids=stored[:seq]
            )
        )
    await dead.nc.close()
    async with running_stage(bus_config, engine):
        sub = await client.nc.subscribe("llm.ev.chosen.finished")
        await sub.next_msg(timeout=120)
    events = await client.replay("chosen")
    await client.close()
    ids = [t for e in events if isinstance(e, TokensGenerated) for t in e.token_ids]
    assert ids[:2] == stored
    assert tok.decode(ids) == choices[0]
    (fin,) = [e for e in events if isinstance(e, RunFinished)]
    assert fin.finish_reason == "stop" and engine.stats().num_free_blocks == NUM_BLOCKS
