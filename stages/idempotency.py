"""Idempotency keys: (tenant, key) -> the one run they started, kept in a KV bucket with a TTL.

The first claim wins through KV `create` (fails if the key exists), so two edges or two auth
workers racing on one key agree on one run. A repeat with the same body gets that run back; a
repeat with another body is a conflict. The bucket's TTL (24 h by default) lies far beyond the
event stream's dedupe window, which only covers redeliveries.
"""

from __future__ import annotations

import hashlib

import msgspec
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from schemas.events import Submit


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


class Claim(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str  # the run this key belongs to
    new: bool  # True: this caller started it and must submit it


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(IdempotencyRecord)


def body_hash(submit: Submit) -> str:
    """What makes two submits 'the same request': everything but identity and the key itself."""
    bare = msgspec.structs.replace(submit, request_id=None, api_key=None, idempotency_key=None)
    return "sha256:" + hashlib.sha256(_encoder.encode(bare)).hexdigest()


def kv_key(tenant: str, key: str) -> str:
    """KV keys allow only [-/_=.a-zA-Z0-9]: hash the pair (the key never lands in a subject)."""
    return hashlib.sha256(f"{tenant}\0{key}".encode()).hexdigest()


class IdempotencyStore:
    def __init__(self, kv: KeyValue) -> None:
        self.kv = kv

    async def claim(self, tenant: str, key: str, digest: str, request_id: str) -> Claim:
        """Claim `key` for `request_id`; the existing run when the body matches; else conflict."""
        record = IdempotencyRecord(request_id=request_id, body_hash=digest, tenant=tenant)
        name = kv_key(tenant, key)
        try:
            await self.kv.create(name, _encoder.encode(record))
            return Claim(request_id=request_id, new=True)
        except KeyWrongLastSequenceError:
            pass
        existing = await self.lookup(tenant, key)
        if existing is None:  # expired between the two calls: claim again
            return await self.claim(tenant, key, digest, request_id)
        if existing.body_hash != digest:
            raise IdempotencyConflict(key, existing.request_id)
        return Claim(request_id=existing.request_id, new=existing.request_id == request_id)

    async def lookup(self, tenant: str, key: str) -> IdempotencyRecord | None:
        try:
            entry = await self.kv.get(kv_key(tenant, key))
        except KeyNotFoundError:
            return None
        if entry.value is None:
            return None
        return _decoder.decode(entry.value)
