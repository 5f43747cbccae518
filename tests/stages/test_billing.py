"""The real ledger stage with issue 4's hooks: one bill per idempotency key, rate reservations
settled to actual usage once."""

import anyio
import duckdb
import pytest

from schemas import subjects
from schemas.events import (
    Message,
    Request,
    RequestAccepted,
    RunBilled,
    RunCancelled,
    RunCompleted,
    Sampling,
    Usage,
    decode_event,
)
from stages import ledger
from stages.runtime.bus import Bus
from stages.runtime.worker import serve
from stages.tenancy.idempotency import IdempotencyStore, kv_key, request_hash
from stages.tenancy.ratelimit import Limits, RateLimiter

pytestmark = pytest.mark.anyio
USAGE = Usage(prompt_tokens=12, completion_tokens=5)


async def test_billed_once_per_idempotency_key_and_reservations_settled(
    bus_config, tmp_path, monkeypatch
):
    db = tmp_path / "ledger.duckdb"
    monkeypatch.setenv(ledger.DB_ENV, str(db))
    request = Request(
        messages=[Message(role="user", content="hi")],
        idempotency_key="order-7",
        sampling=Sampling(max_tokens=88),
    )
    bus = await Bus.connect(bus_config)
    stop, ready = anyio.Event(), anyio.Event()
    billed: list[RunBilled] = []
    try:
        await bus.ensure_streams()
        await bus.ensure_kv()
        keys = IdempotencyStore(await bus.kv(subjects.IDEMPOTENCY_BUCKET))
        limiter = RateLimiter(await bus.kv(subjects.RATES_BUCKET))
        assert (await keys.claim("acme", "order-7", request_hash(request), "runA")).new
        await limiter.admit("acme", "runA", 100, Limits(tokens_per_min=1000))
        await bus.publish(RequestAccepted(request_id="runA", request=request))
        sub = await bus.nc.subscribe(subjects.all_events("billed"))
        async with anyio.create_task_group() as tg:
            tg.start_soon(
                lambda: serve(
                    ledger.SPEC, config=bus_config, stop=stop, ready=ready, handle_signals=False
                )
            )
            await ready.wait()
            await bus.publish(
                RunCompleted(request_id="runA", tenant="acme", finish_reason="stop", usage=USAGE)
            )
            with anyio.fail_after(20):
                billed.append(decode_event((await sub.next_msg(timeout=15)).data))
                await bus.publish(RunCancelled(request_id="runA", tenant="acme", usage=USAGE))
                await bus.publish(
                    RunCompleted(
                        request_id="runB", tenant="acme", finish_reason="length", usage=USAGE
                    )
                )
                while len(billed) < 3:
                    billed.append(decode_event((await sub.next_msg(timeout=15)).data))
            stop.set()
        assert await limiter.settle("runA", 17) is None  # the ledger settled it already
    finally:
        await bus.close()
    idem = f"acme:idem-{kv_key('acme', 'order-7')[:32]}:run"
    assert sorted({b.billing_key for b in billed}) == sorted([idem, "acme:runB:run"])
    assert [b.status for b in billed if b.request_id == "runA"] == ["completed", "completed"]
    con = duckdb.connect(str(db), read_only=True)
    try:
        rows = con.execute(
            "SELECT billing_key, status, completion_tokens FROM billing ORDER BY 1"
        ).fetchall()
    finally:
        con.close()
    assert rows == sorted([(idem, "completed", 5), ("acme:runB:run", "completed", 5)])
