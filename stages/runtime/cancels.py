"""The request ids a stage has seen cancelled, so it can skip their work (bounded, LRU)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from nats.aio.msg import Msg

from schemas import subjects
from stages.runtime.bus import Bus


class CancelledRequests:
    """Request ids whose `cancel` event was seen, fed by a plain subscription (bounded LRU)."""

    def __init__(self, capacity: int = 100_000) -> None:
        self.capacity = capacity
        self._ids: OrderedDict[str, None] = OrderedDict()
        self._callbacks: list[Callable[[str], None]] = []

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._ids

    def add(self, request_id: str) -> None:
        if request_id in self._ids:
            return
        self._ids[request_id] = None
        if len(self._ids) > self.capacity:
            self._ids.popitem(last=False)
        for callback in self._callbacks:
            callback(request_id)

    def on_cancel(self, callback: Callable[[str], None]) -> None:
        self._callbacks.append(callback)

    async def subscribe(self, bus: Bus) -> Any:
        """Feed the set from a plain subscription on llm.ev.*.cancel; returns the subscription."""

        async def seen(msg: Msg) -> None:
            self.add(msg.subject.split(".")[-2])

        sub = await bus.nc.subscribe(subjects.all_events("cancel"), cb=seen)
        await bus.nc.flush()
        return sub
