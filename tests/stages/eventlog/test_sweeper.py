"""The sweeper on a real nats-server: runs past their deadline without a terminal event are
cancelled, then ended (billed by the served ledger, their reservation released); runs that are
alive, ended in the log, or ended in the projection are left alone."""

from __future__ import annotations

import time

import anyio
import msgspec
import nats.errors
import pytest
from nats.js.kv import KeyValue

from schemas import settings, subjects
from schemas.events import (
    CancelRequested,
    Message,
    PromptTokenized,
    Request,
    RequestAccepted,
    RunBilled,
    RunCancelled,
    RunCompleted,
    TokensGenerated,
    decode_event,
)
from stages import ledger
from stages.eventlog.runstate import RunRecord, RunStates
from stages.eventlog.sweeper import AFTER_MARKER_MAX_S, Sweeper, SweeperConfig
from stages.eventlog.sweeper import _records as sweeper_records
from stages.runtime.bus import Bus, BusConfig
from stages.runtime.worker import serve
from stages.tenancy.ratelimit import Limits, RateLimiter

pytestmark = pytest.mark.anyio
CONFIG = SweeperConfig(period_s=1.0, queued_s=10.0, engine_s=20.0, grace_s=5.0)
REQUEST = Request(messages=[Message(role="user", content="hi")])


async def stored(bus: Bus, request_id: str, kind: str) -> list:
    return [e for e in await bus.replay(request_id) if type(e).__struct_config__.tag == kind]


async def test_runs_past_their_deadline_are_cancelled_then_ended(
    bus_config: BusConfig, tmp_path, monkeypatch
) -> None:
    monkeypatch.setenv(settings.LEDGER_DB.name, str(tmp_path / "ledger.duckdb"))
    bus = await Bus.connect(bus_config)
    now = time.time_ns()
    ago = lambda s: now - int(s * 1e9)  # noqa: E731
    try:
        await bus.ensure_streams()
        await bus.ensure_kv()
        kv = await bus.kv(subjects.RUNS_BUCKET)
        runs, limiter = RunStates(kv), RateLimiter(await bus.kv(subjects.RATES_BUCKET))
        one_slot = Limits(max_concurrent=1)
        await limiter.admit("acme", "q-older", 10, one_slot)  # holds acme's only slot

        def accepted(rid: str, s: float, tenant: str | None = "acme") -> RequestAccepted:
            return RequestAccepted(request_id=rid, tenant=tenant, request=REQUEST, ts_ns=ago(s))

        def tokenized(rid: str, s: float) -> PromptTokenized:
            return PromptTokenized(
                request_id=rid, tenant="acme", prompt_token_ids=[1], ts_ns=ago(s)
            )

        for event in (
            accepted("q-young", 2),
            accepted("q-old", 12),  # past 10 s, inside the 5 s grace: a cancel only
            accepted("q-older", 30),
            tokenized("e-alive", 100),
            tokenized("e-dead", 100),
            accepted("behind", 100),
            accepted("done", 100),
            RunCompleted(request_id="done", tenant="acme", finish_reason="stop", ts_ns=ago(99)),
        ):
            await runs.project(event)
        await bus.publish(
            TokensGenerated(request_id="e-alive", tenant="acme", seq=3, token_ids=[5])
        )
        await bus.publish(RunCompleted(request_id="behind", tenant="acme", finish_reason="stop"))

        sweeper = Sweeper(bus, CONFIG)
        assert await sweeper.sweep(kv) == 3
        assert sorted(sweeper.stats.ended_ids) == ["e-dead", "q-older"]
        later = Sweeper(bus, CONFIG, clock=lambda: time.time_ns() + int(5e9))
        assert await later.sweep(kv) == 1  # q-old's grace is over; the others ended in the log
        assert later.stats.ended_ids == ["q-old"]

        for rid in ("q-old", "q-older", "e-dead"):
            (cancel,) = await stored(bus, rid, "cancel")  # once, across both passes
            (ended,) = await stored(bus, rid, "cancelled")
            assert isinstance(cancel, CancelRequested) and cancel.reason == "timeout"
            assert isinstance(ended, RunCancelled)
            assert (ended.reason, ended.stage, ended.tenant) == ("timeout", "sweeper", "acme")
        for rid in ("q-young", "e-alive", "behind", "done"):
            assert (
                await stored(bus, rid, "cancel") == [] and await stored(bus, rid, "cancelled") == []
            )

        # the served ledger bills each ended run once and frees q-older's slot
        stop, ready = anyio.Event(), anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(
                lambda: serve(
                    ledger.SPEC, config=bus_config, stop=stop, ready=ready, handle_signals=False
                )
            )
            await ready.wait()
            with anyio.fail_after(10):
                while await limiter._reservation("q-older") is not None:
                    await anyio.sleep(0.05)
            stop.set()
        await limiter.admit("acme", "next-1", 10, one_slot)  # the slot is free again
        (billed,) = await stored(bus, "q-older", "billed")
        assert isinstance(billed, RunBilled) and billed.status == "cancelled"
        msg = await bus.js.get_last_msg(subjects.EVENTS_STREAM, "llm.ev.e-dead.billed")
        assert decode_event(msg.data).status == "cancelled"
    finally:
        await bus.close()


def test_config_is_checked() -> None:
    with pytest.raises(ValueError, match="queued_s=0"):
        SweeperConfig(queued_s=0)
    with pytest.raises(ValueError, match="max_per_pass=0"):
        SweeperConfig(max_per_pass=0)


def test_config_comes_from_the_declared_settings(monkeypatch) -> None:
    from schemas import settings

    assert SweeperConfig.from_env() == SweeperConfig()  # the declared defaults are the config's
    monkeypatch.setenv("BRIGADE_SWEEP_QUEUED_S", "5")
    monkeypatch.setenv("BRIGADE_SWEEP_MAX_PER_PASS", "7")
    found = SweeperConfig.from_env()
    assert (found.queued_s, found.max_per_pass, found.engine_s) == (5.0, 7, 1800.0)
    monkeypatch.setenv("BRIGADE_SWEEP_GRACE_S", "-1")
    with pytest.raises(settings.InvalidSetting, match="BRIGADE_SWEEP_GRACE_S"):
        SweeperConfig.from_env()
    assert {s.name for s in settings.for_reader("sweeper")} >= {
        "BRIGADE_SWEEP_PERIOD_S", "BRIGADE_SWEEP_QUEUED_S", "BRIGADE_SWEEP_ENGINE_S",
        "BRIGADE_SWEEP_GRACE_S", "BRIGADE_SWEEP_MAX_PER_PASS", "NATS_URL",
    }  # fmt: skip


async def test_a_run_waits_out_its_own_deadline_and_an_unhonoured_cancel_is_ended(
    bus_config: BusConfig,
) -> None:
    """A run no engine took is left alone until the deadline its client gave (here 50 s, past
    the sweeper's 20 s for the engine), then cancelled; a run whose cancel nothing honoured (it
    waited for an engine while none ran) is ended `grace_s` after that cancel."""
    bus = await Bus.connect(bus_config)
    now = time.time_ns()
    ago = lambda s: now - int(s * 1e9)  # noqa: E731
    try:
        await bus.ensure_streams()
        await bus.ensure_kv()
        kv = await bus.kv(subjects.RUNS_BUCKET)
        runs = RunStates(kv)
        waiting = Request(messages=REQUEST.messages, deadline_s=50.0)
        for rid in ("patient", "abandoned"):
            await bus.publish(RequestAccepted(request_id=rid, tenant="acme", request=waiting,
                                              ts_ns=ago(30)))  # fmt: skip
            await runs.project(PromptTokenized(request_id=rid, tenant="acme",
                                               prompt_token_ids=[1], ts_ns=ago(30)))  # fmt: skip
        await bus.publish(CancelRequested(request_id="abandoned", tenant="acme", reason="timeout"))

        sweeper = Sweeper(bus, CONFIG)  # 30 s idle: past engine_s=20, inside the 50 s deadline
        assert await sweeper.sweep(kv) == 0  # and the cancel is younger than grace_s=5
        assert await stored(bus, "patient", "cancel") == []
        later = Sweeper(bus, CONFIG, clock=lambda: time.time_ns() + int(6e9))
        assert await later.sweep(kv) == 1 and later.stats.ended_ids == ["abandoned"]
        (ended,) = await stored(bus, "abandoned", "cancelled")
        assert (ended.reason, ended.stage, ended.usage.completion_tokens) == (
            "timeout",
            "sweeper",
            0,
        )
        assert later.stats.num_cancels == 0 and await stored(bus, "patient", "cancel") == []
        past = Sweeper(bus, CONFIG, clock=lambda: time.time_ns() + int(21e9))  # 51 s idle
        assert await past.sweep(kv) == 1
        (cancel,) = await stored(bus, "patient", "cancel")
        assert cancel.reason == "timeout"
    finally:
        await bus.close()


class _Watch:
    """A KV watch that answers as nats-py's does under load: its end-of-entries marker (None)
    ahead of entries already delivered, then whatever else is due, then a timeout."""

    def __init__(self, answers: list, every_s: float = 0.0) -> None:
        self.answers, self.every_s = list(answers), every_s

    async def updates(self, timeout: float):
        if not self.answers or self.every_s > timeout:
            await anyio.sleep(timeout)
            raise nats.errors.TimeoutError
        await anyio.sleep(self.every_s)
        return self.answers.pop(0)

    async def stop(self) -> None:
        pass


class _Bucket:
    def __init__(self, watch: _Watch) -> None:
        self.watch = watch

    async def watchall(self, ignore_deletes: bool = False) -> _Watch:
        return self.watch


def _entry(rid: str, state: str) -> KeyValue.Entry:
    value = msgspec.json.encode(RunRecord(request_id=rid, state=state))
    return KeyValue.Entry(bucket="b", key=rid, value=value, revision=1, delta=0, created=None,
                          operation=None)  # fmt: skip


async def test_a_pass_reads_the_run_records_behind_an_early_end_marker() -> None:
    """The marker before both records (the flake that left a pass with no runs): both are
    read; a key written twice is its last record."""
    watch = _Watch([None, _entry("a", "prefill"), _entry("b", "queued"), _entry("a", "streaming")])
    got = await sweeper_records(_Bucket(watch))
    assert sorted((r.request_id, r.state) for r in got) == [("a", "streaming"), ("b", "queued")]


async def test_records_written_on_past_the_marker_end_the_read_within_its_bound() -> None:
    """A busy bucket (an entry every 0.1 s, past the 0.2 s quiet) still ends the read within
    AFTER_MARKER_MAX_S of the marker."""
    watch = _Watch([None] + [_entry(f"r{i}", "queued") for i in range(100)], every_s=0.1)
    started = time.monotonic()
    got = await sweeper_records(_Bucket(watch))
    assert time.monotonic() - started < AFTER_MARKER_MAX_S + 0.5
    assert 7 <= len(got) <= 10  # 0.1 s apart for 1 s
