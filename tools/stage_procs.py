"""Stages as child processes, each `brigade stage NAME` exactly as compose runs it.

Each child gets its own process group, so a Ctrl-C in the terminal reaches only the parent,
which then drains every child with one SIGTERM; on Linux a child also gets SIGTERM when its
parent dies, even by SIGKILL, so none outlives `brigade up`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

from stages.runtime.natsd import die_with_parent
from tools.stage import command

STOP_TIMEOUT_S = 15.0
MODEL_SEP = "@"  # a child's key: `engine@<model id>` is an engine worker bound to that model


def child_key(stage: str, model: str | None = None) -> str:
    return stage if model is None else f"{stage}{MODEL_SEP}{model}"


def split_key(key: str) -> tuple[str, str | None]:
    """`engine@tiny` -> ("engine", "tiny"); `ledger` -> ("ledger", None)."""
    stage, sep, model = key.partition(MODEL_SEP)
    return stage, (model if sep else None)


def connected(monitor_url: str | None, name: str) -> bool | None:
    """Whether a client named brigade-<name> is connected (None: cannot tell)."""
    if not monitor_url:
        return None
    try:
        with urllib.request.urlopen(f"{monitor_url}/connz?limit=1024", timeout=2) as r:
            conns = json.load(r).get("connections", [])
    except OSError:
        return None
    return any(c.get("name") == f"brigade-{name}" for c in conns)


class StageProcesses:
    """Start, watch and stop stage processes on one NATS."""

    def __init__(self, url: str, monitor_url: str | None, log_level: str = "WARNING") -> None:
        self.env = dict(os.environ, NATS_URL=url)
        self.monitor_url = monitor_url
        self.log_level = log_level
        self.procs: dict[str, subprocess.Popen] = {}
        self._terminated: set[int] = set()  # pids sent SIGTERM

    def start(self, name: str) -> subprocess.Popen:
        """Start child `name`: a stage, or `engine@<model id>` (an engine worker of that model,
        BRIGADE_ENGINE_MODEL in its environment)."""
        stage, model = split_key(name)
        argv = [sys.executable, "-m", "tools.cli", *command(stage)[1:]]
        env = self.env if model is None else {**self.env, "BRIGADE_ENGINE_MODEL": model}
        proc = subprocess.Popen(
            [*argv, "--log-level", self.log_level],
            env=env,
            process_group=0,
            preexec_fn=die_with_parent if sys.platform == "linux" else None,
        )
        self.procs[name] = proc
        return proc

    def up(self, name: str) -> bool | None:
        """Whether `name` consumes its input yet (None: no monitor to ask, assume so)."""
        return connected(self.monitor_url, name)

    def wait_up(self, name: str, timeout_s: float, tick=None, stopped=None) -> None:
        """Block until `name` is connected (or `stopped()`); raise if it exits or takes longer
        than `timeout_s`. `tick()` runs every 0.1 s while waiting (a progress line)."""
        deadline = time.monotonic() + timeout_s
        proc = self.procs[name]
        while self.up(name) is False and not (stopped is not None and stopped()):
            if proc.poll() is not None:
                raise RuntimeError(f"stage {name} exited with code {proc.returncode}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"stage {name} did not connect within {timeout_s:.0f} s")
            if tick is not None:
                tick()
            time.sleep(0.1)

    def exited(self) -> tuple[str, int] | None:
        """The first child that has exited, with its code."""
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                return name, proc.returncode
        return None

    def terminate(self) -> None:
        """SIGTERM every running child once (each drains its in-flight work); a second SIGTERM
        would find its handler gone and kill it mid-drain."""
        for proc in self.procs.values():
            if proc.poll() is None and proc.pid not in self._terminated:
                proc.send_signal(signal.SIGTERM)
                self._terminated.add(proc.pid)

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM every child (each drains its in-flight work), SIGKILL what outlives timeout_s."""
        self.terminate()
        deadline = time.monotonic() + timeout_s
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
