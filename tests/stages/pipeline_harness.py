"""The whole pipeline in one test process: a private nats-server, every stage, and the edge."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import anyio.abc
import pytest

from schemas import settings
from stages.edge.keys import KeyRing
from stages.runtime import natsd
from stages.runtime.bus import BusConfig
from stages.tenancy import tenants
from tests.stages.edge_harness import ACME_KEY, MODEL, RunningEdge, running_edge
from tools.stage import PIPELINE, serve_stage


async def start_stages(
    tg: anyio.abc.TaskGroup,
    names: Iterable[str],
    config: BusConfig,
    stop: anyio.Event,
    *,
    timeout_s: float = 120.0,
) -> None:
    """Serve each named stage in `tg` until `stop`, one after another, each ready first."""
    for name in names:
        ready = anyio.Event()
        tg.start_soon(
            lambda n=name, r=ready: serve_stage(
                n, config=config, stop=stop, ready=r, handle_signals=False
            )
        )
        with anyio.fail_after(timeout_s):
            await ready.wait()


@asynccontextmanager
async def running_pipeline(
    data_dir: Path, keys: KeyRing, **edge_overrides
) -> AsyncIterator[tuple[RunningEdge, BusConfig]]:
    server = natsd.start(data_dir / "nats")
    config = BusConfig(servers=(server.url,), ack_wait_s=5.0, max_deliver=3)
    stop = anyio.Event()
    try:
        async with anyio.create_task_group() as tg:
            await start_stages(tg, PIPELINE, config, stop)
            async with running_edge(config, keys, **edge_overrides) as edge:
                yield edge, config
            stop.set()
    finally:
        natsd.stop(server)


@asynccontextmanager
async def acme_pipeline(
    data_dir: Path, **edge_overrides
) -> AsyncIterator[tuple[RunningEdge, BusConfig]]:
    """running_pipeline with one tenant, acme (ACME_KEY), and its tenants file and ledger in
    `data_dir` (set in the environment while it runs)."""
    path = data_dir / "tenants.toml"
    tenants.add_key("acme", path=path, api_key=ACME_KEY)
    env = {
        settings.TENANTS.name: str(path),
        settings.LEDGER_DB.name: str(data_dir / "ledger.duckdb"),
    }
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        async with running_pipeline(data_dir, KeyRing(path, (MODEL,)), **edge_overrides) as running:
            yield running


__all__ = ["MODEL", "acme_pipeline", "running_pipeline", "start_stages"]
