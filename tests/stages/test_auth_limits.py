"""Rate limits and idempotency keys in the auth stage: two served workers on one durable of a real
server share a rate limit; the rules run through two workers' handlers on the fake bus (one KV)."""

import anyio
import msgspec
import pytest

from schemas import subjects
from schemas.events import (
    Message,
    Request,
    RequestAccepted,
    RequestAuthorized,
    RequestFailed,
    Sampling,
    decode_event,
)
from stages import auth
from stages.runtime.bus import Bus
from stages.runtime.worker import serve
from stages.tenancy import tenants
from tests.fakebus import FakeBus, FakeServer, deliver, stage_worker

pytestmark = pytest.mark.anyio
KEY = "brg-limits-test-key-000000000000"


def _accepted(rid: str, idem: str | None = None, text: str = "hello") -> RequestAccepted:
    return RequestAccepted(
        request_id=rid,
        request=Request(
            messages=[Message(role="user", content=text)],
            idempotency_key=idem,
            sampling=Sampling(max_tokens=8),
        ),
        key_hash=tenants.hash_key(KEY),
    )


def _tenants(tmp_path, monkeypatch, **settings) -> None:
    path = tmp_path / "tenants.toml"
    tenants.add_key("acme", path=path, api_key=KEY)
    file = tenants.read_file(path)
    file.tenants["acme"] = msgspec.structs.replace(file.tenants["acme"], **settings)
    tenants.write_file(path, file)
    monkeypatch.setenv("BRIGADE_TENANTS", str(path))


async def _through_two_workers(bus_config, events: list[RequestAccepted]) -> dict[str, object]:
    """Publish `events` one by one to two auth workers; each request's authorized or failed."""
    bus = await Bus.connect(bus_config)
    stop = anyio.Event()
    outcomes: dict[str, object] = {}
    try:
        await bus.ensure_streams()
        sub = await bus.nc.subscribe(subjects.ALL_EVENTS)
        async with anyio.create_task_group() as tg:
            for _ in range(2):
                ready = anyio.Event()
                tg.start_soon(
                    lambda r=ready: serve(
                        auth.SPEC, config=bus_config, stop=stop, ready=r, handle_signals=False
                    )
                )
                await ready.wait()
            with anyio.fail_after(10):
                for event in events:
                    await bus.publish(event)
                    while event.request_id not in outcomes:
                        out = decode_event((await sub.next_msg(timeout=5)).data)
                        if isinstance(out, RequestAuthorized | RequestFailed):
                            outcomes[out.request_id] = out
            stop.set()
    finally:
        await bus.close()
    return outcomes


async def test_two_auth_workers_share_the_rate_limit(bus_config, tmp_path, monkeypatch):
    _tenants(tmp_path, monkeypatch, requests_per_min=3)
    outcomes = await _through_two_workers(bus_config, [_accepted(f"r{i}") for i in range(6)])
    kinds = [type(outcomes[f"r{i}"]).__name__ for i in range(6)]
    assert kinds == ["RequestAuthorized"] * 3 + ["RequestFailed"] * 3
    refused = [outcomes[f"r{i}"] for i in range(3, 6)]
    assert [e.code for e in refused] == ["rate_limited"] * 3
    assert all(19.0 < e.retry_after_s <= 20.0 for e in refused)  # 1 request per 60/3 s
    assert all("3 requests/min" in e.message for e in refused)
    assert {e.tenant for e in refused} == {"acme"}


async def _through_two_handlers(events: list[RequestAccepted]) -> dict[str, object]:
    """Each event to one of two auth workers in turn (their own state, one KV); the outcomes."""
    server = FakeServer()
    workers = [await stage_worker(auth.SPEC, FakeBus(server)) for _ in range(2)]
    outcomes: dict[str, object] = {}
    for i, event in enumerate(events):
        worker = workers[i % 2]
        assert (await deliver(worker, event)).outcome == "ack"
        (out,) = (await worker.bus.replay(event.request_id))[1:]
        outcomes[event.request_id] = out
    return outcomes


async def test_tokens_per_min_and_idempotency_keys(tmp_path, monkeypatch):
    # "hello" estimates 1 + 8 framing tokens; + max_tokens 8 -> 17 reserved per request
    _tenants(tmp_path, monkeypatch, tokens_per_min=40)
    outcomes = await _through_two_handlers(
        [
            _accepted("i1", idem="k1"),
            _accepted("i2", idem="k1"),  # same body: names the first run, starts nothing
            _accepted("i3", idem="k1", text="other"),  # other body: conflict
            _accepted("t1"),
            _accepted("t2", idem="k2"),  # over tokens/min: refused, and k2 is given back
            # k2 was given back, so no conflict; this one alone is above tokens/min
            _accepted("t3", idem="k2", text="x" * 400),
        ],
    )
    assert isinstance(outcomes["i1"], RequestAuthorized)
    assert (outcomes["i2"].code, outcomes["i2"].field) == ("conflict", "idempotency_key")
    assert "already started run i1" in outcomes["i2"].message
    assert "different request body" in outcomes["i3"].message
    assert isinstance(outcomes["t1"], RequestAuthorized)
    assert (outcomes["t2"].code, outcomes["t2"].tenant) == ("rate_limited", "acme")
    assert "40 tokens/min" in outcomes["t2"].message
    assert (outcomes["t3"].code, outcomes["t3"].field) == ("invalid_request", "max_tokens")
    assert "reserves 116 tokens" in outcomes["t3"].message
