"""Long-running handlers: a `Service` takes inputs while it has capacity and settles each `Held`
input itself, over any length of time; the runtime (worker.py) keeps what it holds alive.

Contract. The runtime calls `capacity()` before every input it hands over and never calls
`admit` while it is below 1; `admit(held, event)` takes ownership of one decoded input, which
the service later settles exactly once (`complete`, `fail`, `ack`, `term`, `nak`, or `forget` when
another delivery of the same message stands for it). `run(stopping, task_status=...)` is the
service's own loop (a step thread, an HTTP server): it calls `task_status.started()` once it
serves, and after `stopping` is set it finishes what it holds and returns. Past the spec's
`drain_s` it is cancelled, and the runtime hands back (naks) every input still held.
`on_cancel` hears every request's first `cancel` event, from the stage's one subscription.
A spec with no input runs only `run`: capacity and admit are never called.
"""

from __future__ import annotations

import abc
import logging
import time
from typing import Any, Protocol

import anyio
import anyio.abc
from nats.aio.msg import Msg

from schemas.events import CancelRequested, Event
from stages.runtime.failures import StageError

log = logging.getLogger("brigade.runtime")


class Service(abc.ABC):
    """Base of long-running handlers; a stage's `StageSpec.service(ctx, state)` builds one. A
    spec with no input (the edge, the archiver) runs only `run`; one with input builds an
    `InputService`."""

    @abc.abstractmethod
    async def run(self, stopping: anyio.Event, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        """Serve; `task_status.started()` once serving; after `stopping`, finish and return."""

    def on_cancel(self, cancel: CancelRequested) -> None:  # noqa: B027 - most services ignore it
        """A request was cancelled (late and unknown ids included); called on the event loop."""

    def health(self) -> dict[str, Any]:
        """What the worker's heartbeat reports of the service (the engine: its KV room)."""
        return {}


class InputService(Service):
    """A long-running handler of the spec's input (the engine)."""

    @abc.abstractmethod
    def capacity(self) -> int:
        """How many new inputs it can take now (the engine: its KV admission)."""

    @abc.abstractmethod
    async def admit(self, held: Held, event: Any) -> None:
        """Take ownership of one decoded input; settle it exactly once, later."""


class _Owner(Protocol):
    async def complete(self, msg: Msg, outputs: list[Event], started_ns: int) -> None: ...

    async def fail(self, msg: Msg, event: Any, err: StageError, started_ns: int) -> None: ...

    def release(self, held: Held) -> None: ...


class Held:
    """One input a service holds. Every settling call ends the runtime's hold (its in-progress
    acks) even when it raises, so an input whose settling failed is redelivered after ack_wait;
    a second settling call, or one after the runtime handed the input back, does nothing."""

    __slots__ = ("msg", "received_ns", "_owner", "settled")  # received_ns: monotonic

    def __init__(self, owner: _Owner, msg: Msg) -> None:
        self.msg = msg
        self.received_ns = time.monotonic_ns()
        self._owner = owner
        self.settled = False

    @property
    def num_delivered(self) -> int:
        return self.msg.metadata.num_delivered

    async def complete(self, outputs: list[Event]) -> None:
        """Publish `outputs` (acknowledged by the stream, service_ns stamped), then ack."""
        if self._settle():
            try:
                await self._owner.complete(self.msg, outputs, self.received_ns)
            finally:
                self._owner.release(self)

    async def fail(self, event: Any, err: StageError) -> None:
        """Publish a `failed` event for `event`'s request, then ack."""
        if self._settle():
            try:
                await self._owner.fail(self.msg, event, err, self.received_ns)
            finally:
                self._owner.release(self)

    async def ack(self) -> None:
        if self._settle():
            try:
                await self.msg.ack()
            finally:
                self._owner.release(self)

    async def term(self) -> None:
        """Never deliver it again (AckTerm): a poison message, recorded as a dead letter."""
        if self._settle():
            try:
                await self.msg.term()
            finally:
                self._owner.release(self)

    async def nak(self, delay: float | None = None) -> None:
        """Hand it back: another worker (or this one) gets it again."""
        if self._settle():
            try:
                await self.msg.nak(delay=delay)
            finally:
                self._owner.release(self)

    async def in_progress(self) -> None:
        if not self.settled:
            await self.msg.in_progress()

    def forget(self) -> None:
        """Stop holding it unsettled: it is redelivered after ack_wait, unless another delivery
        of the same message is settled first."""
        if self._settle():
            self._owner.release(self)

    def _settle(self) -> bool:
        if self.settled:
            log.debug("input on %s settled twice; the second call is ignored", self.msg.subject)
            return False
        self.settled = True
        return True
