"""Runs the real edge (uvicorn on a free loopback port) against a real nats-server for tests."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import anyio

from stages.bus import BusConfig
from stages.edge import EdgeConfig, serve
from stages.edge_keys import KeyRing, TenantPolicy, key_hash

ACME_KEY = "sk-acme-test-0123456789"
GLOBEX_KEY = "sk-globex-test-9876543210"
MODEL = "smollm2-135m"


def keyring_for_tests() -> KeyRing:
    return KeyRing(
        {
            key_hash(ACME_KEY): TenantPolicy(name="acme"),
            key_hash(GLOBEX_KEY): TenantPolicy(name="globex", allowed_models=("other-model",)),
        },
        default_models=(MODEL,),
    )


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
    bus_config: BusConfig, keys: KeyRing | None = None, **overrides
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
                keys=keys or keyring_for_tests(),
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
