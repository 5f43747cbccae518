"""The edge's OpenAI-compatible routes: POST /v1/chat/completions and /v1/completions, streamed
as SSE ending in `data: [DONE]` or answered whole. A streamed request waits for its first delta
before answering, so a refusal (401/403/429/503) still gets its HTTP status. A RequestError (or
any other exception) raised before the answer starts becomes its OpenAI error in app.py's
middleware; the run's id is the HTTP request's id (X-Request-Id).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import msgspec
import nats.errors
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from schemas.events import RequestFailed, RunCancelled, RunCompleted, TextGenerated
from stages.edge.core import Edge
from stages.edge.errors import (
    RequestError,
    as_request_error,
    bus_error,
    error_body,
    error_response,
    failure_error,
)
from stages.edge.keys import Caller
from stages.edge.logprobs import Logprobs, TokenEvents, TokenText
from stages.edge.openai_schema import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIRequest,
    chat_chunk,
    completion_chunk,
    decode_body,
    finish_reason,
    full_response,
    to_submit,
    usage_chunk,
)
from stages.edge.runwatch import RunWatch
from stages.edge.tool_calls import ToolCallStream, parse

RUN_STATE_HEADER = "X-Brigade-Run-State"  # completed | cancelled (finish_reason reads "stop")


def request_id_of(request: Request) -> str:
    """The id the edge's middleware gave this HTTP request (its run's id, its X-Request-Id)."""
    return request.scope["state"]["request_id"]


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

    async def _serve(self, request: Request, kind: type[OpenAIRequest]) -> Response:
        edge = self.edge
        rid = request_id_of(request)
        caller = edge.authenticate(request)
        body = decode_body(await read_body(request, edge.config.max_body_bytes), kind)
        model = edge.served_model(caller, body.model)
        extra: dict[str, Any] = {"request_id": rid, "model": model}
        if key := request.headers.get("idempotency-key"):
            extra["idempotency_key"] = key
        submit = to_submit(body, **extra)
        tokens = TokenEvents(edge.bus.js, rid) if body.num_logprobs is not None else None
        watch = await edge.open_run(caller, submit, tokens)
        run = _Run(watch, kind is ChatCompletionRequest, model, tokens, self._logprobs(body))
        run.tools = isinstance(body, ChatCompletionRequest) and body.calls_tools
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return await self._stream(caller, run, include_usage)
        return await self._whole(request, caller, run)

    def _logprobs(self, body: OpenAIRequest) -> Logprobs | None:
        if body.num_logprobs is None:
            return None
        assert self.edge.tokenizer is not None, "the edge was not started"
        chat = isinstance(body, ChatCompletionRequest)
        return Logprobs(TokenText(self.edge.tokenizer), chat=chat, num_top=body.num_logprobs)

    async def _whole(self, request: Request, caller: Caller, run: _Run) -> Response:
        watch = run.watch
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
                    await run.logprobs_of(delta)
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
        rid = watch.request_id
        if timeout is not None:
            response = error_response(timeout, rid)
            response.headers[RUN_STATE_HEADER] = "cancelled"  # it will not run or bill further
            return response
        term = watch.terminal
        if term is None:
            return Response(status_code=499)  # the client left; nobody reads this
        if isinstance(term, RequestFailed):
            return error_response(failure_error(term), rid)
        logprobs = run.logprobs.whole() if run.logprobs is not None else None
        text: str | None = "".join(texts)
        reason, calls = finish_reason(term), None
        if run.tools:
            text, calls = parse(rid, text)
            reason = "tool_calls" if calls and reason == "stop" else reason
        body = full_response(run.chat, rid, _created(term), run.model, text, reason,
                             term.usage, logprobs, calls)  # fmt: skip
        headers = {"X-Request-Id": rid, RUN_STATE_HEADER: _state(term)}
        return JSONResponse(body, headers=headers)

    async def _first_token_timed_out(
        self, caller: Caller, watch: RunWatch, err: TimeoutError
    ) -> Response:
        """No event within the edge's idle timeout before the stream's first token. The 504
        says what happens next: a run with an idempotency key is resumable (it keeps running
        for the reconnect grace; a retry with the key or GET /v1/runs/{id}/stream re-attaches,
        else it is cancelled then), any other run is cancelled now, so it never runs or bills
        after its client was told it timed out."""
        rid = watch.request_id
        grace = self.edge.config.reconnect_grace_s
        resumable = watch.idempotency_key is not None and grace > 0
        with anyio.CancelScope(shield=True):
            await self.edge.left(caller, watch, "timeout")  # now, or after the grace if keyed
            await watch.close()
        if resumable:
            message = (f"{err}; the run is still running: resume it with GET /v1/runs/{rid}"
                       f"/stream or retry with the same idempotency key within {grace:g} s")  # fmt: skip
        else:
            message = f"{err}; the run was cancelled and will not run or be billed further"
        response = error_response(RequestError("timeout", message), rid)
        response.headers[RUN_STATE_HEADER] = "running" if resumable else "cancelled"
        return response

    async def _stream(self, caller: Caller, run: _Run, include_usage: bool) -> Response:
        watch = run.watch
        deltas = self.edge.deltas(watch)
        rid, model, chat = watch.request_id, run.model, run.chat
        try:
            first = await anext(deltas, None)
        except TimeoutError as err:
            return await self._first_token_timed_out(caller, watch, err)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await watch.close()
            raise
        if first is None and isinstance(watch.terminal, RequestFailed):
            await watch.close()
            return error_response(failure_error(watch.terminal), rid)
        created = int(time.time())

        def chunk(text: str, reason: str | None, logprobs: dict[str, Any] | None) -> bytes:
            if chat:
                delta = {"content": text} if text or reason is None else {}
                return sse(chat_chunk(rid, created, model, delta, reason, logprobs))
            return sse(completion_chunk(rid, created, model, text, reason, logprobs))

        calls = ToolCallStream(rid) if run.tools else None

        async def pieces(delta: TextGenerated) -> AsyncIterator[bytes]:
            logprobs = await run.logprobs_of(delta)
            if calls is None:
                if delta.text or logprobs is not None:
                    yield chunk(delta.text, None, logprobs)
                return
            parts = calls.feed(delta.text) or ([{}] if logprobs is not None else [])
            for i, part in enumerate(parts):
                yield sse(chat_chunk(rid, created, model, part, None, logprobs if i == 0 else None))

        async def events() -> AsyncIterator[bytes]:
            try:
                if chat:
                    yield sse(
                        chat_chunk(rid, created, model, {"role": "assistant", "content": ""}, None)
                    )
                if first is not None:
                    async for piece in pieces(first):
                        yield piece
                async for delta in deltas:
                    async for piece in pieces(delta):
                        yield piece
                term = watch.terminal
                if isinstance(term, RequestFailed):
                    yield sse(error_body(failure_error(term)))
                elif term is not None:
                    reason = finish_reason(term)
                    if calls is not None:
                        for part in calls.end():
                            yield sse(chat_chunk(rid, created, model, part, None))
                        reason = "tool_calls" if calls.num_complete and reason == "stop" else reason
                    yield chunk("", reason, None)
                    if include_usage:
                        yield sse(usage_chunk(chat, rid, created, model, term.usage))
                yield b"data: [DONE]\n\n"
            except TimeoutError as err:
                yield sse(error_body(bus_error(err) or RequestError("timeout", str(err))))
            except nats.errors.Error as err:
                yield sse(error_body(bus_error(err) or as_request_error(err)))
            finally:
                with anyio.CancelScope(shield=True):
                    await self.edge.left(caller, watch)
                    await deltas.aclose()
                    await watch.close()

        headers = {"X-Request-Id": rid, "Cache-Control": "no-cache"}
        return StreamingResponse(events(), media_type="text/event-stream", headers=headers)


class _Run:
    """One run being answered: its watch, its shape, and its logprobs when asked."""

    def __init__(
        self,
        watch: RunWatch,
        chat: bool,
        model: str,
        tokens: TokenEvents | None,
        logprobs: Logprobs | None,
    ) -> None:
        self.watch, self.chat, self.model = watch, chat, model
        self.tokens, self.logprobs = tokens, logprobs
        self.tools = False  # the output may hold tool calls (tool_calls.py parses them)

    async def logprobs_of(self, delta: TextGenerated) -> dict[str, Any] | None:
        """The logprobs of the tokens behind this text delta (None when not asked or none)."""
        if self.logprobs is None or self.tokens is None:
            return None
        part = self.logprobs.add(await self.tokens.take(delta.seq))
        if delta.stopped:
            self.logprobs.stopped = True
        return part


def _state(term: RunCompleted | RunCancelled) -> str:
    return "completed" if isinstance(term, RunCompleted) else "cancelled"


def _created(term: RunCompleted | RunCancelled) -> int:
    return int((term.ts_ns or time.time_ns()) // 1_000_000_000)
