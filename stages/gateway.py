"""Gateway: a JSON submit on `llm.in` -> `accepted` (or `failed` naming the field), and an answer.

It assigns the request id (or keeps a valid client one, claimed for the key's tenant: another
tenant's id is refused before anything is stored under it), hashes the API key (read from the
Brigade-Api-Key header, or from the body of an older client; the key itself is never stored),
normalizes the submit into a `Request`, and answers on the submit's reply inbox (header
Brigade-Reply-To) with a `SubmitReply` once the event is stored.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

import msgspec

from schemas import models, settings, subjects
from schemas.bounded import MAX_VALUE_DEPTH, json_depth, value_depth
from schemas.events import (
    Event,
    Message,
    Request,
    RequestAccepted,
    RequestFailed,
    RunCancelled,
    Sampling,
    Submit,
    SubmitReply,
    encode,
)
from stages.auth import AuthState
from stages.engine_params import CONSTRAINT_FIELDS, constraint
from stages.runtime.failures import StageError, error_field, new_request_id, read_envelope
from stages.runtime.spec import StageContext, StageSpec
from stages.tenancy import tenants
from stages.tenancy.request_ids import RequestIds, RequestIdTaken, body_hash
from stages.tenancy.tenants import hash_key

STAGE = "gateway"
SAMPLING_FIELDS = tuple(f.name for f in msgspec.structs.fields(Sampling))


def max_text_chars() -> int:
    return settings.MAX_SUBMIT_CHARS.get()


def _invalid(field: str, message: str) -> StageError:
    return StageError("invalid_request", message, field=field)


def served_model_id(name: str | None) -> str:
    """The id of the served model `name` names (None: the default, BRIGADE_MODEL's first); a
    model nobody here serves fails at once as `model_not_found`, never left waiting."""
    served = models.served()
    found = models.find(served, name)
    if found is None:
        raise StageError("model_not_found", models.not_served(name, served), field="model")
    return found.id


def normalize(submit: Submit, *, limit_chars: int) -> Request:
    """Check what the schema cannot express and build the pipeline's `Request`."""
    given = [
        n for n in ("messages", "prompt", "prompt_token_ids") if getattr(submit, n) is not None
    ]
    if not given:
        raise _invalid(
            "messages",
            "give `messages` (a list of {role, content}), `prompt` (a string) or "
            "`prompt_token_ids`; none was sent",
        )
    if len(given) > 1:
        raise _invalid(given[1], f"give one of `messages`, `prompt` and `prompt_token_ids`, not "
                       f"{' and '.join(given)}")  # fmt: skip
    raw = submit.prompt is not None or submit.prompt_token_ids is not None
    if submit.messages is not None and not submit.messages:
        raise _invalid("messages", "`messages` is empty; send at least one {role, content}")
    if raw:
        if submit.prompt is not None and not submit.prompt:
            raise _invalid("prompt", "`prompt` is empty")
        for name in ("system", "documents", "retrieval"):
            if getattr(submit, name):
                raise _invalid(
                    name, f"`{name}` needs `messages`: a raw `prompt` reaches the model as is"
                )
    if submit.min_tokens > submit.max_tokens:
        raise _invalid(
            "min_tokens",
            f"min_tokens={submit.min_tokens} is above max_tokens={submit.max_tokens}",
        )
    messages = submit.messages or (
        []
        if submit.prompt_token_ids is not None
        else [Message(role="user", content=submit.prompt or "")]
    )
    num_chars = (
        sum(len(m.content) for m in messages)
        + len(submit.system or "")
        + sum(len(d.content) for d in submit.documents)
    )
    if num_chars > limit_chars:
        raise _invalid(
            "messages" if submit.prompt is None else "prompt",
            f"the submit holds {num_chars} characters of text; the limit is {limit_chars} "
            f"({settings.MAX_SUBMIT_CHARS.name})",
        )
    sampling = Sampling(**{name: getattr(submit, name) for name in SAMPLING_FIELDS})
    check_value_depth(sampling)
    check_constraint(sampling)
    return Request(
        messages=messages,
        raw_prompt=raw,
        prompt_token_ids=submit.prompt_token_ids,
        system=submit.system,
        documents=submit.documents,
        model=submit.model,
        truncation=submit.truncation,
        retrieval=submit.retrieval,
        priority=submit.priority,
        idempotency_key=submit.idempotency_key,
        sampling=sampling,
        deadline_s=submit.deadline_s,
        edge_worker=submit.edge_worker,
    )


def check_value_depth(sampling: Sampling) -> None:
    """A free-form JSON value (a schema, or its text) nests at most MAX_VALUE_DEPTH levels, so
    every event that carries it stays within the bus decoders' MAX_JSON_DEPTH."""
    fmt = sampling.response_format
    values = {
        "guided_json": sampling.guided_json,
        "response_format.json_schema.schema": (
            fmt.json_schema.schema if fmt is not None and fmt.json_schema is not None else None
        ),
    }
    for field, value in values.items():
        if value is None:
            continue
        depth = json_depth(value.encode()) if isinstance(value, str) else value_depth(value)
        if depth > MAX_VALUE_DEPTH:
            raise _invalid(
                field,
                f"`{field}` nests {depth} levels of JSON; at most {MAX_VALUE_DEPTH} are taken",
            )


def check_constraint(sampling: Sampling) -> None:
    """A structured-output field that can never compile (a bad schema, regex or grammar) fails
    here, before the request is accepted, naming the field and the problem."""
    if all(getattr(sampling, name) is None for name in CONSTRAINT_FIELDS):
        return
    from engine.errors import RequestRejected
    from engine.grammar import check

    try:
        found = constraint(sampling)
        if found is not None:
            check(found)
    except RequestRejected as err:
        raise _invalid(err.field or "response_format", err.message) from err


def with_key_header(submit: Submit, headers: Mapping[str, str]) -> Submit:
    """The submit with its API key from the Brigade-Api-Key header (held in memory only: the
    `accepted` event carries its hash). A key in the body as well must be the same key."""
    key = headers.get(subjects.API_KEY_HEADER)
    if key is None:
        return submit
    if submit.api_key is not None and submit.api_key != key:
        raise msgspec.ValidationError(
            f"two different API keys: send the key once, in the {subjects.API_KEY_HEADER} "
            "header - at `$.api_key`"
        )
    return msgspec.structs.replace(submit, api_key=key)


def handle(submit: Submit, state: object) -> list[Event]:
    request_id = submit.request_id or new_request_id()
    try:
        request = normalize(submit, limit_chars=max_text_chars())
        request = msgspec.structs.replace(request, model=served_model_id(submit.model))
    except StageError as err:
        failed = RequestFailed(
            request_id=request_id,
            stage=STAGE,
            code=err.code,  # type: ignore[arg-type]  # invalid_request or model_not_found
            message=err.message,
            field=err.field,
        )
        return [failed]
    accepted = RequestAccepted(
        request_id=request_id,
        request=request,
        key_hash=hash_key(submit.api_key) if submit.api_key else None,
        received_ns=time.time_ns(),
    )
    return [accepted]


@dataclass
class GatewayState:
    """The tenants file (to name a submit's owner before anything is stored) and the claims."""

    tenants: AuthState
    ids: RequestIds
    repeat_within_s: float  # the events stream's dedupe window: a repeat in it is stored once


async def admit(submit: Submit, state: GatewayState) -> list[Event]:
    """Claim the submit's request id for its tenant, then `handle` it. A colliding id is refused
    under a fresh id: nothing is stored under the taken one, so its run is untouched."""
    if submit.request_id is None:
        submit = msgspec.structs.replace(submit, request_id=new_request_id())
    assert submit.request_id is not None, "set above"
    key_hash = hash_key(submit.api_key) if submit.api_key else None
    state.tenants.refresh()
    found = state.tenants.tenants.lookup(key_hash)
    tenant = found[0] if found is not None else None
    try:
        await state.ids.claim(
            submit.request_id,
            tenant,
            body_hash(encode(submit)),
            repeat_within_s=state.repeat_within_s,
        )
    except RequestIdTaken as err:
        failed = RequestFailed(
            request_id=new_request_id(),
            tenant=tenant,
            stage=STAGE,
            code="conflict",
            message=str(err),
            field="request_id",
        )
        return [failed]
    return handle(submit, None)


async def setup(ctx: StageContext) -> GatewayState:
    bus = ctx.bus
    kv = await bus.kv(subjects.REQUEST_IDS_BUCKET, ttl_s=bus.config.events_max_age_s)
    return GatewayState(
        tenants=AuthState(tenants.default_path()),
        ids=RequestIds(kv),
        repeat_within_s=bus.config.duplicate_window_s,
    )


async def on_invalid(data: bytes, err: Exception, state: GatewayState | None) -> RequestFailed:
    """invalid_submit's failure, under a fresh id when the client's id is already claimed: a
    submit that does not decode names no verifiable tenant, so it may not end another's run."""
    failed = invalid_submit(data, err)
    client_id, _ = read_envelope(data)
    if state is None or client_id is None or failed.request_id != client_id:
        return failed
    if await state.ids.owner(client_id) is None:
        return failed
    return msgspec.structs.replace(
        failed,
        request_id=new_request_id(),
        message=f"{failed.message} (request_id {client_id!r} belongs to a run already; this "
        "failure is reported under its own id)",
    )


def invalid_submit(data: bytes, err: Exception) -> RequestFailed:
    """A submit that does not decode still gets a request id and a failed event."""
    request_id, _ = read_envelope(data)
    field = error_field(err)
    if isinstance(err, msgspec.ValidationError):  # (a subclass of DecodeError)
        detail = str(err).split(" - at `", 1)[0]
        message = (
            f"invalid submit field `{field}`: {detail}" if field else f"invalid submit: {detail}"
        )
    else:
        message = f"the submit is not valid JSON: {err}"
    if len(data) > 1_000_000:
        message += f" (the submit was {len(data)} bytes)"
    if field == "request_id":
        request_id = None
    return RequestFailed(
        request_id=request_id or new_request_id(),
        stage=STAGE,
        code="invalid_request",
        message=message,
        field=field,
    )


def reply(outputs: list[Event]) -> bytes:
    first = outputs[0]
    if isinstance(first, RequestFailed):
        answer = SubmitReply(
            request_id=first.request_id,
            accepted=False,
            code=first.code,
            message=first.message,
            field=first.field,
        )
    elif isinstance(first, RunCancelled):  # its cancel came first: ended, never accepted
        answer = SubmitReply(
            request_id=first.request_id,
            accepted=False,
            message=f"run {first.request_id} was cancelled ({first.reason}) before it was accepted",
        )
    else:
        answer = SubmitReply(request_id=first.request_id, accepted=True)
    return encode(answer)


SPEC = StageSpec(
    name=STAGE,
    input_event=None,
    subject=subjects.SUBMIT,
    stream=subjects.SUBMIT_STREAM,
    decoder=msgspec.json.Decoder(Submit),
    with_headers=with_key_header,
    handle=admit,
    setup=setup,
    on_invalid=on_invalid,
    reply=reply,
)
