"""Stage child processes: each in its own process group, up once connected, drained by one
SIGTERM; background stages run at low CPU priority; a child that dies is reported."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from stages.runtime.natsd import NatsServer
from tools.stage_procs import StageProcesses, connected


def _threads(pid: int) -> list[tuple[int, int]]:
    """(policy, nice) of every thread of `pid`, from /proc (Linux)."""
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        out.append((int(fields[38]), int(fields[16])))  # policy, nice (man 5 proc: 41, 19)
    return out


@pytest.fixture
def children(nats_server: NatsServer, tmp_path, monkeypatch):
    monkeypatch.setenv("BRIGADE_DATA_DIR", str(tmp_path))
    monkeypatch.delenv("BRIGADE_BACKGROUND_CPU_PRIORITY", raising=False)
    procs = StageProcesses(nats_server.url, nats_server.monitor_url)
    yield procs
    procs.stop(timeout_s=10)


def test_a_child_connects_in_its_own_group_and_drains_on_one_sigterm(children, nats_server):
    assert connected(nats_server.monitor_url, "gateway") is False
    proc = children.start("gateway")
    children.wait_up("gateway", 60)
    assert connected(nats_server.monitor_url, "gateway") is True
    assert os.getpgid(proc.pid) == proc.pid  # a terminal's Ctrl-C reaches only the parent
    assert children.exited() is None
    children.stop(timeout_s=20)
    assert proc.returncode == 0  # drained and exited by itself, not killed
    assert connected(nats_server.monitor_url, "gateway") is False


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="Linux /proc only")
def test_a_background_stage_runs_every_thread_at_batch_nice_19(children):
    proc = children.start("ledger")
    children.wait_up("ledger", 60)
    assert set(_threads(proc.pid)) == {(os.SCHED_BATCH, 19)}  # threads it starts inherit it
    gateway = children.start("gateway")
    children.wait_up("gateway", 60)
    assert {policy for policy, _ in _threads(gateway.pid)} == {os.SCHED_OTHER}


def test_a_child_that_exits_is_reported(nats_server, tmp_path, monkeypatch):
    monkeypatch.setenv("BRIGADE_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("BRIGADE_BACKGROUND_CPU_PRIORITY", "fast")  # refused: exits with code 2
    children = StageProcesses(nats_server.url, nats_server.monitor_url)
    children.start("ledger")
    with pytest.raises(RuntimeError, match="stage ledger exited with code 2"):
        children.wait_up("ledger", 60)
    assert children.exited() == ("ledger", 2)
    assert connected(None, "ledger") is None  # no monitor to ask: cannot tell
