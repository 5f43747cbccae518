"""Idempotency keys: (tenant, key) -> the one run they started, kept in a KV bucket with a TTL.

The first claim wins through KV `create` (fails if the key exists), so two edges or two auth
workers racing on one key agree on one run. A repeat with the same body gets that run back; a
repeat with another body is a conflict. The bucket's TTL (24 h by default) lies far beyond the
event stream's dedupe window, which only covers redeliveries.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable

import msgspec
from nats.js import JetStreamContext
from nats.js.errors import (
    BadRequestError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
    NotFoundError,
)
from nats.js.kv import KeyValue

from schemas import subjects
from schemas.bounded import decode_bounded
from schemas.events import Event, Request, RequestAccepted, RequestAuthorized


class IdempotencyConflict(Exception):
    """The key was used before with a different body."""

    def __init__(self, key: str, request_id: str) -> None:
        super().__init__(
            f"Idempotency-Key {key!r} was already used with a different request body "
            f"(run {request_id}); reuse a key only to retry the identical request"
        )
        self.request_id = request_id


class IdempotencyRecord(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str
    body_hash: str
    tenant: str
    created_ns: int = 0  # wall clock of the claim


class Claim(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str  # the run this key belongs to
    new: bool  # True: this caller started it and must submit it
    age_s: float = 0.0  # how long ago the key was claimed


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(IdempotencyRecord)
_accepted = msgspec.json.Decoder(RequestAccepted)


def request_hash(request: Request) -> str:
    """What makes two requests 'the same': the normalized request without the key itself, so
    the edge and the auth stage (which both claim) hash alike, and without how long it may wait
    or which edge follows it (a retry through another edge, or with another deadline, is the
    same request)."""
    bare = msgspec.structs.replace(request, idempotency_key=None, deadline_s=None, edge_worker=None)
    return "sha256:" + hashlib.sha256(_encoder.encode(bare)).hexdigest()


def kv_key(tenant: str, key: str) -> str:
    """KV keys allow only [-/_=.a-zA-Z0-9]: hash the pair (the key never lands in a subject)."""
    return hashlib.sha256(f"{tenant}\0{key}".encode()).hexdigest()


class IdempotencyStore:
    def __init__(self, kv: KeyValue, clock: Callable[[], int] = time.time_ns) -> None:
        self.kv = kv
        self.clock = clock

    async def claim(self, tenant: str, key: str, digest: str, request_id: str) -> Claim:
        """Claim `key` for `request_id`; the existing run when the body matches; else conflict."""
        record = IdempotencyRecord(
            request_id=request_id, body_hash=digest, tenant=tenant, created_ns=self.clock()
        )
        name = kv_key(tenant, key)
        try:
            await self.kv.create(name, _encoder.encode(record))
            return Claim(request_id=request_id, new=True)
        except KeyWrongLastSequenceError:
            pass
        existing = await self.lookup(tenant, key)
        if existing is None:  # expired or released between the two calls: claim again
            return await self.claim(tenant, key, digest, request_id)
        if existing.request_id == request_id:
            return Claim(request_id=request_id, new=True)  # claimed by this run's edge
        if existing.body_hash != digest:
            raise IdempotencyConflict(key, existing.request_id)
        age_s = max(0, self.clock() - existing.created_ns) / 1e9
        return Claim(request_id=existing.request_id, new=False, age_s=age_s)

    async def take_over(
        self, tenant: str, key: str, digest: str, stale_id: str, request_id: str
    ) -> bool:
        """Point the key at `request_id` if it still names `stale_id` (a run that was claimed
        but never submitted). A late submit of the stale run is then refused by auth."""
        try:
            entry = await self.kv.get(kv_key(tenant, key))
        except KeyNotFoundError:
            return False
        if not entry.value or _decoder.decode(entry.value).request_id != stale_id:
            return False
        record = IdempotencyRecord(
            request_id=request_id, body_hash=digest, tenant=tenant, created_ns=self.clock()
        )
        try:
            await self.kv.update(kv_key(tenant, key), _encoder.encode(record), last=entry.revision)
        except KeyWrongLastSequenceError:
            return False  # someone else took it first
        return True

    async def release(self, tenant: str, key: str, request_id: str) -> None:
        """Forget the key if it still names `request_id` (a run refused before it started, e.g.
        rate limited: a retry with the same key must start a run, not replay the refusal)."""
        try:
            entry = await self.kv.get(kv_key(tenant, key))
        except KeyNotFoundError:
            return
        if entry.value and _decoder.decode(entry.value).request_id == request_id:
            try:
                await self.kv.delete(kv_key(tenant, key), last=entry.revision)
            except BadRequestError:
                pass  # changed meanwhile: someone else owns it now

    async def lookup(self, tenant: str, key: str) -> IdempotencyRecord | None:
        try:
            entry = await self.kv.get(kv_key(tenant, key))
        except KeyNotFoundError:
            return None
        if entry.value is None:
            return None
        return _decoder.decode(entry.value)


async def claim_authorized(store: IdempotencyStore, event: RequestAuthorized) -> bool:
    """Auth's check; True when the run holds a key. Raises StageError for a reused key."""
    from stages.runtime.failures import StageError

    key = event.request.idempotency_key
    if key is None or event.tenant is None:
        return False
    try:
        claim = await store.claim(event.tenant, key, request_hash(event.request), event.request_id)
    except IdempotencyConflict as err:
        raise StageError("conflict", str(err), field="idempotency_key") from None
    if not claim.new:
        raise StageError(
            "conflict",
            f"Idempotency-Key {key!r} already started run {claim.request_id}; follow "
            f"llm.ev.{claim.request_id}.> for its result (this submit started nothing)",
            field="idempotency_key",
        )
    return True


async def billing_id(js: JetStreamContext, store: IdempotencyStore, event: Event) -> str:
    """What the ledger bills a run under: its idempotency key while the run holds that key (so
    a key is billed once, whatever happens to request ids), else its request id."""
    if event.tenant is None:
        return event.request_id
    subject = subjects.event_subject(event.request_id, "accepted")
    try:
        msg = await js.get_last_msg(subjects.EVENTS_STREAM, subject, direct=True)
    except NotFoundError:
        return event.request_id
    try:
        accepted = decode_bounded(_accepted, msg.data) if msg.data else None
    except msgspec.DecodeError:  # a poison stored on the subject: bill under the request id
        return event.request_id
    key = accepted.request.idempotency_key if accepted is not None else None
    if key is None:
        return event.request_id
    record = await store.lookup(event.tenant, key)
    if record is None or record.request_id != event.request_id:
        return event.request_id
    return f"idem-{kv_key(event.tenant, key)[:32]}"
