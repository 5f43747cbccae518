"""Heartbeats: a worker's beat says ready once it serves and carries its service's health; a
stopped worker's entry goes at once, a dead one's ages out of the bucket; a health() that
raises is reported in the beat, not a crash."""

from __future__ import annotations

import os

import anyio
import pytest

from schemas import subjects
from stages.runtime import heartbeat
from stages.runtime.bus import Bus, BusConfig

pytestmark = pytest.mark.anyio


async def test_a_beat_turns_ready_carries_health_and_goes_when_stopped(
    bus_config: BusConfig,
) -> None:
    bus = await Bus.connect(bus_config)
    kv = await bus.kv(subjects.STAGES_BUCKET, ttl_s=heartbeat.TTL_S)
    heart = heartbeat.Heart(lambda: bus.kv(subjects.STAGES_BUCKET), "engine",
                            lambda: {"num_free_blocks": 7})  # fmt: skip
    broken = heartbeat.Heart(lambda: bus.kv(subjects.STAGES_BUCKET), "tokenize", lambda: 1 / 0)
    async with anyio.create_task_group() as tg:
        tg.start_soon(heart.run)
        tg.start_soon(broken.run)
        with anyio.fail_after(5):
            while len(found := await heartbeat.beats(kv)) < 2:
                await anyio.sleep(0.05)
        assert not any(b.ready for b in found)
        heart.mark_ready()
        with anyio.fail_after(5):  # at once, not at the next period
            while not any(b.ready for b in await heartbeat.beats(kv)):
                await anyio.sleep(0.02)
        stages = heartbeat.by_stage(await heartbeat.beats(kv))
        assert stages["engine"] == {"workers": 1, "ready": 1, "pids": [os.getpid()],
                                    "detail": [{"num_free_blocks": 7}]}  # fmt: skip
        assert "ZeroDivisionError" in stages["tokenize"]["detail"][0]["health_error"]
        tg.cancel_scope.cancel()
    await heart.stop()
    assert {b.stage for b in await heartbeat.beats(kv)} == {"tokenize"}  # a dead one lingers
    with anyio.fail_after(heartbeat.TTL_S + 5):  # ... for the bucket's TTL, then it is gone
        while await heartbeat.beats(kv):
            await anyio.sleep(0.5)
    await bus.close()
