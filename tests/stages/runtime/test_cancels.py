"""The cancel set: fed by llm.ev.*.cancel, bounded, with callbacks for stages that abort work."""

from __future__ import annotations

import anyio
import pytest

from schemas.events import CancelRequested
from stages.runtime.bus import Bus, BusConfig
from stages.runtime.cancels import CancelledRequests


def test_bounded_lru_and_callbacks_fire_once() -> None:
    seen: list[CancelRequested] = []
    cancels = CancelledRequests(capacity=2)
    cancels.on_cancel(seen.append)
    for rid in ("a", "b", "a", "c"):
        cancels.add(rid)
    assert [c.request_id for c in seen] == ["a", "b", "c"]
    assert {c.reason for c in seen} == {"client"}
    assert ("a" in cancels, "b" in cancels, "c" in cancels) == (False, True, True)


def test_the_first_cancels_reason_is_kept() -> None:
    cancels = CancelledRequests()
    cancels.add("r", CancelRequested(request_id="r", reason="timeout"))
    cancels.add("r", CancelRequested(request_id="r", reason="client"))
    assert (cancels.reason("r"), cancels.reason("other")) == ("timeout", None)


@pytest.mark.anyio
async def test_fed_by_the_cancel_subject(bus_config: BusConfig) -> None:
    bus = await Bus.connect(bus_config)
    await bus.ensure_streams()
    cancels = CancelledRequests()
    seen: list[CancelRequested] = []
    cancels.on_cancel(seen.append)
    sub = await cancels.subscribe(bus)
    await bus.publish(CancelRequested(request_id="gone-1", reason="stop_string", seq=4))
    await bus.nc.publish("llm.ev.gone-2.cancel", b"not json")  # the subject still names it
    with anyio.fail_after(5):
        while "gone-1" not in cancels or "gone-2" not in cancels:
            await anyio.sleep(0.01)
    assert "other" not in cancels
    assert [(c.request_id, c.reason, c.seq) for c in seen] == [
        ("gone-1", "stop_string", 4),
        ("gone-2", "client", None),
    ]
    await sub.unsubscribe()
    await bus.close()
