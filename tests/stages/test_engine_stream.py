"""Coalescing `tokens` events while detokenize lags: the interval's rule, and the engine stage on
a real nats-server against a detokenize durable that falls behind (nothing pulls it), with the
real SmolLM2 engine: events grow past one token, seq stays contiguous, each event's context is
the tokens before it, and the text detokenize makes of the events is the text of all tokens."""

from __future__ import annotations

import anyio
import pytest

from schemas import subjects
from schemas.events import RunCompleted, RunFinished, TextGenerated, TokensGenerated
from stages.detokenize import Detokenizer
from stages.engine_stream import StreamConfig, StreamInterval
from stages.runtime.bus import ConsumerSpec
from tests.stages.test_engine_stage import engine, events_until_end, running_stage, tokenized

__all__ = ["engine"]  # the module fixture, shared


async def lagging_detokenize(bus) -> None:
    """detokenize's durable, lagging: nobody pulls it (yet), so its backlog is every event."""
    await bus.ensure_consumer(
        ConsumerSpec(
            durable=subjects.durable_name("detokenize"),
            filter_subject=(subjects.all_events("tokens"), subjects.all_events("finished")),
        )
    )


def test_the_interval_rises_to_cover_a_backlog_and_falls_back_by_one():
    s = StreamInterval(None, StreamConfig(max_tokens_per_event=8))
    assert s.update(backlog=4, num_running=4) == 1  # one step's events: keeping up
    assert s.update(backlog=9, num_running=4) == 3  # 1 + 9 // 4
    assert s.update(backlog=5, num_running=4) == 3  # still behind: it does not fall
    assert s.update(backlog=100, num_running=4) == 8  # at most the cap
    assert [s.update(0, 4) for _ in range(8)] == [7, 6, 5, 4, 3, 2, 1, 1]
    assert s.update(backlog=3, num_running=0) == 4  # no runs: a step of one event is the unit
    off = StreamInterval(None, StreamConfig(max_tokens_per_event=1))
    assert off.update(backlog=1000, num_running=1) == 1


@pytest.mark.anyio
async def test_events_coalesce_while_detokenize_lags_and_the_text_is_the_same(
    bus_config, engine, monkeypatch
):
    monkeypatch.setenv("BRIGADE_STREAM_MAX_COALESCE", "4")
    monkeypatch.setenv("BRIGADE_STREAM_LAG_POLL_S", "0.01")
    prompts = [
        engine.tokenizer.encode_chat([{"role": "user", "content": f"Count to {n}."}])
        for n in (5, 6, 7, 8)
    ]
    async with running_stage(bus_config, engine) as bus:
        await lagging_detokenize(bus)
        sub = await bus.nc.subscribe("llm.ev.*.>")
        for i, prompt in enumerate(prompts):
            await bus.publish(tokenized(f"r{i}", prompt, max_tokens=40, ignore_eos=True))
        got = await events_until_end(sub, {f"r{i}" for i in range(len(prompts))})
        await anyio.sleep(0)
    detok = Detokenizer(engine.tokenizer)
    sizes = []
    for events in got.values():
        tokens = [e for e in events if isinstance(e, TokensGenerated)]
        (fin,) = [e for e in events if isinstance(e, RunFinished)]
        ids = [t for e in tokens for t in e.token_ids]
        assert len(ids) == fin.usage.completion_tokens == 40
        assert [e.seq for e in tokens] == list(range(len(tokens)))  # seq counts events
        assert fin.last_seq == len(tokens) - 1
        assert len(tokens[0].token_ids) == 1  # the first token is never held
        at = 0
        for e in tokens:  # each event's context is the tokens just before it
            assert e.context_token_ids == ids[:at][-len(e.context_token_ids) :]
            assert len(e.context_token_ids) == min(at, 8)
            at += len(e.token_ids)
        text = "".join(
            out.text
            for e in [*tokens, fin]
            for out in detok.handle(e)
            if isinstance(out, TextGenerated)
        )
        assert text == engine.tokenizer.decode(ids)
        sizes += [len(e.token_ids) for e in tokens]
    assert max(sizes) == 4  # coalesced up to the cap under the backlog, never past it
    assert len(sizes) < len(prompts) * 40 * 0.6  # far fewer events than tokens


@pytest.mark.anyio
async def test_flushing_per_step_carries_the_same_events_as_per_event(
    bus_config, engine, monkeypatch
):
    """BRIGADE_STREAM_FLUSH=step writes a step's events together: the runs' events are the same
    ones (one token each, seq contiguous, the same greedy tokens) as with a write per event."""
    prompts = [
        engine.tokenizer.encode_chat([{"role": "user", "content": f"Name {n} colours."}])
        for n in (2, 3, 4)
    ]
    ids_by_mode = {}
    for mode in ("event", "step"):
        monkeypatch.setenv("BRIGADE_STREAM_FLUSH", mode)
        async with running_stage(bus_config, engine) as bus:
            sub = await bus.nc.subscribe("llm.ev.*.>")
            for i, prompt in enumerate(prompts):
                await bus.publish(
                    tokenized(f"{mode}{i}", prompt, max_tokens=12, ignore_eos=True, temperature=0.0)
                )
            got = await events_until_end(sub, {f"{mode}{i}" for i in range(len(prompts))})
        ids = []
        for i in range(len(prompts)):
            tokens = [e for e in got[f"{mode}{i}"] if isinstance(e, TokensGenerated)]
            assert [e.seq for e in tokens] == list(range(12))
            assert all(len(e.token_ids) == 1 for e in tokens)
            ids.append([e.token_ids[0] for e in tokens])
        ids_by_mode[mode] = ids
    assert ids_by_mode["step"] == ids_by_mode["event"]


@pytest.mark.anyio
async def test_two_detokenize_workers_make_the_text_of_coalesced_events(
    bus_config, engine, monkeypatch
):
    """`--scale detokenize=2` with coalescing: the engine coalesces while detokenize's durable
    lags (nobody pulls it yet), then two detokenize workers share that durable. Each run's text
    events, whichever worker made each, are seq 0..last_seq once each, and their text is the
    text of all its tokens."""
    from stages import detokenize
    from stages.runtime import worker as runtime

    monkeypatch.setenv("BRIGADE_STREAM_MAX_COALESCE", "4")
    monkeypatch.setenv("BRIGADE_STREAM_LAG_POLL_S", "0.01")
    prompts = [
        engine.tokenizer.encode_chat([{"role": "user", "content": f"Spell the number {n}."}])
        for n in (11, 12, 13, 14)
    ]
    ids = [f"two{i}" for i in range(len(prompts))]
    async with running_stage(bus_config, engine) as bus:
        await lagging_detokenize(bus)
        sub = await bus.nc.subscribe("llm.ev.*.>")
        for rid, prompt in zip(ids, prompts, strict=True):
            await bus.publish(tokenized(rid, prompt, max_tokens=24, ignore_eos=True))
        got = await events_until_end(sub, set(ids))  # the engine is done; detokenize is not
        await sub.unsubscribe()
        stop = anyio.Event()
        async with anyio.create_task_group() as tg:
            for _ in range(2):
                tg.start_soon(
                    lambda: runtime.serve(
                        detokenize.SPEC, config=bus_config, stop=stop, handle_signals=False
                    )
                )
            with anyio.fail_after(60):
                while True:
                    events = {rid: await bus.replay(rid) for rid in ids}
                    done = {
                        rid
                        for rid, evs in events.items()
                        if any(isinstance(e, RunCompleted) for e in evs)
                        and {e.seq for e in evs if isinstance(e, TextGenerated)}
                        >= set(
                            range(next(e for e in evs if isinstance(e, RunCompleted)).last_seq + 1)
                        )
                    }
                    if done == set(ids):
                        break
                    await anyio.sleep(0.05)
            stop.set()
    sizes = []
    for rid in ids:
        tokens = sorted(
            (e for e in got[rid] if isinstance(e, TokensGenerated)), key=lambda e: e.seq
        )
        token_ids = [t for e in tokens for t in e.token_ids]
        texts = sorted(
            (e for e in events[rid] if isinstance(e, TextGenerated)), key=lambda e: e.seq
        )
        assert [e.seq for e in texts] == list(range(len(texts)))  # once each, none missing
        assert "".join(e.text for e in texts) == engine.tokenizer.decode(token_ids)
        assert len(token_ids) == 24
        sizes += [len(e.token_ids) for e in tokens]
    assert max(sizes) > 1  # the events were coalesced
