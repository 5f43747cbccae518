"""Run state, a projection of the event log kept in the `brigade_runs` KV bucket.

queued -> prefill -> streaming -> completed | failed | cancelled -> billed. A transition that
is not in TRANSITIONS is refused (a late or redelivered event never moves a run backwards or
out of a terminal state); the log stays the source of truth. Writes use KV compare-and-set, so
any number of projector workers can share one durable.
"""

from __future__ import annotations

from typing import Literal

import anyio
import msgspec
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from schemas import subjects
from schemas.events import (
    AnyEvent,
    Event,
    RequestFailed,
    RunBilled,
    RunCancelled,
    RunCompleted,
    TextGenerated,
    TokensGenerated,
    Usage,
)
from stages.runtime.spec import StageContext, StageSpec

State = Literal["queued", "prefill", "streaming", "completed", "failed", "cancelled", "billed"]
TERMINAL: frozenset[State] = frozenset({"completed", "failed", "cancelled"})
TRANSITIONS: dict[State | None, frozenset[State]] = {
    None: frozenset({"queued", "prefill", "streaming", "failed", "cancelled", "completed"}),
    "queued": frozenset({"prefill", "streaming", "completed", "failed", "cancelled"}),
    "prefill": frozenset({"streaming", "completed", "failed", "cancelled"}),
    "streaming": frozenset({"completed", "failed", "cancelled"}),
    "completed": frozenset({"billed"}),
    "failed": frozenset({"billed"}),
    "cancelled": frozenset({"billed"}),
    "billed": frozenset(),
}
STATE_OF_EVENT: dict[str, State] = {
    "accepted": "queued",
    "authorized": "queued",
    "assembled": "queued",
    "tokenized": "prefill",
    "started": "streaming",
    "tokens": "streaming",  # a log from before `started` (its consumer takes tokens no more)
    "text": "streaming",
    "completed": "completed",
    "failed": "failed",
    "cancelled": "cancelled",
    "billed": "billed",
}


class IllegalTransition(Exception):
    pass


class RunRecord(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    request_id: str
    state: State
    tenant: str | None = None
    last_seq: int | None = None
    usage: Usage = Usage()
    finish_reason: str | None = None
    error_code: str | None = None
    updated_ns: int = 0


def check(current: State | None, new: State) -> None:
    if new not in TRANSITIONS[current]:
        raise IllegalTransition(f"run state {current} -> {new} is not allowed")


def apply(record: RunRecord | None, event: AnyEvent) -> RunRecord | None:
    """The record after `event`; None when the event changes nothing (same state, refused)."""
    tag = type(event).__struct_config__.tag
    new = STATE_OF_EVENT.get(tag)  # type: ignore[arg-type]
    if new is None:
        return None
    current = record.state if record is not None else None
    if current == new:
        if record is not None and record.tenant is None and event.tenant is not None:
            return msgspec.structs.replace(record, tenant=event.tenant)  # auth named it
        return None  # the next token of a streaming run: nothing to write
    try:
        if isinstance(event, RunBilled) and current not in TERMINAL:
            # handled before its run's end (workers race): `billed` names the end, pass through it
            check(current, event.status)
            check(event.status, new)
        else:
            check(current, new)
    except IllegalTransition:
        return None
    fields: dict[str, object] = {"state": new, "updated_ns": event.ts_ns}
    if event.tenant is not None:
        fields["tenant"] = event.tenant
    if isinstance(event, TokensGenerated | TextGenerated):
        fields["last_seq"] = event.seq
    elif isinstance(event, RunCompleted):
        fields |= {"last_seq": event.last_seq, "usage": event.usage,
                   "finish_reason": event.finish_reason}  # fmt: skip
    elif isinstance(event, RunCancelled):
        fields |= {"last_seq": event.last_seq, "usage": event.usage, "finish_reason": "cancelled"}
    elif isinstance(event, RequestFailed):
        fields |= {"usage": event.usage, "error_code": event.code}
    elif isinstance(event, RunBilled):
        fields["usage"] = event.usage
        if current not in TERMINAL:
            fields["finish_reason"] = event.status
    if record is None:
        return RunRecord(request_id=event.request_id, **fields)  # type: ignore[arg-type]
    return msgspec.structs.replace(record, **fields)


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(RunRecord)


class RunStates:
    """Read and project run records in the KV bucket (compare-and-set on every write)."""

    def __init__(self, kv: KeyValue) -> None:
        self.kv = kv

    async def get(self, request_id: str) -> RunRecord | None:
        entry = await self._entry(request_id)
        return None if entry is None else _decoder.decode(entry.value)

    async def _entry(self, request_id: str) -> KeyValue.Entry | None:
        try:
            entry = await self.kv.get(request_id)
        except KeyNotFoundError:
            return None
        return entry if entry.value else None

    async def project(self, event: AnyEvent) -> RunRecord | None:
        """Apply one event; returns the new record, or None when it changed nothing.

        On an R3 bucket a read may come from a replica a write has not reached yet: the write
        is then refused as a lost race (nats-py's `create` even re-reads and says the key is
        missing), and it is read and tried again after a short pause."""
        for attempt in range(16):
            entry = await self._entry(event.request_id)
            record = None if entry is None else _decoder.decode(entry.value)
            new = apply(record, event)
            if new is None:
                return None
            try:
                if entry is None:
                    await self.kv.create(event.request_id, _encoder.encode(new))
                else:
                    await self.kv.update(
                        event.request_id, _encoder.encode(new), last=entry.revision
                    )
                return new
            except (KeyWrongLastSequenceError, KeyNotFoundError):
                # another worker wrote first, or the read was stale: re-read and re-apply
                await anyio.sleep(min(0.005 * 2**attempt, 0.2))
        raise RuntimeError(f"run {event.request_id}: 16 compare-and-set retries lost")


async def _setup(ctx: StageContext) -> RunStates:
    return RunStates(await ctx.bus.kv(subjects.RUNS_BUCKET))


async def _handle(event: AnyEvent, runs: RunStates) -> list[Event]:
    await runs.project(event)  # its durable delivers no deltas: every event is one to apply
    return []


# Every event a run's state comes from but its deltas: a run streams from its `started` on, so
# no `tokens` or `text` moves it, and taking them cost 4.5 of a token's 16 messages on the bus
# (each delivered, then acked) for nothing written.
PROJECTED = tuple(
    subjects.routed_events(tag) if tag in subjects.ROUTED_EVENTS else subjects.all_events(tag)
    for tag in STATE_OF_EVENT
    if tag not in ("tokens", "text")
)

SPEC = StageSpec(
    name="runstate",
    input_event=None,
    subject=PROJECTED,
    decoder=msgspec.json.Decoder(AnyEvent),
    handle=_handle,
    setup=_setup,
    skip_cancelled=False,
    on_invalid=lambda data, err, state: None,  # not ours to fail: the stage that consumes it does
    fails_requests=False,  # a projection: what it cannot write is a dead letter, the run goes on
    max_in_flight=64,
)
