"""CPU priority of compute threads: the engine's step thread runs below the stages and nats-server.

Linux keeps scheduling policy and nice per thread and a new thread inherits its creator's, so
lowering the step thread before its first torch op also lowers the OpenMP workers torch starts
from it, while the stage's event loop thread (which publishes the tokens) keeps normal priority.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from typing import Literal

from schemas import settings

ENV = settings.ENGINE_CPU_PRIORITY.name
BACKGROUND_ENV = settings.BACKGROUND_CPU_PRIORITY.name  # ledger and archiver processes
# batch:19 is as quick to yield as SCHED_IDLE here, less starved by other work
DEFAULT = settings.ENGINE_CPU_PRIORITY.default
log = logging.getLogger("brigade.cpu_priority")


@dataclass(frozen=True, kw_only=True)
class CpuPriority:
    """`batch` (default `batch:19`): SCHED_BATCH at `nice`; `idle`: SCHED_IDLE, only what no
    other thread wants; `nice`: SCHED_OTHER at `nice`; `normal`: left alone."""

    policy: Literal["idle", "batch", "nice", "normal"]
    nice: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.nice <= 19:
            raise ValueError(f"nice={self.nice}: give 0..19 (higher runs later)")

    @classmethod
    def parse(cls, text: str, env: str = ENV) -> CpuPriority:
        """`idle`, `batch`, `batch:N`, `nice:N` or `normal` (N in 0..19)."""
        name, _, value = text.strip().lower().partition(":")
        allowed = "idle, batch, batch:N, nice:N or normal (N in 0..19)"
        if name not in ("idle", "batch", "nice", "normal") or (
            value and name in ("idle", "normal")
        ):
            raise ValueError(f"{env}={text!r}: give {allowed}")
        if name == "nice" and not value:
            raise ValueError(f"{env}={text!r}: nice needs a value, e.g. nice:10; give {allowed}")
        try:
            nice = int(value) if value else 0
        except ValueError:
            raise ValueError(
                f"{env}={text!r}: {value!r} is not an integer; give {allowed}"
            ) from None
        return cls(policy=name, nice=nice)  # type: ignore[arg-type]

    @classmethod
    def from_env(cls, env: str = ENV) -> CpuPriority:
        """The priority the setting named `env` holds (ENV or BACKGROUND_ENV)."""
        return cls.parse(settings.BY_NAME[env].get(), env)


def apply_to_current_thread(priority: CpuPriority) -> bool:
    """Lower the calling thread (and the threads it starts later); False where not supported."""
    if priority.policy == "normal":
        return True
    tid = threading.get_native_id()
    try:
        if priority.policy == "idle":
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            return True
        if priority.policy == "batch":
            os.sched_setscheduler(tid, os.SCHED_BATCH, os.sched_param(0))
        if priority.nice > os.getpriority(os.PRIO_PROCESS, tid):
            os.setpriority(os.PRIO_PROCESS, tid, priority.nice)
        return True
    except (AttributeError, OSError) as err:  # not Linux, or a sandbox that forbids it
        log.warning("could not lower this thread's CPU priority (%s): %s", priority, err)
        return False


class LowPriorityThreads:
    """Lowers each thread that calls `ensure()` once: call it first thing in the step thread."""

    def __init__(self, priority: CpuPriority) -> None:
        self.priority = priority
        self._done = threading.local()

    def ensure(self) -> None:
        if not getattr(self._done, "applied", False):
            apply_to_current_thread(self.priority)
            self._done.applied = True
