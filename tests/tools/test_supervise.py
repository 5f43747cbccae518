"""Supervision: bounded exponential backoff; an in-process stage task that crashes (or ends by
itself) is logged and started again, and serves; stop ends it without a restart."""

from __future__ import annotations

import logging

import anyio
import pytest

from schemas.events import Submit
from stages.runtime.bus import Bus, BusConfig
from tools.stage import serve_stage
from tools.supervise import Backoff, supervise_task


def test_backoff_doubles_up_to_its_bound_and_resets_after_a_long_run() -> None:
    b = Backoff(initial_s=0.5, max_s=4.0, reset_after_s=60.0)
    assert [b.delay(served_s=1.0) for _ in range(6)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert b.delay(served_s=61.0) == 0.5  # it served a while: a fresh crash, not a loop
    assert b.delay(served_s=0.1) == 1.0
    assert b.num_restarts == 8
    with pytest.raises(ValueError, match="initial_s"):
        Backoff(initial_s=0.0)


@pytest.mark.anyio
async def test_a_crashed_stage_task_is_restarted_and_serves(
    bus_config: BusConfig, caplog: pytest.LogCaptureFixture
) -> None:
    stop = anyio.Event()
    calls: list[int] = []

    async def serve_once() -> None:
        calls.append(len(calls))
        if len(calls) == 1:
            raise ConnectionResetError("the stage's connection broke")
        if len(calls) == 2:
            return  # ended by itself before stop: restarted too
        await serve_stage("gateway", config=bus_config, stop=stop, handle_signals=False)

    caplog.set_level(logging.WARNING, logger="brigade.up")
    bus = await Bus.connect(bus_config)
    await bus.ensure_streams()  # the submit is stored before any gateway runs
    async with anyio.create_task_group() as tg:
        tg.start_soon(supervise_task, "gateway", serve_once, stop, Backoff(initial_s=0.05))
        with anyio.fail_after(30):
            reply = await bus.submit(Submit(request_id="after-crash", prompt="Hi", api_key="k"))
        assert reply.accepted
        stop.set()
    await bus.close()
    assert calls == [0, 1, 2]  # no restart after stop
    text = caplog.text
    assert "stage gateway crashed" in text and "ConnectionResetError" in text
    assert "stage gateway ended by itself" in text
    assert "restarting stage gateway in 0.1 s (restart 2)" in text
