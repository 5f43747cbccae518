"""The websocket protocol of `/v1/stream`, typed JSON events in the style of OpenAI's Realtime API.

Client: `response.create` {response: {messages | prompt, model, sampling..., idempotency_key}},
`response.cancel` {request_id?}, `response.resume` {request_id, starting_after} (or, on
connect, /v1/stream?request_id=...&starting_after=...).
Server: `response.created`, `response.waiting` (a keep-alive while it waits),
`response.output_text.delta`, `response.done`, `error`.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec
from msgspec import Struct

from schemas.bounded import JsonBoundsError, decode_bounded
from schemas.events import RequestFailed, RunCancelled, RunCompleted, Submit, Usage
from schemas.subjects import REQUEST_ID_PATTERN
from stages.edge.errors import RequestError
from stages.edge.openai_schema import usage_body
from stages.edge.runwatch import Waiting

# Fields a client may set in `response`; identity (request_id, api_key) comes from the edge.
# Logprobs (of the output or the prompt) are served on the HTTP routes only: the delta events
# here carry text.
LOGPROB_FIELDS = ("logprobs", "prompt_logprobs")
CLIENT_FIELDS = frozenset(Submit.__struct_fields__) - {
    "request_id", "api_key", "priority", "edge_worker", *LOGPROB_FIELDS
}  # fmt: skip


class ResponseCreate(Struct, tag="response.create", tag_field="type", frozen=True):
    response: dict[str, Any]
    event_id: str | None = None


class ResponseCancel(Struct, tag="response.cancel", tag_field="type", frozen=True):
    request_id: str | None = None
    event_id: str | None = None


class ResponseResume(Struct, tag="response.resume", tag_field="type", frozen=True):
    request_id: str
    starting_after: int = -1
    event_id: str | None = None


ClientEvent = ResponseCreate | ResponseCancel | ResponseResume
_client_decoder = msgspec.json.Decoder(ClientEvent)
_REQUEST_ID_RE = re.compile(REQUEST_ID_PATTERN)
_encoder = msgspec.json.Encoder()


def decode_client_event(frame: str | bytes) -> ClientEvent:
    try:
        event = decode_bounded(_client_decoder, frame)
    except JsonBoundsError as err:
        raise RequestError("invalid_request", f"invalid client event: {err}", err.field) from None
    except msgspec.ValidationError as err:
        raise RequestError("invalid_request", f"invalid client event: {err}", "type") from None
    except msgspec.DecodeError as err:
        raise RequestError("invalid_request", f"frame is not valid JSON: {err}") from None
    if isinstance(event, ResponseResume):
        if not _REQUEST_ID_RE.match(event.request_id):
            raise RequestError(
                "invalid_request", "request_id must match [A-Za-z0-9_-]{1,64}", "request_id"
            )
        if event.starting_after < -1:
            raise RequestError("invalid_request", "starting_after must be >= -1", "starting_after")
    return event


def submit_of(event: ResponseCreate, **identity: Any) -> Submit:
    """The `response` object as a validated submit; unknown fields are refused by name."""
    for name in LOGPROB_FIELDS:
        if event.response.get(name) is not None:
            raise RequestError(
                "unsupported_parameter",
                f"{name} are not sent on the websocket; ask POST /v1/chat/completions or "
                "/v1/completions for them",
                f"response.{name}",
            )
    fields = {k: v for k, v in event.response.items() if k not in LOGPROB_FIELDS}
    unknown = sorted(set(fields) - CLIENT_FIELDS)
    if unknown:
        raise RequestError(
            "invalid_request",
            f"unknown field {unknown[0]!r} in response; allowed: {', '.join(sorted(CLIENT_FIELDS))}",
            f"response.{unknown[0]}",
        )
    try:
        # str_keys: JSON object keys are text; logit_bias's are token ids
        submit = msgspec.convert({**fields, **identity}, Submit, str_keys=True)
    except msgspec.ValidationError as err:
        field = str(err).rpartition("`$.")[2].rstrip("`").split("[")[0].split(".")[0] or None
        raise RequestError("invalid_request", f"invalid response.create: {err}", field) from None
    given = [x for x in (submit.messages, submit.prompt, submit.prompt_token_ids) if x is not None]
    if len(given) != 1:
        raise RequestError(
            "invalid_request",
            "give exactly one of response.messages, response.prompt or response.prompt_token_ids",
            "messages",
        )
    return submit


def created(request_id: str, event_id: str | None = None) -> bytes:
    return _encoder.encode(
        {"type": "response.created", "event_id": event_id, "request_id": request_id,
         "response": {"id": request_id, "status": "in_progress"}}
    )  # fmt: skip


def delta(request_id: str, seq: int, text: str) -> bytes:
    return _encoder.encode(
        {"type": "response.output_text.delta", "request_id": request_id, "seq": seq, "text": text}
    )


def done(request_id: str, terminal: RunCompleted | RunCancelled | RequestFailed) -> bytes:
    usage: Usage = terminal.usage
    body: dict[str, Any] = {"type": "response.done", "request_id": request_id}
    if isinstance(terminal, RunCompleted):
        status = "completed" if terminal.finish_reason == "stop" else "incomplete"
        body |= {"status": status, "finish_reason": terminal.finish_reason,
                 "last_seq": terminal.last_seq}  # fmt: skip
    elif isinstance(terminal, RunCancelled):
        body |= {"status": "cancelled", "finish_reason": "cancelled", "last_seq": terminal.last_seq}
    else:
        body |= {"status": "failed", "finish_reason": "error",
                 "error": {"code": terminal.code, "message": terminal.message, "field": terminal.field}}  # fmt: skip
    body["usage"] = usage_body(usage)
    return _encoder.encode(body)


def waiting(request_id: str, wait: Waiting) -> bytes:
    """The keep-alive of a response still waiting: for its first token (`started` false: for
    an engine, until `deadline_s` after it was created), or for text an engine is making."""
    return _encoder.encode(
        {"type": "response.waiting", "request_id": request_id,
         "waited_s": round(wait.waited_s, 3), "deadline_s": wait.deadline_s,
         "started": wait.started}
    )  # fmt: skip


def error(err: RequestError, request_id: str | None = None, event_id: str | None = None) -> bytes:
    body: dict[str, Any] = {"code": err.code, "message": err.message, "field": err.field}
    if err.retry_after_s is not None:
        body["retry_after_s"] = err.retry_after_s
    return _encoder.encode(
        {"type": "error", "event_id": event_id, "request_id": request_id, "error": body}
    )
