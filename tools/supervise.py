"""Supervision for `brigade up`: a stage that dies, as a child process or as a task of this one,
is logged and started again after a bounded exponential backoff, and never stops the others.

`Backoff` doubles from `initial_s` to at most `max_s`; a stage that served `reset_after_s`
before it died starts again from `initial_s`. `supervise_task` runs one in-process stage;
`ProcessSupervisor.poll` restarts the children of a `StageProcesses` that have exited.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import anyio

from tools.stage_procs import StageProcesses

log = logging.getLogger("brigade.up")


@dataclass
class Backoff:
    initial_s: float = 0.5
    max_s: float = 30.0
    reset_after_s: float = 60.0
    num_restarts: int = 0
    _next_s: float = field(default=0.0, repr=False)

    def __post_init__(self) -> None:
        if not 0 < self.initial_s <= self.max_s:
            raise ValueError(f"need 0 < initial_s ({self.initial_s}) <= max_s ({self.max_s})")
        self._next_s = self.initial_s

    def delay(self, served_s: float) -> float:
        """The wait before the next start, for a stage that served `served_s` before it died."""
        if served_s >= self.reset_after_s:
            self._next_s = self.initial_s
        delay, self._next_s = self._next_s, min(self._next_s * 2, self.max_s)
        self.num_restarts += 1
        return delay


async def supervise_task(
    name: str,
    serve_once: Callable[[], Awaitable[None]],
    stop: anyio.Event,
    backoff: Backoff | None = None,
) -> None:
    """Run `serve_once()` until `stop`; whenever it raises or returns before `stop`, log it and
    run it again after the backoff. Returns once `stop` is set and the stage has ended."""
    backoff = backoff or Backoff()
    while not stop.is_set():
        started = time.monotonic()
        try:
            await serve_once()
            if stop.is_set():
                return
            log.error("stage %s ended by itself", name)
        except Exception:  # noqa: BLE001 - one stage's crash must not end the others
            log.exception("stage %s crashed", name)
        delay = backoff.delay(time.monotonic() - started)
        log.warning("restarting stage %s in %.1f s (restart %d)", name, delay, backoff.num_restarts)
        with anyio.move_on_after(delay):
            await stop.wait()


class ProcessSupervisor:
    """Restarts exited children of `children` with a backoff each; call `poll()` periodically."""

    def __init__(self, children: StageProcesses, make_backoff=Backoff) -> None:
        self.children = children
        self.make_backoff = make_backoff
        self.backoffs: dict[str, Backoff] = {}
        self._started_at: dict[str, float] = {}
        self._due: dict[str, float] = {}  # name -> monotonic time of its next start

    def started(self, name: str) -> None:
        self._started_at[name] = time.monotonic()

    def poll(self) -> list[str]:
        """Schedule a restart for each newly exited child and start those that are due;
        returns the names started now."""
        now = time.monotonic()
        for name, proc in self.children.procs.items():
            if proc.poll() is None or name in self._due:
                continue
            backoff = self.backoffs.setdefault(name, self.make_backoff())
            delay = backoff.delay(now - self._started_at.get(name, now))
            self._due[name] = now + delay
            log.error(
                "stage %s (pid %d) exited with code %s; restarting in %.1f s (restart %d)",
                name, proc.pid, proc.returncode, delay, backoff.num_restarts,
            )  # fmt: skip
        restarted = []
        for name, at in list(self._due.items()):
            if at <= now:
                del self._due[name]
                proc = self.children.start(name)
                self.started(name)
                log.warning("stage %s started again, pid %d", name, proc.pid)
                restarted.append(name)
        return restarted
