"""GET /v1/runs/{id} (state, last seq, usage) and GET /v1/runs/{id}/stream?starting_after=N
(the rest of the run from the log as SSE, in the websocket's event shapes, ending `[DONE]`).

Another tenant's run answers exactly like a run that does not exist: 404.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator

import msgspec
import nats.errors
from nats.js.errors import NotFoundError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from schemas import subjects
from schemas.events import decode_event
from schemas.subjects import REQUEST_ID_PATTERN
from stages.edge import realtime
from stages.edge.core import Edge
from stages.edge.deadline import SSE_KEEPALIVE
from stages.edge.errors import RequestError, bus_error, error_response
from stages.edge.openai_schema import usage_body
from stages.edge.runwatch import Waiting

_REQUEST_ID = re.compile(REQUEST_ID_PATTERN)


def _request_id(request: Request) -> str:
    rid = request.path_params["request_id"]
    if not _REQUEST_ID.match(rid):
        raise RequestError("invalid_request", "a run id matches [A-Za-z0-9_-]{1,64}", "request_id")
    return rid


def _starting_after(request: Request) -> int:
    raw = request.query_params.get("starting_after", "-1")
    try:
        value = int(raw)
    except ValueError:
        value = -2
    if value < -1:
        raise RequestError(
            "invalid_request", f"starting_after must be an integer >= -1, got {raw[:32]!r}",
            "starting_after",
        )  # fmt: skip
    return value


class RunRoutes:
    def __init__(self, edge: Edge) -> None:
        self.edge = edge

    async def get(self, request: Request) -> Response:
        edge = self.edge
        try:
            caller = edge.authenticate(request)
            rid = _request_id(request)
            await edge.owned(caller, rid)
        except RequestError as err:
            return error_response(err)
        assert edge.runs is not None
        record = await edge.runs.get(rid)
        state = record.state if record is not None else "queued"
        last_seq = record.last_seq if record is not None else None
        if state in ("prefill", "streaming", "queued") or last_seq is None:
            last_seq = await self._last_text_seq(rid)  # live, or the end not projected yet
        body = {
            "id": rid,
            "object": "run",
            "state": state,
            "last_seq": last_seq,
            "usage": usage_body(record.usage) if record is not None else None,
            "finish_reason": record.finish_reason if record is not None else None,
            "error_code": record.error_code if record is not None else None,
        }
        return JSONResponse(body)

    async def _last_text_seq(self, rid: str) -> int | None:
        subject = subjects.event_subject(rid, "text")
        try:
            msg = await self.edge.bus.js.get_last_msg(subjects.EVENTS_STREAM, subject, direct=True)
        except NotFoundError:
            return None
        try:
            return getattr(decode_event(msg.data), "seq", None) if msg.data else None
        except msgspec.DecodeError:  # a poison stored on the subject: no text seq to report
            return None

    async def stream(self, request: Request) -> Response:
        edge = self.edge
        try:
            caller = edge.authenticate(request)
            rid = _request_id(request)
            watch = await edge.attach(caller, rid, _starting_after(request))
        except RequestError as err:
            return error_response(err)

        async def events() -> AsyncIterator[bytes]:
            try:
                async for delta in edge.deltas(watch, keepalive=True):
                    if isinstance(delta, Waiting):
                        yield SSE_KEEPALIVE
                        continue
                    yield b"data: " + realtime.delta(rid, delta.seq, delta.text) + b"\n\n"
                if watch.terminal is not None:
                    yield b"data: " + realtime.done(rid, watch.terminal) + b"\n\n"
                yield b"data: [DONE]\n\n"
            except (TimeoutError, nats.errors.Error) as err:
                found = bus_error(err) or RequestError("timeout", str(err))
                yield b"data: " + realtime.error(found, rid) + b"\n\n"
            finally:
                await watch.close()

        return StreamingResponse(events(), media_type="text/event-stream")
