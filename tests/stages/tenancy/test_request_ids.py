"""Request id claims: the first owner keeps the id; only a young repeat of its own submit passes."""

import pytest

from schemas import subjects
from stages.tenancy.request_ids import RequestIds, RequestIdTaken
from tests.fakebus import FakeBus

pytestmark = pytest.mark.anyio


async def test_first_owner_keeps_the_id_and_only_a_young_repeat_passes() -> None:
    now = [1_000_000_000_000]
    bus = FakeBus()
    ids = RequestIds(await bus.kv(subjects.REQUEST_IDS_BUCKET), clock=lambda: now[0])
    assert await ids.claim("r1", "a", "h1", repeat_within_s=120.0) is True
    assert await ids.claim("r1", "a", "h1", repeat_within_s=120.0) is False  # a redelivery
    for tenant, digest in (("b", "h1"), ("a", "h2"), (None, "h1")):
        with pytest.raises(RequestIdTaken, match="'r1' is already used"):
            await ids.claim("r1", tenant, digest, repeat_within_s=120.0)
    now[0] += 121 * 10**9  # past the dedupe window a repeat would store a second run
    with pytest.raises(RequestIdTaken):
        await ids.claim("r1", "a", "h1", repeat_within_s=120.0)
    # a key that names no tenant owns its id too: only its own submit repeats
    assert await ids.claim("r2", None, "h3", repeat_within_s=120.0) is True
    assert await ids.claim("r2", None, "h3", repeat_within_s=120.0) is False
    with pytest.raises(RequestIdTaken):
        await ids.claim("r2", None, "h4", repeat_within_s=120.0)
    assert (await ids.owner("r1")).tenant == "a" and await ids.owner("r3") is None
