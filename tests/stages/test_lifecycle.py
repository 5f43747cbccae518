"""A run's end across the stages before the engine, on a real nats-server: a cancel seen by any
stage ends the run as `cancelled` there, billed once, its rate-limit slot and KV released."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import msgspec
import pytest

from schemas import settings, subjects
from schemas.events import (
    CancelRequested,
    RunBilled,
    RunCancelled,
    Submit,
    decode_event,
)
from stages.eventlog import runstate
from stages.runtime.bus import Bus, BusConfig
from stages.runtime.worker import serve
from stages.tenancy import tenants
from stages.tenancy.ratelimit import RateLimiter
from tools.stage import MODULES

pytestmark = pytest.mark.anyio
KEY = "brg-lifecycle-test-key-0000000000"
BEFORE_ENGINE = ("gateway", "auth", "context", "tokenize")
OUTPUT_OF = {"gateway": "accepted", "auth": "authorized", "context": "assembled"}


@pytest.fixture
def one_run_at_a_time(tmp_path, monkeypatch) -> None:
    """Tenant `acme` may hold one run at a time; the ledger writes under tmp_path."""
    path = tmp_path / "tenants.toml"
    tenants.add_key("acme", path=path, api_key=KEY)
    file = tenants.read_file(path)
    file.tenants["acme"] = msgspec.structs.replace(file.tenants["acme"], max_concurrent=1)
    tenants.write_file(path, file)
    monkeypatch.setenv("BRIGADE_TENANTS", str(path))
    monkeypatch.setenv(settings.LEDGER_DB.name, str(tmp_path / "ledger.duckdb"))


def spec_of(name: str):
    import importlib

    return runstate.SPEC if name == "runstate" else importlib.import_module(MODULES[name]).SPEC


@asynccontextmanager
async def serving(config: BusConfig, names: tuple[str, ...]) -> AsyncIterator[None]:
    stop = anyio.Event()
    async with anyio.create_task_group() as tg:
        for name in names:
            ready = anyio.Event()
            tg.start_soon(
                lambda s=spec_of(name), r=ready: serve(
                    s, config=config, stop=stop, ready=r, handle_signals=False
                )
            )
            with anyio.fail_after(60):
                await ready.wait()
        yield
        stop.set()


async def wait_event(bus: Bus, request_id: str, kind: str, timeout_s: float = 10.0):
    subject = subjects.event_subject(request_id, kind)
    with anyio.fail_after(timeout_s):
        while True:
            try:
                msg = await bus.js.get_last_msg(subjects.EVENTS_STREAM, subject)
                return decode_event(msg.data)
            except Exception:  # noqa: BLE001 - not there yet
                await anyio.sleep(0.05)


def submit(rid: str) -> Submit:
    return Submit(request_id=rid, api_key=KEY, prompt="hello", max_tokens=8)


@pytest.mark.parametrize("stage", BEFORE_ENGINE)
async def test_a_cancel_seen_first_by_a_stage_ends_the_run_there(
    bus_config: BusConfig, one_run_at_a_time, stage: str
) -> None:
    """The stages from `stage` on hear the cancel, those before it start afterwards (so they do
    their work): `stage` skips the run and publishes its end, which the ledger bills and settles.
    """
    at = BEFORE_ENGINE.index(stage)
    bus = await Bus.connect(bus_config)
    rid = f"cancel-at-{stage}"
    try:
        await bus.ensure_streams()
        await bus.ensure_kv()
        limiter = RateLimiter(await bus.kv(subjects.RATES_BUCKET))
        async with serving(bus_config, (*BEFORE_ENGINE[at:], "ledger", "runstate")):
            await bus.publish(CancelRequested(request_id=rid, tenant="acme", reason="disconnect"))
            await bus.nc.flush()
            await anyio.sleep(0.2)  # every running stage has it
            async with serving(bus_config, BEFORE_ENGINE[:at]):
                reply = await bus.submit(submit(rid))
                assert reply.accepted == (stage != "gateway")
                ended = await wait_event(bus, rid, "cancelled")
                billed = await wait_event(bus, rid, "billed")
                assert isinstance(ended, RunCancelled) and isinstance(billed, RunBilled)
                assert (ended.stage, ended.reason, billed.status) == (
                    stage,
                    "disconnect",
                    "cancelled",
                )
                # auth named the tenant (and reserved its one slot) only from context on
                assert ended.tenant == ("acme" if at >= 2 else None)
                if stage in OUTPUT_OF:
                    with pytest.raises(TimeoutError):
                        await wait_event(bus, rid, OUTPUT_OF[stage], timeout_s=0.3)
                assert await limiter._reservation(rid) is None  # released (or never held)
                runs = runstate.RunStates(await bus.kv(subjects.RUNS_BUCKET))
                with anyio.fail_after(5):
                    while (record := await runs.get(rid)) is None or record.state != "billed":
                        await anyio.sleep(0.05)
                # the tenant's one slot is free again: the next run is admitted
                reply = await bus.submit(submit(f"{rid}-next"))
                assert reply.accepted
                if at >= 2:
                    nxt = await wait_event(bus, f"{rid}-next", "authorized")
                    assert nxt.tenant == "acme"
    finally:
        await bus.close()
