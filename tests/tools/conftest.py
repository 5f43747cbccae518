"""`brigade up --procs` as a fixture: the real pipeline (private nats-server, every stage in its
own process, the real model, the edge, the archiver), stopped by its own pid at the end."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

API_KEY = "brg-tools-test-key-00000000000000000"
START_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class RunningBrigade:
    data_dir: Path
    edge_url: str
    api_key: str

    def env(self, monkeypatch) -> None:
        """Point this test's tools at the running pipeline (as a second terminal would be)."""
        monkeypatch.setenv("BRIGADE_DATA_DIR", str(self.data_dir))
        monkeypatch.setenv("BRIGADE_API_KEY", self.api_key)
        monkeypatch.delenv("NATS_URL", raising=False)
        monkeypatch.delenv("BRIGADE_ARCHIVE_DIR", raising=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="package")  # stopped once tests/tools is done
def brigade_up(tmp_path_factory) -> Iterator[RunningBrigade]:
    data = tmp_path_factory.mktemp("brigade-up")
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("NATS_URL", "BRIGADE_ARCHIVE_DIR")}
    env.update(BRIGADE_DATA_DIR=str(data), BRIGADE_API_KEY=API_KEY, BRIGADE_EDGE_PORT=str(port))
    # these tests check what clients and the log measure, not admission: a busy shared CPU
    # must not turn their second concurrent request into a 503 (tests/stages/edge tests that)
    env.update(BRIGADE_EDGE_MAX_WAIT_S="30")
    log_path = data / "up.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tools.cli", "up", "--procs"],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while b"Brigade is up" not in log_path.read_bytes():
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"brigade up did not come up:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.5)
        yield RunningBrigade(data_dir=data, edge_url=f"http://127.0.0.1:{port}", api_key=API_KEY)
    finally:
        proc.send_signal(signal.SIGINT)  # what Ctrl-C does: drain every stage, stop NATS
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the group it leads: our processes only
            proc.wait()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests on the running pipeline start a nats-server: they carry the `nats` marker."""
    for item in items:
        if "brigade_up" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.nats)
