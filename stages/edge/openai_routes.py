"""The edge's OpenAI-compatible routes: POST /v1/chat/completions and /v1/completions, streamed
as SSE ending in `data: [DONE]` or answered whole. A streamed request waits for its first delta
before answering, so a refusal (401/403/429/503) still gets its HTTP status.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from schemas.events import RequestFailed, RunCancelled, RunCompleted
from stages.edge.core import Edge
from stages.edge.errors import RequestError, error_body, error_response, failure_error
from stages.edge.keys import Caller
from stages.edge.openai_schema import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_chunk,
    completion_chunk,
    decode_body,
    full_response,
    to_submit,
    usage_chunk,
)
from stages.edge.runwatch import RunWatch


def sse(body: Any) -> bytes:
    return b"data: " + msgspec.json.encode(body) + b"\n\n"


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestError(
            "too_large", f"body is {declared} bytes; at most {limit} (BRIGADE_EDGE_MAX_BODY)"
        )
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RequestError("too_large", f"body exceeds {limit} bytes (BRIGADE_EDGE_MAX_BODY)")
        chunks.append(chunk)
    return b"".join(chunks)


class OpenAIRoutes:
    """POST /v1/chat/completions and /v1/completions, streamed (SSE) or not."""

    def __init__(self, edge: Edge) -> None:
        self.edge = edge

    async def chat(self, request: Request) -> Response:
        return await self._serve(request, ChatCompletionRequest)

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, CompletionRequest)

    async def _serve(self, request: Request, kind: type) -> Response:
        edge = self.edge
        try:
            caller = edge.authenticate(request)
            body = decode_body(await read_body(request, edge.config.max_body_bytes), kind)
            key = request.headers.get("idempotency-key")
            submit = to_submit(body, **({"idempotency_key": key} if key else {}))
            watch = await edge.open_run(caller, submit)
        except RequestError as err:
            return error_response(err)
        chat = kind is ChatCompletionRequest
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return await self._stream(caller, watch, chat, body.model, include_usage)
        return await self._whole(request, caller, watch, chat, body.model)

    async def _whole(
        self, request: Request, caller: Caller, watch: RunWatch, chat: bool, model: str
    ) -> Response:
        texts: list[str] = []
        timeout: RequestError | None = None
        async with anyio.create_task_group() as tg:

            async def on_disconnect() -> None:
                while (await request.receive())["type"] != "http.disconnect":
                    pass
                tg.cancel_scope.cancel()

            tg.start_soon(on_disconnect)
            try:
                async for delta in self.edge.deltas(watch):
                    texts.append(delta.text)
            except TimeoutError as err:
                timeout = RequestError("timeout", str(err))
            finally:
                tg.cancel_scope.cancel()
                if timeout is not None:
                    await self.edge.cancel(caller, watch.request_id, "timeout")
                else:
                    await self.edge.left(caller, watch)
                with anyio.CancelScope(shield=True):
                    await watch.close()
        if timeout is not None:
            return error_response(timeout)
        term = watch.terminal
        if term is None:
            return Response(status_code=499)  # the client left; nobody reads this
        if isinstance(term, RequestFailed):
            return error_response(failure_error(term))
        reason = term.finish_reason if isinstance(term, RunCompleted) else "cancelled"
        body = full_response(chat, watch.request_id, _created(term), model, "".join(texts),
                             reason, term.usage)  # fmt: skip
        return JSONResponse(body, headers={"X-Request-Id": watch.request_id})

    async def _stream(
        self, caller: Caller, watch: RunWatch, chat: bool, model: str, include_usage: bool
    ) -> Response:
        deltas = self.edge.deltas(watch)
        try:
            first = await anext(deltas, None)
        except TimeoutError as err:
            await watch.close()
            return error_response(RequestError("timeout", str(err)))
        if first is None and isinstance(watch.terminal, RequestFailed):
            await watch.close()
            return error_response(failure_error(watch.terminal))
        rid, created = watch.request_id, int(time.time())

        def chunk(text: str, reason: str | None) -> bytes:
            if chat:
                return sse(chat_chunk(rid, created, model, {"content": text}, reason))
            return sse(completion_chunk(rid, created, model, text, reason))

        async def events() -> AsyncIterator[bytes]:
            try:
                if chat:
                    yield sse(
                        chat_chunk(rid, created, model, {"role": "assistant", "content": ""}, None)
                    )
                if first is not None and first.text:
                    yield chunk(first.text, None)
                async for delta in deltas:
                    if delta.text:
                        yield chunk(delta.text, None)
                term = watch.terminal
                if isinstance(term, RequestFailed):
                    yield sse(error_body(failure_error(term)))
                elif term is not None:
                    reason = term.finish_reason if isinstance(term, RunCompleted) else "cancelled"
                    yield (
                        sse(chat_chunk(rid, created, model, {}, reason))
                        if chat
                        else chunk("", reason)
                    )
                    if include_usage:
                        yield sse(usage_chunk(chat, rid, created, model, term.usage))
                yield b"data: [DONE]\n\n"
            except TimeoutError as err:
                yield sse(error_body(RequestError("timeout", str(err))))
            finally:
                with anyio.CancelScope(shield=True):
                    await self.edge.left(caller, watch)
                    await deltas.aclose()
                    await watch.close()

        headers = {"X-Request-Id": rid, "Cache-Control": "no-cache"}
        return StreamingResponse(events(), media_type="text/event-stream", headers=headers)


def _created(term: RunCompleted | RunCancelled) -> int:
    return int((term.ts_ns or time.time_ns()) // 1_000_000_000)
