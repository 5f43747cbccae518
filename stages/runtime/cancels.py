"""The request ids a stage has seen cancelled, so it can skip their work (bounded, LRU), and the
callbacks of a long-running handler that aborts work in flight (each id's first cancel only)."""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import msgspec
from nats.aio.msg import Msg

from schemas import subjects
from schemas.bounded import decode_bounded
from schemas.events import CancelRequested, decoder_for
from stages.runtime.bus import Bus

log = logging.getLogger("brigade.runtime")
_decoder = decoder_for(CancelRequested)


class CancelledRequests:
    """Request ids whose `cancel` event was seen, fed by a plain subscription (bounded LRU)."""

    def __init__(self, capacity: int = 100_000) -> None:
        self.capacity = capacity
        self._ids: OrderedDict[str, str] = OrderedDict()  # request id -> the cancel's reason
        self._callbacks: list[Callable[[CancelRequested], None]] = []

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._ids

    def reason(self, request_id: str) -> str | None:
        """The reason of the request's first cancel seen here; None when none was."""
        return self._ids.get(request_id)

    def add(self, request_id: str, cancel: CancelRequested | None = None) -> None:
        """Record a cancel; callbacks get its event (one with the default reason without)."""
        if request_id in self._ids:
            return
        event = cancel if cancel is not None else CancelRequested(request_id=request_id)
        self._ids[request_id] = event.reason
        if len(self._ids) > self.capacity:
            self._ids.popitem(last=False)
        for callback in self._callbacks:
            callback(event)

    def on_cancel(self, callback: Callable[[CancelRequested], None]) -> None:
        self._callbacks.append(callback)

    async def subscribe(self, bus: Bus) -> Any:
        """Feed the set from a plain subscription on llm.ev.*.cancel; returns the subscription.

        The subject names the request; a payload that does not decode still cancels it."""

        async def seen(msg: Msg) -> None:
            request_id = msg.subject.split(".")[-2]
            try:
                cancel: CancelRequested | None = decode_bounded(_decoder, msg.data)
            except (msgspec.DecodeError, msgspec.ValidationError) as err:
                log.warning(
                    "cancel for %s did not decode (%s); cancelling it anyway", request_id, err
                )
                cancel = None
            if cancel is not None and cancel.request_id != request_id:
                cancel = msgspec.structs.replace(cancel, request_id=request_id)
            self.add(request_id, cancel)

        sub = await bus.nc.subscribe(subjects.all_events("cancel"), cb=seen)
        await bus.nc.flush()
        return sub
