"""Rate limits in KV: sequential rules on two workers sharing the fake bus, racing admissions on
a real server."""

import anyio
import pytest

from schemas import subjects
from stages.runtime.bus import Bus
from stages.tenancy.ratelimit import Buckets, Limits, RateLimited, RateLimiter, TooLarge, refill
from tests.fakebus import FakeBus, FakeServer

T0 = 1_000_000_000_000


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> int:
        return self.now


def test_refill_is_continuous_and_capped():
    limits = Limits(requests_per_min=60, tokens_per_min=600)
    b = refill(Buckets(requests=0, tokens=0, updated_ns=T0), limits, T0 + 2_000_000_000)
    assert (b.requests, b.tokens) == (2.0, 20.0)
    b = refill(Buckets(requests=59.5, tokens=599, updated_ns=T0), limits, T0 + 60_000_000_000)
    assert (b.requests, b.tokens) == (60.0, 600.0)


async def _limiters(buses: list[Bus], clock: Clock) -> tuple[list[Bus], list[RateLimiter]]:
    """One limiter per bus (per worker), all on the same rates bucket."""
    kvs = [await b.kv(subjects.RATES_BUCKET, ttl_s=3600) for b in buses]
    return buses, [RateLimiter(kv, clock=clock) for kv in kvs]


@pytest.mark.anyio
async def test_two_workers_share_one_requests_per_minute_budget(bus_config):
    clock = Clock()
    buses, (w1, w2) = await _limiters([await Bus.connect(bus_config) for _ in range(2)], clock)
    limits = Limits(requests_per_min=10)
    admitted, refused = [], []
    try:

        async def one(i: int) -> None:
            try:
                await (w1 if i % 2 else w2).admit("acme", f"r{i}", 5, limits)
                admitted.append(i)
            except RateLimited as err:
                refused.append(err.retry_after_s)

        async with anyio.create_task_group() as tg:
            for i in range(16):
                tg.start_soon(one, i)
        assert len(admitted) == 10
        assert refused == [6.0] * 6  # one request refills in 60/10 s
        clock.now += 6_000_000_000
        await w1.admit("acme", "late", 5, limits)
        with pytest.raises(RateLimited, match="10 requests/min"):
            await w2.admit("acme", "later", 5, limits)
        await w2.admit("other-tenant", "o1", 5, limits)
    finally:
        for b in buses:
            await b.close()


@pytest.mark.anyio
async def test_tokens_reserved_then_settled_to_actual_usage():
    clock = Clock()
    server = FakeServer()
    buses, (w1, w2) = await _limiters([FakeBus(server), FakeBus(server)], clock)
    limits = Limits(tokens_per_min=1000)
    try:
        await w1.admit("acme", "a", 600, limits)  # prompt 100 + max_tokens 500
        with pytest.raises(RateLimited, match="1000 tokens/min; retry in 12.0 s") as info:
            await w2.admit("acme", "b", 600, limits)
        assert info.value.retry_after_s == 12.0  # 200 missing tokens at 1000/60 per second
        assert await w2.settle("a", 130) == 470  # used 100 + 30: 470 come back
        assert await w1.settle("a", 130) is None  # settled once only
        await w2.admit("acme", "b", 600, limits)
        assert await w1.settle("b", 700) == -100  # used more than reserved: charged
        with pytest.raises(TooLarge, match="reserves 1001 tokens"):
            await w1.admit("acme", "c", 1001, limits)
    finally:
        for b in buses:
            await b.close()


@pytest.mark.anyio
async def test_concurrent_runs_capped_until_settled():
    clock = Clock()
    server = FakeServer()
    buses, (w1, w2) = await _limiters([FakeBus(server), FakeBus(server)], clock)
    limits = Limits(max_concurrent=2)
    try:
        await w1.admit("acme", "a", 10, limits)
        await w2.admit("acme", "a", 10, limits)  # redelivered admission: no second slot
        await w2.admit("acme", "b", 10, limits)
        with pytest.raises(RateLimited, match="2 runs in flight, its max_concurrent is 2"):
            await w1.admit("acme", "c", 10, limits)
        assert await w1.settle("a", 5) == 5
        await w2.admit("acme", "c", 10, limits)
    finally:
        for b in buses:
            await b.close()
