"""Shared fixtures: a real nats-server on random loopback ports, stopped by its own pid."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

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
