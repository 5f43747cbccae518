"""The websocket `/v1/stream`: one session per connection, at most one response in flight.

A bad frame gets an `error` event and the session stays open; a frame over the limit closes the
socket (1009). Leaving with a response in flight cancels it (reason `disconnect`). A response
waiting for its first token gets `response.waiting` every BRIGADE_EDGE_KEEPALIVE_S; past its
deadline it is cancelled and the client gets an `error` (code `timeout`).
"""

from __future__ import annotations

import contextlib
import json

import anyio
import nats.errors
from starlette.websockets import WebSocket, WebSocketDisconnect

from stages.edge import realtime
from stages.edge.core import Edge, new_request_id
from stages.edge.errors import RequestError, as_request_error, bus_error, error_response
from stages.edge.keys import Caller
from stages.edge.realtime import ResponseCancel, ResponseCreate, ResponseResume
from stages.edge.runwatch import RunWatch, Waiting

MESSAGE_TOO_BIG = 1009
CANCELLED = "the response was cancelled and will not run or be billed further"


class Session:
    def __init__(self, edge: Edge, caller: Caller, ws: WebSocket) -> None:
        self.edge, self.caller, self.ws = edge, caller, ws
        self.active: RunWatch | None = None

    async def send_error(self, err: RequestError, event_id: str | None = None) -> None:
        rid = self.active.request_id if self.active is not None else None
        await self.ws.send_text(realtime.error(err, rid, event_id).decode())

    async def serve(self, resume: str | None = None) -> None:
        async with anyio.create_task_group() as tg:
            try:
                if resume is not None:  # /v1/stream?request_id=...&starting_after=...
                    try:
                        await self._on_frame(resume, tg)
                    except (RequestError, nats.errors.Error) as err:
                        await self.send_error(as_request_error(err))
                while True:
                    frame = await self._receive()
                    if frame is None:
                        break
                    try:
                        await self._on_frame(frame, tg)
                    except (RequestError, nats.errors.Error) as err:
                        await self.send_error(as_request_error(err))
            finally:
                if self.active is not None:
                    await self.edge.left(self.caller, self.active)
                tg.cancel_scope.cancel()

    async def _receive(self) -> str | None:
        limit = self.edge.config.max_frame_bytes
        while True:
            message = await self.ws.receive()
            if message["type"] == "websocket.disconnect":
                return None
            text = message.get("text")
            if text is None:
                await self.send_error(
                    RequestError(
                        "invalid_request", "binary frames are not accepted; send JSON text"
                    )
                )
                continue
            if len(text) > limit:  # characters >= bytes/4; the server refuses beyond 2x bytes
                await self.send_error(
                    RequestError(
                        "too_large",
                        f"frame of {len(text)} characters exceeds {limit} (BRIGADE_EDGE_MAX_FRAME)",
                    )  # fmt: skip
                )
                await self.ws.close(MESSAGE_TOO_BIG)
                return None
            return text

    async def _on_frame(self, frame: str, tg: anyio.abc.TaskGroup) -> None:
        event = realtime.decode_client_event(frame)
        if isinstance(event, ResponseCancel):
            await self._cancel(event)
            return
        if self.active is not None:
            raise RequestError(
                "conflict",
                f"response {self.active.request_id} is still in progress; send response.cancel "
                "or wait for its response.done",
            )
        if isinstance(event, ResponseCreate):
            submit = realtime.submit_of(event)
            watch = await self.edge.open_run(self.caller, submit)
        else:
            assert isinstance(event, ResponseResume)
            watch = await self.edge.attach(self.caller, event.request_id, event.starting_after)
        self.active = watch
        await self.ws.send_text(realtime.created(watch.request_id, event.event_id).decode())
        tg.start_soon(self._stream, watch)

    async def _cancel(self, event: ResponseCancel) -> None:
        rid = event.request_id or (self.active.request_id if self.active else None)
        if rid is None:
            raise RequestError("invalid_request", "no response in progress to cancel", "request_id")
        if self.active is None or rid != self.active.request_id:
            await self.edge.owned(self.caller, rid)
        await self.edge.cancel(self.caller, rid, "client")

    async def _stream(self, watch: RunWatch) -> None:
        rid = watch.request_id
        try:
            async for delta in self.edge.deltas(watch, keepalive=True):
                if isinstance(delta, Waiting):  # no first token yet: still waiting, and until when
                    await self.ws.send_text(realtime.waiting(rid, delta).decode())
                    continue
                await self.ws.send_text(realtime.delta(rid, delta.seq, delta.text).decode())
            if watch.terminal is not None:
                await self.ws.send_text(realtime.done(rid, watch.terminal).decode())
        except nats.errors.Error as err:  # the bus went away mid-run: say so, keep the socket
            with contextlib.suppress(WebSocketDisconnect, RuntimeError):
                await self.send_error(bus_error(err) or RequestError("internal", str(err)))
        except TimeoutError as err:
            await self.edge.cancel(self.caller, rid, "timeout")
            with contextlib.suppress(WebSocketDisconnect, RuntimeError):
                await self.send_error(RequestError("timeout", f"{err}; {CANCELLED}"))
        except (WebSocketDisconnect, RuntimeError):
            await self.edge.left(self.caller, watch)  # the client left while we sent
        finally:
            with anyio.CancelScope(shield=True):
                await watch.close()
            if self.active is watch:
                self.active = None


async def stream_socket(edge: Edge, ws: WebSocket) -> None:
    try:
        caller = edge.authenticate(ws)
    except RequestError as err:
        await ws.send_denial_response(error_response(err, new_request_id()))
        return
    await ws.accept()
    query = ws.query_params
    resume = None
    if "request_id" in query:
        raw_after = query.get("starting_after", "-1")
        after = int(raw_after) if raw_after.lstrip("-").isdigit() else -2  # -2: refused by name
        resume = json.dumps({"type": "response.resume", "request_id": query["request_id"],
                             "starting_after": after})  # fmt: skip
    await Session(edge, caller, ws).serve(resume)
