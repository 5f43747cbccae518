import anyio
import pytest

from schemas import subjects
from schemas.events import (
    PromptTokenized,
    RequestFailed,
    RunCompleted,
    RunFinished,
    RunStarted,
    TextGenerated,
    TokensGenerated,
    Usage,
    encode,
)
from stages.edge.runwatch import GAP_SLACK_S, DeadlinePassed, RunWatch, gap_timeout_for
from stages.runtime.bus import Bus

pytestmark = pytest.mark.anyio


def _text(rid: str, seq: int) -> TextGenerated:
    return TextGenerated(request_id=rid, tenant="acme", seq=seq, text=f"<{seq}>")


def _done(rid: str, last_seq: int) -> RunCompleted:
    return RunCompleted(
        request_id=rid,
        tenant="acme",
        finish_reason="stop",
        last_seq=last_seq,
        usage=Usage(completion_tokens=3),
    )


async def _collect(watch: RunWatch) -> list[int]:
    with anyio.fail_after(10):
        return [d.seq async for d in watch.deltas()]


async def test_live_deltas_reordered_and_deduplicated(bus_config):
    bus = await Bus.connect(bus_config)
    try:
        await bus.ensure_streams()
        async with RunWatch(bus.nc, bus.js, "live1") as watch:
            await bus.nc.flush()
            for seq in (2, 0, 1, 1, 0):
                await bus.nc.publish(
                    subjects.event_subject("live1", "text"), encode(_text("live1", seq))
                )
            await bus.publish(_done("live1", 3))  # arrives before seq 3
            await bus.publish(_text("live1", 3))
            assert await _collect(watch) == [0, 1, 2, 3]
            assert watch.terminal.last_seq == 3
            assert watch.buffer.num_duplicates == 2
    finally:
        await bus.close()


async def test_a_delta_missed_live_is_filled_from_the_log(bus_config):
    bus = await Bus.connect(bus_config)
    try:
        await bus.ensure_streams()
        await bus.publish(_text("gap1", 0))  # stored before the watcher subscribed
        async with RunWatch(bus.nc, bus.js, "gap1") as watch:
            await bus.nc.flush()
            await bus.publish(_text("gap1", 1))
            await bus.publish(_done("gap1", 1))
            assert await _collect(watch) == [0, 1]
            assert watch.num_gap_fills == 1
        consumers = await bus.js.streams_info()
        assert [
            s.state.consumer_count for s in consumers if s.config.name == subjects.EVENTS_STREAM
        ] == [0]
    finally:
        await bus.close()


async def test_a_delta_redelivered_after_the_end_still_reaches_the_client(bus_config):
    """A detokenizer killed holding seq 1 has it redelivered after the ack wait, while its
    successor ends the run from the `finished` that came next: the watch waits out the ack wait."""
    bus = await Bus.connect(bus_config)
    try:
        await bus.ensure_streams()
        gap = gap_timeout_for(0.8, 1)  # an ack wait of 0.8 s, one delivery: 2.8 s
        assert gap == 0.8 + GAP_SLACK_S
        async with RunWatch(bus.nc, bus.js, "redeliver1", gap_timeout_s=gap) as watch:
            await bus.nc.flush()
            await bus.publish(_text("redeliver1", 0))
            await bus.publish(_done("redeliver1", 2))  # seq 1 and the flush, seq 2, still due
            await bus.publish(_text("redeliver1", 2))
            with anyio.fail_after(10):
                got = []
                async with anyio.create_task_group() as tg:

                    async def late() -> None:
                        await anyio.sleep(2.2)  # past the old 2 s bound, within the ack wait's
                        await bus.publish(_text("redeliver1", 1))

                    tg.start_soon(late)
                    got = [d.seq async for d in watch.deltas()]
            assert got == [0, 1, 2]
    finally:
        await bus.close()


def test_the_gap_wait_covers_a_redelivery_and_a_publish_handed_back_through_an_election():
    """A detokenizer whose text publish finds the bus away hands its `tokens` back for 1, 2, 4
    and 8 s (five deliveries): with a 5 s ack wait the run's end may come 15 s before that text,
    and with the default 30 s ack wait a dead consumer's redelivery is the longer."""
    assert gap_timeout_for(5.0, 5) == 1 + 2 + 4 + 8 + GAP_SLACK_S
    assert gap_timeout_for(30.0, 5) == 30.0 + GAP_SLACK_S
    assert gap_timeout_for(5.0, 3) == 5.0 + GAP_SLACK_S  # waits of 1 and 2 s


async def test_resume_replays_the_rest_from_the_log(bus_config):
    bus = await Bus.connect(bus_config)
    try:
        await bus.ensure_streams()
        for seq in range(4):
            await bus.publish(_text("res1", seq))
        await bus.publish(_done("res1", 3))
        async with RunWatch(bus.nc, bus.js, "res1", starting_after=1) as watch:
            assert await _collect(watch) == [2, 3]
        async with RunWatch(bus.nc, bus.js, "res1", starting_after=-1) as watch:
            assert await _collect(watch) == [0, 1, 2, 3]
        async with RunWatch(bus.nc, bus.js, "res1", starting_after=3) as watch:
            assert await _collect(watch) == []
            assert isinstance(watch.terminal, RunCompleted)
    finally:
        await bus.close()


async def test_failed_run_ends_the_watch(bus_config):
    bus = await Bus.connect(bus_config)
    try:
        await bus.ensure_streams()
        async with RunWatch(bus.nc, bus.js, "f1") as watch:
            await bus.nc.flush()
            await bus.publish(
                RequestFailed(request_id="f1", stage="auth", code="unauthorized", message="bad key")
            )
            assert await _collect(watch) == []
            assert watch.terminal.code == "unauthorized"
    finally:
        await bus.close()


async def test_silence_times_out(bus_config):
    bus = await Bus.connect(bus_config)
    try:
        async with RunWatch(bus.nc, bus.js, "quiet", idle_timeout_s=0.2) as watch:
            with pytest.raises(TimeoutError, match="no event for 0.2s"):
                await _collect(watch)
    finally:
        await bus.close()


async def test_an_end_missed_live_is_found_in_the_log(bus_config):
    bus = await Bus.connect(bus_config)
    try:
        await bus.ensure_streams()
        async with RunWatch(bus.nc, bus.js, "lost1", poll_s=0.1) as watch:
            await bus.nc.flush()
            await bus.publish(_text("lost1", 0))
            await bus.nc.flush()
            for sub in watch._live:  # from here on nothing arrives live (a slow consumer)
                await sub.unsubscribe()
            await bus.publish(_text("lost1", 1))
            await bus.publish(_done("lost1", 1))
            assert await _collect(watch) == [0, 1]
            assert watch.terminal.last_seq == 1
    finally:
        await bus.close()


def _run_events(rid: str) -> list:
    """One run's events in the order the stages publish them, two tokens steps."""
    tokens = [TokensGenerated(request_id=rid, seq=seq, token_ids=[7 + seq]) for seq in (0, 1)]
    return [
        PromptTokenized(request_id=rid, prompt_token_ids=[1, 2], model="smol"),  # routed
        RunStarted(request_id=rid, num_running=3, kv_usage=0.25),
        tokens[0],
        _text(rid, 0),
        tokens[1],
        _text(rid, 1),
        RunFinished(request_id=rid, finish_reason="length", last_seq=1),
        _done(rid, 1),
    ]


@pytest.mark.parametrize("with_tokens", [False, True])
async def test_a_live_watch_takes_tokens_events_only_when_asked(bus_config, with_tokens):
    """The detokenizer reads each step's `tokens`; a watch takes them only for logprobs, and
    sees the run's start, text and end either way."""
    bus = await Bus.connect(bus_config)
    seen: list[str] = []
    try:
        await bus.ensure_streams()
        rid = f"tok{int(with_tokens)}"
        observe = lambda event, _ns: seen.append(type(event).__struct_config__.tag)  # noqa: E731
        async with RunWatch(
            bus.nc, bus.js, rid, on_event=observe, with_tokens=with_tokens, deadline_s=5.0
        ) as watch:
            await bus.nc.flush()
            for event in _run_events(rid):
                await bus.publish(event)
            assert await _collect(watch) == [0, 1]
            assert watch.started and watch.terminal.last_seq == 1
        expected = ["tokenized", "started", "text", "text", "finished", "completed"]
        if with_tokens:
            expected = ["tokenized", "started", "tokens", "text", "tokens", "text", "finished",
                        "completed"]  # fmt: skip
        assert sorted(seen) == sorted(expected)
        assert watch._live == []  # every live subscription closed
    finally:
        await bus.close()


async def test_started_alone_ends_the_wait_for_an_engine(bus_config):
    """The deadline bounds the wait until the engine's `started`, which comes before any text."""
    bus = await Bus.connect(bus_config)
    try:
        await bus.ensure_streams()
        async with RunWatch(bus.nc, bus.js, "st1", deadline_s=0.3, idle_timeout_s=0.6) as watch:
            await bus.nc.flush()
            await bus.publish(RunStarted(request_id="st1"))
            with pytest.raises(TimeoutError, match="no event for 0.6s") as raised:
                await _collect(watch)  # past the deadline, the idle timeout ends it
            assert not isinstance(raised.value, DeadlinePassed)
            assert watch.started
    finally:
        await bus.close()
