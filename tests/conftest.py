"""Shared fixtures: a real nats-server on random loopback ports, stopped by its own pid."""
# ruff: noqa: E402 - the thread count is set before anything imports torch

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

# `make test` runs pytest-xdist workers side by side: each worker's torch, and the stage
# processes its tests start, get an equal share of the cores, or OpenMP's threads of both
# workers fight over them (a 2-core machine ran the suite 10 % slower oversubscribed).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // _WORKERS)))

import pytest

import engine  # noqa: F401 - first: sets OpenMP's spin count before anything loads torch
from stages.runtime import natsd
from stages.runtime.bus import BusConfig


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, bool]]:
    """`@pytest.mark.anyio` tests run on asyncio with uvloop, like the services."""
    return "asyncio", {"use_uvloop": True}


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[natsd.NatsServer]:
    """A private JetStream server with its data under the test's tmp dir."""
    server = natsd.start(tmp_path / "nats")
    try:
        yield server
    finally:
        natsd.stop(server)


@pytest.fixture
def bus_config(nats_server: natsd.NatsServer) -> BusConfig:
    """Short redelivery times so crash tests finish in seconds."""
    return BusConfig(servers=(nats_server.url,), ack_wait_s=2.0, max_deliver=3)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test that starts a nats-server carries the `nats` marker (`-m "not nats"` skips)."""
    for item in items:
        if "nats_server" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.nats)
