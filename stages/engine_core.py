"""The engine core's own thread: it steps back to back while the event loop publishes.

The core (`engine.Engine`) is not thread-safe, so one thread owns it. Between steps that thread
applies what the loop queued (requests admitted, aborts) and then steps again at once; each
step's outputs go to the loop without waiting for it. The loop used to start every step in a
worker thread and handle its outputs before it started the next, so every step also paid a
wake-up of the step thread (it runs at batch priority, behind every light process), a wake-up of
the loop, and the loop's own work on the outputs, with the engine's cores idle meanwhile
(docs/benchmarks.md, Serving).

`ahead` bounds how far the core runs past the loop (BRIGADE_ENGINE_STEPS_AHEAD). With 1, the
default and SGLang's overlap schedule, step N+1 computes while the loop publishes step N's tokens,
and step N+2 waits until those are handled: an abort or a stop string takes effect one step
later than it would with 0, which waits for each step's outputs to be handled first.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class StepDone:
    """One step, as the loop receives it (or only the refusals, when nothing was left to step)."""

    outputs: list[Any] = field(default_factory=list)
    stats: Any = None  # the core's stats right after the step
    took_ns: int = 0  # the step alone, in this thread
    refused: list[Any] = field(default_factory=list)  # what prepare() could not add
    error: BaseException | None = None  # the step raised: nothing it ran can go on
    stepped: bool = True  # False: the core had nothing to step, only refusals to report


class CoreThread:
    """Steps `engine` in the calling thread (`run()`, through anyio.to_thread) until `halt()`.

    `prepare()` runs in this thread before every step (the loop's queued adds and aborts; it
    returns the refusals), `lower()` once first (the thread's CPU priority), and `post(done)`
    must hand a StepDone to the loop without blocking (call_soon_threadsafe). The loop calls
    `handled()` once for every StepDone it has finished with, and `kick()` when it queues work.
    """

    def __init__(
        self,
        engine: Any,
        *,
        prepare: Callable[[], list[Any]],
        post: Callable[[StepDone], None],
        lower: Callable[[], None] = lambda: None,
        ahead: int = 1,
    ) -> None:
        if ahead < 0:
            raise ValueError(f"ahead must be >= 0, not {ahead}")
        self.engine = engine
        self.prepare = prepare
        self.post = post
        self.lower = lower
        self.ahead = ahead
        self._cond = threading.Condition()
        self._unhandled = 0  # StepDones posted that the loop has not finished with
        self._kicked = False
        self._halted = False

    # ---- from the event loop ----

    def kick(self) -> None:
        """New work queued (an admission, an abort): an idle core looks again."""
        with self._cond:
            self._kicked = True
            self._cond.notify()

    def handled(self) -> None:
        """The loop is done with one StepDone: the core may run one more step past it."""
        with self._cond:
            self._unhandled -= 1
            if self._unhandled <= self.ahead:
                self._cond.notify()

    def halt(self) -> None:
        """Stop after the step in progress (if any); `run()` then returns."""
        with self._cond:
            self._halted = True
            self._cond.notify()

    # ---- the core's thread ----

    def run(self) -> None:
        self.lower()
        while True:
            with self._cond:
                while not self._halted and self._unhandled > self.ahead:
                    self._cond.wait()
                if self._halted:
                    return
                self._kicked = False  # work queued after this is seen by prepare() or the wait
            refused = self.prepare()
            if not self.engine.has_unfinished_requests():
                if refused:
                    self._send(StepDone(refused=refused, stepped=False))
                with self._cond:
                    while not (self._halted or self._kicked):
                        self._cond.wait()
                continue
            began = time.monotonic_ns()
            try:
                outputs, error = self.engine.step(), None
            except Exception as err:  # noqa: BLE001 - the loop fails what the step ran
                outputs, error = [], err
            took = time.monotonic_ns() - began
            self._send(StepDone(outputs, self.engine.stats(), took, refused, error))

    def _send(self, done: StepDone) -> None:
        with self._cond:
            self._unhandled += 1
        self.post(done)
