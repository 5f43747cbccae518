import anyio
import pytest

from schemas import subjects
from schemas.events import Submit
from stages.bus import Bus
from stages.idempotency import IdempotencyConflict, IdempotencyStore, body_hash, kv_key

pytestmark = pytest.mark.anyio


def test_body_hash_ignores_identity_but_not_content():
    a = Submit(prompt="hi", max_tokens=5, request_id="r1", api_key="k1", idempotency_key="x")
    b = Submit(prompt="hi", max_tokens=5, request_id="r2", api_key="k2", idempotency_key="y")
    c = Submit(prompt="hi", max_tokens=6)
    assert body_hash(a) == body_hash(b)
    assert body_hash(a) != body_hash(c)
    assert kv_key("t1", "k") != kv_key("t2", "k")


async def test_same_key_same_body_returns_the_first_run(bus_config):
    bus = await Bus.connect(bus_config)
    try:
        store = IdempotencyStore(await bus.kv(subjects.IDEMPOTENCY_BUCKET, ttl_s=3600))
        digest = body_hash(Submit(prompt="hi"))
        first = await store.claim("acme", "key-1", digest, "run1")
        again = await store.claim("acme", "key-1", digest, "run2")
        mine = await store.claim("acme", "key-1", digest, "run1")
        other_tenant = await store.claim("globex", "key-1", digest, "run3")
        assert (first.request_id, first.new) == ("run1", True)
        assert (again.request_id, again.new) == ("run1", False)
        assert (mine.request_id, mine.new) == ("run1", True)
        assert (other_tenant.request_id, other_tenant.new) == ("run3", True)
        with pytest.raises(IdempotencyConflict, match="run run1"):
            await store.claim("acme", "key-1", body_hash(Submit(prompt="bye")), "run4")
    finally:
        await bus.close()


async def test_racing_claims_agree_on_one_run(bus_config):
    buses = [await Bus.connect(bus_config) for _ in range(2)]
    try:
        stores = [
            IdempotencyStore(await b.kv(subjects.IDEMPOTENCY_BUCKET, ttl_s=3600)) for b in buses
        ]
        digest = body_hash(Submit(prompt="race"))
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
