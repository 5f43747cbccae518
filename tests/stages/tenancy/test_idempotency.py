"""Idempotency keys in KV: the rules on the fake bus, racing claims on a real server."""

import anyio
import pytest

from schemas import subjects
from schemas.events import Message, Request, Sampling
from stages.runtime.bus import Bus
from stages.tenancy.idempotency import IdempotencyConflict, IdempotencyStore, kv_key, request_hash
from tests.fakebus import FakeBus

pytestmark = pytest.mark.anyio


def _req(text: str, key: str | None = None, max_tokens: int = 5) -> Request:
    return Request(
        messages=[Message(role="user", content=text)],
        idempotency_key=key,
        sampling=Sampling(max_tokens=max_tokens),
    )


def test_request_hash_ignores_the_key_but_not_content():
    assert request_hash(_req("hi", "x")) == request_hash(_req("hi", "y"))
    assert request_hash(_req("hi")) != request_hash(_req("hi", max_tokens=6))
    assert request_hash(_req("hi")) != request_hash(_req("bye"))
    assert kv_key("t1", "k") != kv_key("t2", "k")


async def test_same_key_same_body_returns_the_first_run():
    bus = FakeBus()
    try:
        store = IdempotencyStore(await bus.kv(subjects.IDEMPOTENCY_BUCKET, ttl_s=3600))
        digest = request_hash(_req("hi"))
        first = await store.claim("acme", "key-1", digest, "run1")
        again = await store.claim("acme", "key-1", digest, "run2")
        mine = await store.claim("acme", "key-1", digest, "run1")
        other_tenant = await store.claim("globex", "key-1", digest, "run3")
        assert (first.request_id, first.new) == ("run1", True)
        assert (again.request_id, again.new) == ("run1", False)
        assert (mine.request_id, mine.new) == ("run1", True)
        assert (other_tenant.request_id, other_tenant.new) == ("run3", True)
        await store.release("acme", "key-1", "run9")  # not its run: kept
        assert (await store.lookup("acme", "key-1")).request_id == "run1"
        await store.release("acme", "key-1", "run1")
        assert (await store.claim("acme", "key-1", digest, "run5")).new
        with pytest.raises(IdempotencyConflict, match="run run5"):
            await store.claim("acme", "key-1", request_hash(_req("bye")), "run4")
    finally:
        await bus.close()


async def test_racing_claims_agree_on_one_run(bus_config):
    buses = [await Bus.connect(bus_config) for _ in range(2)]
    try:
        stores = [
            IdempotencyStore(await b.kv(subjects.IDEMPOTENCY_BUCKET, ttl_s=3600)) for b in buses
        ]
        digest = request_hash(_req("race"))
        claims = []

        async def claim(i: int) -> None:
            claims.append(await stores[i % 2].claim("acme", "k", digest, f"run{i}"))

        async with anyio.create_task_group() as tg:
            for i in range(8):
                tg.start_soon(claim, i)
        assert len({c.request_id for c in claims}) == 1
        assert sum(c.new for c in claims) == 1
    finally:
        for b in buses:
            await b.close()


async def test_take_over_only_from_the_named_stale_run():
    bus = FakeBus()
    now = [1_000 * 10**9]
    try:
        store = IdempotencyStore(
            await bus.kv(subjects.IDEMPOTENCY_BUCKET, ttl_s=3600), clock=lambda: now[0]
        )
        digest = request_hash(_req("hi"))
        await store.claim("acme", "k", digest, "ghost")
        now[0] += 12 * 10**9
        again = await store.claim("acme", "k", digest, "r2")
        assert (again.request_id, again.new, again.age_s) == ("ghost", False, 12.0)
        assert not await store.take_over("acme", "k", digest, "someone-else", "r2")
        assert await store.take_over("acme", "k", digest, "ghost", "r2")
        assert not await store.take_over("acme", "k", digest, "ghost", "r3")  # taken already
        assert (await store.lookup("acme", "k")).request_id == "r2"
    finally:
        await bus.close()
