"""The edge's OpenAI-compatible routes: POST /v1/chat/completions and /v1/completions, streamed
as SSE ending in `data: [DONE]` or answered whole. A request has one run per choice (a
completions request one per prompt, choice i answering prompt i). A streamed request waits for
each run's first delta before answering, so a refusal (401/403/429/503) still gets its HTTP
status. A RequestError (or any other exception) raised before the answer starts becomes its
OpenAI error in app.py's middleware; the runs' ids come from the HTTP request's id (X-Request-Id:
the run's id, or with several prompts `<id>-<i>` for prompt i).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import msgspec
import nats.errors
from anyio.streams.memory import MemoryObjectReceiveStream
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from schemas.events import RequestFailed, RunCancelled, RunCompleted, Submit, TextGenerated
from stages import gateway
from stages.edge import deadline
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
from stages.edge.openai_bodies import (
    Choice,
    chat_chunk,
    completion_chunk,
    full_response,
    total_usage,
    usage_chunk,
)
from stages.edge.openai_schema import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIRequest,
    decode_body,
    finish_reason,
    num_candidates,
    ranks_candidates,
    to_submits,
)
from stages.edge.runwatch import RunWatch, Waiting
from stages.edge.tool_calls import ToolCallStream, parse
from stages.runtime.failures import StageError

RUN_STATE_HEADER = "X-Brigade-Run-State"  # completed | cancelled (finish_reason reads "stop")
CANCELLED = "the run was cancelled and will not run or be billed further"


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


class _Run:
    """One run being answered as choice `index`: its watch, its shape, its logprobs when asked,
    and with echo the prompt that goes before its text."""

    def __init__(
        self, index: int, watch: RunWatch, body: OpenAIRequest, tokens: TokenEvents | None
    ) -> None:
        self.index, self.watch, self.tokens = index, watch, tokens
        self.chat = isinstance(body, ChatCompletionRequest)
        self.logprobs: Logprobs | None = None
        self.tools = isinstance(body, ChatCompletionRequest) and body.calls_tools
        self.echo: str | None = None  # with echo: the prompt's text, sent before the first delta
        self.prompt_token_ids: list[int] = []  # with echo and logprobs
        self.prompt_index = 0  # the prompt it answers
        self.show_logprobs = True  # False: kept only to rank best_of candidates
        self.cumulative_logprob = 0.0  # of its sampled tokens, eos included (as vLLM ranks)

    async def logprobs_of(self, delta: TextGenerated) -> dict[str, Any] | None:
        """The logprobs of the tokens behind this text delta (None when not asked or none),
        after the prompt's with echo."""
        if self.logprobs is None or self.tokens is None:
            return None
        event = await self.tokens.take(delta.seq)
        if event is not None and event.logprobs is not None:
            self.cumulative_logprob += sum(ranked[0].logprob for ranked in event.logprobs)
        prompt = None
        if event is not None and event.prompt_logprobs is not None and self.echo is not None:
            prompt = self.logprobs.add_prompt(self.prompt_token_ids, event.prompt_logprobs)
        part = self.logprobs.add(event)
        if delta.stopped:
            self.logprobs.stopped = True
        if prompt is None:
            return part
        return {k: v + (part[k] if part else []) for k, v in prompt.items()}

    def take_echo(self) -> str:
        """With echo, the prompt's text the first time (then ""); without, ""."""
        text = self.echo or ""
        if self.echo is not None:
            self.echo = ""  # sent; still not None: the prompt's logprobs come with seq 0
        return text


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
        own = deadline.requested(request.headers.get(deadline.DEADLINE_HEADER), body.deadline_s)
        if own is not None:
            extra["deadline_s"] = own
        submits = to_submits(body, **extra)
        if len(submits) > 1:  # a bad prompt is refused before any of the request's runs starts
            for submit in submits:
                _check_submit(submit)
        runs: list[_Run] = []
        try:
            for i, submit in enumerate(submits):
                tokens = TokenEvents(edge.bus.js, submit.request_id or rid)
                watch = await edge.open_run(
                    caller, submit, tokens if submit.logprobs is not None else None, i == 0
                )
                runs.append(self._run(i, watch, body, submit, tokens))
        except BaseException:
            with anyio.CancelScope(shield=True):
                for run in runs:
                    await edge.cancel(caller, run.watch.request_id)
                    await run.watch.close()
            raise
        if len(runs) == 1:  # its run's id: a re-attached key's run is not this request's
            rid = runs[0].watch.request_id
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return await self._stream(caller, rid, model, runs, include_usage)
        best_n = (body.n or 1) if ranks_candidates(body) else None
        return await self._whole(request, caller, rid, model, runs, best_n)

    def _run(
        self, index: int, watch: RunWatch, body: OpenAIRequest, submit: Submit, tokens: TokenEvents
    ) -> _Run:
        tok = self.edge.tokenizer_of(submit.model)
        run = _Run(index, watch, body, tokens if submit.logprobs is not None else None)
        run.prompt_index = index // num_candidates(body)
        if submit.logprobs is not None:
            run.logprobs = Logprobs(TokenText(tok), chat=run.chat, num_top=submit.logprobs)
            run.show_logprobs = body.num_logprobs is not None
        if isinstance(body, CompletionRequest) and body.echo:
            ids = submit.prompt_token_ids or tok.encode(submit.prompt or "")
            run.echo = submit.prompt if submit.prompt is not None else tok.decode(ids, False)
            run.prompt_token_ids = list(ids)
        return run

    async def _whole(
        self,
        request: Request,
        caller: Caller,
        rid: str,
        model: str,
        runs: list[_Run],
        best_n: int | None = None,  # best_of: answer each prompt's best_n most likely runs
    ) -> Response:
        texts: list[list[str]] = [[] for _ in runs]
        timeout: RequestError | None = None
        async with anyio.create_task_group() as tg:

            async def on_disconnect() -> None:
                while (await request.receive())["type"] != "http.disconnect":
                    pass
                tg.cancel_scope.cancel()

            async def collect(run: _Run) -> None:
                nonlocal timeout
                try:
                    async for delta in self.edge.deltas(run.watch):
                        texts[run.index].append(delta.text)
                        await run.logprobs_of(delta)
                except TimeoutError as err:
                    timeout = RequestError("timeout", f"{err}; {CANCELLED}")

            tg.start_soon(on_disconnect)
            try:
                async with anyio.create_task_group() as collectors:
                    for run in runs:
                        collectors.start_soon(collect, run)
            finally:
                tg.cancel_scope.cancel()
                for run in runs:
                    if timeout is not None:
                        await self.edge.cancel(caller, run.watch.request_id, "timeout")
                    else:
                        await self.edge.left(caller, run.watch)
                with anyio.CancelScope(shield=True):
                    for run in runs:
                        await run.watch.close()
        if timeout is not None:
            response = error_response(timeout, rid)
            response.headers[RUN_STATE_HEADER] = "cancelled"  # it will not run or bill further
            response.headers[deadline.DEADLINE_HEADER] = _deadline_of(runs)
            return response
        terms = [run.watch.terminal for run in runs]
        if any(term is None for term in terms):
            return Response(status_code=499)  # the client left; nobody reads this
        for term in terms:
            if isinstance(term, RequestFailed):
                return error_response(failure_error(term), rid)
        choices = [self._choice(run, "".join(texts[run.index])) for run in runs]
        if best_n is not None:
            choices = _best(runs, choices, best_n)
        body = full_response(runs[0].chat, rid, _created(terms[0]), model, choices,
                             total_usage([t.usage for t in terms],
                                         [r.prompt_index for r in runs]))  # fmt: skip
        states = {_state(t) for t in terms}
        state = "cancelled" if "cancelled" in states else "completed"
        headers = {"X-Request-Id": rid, RUN_STATE_HEADER: state,
                   deadline.DEADLINE_HEADER: _deadline_of(runs)}  # fmt: skip
        return JSONResponse(body, headers=headers)

    def _choice(self, run: _Run, text: str) -> Choice:
        term = run.watch.terminal
        assert isinstance(term, RunCompleted | RunCancelled), "a choice of an ended run"
        logprobs = run.logprobs.whole() if run.logprobs is not None and run.show_logprobs else None
        reason, content, calls = finish_reason(term), text, None
        if run.tools:
            content, calls = parse(run.watch.request_id, text)
            reason = "tool_calls" if calls and reason == "stop" else reason
        elif run.echo is not None:
            content = run.echo + text
        return Choice(index=run.index, text=content, finish_reason=reason, logprobs=logprobs,
                      tool_calls=calls)  # fmt: skip

    async def _stream(
        self, caller: Caller, rid: str, model: str, runs: list[_Run], include_usage: bool
    ) -> Response:
        firsts: list[TextGenerated | Waiting | None] = []
        deltas = [self.edge.deltas(run.watch, keepalive=True) for run in runs]
        closed = False

        async def close_all(reason: str = "disconnect") -> None:
            nonlocal closed
            if closed:
                return
            closed = True
            with anyio.CancelScope(shield=True):
                for run, stream in zip(runs, deltas, strict=True):
                    await self.edge.left(caller, run.watch, reason)
                    await stream.aclose()
                    await run.watch.close()

        try:  # each run's first delta or end, unless a keep-alive comes first: then answer 200
            for stream in deltas:
                firsts.append(await anext(stream, None))
                if isinstance(firsts[-1], Waiting):
                    break
            firsts += [None] * (len(runs) - len(firsts))
        except TimeoutError as err:
            with anyio.CancelScope(shield=True):
                for stream in deltas:
                    await stream.aclose()
            return await self._first_token_timed_out(caller, rid, runs, err)
        except BaseException:
            await close_all()
            raise
        for run, first in zip(runs, firsts, strict=True):
            if first is None and isinstance(run.watch.terminal, RequestFailed):
                await close_all()
                return error_response(failure_error(run.watch.terminal), rid)
        created = int(time.time())
        chat = runs[0].chat
        send, receive = anyio.create_memory_object_stream[bytes](max_buffer_size=64)
        batch = self.edge.config.batch_sse
        errors: list[Exception] = []  # a run's bus error ends the whole answer

        async def follow(run: _Run, first: TextGenerated | Waiting | None, stream, out) -> None:
            async with out:
                try:
                    async for piece in self._pieces(run, first, stream, rid, created, model):
                        await out.send(piece)
                except (TimeoutError, nats.errors.Error) as err:
                    errors.append(err)

        async def events() -> AsyncIterator[bytes]:
            try:
                async with anyio.create_task_group() as tg:
                    for run, first, stream in zip(runs, firsts, deltas, strict=True):
                        tg.start_soon(follow, run, first, stream, send.clone())
                    send.close()
                    async for piece in receive:
                        yield _with_ready(piece, receive) if batch else piece
                if errors:
                    raise errors[0]
                terms = [r.watch.terminal for r in runs]
                failed = [t for t in terms if isinstance(t, RequestFailed)]
                if failed:
                    yield sse(error_body(failure_error(failed[0])))
                elif include_usage and all(t is not None for t in terms):
                    prompts = [r.prompt_index for r in runs]
                    usage = total_usage([t.usage for t in terms if t is not None], prompts)
                    yield sse(usage_chunk(chat, rid, created, model, usage))
                yield b"data: [DONE]\n\n"
            except TimeoutError as err:
                found = bus_error(err)
                if found is None:  # cancelled (or left to its reconnect grace) before it is said
                    found, _ = self._timed_out(runs, err)
                    await close_all("timeout")
                yield sse(error_body(found))  # and no [DONE], as vLLM ends a failed stream
            except nats.errors.Error as err:
                yield sse(error_body(bus_error(err) or as_request_error(err)))
            finally:
                await close_all()

        headers = {"X-Request-Id": rid, "Cache-Control": "no-cache",
                   deadline.DEADLINE_HEADER: _deadline_of(runs)}  # fmt: skip
        return StreamingResponse(events(), media_type="text/event-stream", headers=headers)

    async def _first_token_timed_out(
        self, caller: Caller, rid: str, runs: list[_Run], err: TimeoutError
    ) -> Response:
        """No first token within the deadline (or no event within the idle timeout) before the
        stream's answer started: a 504 that says what happens next (`_timed_out`)."""
        with anyio.CancelScope(shield=True):
            for run in runs:
                await self.edge.left(caller, run.watch, "timeout")  # now, or after the grace
                await run.watch.close()
        found, state = self._timed_out(runs, err)
        response = error_response(found, rid)
        response.headers[RUN_STATE_HEADER] = state
        response.headers[deadline.DEADLINE_HEADER] = _deadline_of(runs)
        return response

    def _timed_out(self, runs: list[_Run], err: TimeoutError) -> tuple[RequestError, str]:
        """The timeout's error and the runs' state: runs with an idempotency key are resumable
        (`running`: they keep running for the reconnect grace; a retry with the key or GET
        /v1/runs/{id}/stream re-attaches, else they are cancelled then), any other run is
        `cancelled` now, so it never runs or bills after its client was told it timed out."""
        grace = self.edge.config.reconnect_grace_s
        resumable = all(r.watch.idempotency_key is not None for r in runs) and grace > 0
        ids = ", ".join(r.watch.request_id for r in runs)
        if resumable:
            message = (f"{err}; the run is still running: resume it with GET /v1/runs/{ids}"
                       f"/stream or retry with the same idempotency key within {grace:g} s")  # fmt: skip
        else:
            message = f"{err}; {CANCELLED}"
        return RequestError("timeout", message), "running" if resumable else "cancelled"

    async def _pieces(
        self,
        run: _Run,
        first: TextGenerated | Waiting | None,
        stream: AsyncIterator[TextGenerated | Waiting],
        rid: str,
        created: int,
        model: str,
    ) -> AsyncIterator[bytes]:
        """One run's chunks, in order: the role (chat), its deltas, then its finish reason."""
        index, calls = run.index, ToolCallStream(run.watch.request_id) if run.tools else None

        def chunk(text: str, reason: str | None, logprobs: dict[str, Any] | None) -> bytes:
            if run.chat:
                delta = {"content": text} if text or reason is None else {}
                return sse(chat_chunk(rid, created, model, delta, reason, logprobs, index))
            return sse(completion_chunk(rid, created, model, text, reason, logprobs, index))

        async def pieces(delta: TextGenerated) -> AsyncIterator[bytes]:
            logprobs = await run.logprobs_of(delta)
            if calls is None:
                text = run.take_echo() + delta.text
                if text or logprobs is not None:
                    yield chunk(text, None, logprobs)
                return
            parts = calls.feed(delta.text) or ([{}] if logprobs is not None else [])
            for i, part in enumerate(parts):
                lp = logprobs if i == 0 else None
                yield sse(chat_chunk(rid, created, model, part, None, lp, index))

        if run.chat:
            role = {"role": "assistant", "content": ""}
            yield sse(chat_chunk(rid, created, model, role, None, None, index))
        async for delta in _chain(first, stream):
            if isinstance(delta, Waiting):
                yield deadline.SSE_KEEPALIVE
                continue
            async for piece in pieces(delta):
                yield piece
        term = run.watch.terminal
        if term is None or isinstance(term, RequestFailed):
            return
        reason = finish_reason(term)
        if calls is not None:
            for part in calls.end():
                yield sse(chat_chunk(rid, created, model, part, None, None, index))
            reason = "tool_calls" if calls.num_complete and reason == "stop" else reason
        if echo := run.take_echo():  # a run that ended before any delta
            yield chunk(echo, None, None)
        yield chunk("", reason, None)


def _with_ready(piece: bytes, receive: MemoryObjectReceiveStream[bytes]) -> bytes:
    """`piece` and the chunks already waiting behind it, as one write."""
    pieces = [piece]
    while True:
        try:
            pieces.append(receive.receive_nowait())
        except (anyio.WouldBlock, anyio.EndOfStream):
            return pieces[0] if len(pieces) == 1 else b"".join(pieces)


async def _chain(
    first: TextGenerated | Waiting | None, rest: AsyncIterator[TextGenerated | Waiting]
) -> AsyncIterator[TextGenerated | Waiting]:
    if first is not None:
        yield first
    async for item in rest:
        yield item


def _deadline_of(runs: list[_Run]) -> str:
    """The runs' wait for a first token, as X-Brigade-Deadline-S says it."""
    return f"{max(r.watch.deadline_s or 0.0 for r in runs):g}"


def _check_submit(submit: Submit) -> None:
    """The gateway's own checks of a submit, as a 400 naming the field."""
    try:
        gateway.normalize(submit, limit_chars=gateway.max_text_chars())
    except StageError as err:
        raise RequestError("invalid_request", err.message, err.field) from None


def _best(runs: list[_Run], choices: list[Choice], n: int) -> list[Choice]:
    """best_of: each prompt's n candidates of highest cumulative logprob, as its choices
    prompt * n .. prompt * n + n - 1, most likely first."""
    best: list[Choice] = []
    for prompt in sorted({r.prompt_index for r in runs}):
        ranked = sorted((r for r in runs if r.prompt_index == prompt),
                        key=lambda r: -r.cumulative_logprob)[:n]  # fmt: skip
        for rank, run in enumerate(ranked):
            best.append(dataclasses.replace(choices[run.index], index=prompt * n + rank))
    return best


def _state(term: RunCompleted | RunCancelled | RequestFailed | None) -> str:
    return "completed" if isinstance(term, RunCompleted) else "cancelled"


def _created(term: RunCompleted | RunCancelled | RequestFailed | None) -> int:
    ts = term.ts_ns if term is not None else 0
    return int((ts or time.time_ns()) // 1_000_000_000)
