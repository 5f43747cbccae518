"""Runs the real edge (uvicorn on a free loopback port) against a real nats-server for tests."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import anyio
import msgspec

from stages.edge.app import serve
from stages.edge.core import EdgeConfig
from stages.edge.keys import KeyRing
from stages.runtime.bus import BusConfig
from stages.tenancy import tenants

ACME_KEY = "sk-acme-test-0123456789"
GLOBEX_KEY = "sk-globex-test-9876543210"
MODEL = "smollm2-135m"


def keyring_for_tests(tmp_path: Path) -> KeyRing:
    """A real tenants.toml: acme may use every model, globex only `other-model`."""
    path = tmp_path / "tenants.toml"
    tenants.add_key("acme", path=path, api_key=ACME_KEY)
    tenants.add_key("globex", path=path, api_key=GLOBEX_KEY)
    file = tenants.read_file(path)
    file.tenants["globex"] = msgspec.structs.replace(
        file.tenants["globex"], allowed_models=["other-model"]
    )
    tenants.write_file(path, file)
    return KeyRing(path, default_models=(MODEL,))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class RunningEdge:
    url: str
    ws_url: str
    config: EdgeConfig


@asynccontextmanager
async def running_edge(
    bus_config: BusConfig, keys: KeyRing, **overrides
) -> AsyncIterator[RunningEdge]:
    config = EdgeConfig(port=free_port(), **overrides)
    stop, ready = anyio.Event(), anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(
            lambda: serve(
                config=bus_config,
                stop=stop,
                ready=ready,
                edge_config=config,
                keys=keys,
                handle_signals=False,
            )
        )
        with anyio.fail_after(20):
            await ready.wait()
        try:
            yield RunningEdge(
                url=f"http://127.0.0.1:{config.port}",
                ws_url=f"ws://127.0.0.1:{config.port}/v1/stream",
                config=config,
            )
        finally:
            stop.set()
