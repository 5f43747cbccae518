"""The archiver against a real nats-server: across restarts and crashes, every stream sequence
lands in the Parquet archive exactly once, with its payload intact."""

from __future__ import annotations

from pathlib import Path

import anyio
import duckdb
import pytest

from schemas import events as ev
from stages.eventlog import archiver as archiver_stage
from stages.eventlog.archiver import Archiver, ArchiverConfig
from stages.eventlog.parquet import ParquetLog
from stages.runtime import worker as runtime
from stages.runtime.bus import Bus, BusConfig
from stages.runtime.natscluster import NatsCluster

pytestmark = pytest.mark.anyio


class Crash(Exception):
    """Stands for the process dying at an exact point."""


def request_events(rid: str, num_tokens: int) -> list[ev.Event]:
    req = ev.Request(messages=[ev.Message(role="user", content=f"question {rid}")])
    out: list[ev.Event] = [ev.RequestAccepted(request_id=rid, request=req, received_ns=1)]
    for seq in range(num_tokens):
        out.append(ev.TokensGenerated(request_id=rid, seq=seq, token_ids=[seq, seq + 1]))
        out.append(ev.TextGenerated(request_id=rid, seq=seq, text=f"t{seq} é"))
    out.append(ev.RunCompleted(request_id=rid, finish_reason="length", last_seq=num_tokens - 1))
    return out


async def publish(bus: Bus, rid: str, num_tokens: int) -> int:
    acks = await bus.publish_all(request_events(rid, num_tokens))
    return max(a.seq for a in acks)


def archived(root: Path) -> list[tuple]:
    return duckdb.sql(
        f"SELECT stream_seq, type, request_id, seq, num_tokens, text, data "
        f"FROM read_parquet('{root}/**/*.parquet') ORDER BY stream_seq"
    ).fetchall()


async def run_until(bus_config: BusConfig, config: ArchiverConfig, last_seq: int, crash_at=None):
    """Run one archiver until its checkpoint reaches `last_seq` (or it crashes)."""
    bus = await Bus.connect(bus_config)
    archiver = Archiver(bus, config)
    if crash_at is not None:
        crash_at(archiver)
    stop = anyio.Event()
    crashed = False
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(archiver.run, stop)
            with anyio.fail_after(20):
                while archiver.stats.last_stream_seq < last_seq:
                    await anyio.sleep(0.02)
            stop.set()
    except* Crash:
        crashed = True
    finally:
        await bus.nc.close()  # no drain: a crash leaves its acks unsent
    return archiver.stats, crashed


def crash_after_files(archiver: Archiver) -> None:
    """Files durable and renamed, checkpoint never written, nothing acked."""

    def commit(last_stream_seq: int) -> None:
        raise Crash

    archiver.log.commit = commit  # type: ignore[method-assign]


def crash_after_checkpoint(archiver: Archiver) -> None:
    """Files and checkpoint durable, the ack never sent."""
    original = archiver.log.commit

    def commit(last_stream_seq: int) -> None:
        original(last_stream_seq)
        raise Crash

    archiver.log.commit = commit  # type: ignore[method-assign]


async def test_exactly_once_across_restarts_and_crashes(bus_config: BusConfig, tmp_path: Path):
    root = tmp_path / "archive"
    config = ArchiverConfig(archive_dir=root, max_age_s=0.2, ack_wait_s=2.0)
    bus = await Bus.connect(bus_config)
    await bus.ensure_streams()
    try:
        last = await publish(bus, "r1", 3)  # 8 events: seqs 1..8
        stats, crashed = await run_until(bus_config, config, last)
        assert (crashed, stats.num_rows, stats.last_stream_seq) == (False, 8, 8)

        last = await publish(bus, "r2", 2)  # seqs 9..14
        _, crashed = await run_until(bus_config, config, last, crash_after_files)
        assert crashed and ParquetLog(root).read_checkpoint() == 8
        last = await publish(bus, "r3", 1)  # seqs 15..18
        stats, crashed = await run_until(bus_config, config, last)
        assert not crashed and stats.num_rows == 4  # 9..14 were on disk: recovered, not redone

        last = await publish(bus, "r4", 4)  # seqs 19..28
        _, crashed = await run_until(bus_config, config, last, crash_after_checkpoint)
        assert crashed and ParquetLog(root).read_checkpoint() == 28
        last = await publish(bus, "r5", 1)  # seqs 29..32
        stats, crashed = await run_until(bus_config, config, last)
        assert not crashed and stats.num_rows == 4 and stats.num_lost == 0
    finally:
        await bus.close()

    rows = archived(root)
    assert [r[0] for r in rows] == list(range(1, 33))  # every sequence once, none twice
    by_seq = {r[0]: r[1:] for r in rows}
    assert by_seq[1][:2] == ("accepted", "r1")
    assert by_seq[2][:5] == ("tokens", "r1", 0, 2, None)
    assert by_seq[3][:5] == ("text", "r1", 0, None, "t0 é")
    decoded = ev.decode_event(by_seq[20][5].encode())
    assert decoded == ev.TokensGenerated(
        request_id="r4", seq=0, token_ids=[0, 1], ts_ns=decoded.ts_ns
    )
    assert ParquetLog(root).read_checkpoint() == 32
    assert not list(root.glob("**/*.tmp")) and not list((root / ".staging").iterdir())


async def test_clean_restart_reuses_the_durable(bus_config: BusConfig, tmp_path: Path):
    config = ArchiverConfig(archive_dir=tmp_path / "archive", max_age_s=0.2, ack_wait_s=2.0)
    bus = await Bus.connect(bus_config)
    await bus.ensure_streams()
    try:
        await run_until(bus_config, config, await publish(bus, "a", 1))
        first = await bus.js.consumer_info("BRIGADE_EVENTS", "brigade-archiver")
        await run_until(bus_config, config, await publish(bus, "b", 1))
        second = await bus.js.consumer_info("BRIGADE_EVENTS", "brigade-archiver")
    finally:
        await bus.close()
    assert first.created == second.created  # the same durable, not a recreated one
    assert (second.ack_floor.stream_seq, second.num_ack_pending) == (8, 0)
    assert [r[0] for r in archived(tmp_path / "archive")] == list(range(1, 9))


async def test_an_archive_ahead_of_a_recreated_stream_is_refused(
    bus_config: BusConfig, tmp_path: Path
):
    ParquetLog(tmp_path / "archive").commit(500)  # an archive of an earlier stream
    bus = await Bus.connect(bus_config)
    await bus.ensure_streams()
    try:
        await publish(bus, "fresh", 1)  # the new stream ends at seq 4
        archiver = Archiver(bus, ArchiverConfig(archive_dir=tmp_path / "archive"))
        with pytest.raises(RuntimeError, match="up to 500 but the BRIGADE_EVENTS stream ends at 4"):
            await archiver.start()
    finally:
        await bus.close()


async def test_as_a_stage_it_writes_what_it_holds_when_stopped(
    bus_config: BusConfig, tmp_path: Path
):
    """Through the runtime's serve, as `brigade stage archiver` runs it: files are cut only
    every 60 s here, so everything on disk after the stop was written by the stop's drain."""
    root = tmp_path / "archive"
    config = ArchiverConfig(archive_dir=root, max_age_s=60.0, ack_wait_s=120.0)
    bus = await Bus.connect(bus_config)
    await bus.ensure_streams()
    stop, ready = anyio.Event(), anyio.Event()
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(
                lambda: runtime.serve(
                    archiver_stage.spec(config),
                    config=bus_config,
                    stop=stop,
                    ready=ready,
                    handle_signals=False,
                )
            )
            await ready.wait()
            last = await publish(bus, "s1", 2)  # seqs 1..6
            with anyio.fail_after(10):  # delivered to it, buffered, not acked yet
                while (
                    await bus.js.consumer_info("BRIGADE_EVENTS", "brigade-archiver")
                ).delivered.stream_seq < last:
                    await anyio.sleep(0.02)
            assert not list(root.glob("**/*.parquet"))
            stop.set()
        info = await bus.js.consumer_info("BRIGADE_EVENTS", "brigade-archiver")
    finally:
        await bus.close()
    assert [r[0] for r in archived(root)] == list(range(1, last + 1))
    assert ParquetLog(root).read_checkpoint() == last
    assert (info.ack_floor.stream_seq, info.num_ack_pending) == (last, 0)


async def test_it_waits_out_a_cluster_without_quorum_at_start_then_archives(tmp_path: Path):
    """Two of three nodes down: JetStream answers 'temporarily unavailable' (or nothing). The
    archiver's start waits with a bounded backoff instead of exiting, and once the nodes are
    back it archives what was published before."""
    cluster = NatsCluster(tmp_path / "nats").start()
    config = BusConfig(servers=cluster.urls, replicas=3)
    try:
        bus = await Bus.connect(config)
        await bus.ensure_streams()
        last = await publish(bus, "r1", 3)
        await bus.close()
        leader = cluster.meta_leader()
        down = [n.name for n in cluster.nodes if n.name != leader][:1] + [leader]
        for name in down:
            cluster.kill(name)
        bus = await Bus.connect(config)
        archiver = Archiver(bus, ArchiverConfig(archive_dir=tmp_path / "archive"))
        stop = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(archiver.run, stop)
            await anyio.sleep(3.0)  # several tries fail meanwhile: none of them ends the task
            for name in down:
                cluster.launch(name)
            with anyio.fail_after(30):
                while archiver.stats.last_stream_seq < last:
                    await anyio.sleep(0.1)
            stop.set()
        await bus.close()
        assert [row[0] for row in archived(tmp_path / "archive")] == list(range(1, last + 1))
    finally:
        cluster.stop()


@pytest.mark.parametrize(
    ("pace_s", "max_spread_s", "min_spread_s"), [(1.0, 0.1, 0.0), (0.0, None, 0.25)]
)
async def test_caught_up_it_waits_so_the_next_events_come_in_one_fetch(
    bus_config: BusConfig, tmp_path: Path, pace_s, max_spread_s, min_spread_s
):
    """After a fetch that did not fill its batch the archiver waits `pace_s`: eight events
    published 50 ms apart meanwhile arrive in one fetch (taken within a few ms of each other),
    not one wake-up each. Without the pace they are taken as they come, spread over ~350 ms."""
    config = ArchiverConfig(archive_dir=tmp_path / "archive", max_age_s=5.0, pace_s=pace_s)
    bus = await Bus.connect(bus_config)
    await bus.ensure_streams()
    archiver = Archiver(bus, config)
    taken: list[float] = []
    accept = archiver.accept

    def stamped(msg) -> None:
        taken.append(anyio.current_time())
        accept(msg)

    archiver.accept = stamped  # type: ignore[method-assign]
    stop = anyio.Event()
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(archiver.run, stop)
            await bus.publish(ev.RunCompleted(request_id="first", finish_reason="length"))
            with anyio.fail_after(10):
                while not taken:
                    await anyio.sleep(0.01)
            for i in range(8):
                await bus.publish(ev.RunCompleted(request_id=f"later-{i}", finish_reason="length"))
                await anyio.sleep(0.05)
            with anyio.fail_after(10):
                while len(taken) < 9:
                    await anyio.sleep(0.01)
            stop.set()
    finally:
        await bus.close()
    spread = taken[-1] - taken[1]
    if max_spread_s is not None:
        assert spread < max_spread_s, taken
    assert spread >= min_spread_s, taken
