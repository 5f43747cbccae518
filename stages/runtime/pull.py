"""A continuous pull on a shared durable consumer: each message goes to `deliver` the moment it
arrives, with at most `capacity()` messages requested and not yet finished at any time (a fixed
number, or what a long-running handler can admit now: the engine's KV room).

nats-py's `fetch(n)` waits for its batch to fill or for the server's "no more" status, and each
call is one more request round trip before the next message can come; here a pull request stays
open (`expires`) and is topped up as work finishes. The server serves one client's waiting
requests first in, first out, so each delivery and each end-of-request status (404/408/409)
counts against the oldest one; a request the server never closed (a lost connection) is
forgotten after expires + a grace, and asked for again.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from nats.aio.client import Client
from nats.aio.msg import Msg

STATUS_HEADER = "Status"
HEARTBEAT = "100"
GRACE_S = 1.0


@dataclass
class _Request:
    remaining: int
    forget_at: float  # monotonic: the server should have closed it by then


class ContinuousPull:
    """Deliver the durable's messages as they arrive: `start()`, then `run()` until stopped.

    `deliver(msg)` is called from the subscription's callback and must not block (start a
    task); the caller reports each finished message with `done()`, which frees its credit.
    `capacity` is an int or a function read at every top-up; `wake()` tops up now (the
    capacity grew without a `done()`).
    """

    def __init__(
        self,
        nc: Client,
        stream: str,
        durable: str,
        deliver: Callable[[Msg], None],
        *,
        capacity: int | Callable[[], int],
        expires_s: float = 1.0,
    ) -> None:
        if (isinstance(capacity, int) and capacity < 1) or expires_s <= 0:
            raise ValueError(f"capacity={capacity} must be >= 1, expires_s={expires_s} > 0")
        self.nc = nc
        self.next_subject = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{durable}"
        self.inbox = nc.new_inbox()
        self.deliver = deliver
        self._capacity = capacity
        self.expires_s = expires_s
        self.num_active = 0  # delivered and not done yet
        self._requests: deque[_Request] = deque()
        self._changed = asyncio.Event()
        self._sub = None

    @property
    def num_requested(self) -> int:
        """Messages asked for and not delivered yet."""
        return sum(r.remaining for r in self._requests)

    async def start(self) -> None:
        self._sub = await self.nc.subscribe(self.inbox, cb=self._on_msg)

    async def stop(self) -> None:
        """Stop receiving; messages requested but not delivered go to another worker."""
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None
        self._requests.clear()

    @property
    def capacity(self) -> int:
        return self._capacity if isinstance(self._capacity, int) else self._capacity()

    def done(self) -> None:
        """One delivered message is finished (acked, nacked or left): its credit is free."""
        self.num_active -= 1
        self._changed.set()

    def wake(self) -> None:
        self._changed.set()

    async def run(self, stop: asyncio.Event | object, check_s: float = 1.0) -> None:
        """Keep requests topped up until `stop` (an anyio or asyncio Event) is set."""
        while not stop.is_set():  # type: ignore[attr-defined]
            self._changed.clear()
            await self._top_up()
            try:
                await asyncio.wait_for(self._changed.wait(), check_s)
            except TimeoutError:
                pass

    async def _on_msg(self, msg: Msg) -> None:
        status = (msg.headers or {}).get(STATUS_HEADER)
        if status == HEARTBEAT:
            return
        if self._requests:
            oldest = self._requests[0]
            oldest.remaining -= 1
            if status is not None or oldest.remaining <= 0:  # ended: expired, refused or filled
                self._requests.popleft()
        if status is not None:
            self._changed.set()
            return
        self.num_active += 1
        self.deliver(msg)

    async def _top_up(self) -> None:
        """Ask for what capacity allows beyond what is active and asked already; in chunks of
        at least half the capacity while a request is open, so a busy stage sends few."""
        now = time.monotonic()
        while self._requests and self._requests[0].forget_at < now:
            self._requests.popleft()
        requested = self.num_requested
        capacity = self.capacity
        want = capacity - self.num_active - requested
        if want <= 0 or (requested and want < max(1, capacity // 2)):
            return
        request = {"batch": want, "expires": int(self.expires_s * 1e9)}
        self._requests.append(_Request(want, now + self.expires_s + GRACE_S))
        await self.nc.publish(self.next_subject, json.dumps(request).encode(), reply=self.inbox)
