"""The ledger with issue 4's hooks: one bill per idempotency key, rate reservations settled to
actual usage once. Runs on the fake bus (the served ledger on a real server: test_ledger.py)."""

import duckdb
import pytest

from schemas import settings, subjects
from schemas.events import (
    Message,
    Request,
    RequestAccepted,
    RunBilled,
    RunCancelled,
    RunCompleted,
    Sampling,
    Usage,
)
from stages import ledger
from stages.tenancy.idempotency import IdempotencyStore, kv_key, request_hash
from stages.tenancy.ratelimit import Limits, RateLimiter
from tests.fakebus import FakeBus, deliver, stage_worker

pytestmark = pytest.mark.anyio
USAGE = Usage(prompt_tokens=12, completion_tokens=5)


async def test_billed_once_per_idempotency_key_and_reservations_settled(tmp_path, monkeypatch):
    db = tmp_path / "ledger.duckdb"
    monkeypatch.setenv(settings.LEDGER_DB.name, str(db))
    request = Request(
        messages=[Message(role="user", content="hi")],
        idempotency_key="order-7",
        sampling=Sampling(max_tokens=88),
    )
    bus = FakeBus()
    await bus.ensure_streams()
    await bus.ensure_kv()
    keys = IdempotencyStore(await bus.kv(subjects.IDEMPOTENCY_BUCKET))
    limiter = RateLimiter(await bus.kv(subjects.RATES_BUCKET))
    assert (await keys.claim("acme", "order-7", request_hash(request), "runA")).new
    await limiter.admit("acme", "runA", 100, Limits(tokens_per_min=1000))
    await bus.publish(RequestAccepted(request_id="runA", request=request))
    worker = await stage_worker(ledger.SPEC, bus)
    for event in (
        RunCompleted(request_id="runA", tenant="acme", finish_reason="stop", usage=USAGE),
        RunCancelled(request_id="runA", tenant="acme", usage=USAGE),
        RunCompleted(request_id="runB", tenant="acme", finish_reason="length", usage=USAGE),
    ):
        assert (await deliver(worker, event)).outcome == "ack"
    assert await limiter.settle("runA", 17) is None  # the ledger settled it already
    billed = bus.server.events(subjects.all_events("billed"))
    assert all(isinstance(b, RunBilled) for b in billed) and len(billed) == 3
    idem = f"acme:idem-{kv_key('acme', 'order-7')[:32]}:run"
    assert sorted({b.billing_key for b in billed}) == sorted([idem, "acme:runB:run"])
    assert [b.status for b in billed if b.request_id == "runA"] == ["completed", "completed"]
    stored = [e for e in await bus.replay("runA") if isinstance(e, RunBilled)]
    assert [b.billing_key for b in stored] == [idem]  # the repeat carries the same Nats-Msg-Id
    con = duckdb.connect(str(db), read_only=True)
    try:
        rows = con.execute(
            "SELECT billing_key, status, completion_tokens FROM billing ORDER BY 1"
        ).fetchall()
    finally:
        con.close()
    assert rows == sorted([(idem, "completed", 5), ("acme:runB:run", "completed", 5)])
