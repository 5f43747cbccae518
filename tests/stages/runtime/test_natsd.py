"""The private nats-server: random loopback ports, JetStream on, found by a second process."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import nats
import pytest

from stages.runtime import natsd


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.nats
@pytest.mark.anyio
async def test_start_serves_jetstream_with_large_payloads(tmp_path: Path) -> None:
    server = natsd.start(tmp_path / "d")
    try:
        assert server.url.startswith("nats://127.0.0.1:")
        nc = await nats.connect(server.url)
        try:
            assert nc.max_payload == natsd.MAX_PAYLOAD_BYTES == 16 * 1024 * 1024
            info = await nc.jetstream().account_info()
            assert info.streams == 0
        finally:
            await nc.close()
        assert (tmp_path / "d" / "jetstream").is_dir()
    finally:
        natsd.stop(server)
    assert not _alive(server.pid)


@pytest.mark.nats
def test_second_process_finds_running_server_then_not_after_stop(tmp_path: Path) -> None:
    server = natsd.start(tmp_path)
    try:
        found = natsd.find_running(tmp_path)
        assert found is not None
        assert (found.url, found.pid) == (server.url, server.pid)
    finally:
        natsd.stop(server)
    assert natsd.find_running(tmp_path) is None
    assert not (tmp_path / natsd.STATE_FILE).exists()


def test_stale_state_file_is_ignored(tmp_path: Path) -> None:
    dead = os.fork()
    if dead == 0:
        os._exit(0)
    os.waitpid(dead, 0)
    (tmp_path / natsd.STATE_FILE).write_text(
        json.dumps({"url": "nats://127.0.0.1:1", "monitor_url": None, "pid": dead})
    )
    assert natsd.find_running(tmp_path) is None


@pytest.mark.nats
def test_a_server_on_4222_does_not_matter(tmp_path: Path) -> None:
    blocker = socket.socket()
    blocker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        blocker.bind(("127.0.0.1", 4222))
        blocker.listen()
    except OSError:
        pass  # something already listens on 4222: the case under test
    try:
        first = natsd.start(tmp_path / "a")
        second = natsd.start(tmp_path / "b")
        try:
            ports = {first.url.rsplit(":", 1)[1], second.url.rsplit(":", 1)[1]}
            assert len(ports) == 2 and "4222" not in ports
        finally:
            natsd.stop(second)
            natsd.stop(first)
    finally:
        blocker.close()
    assert not _alive(first.pid) and not _alive(second.pid)


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(e.decode().partition("=")[::2] for e in raw if e)


@pytest.mark.nats
@pytest.mark.parametrize(
    ("max_procs", "inherited", "expected"),
    [(None, None, "1"), (0, None, None), (3, None, "3"), (1, "2", "2")],
    ids=["default one", "go's own", "three", "environment wins"],
)
def test_the_server_runs_on_the_go_processors_asked(
    tmp_path: Path, monkeypatch, max_procs, inherited, expected
) -> None:
    """The embedded server runs on BRIGADE_NATS_MAX_PROCS Go processors (default 1: half the
    wake-ups of two on a two-core machine, see docs/benchmarks.md); 0 leaves Go's default, and
    GOMAXPROCS set by the user wins."""
    monkeypatch.delenv("BRIGADE_NATS_MAX_PROCS", raising=False)
    if inherited is None:
        monkeypatch.delenv("GOMAXPROCS", raising=False)
    else:
        monkeypatch.setenv("GOMAXPROCS", inherited)
    server = natsd.start(tmp_path, max_procs=max_procs)
    try:
        assert _environ(server.pid).get("GOMAXPROCS") == expected
    finally:
        natsd.stop(server)
