"""Request ids belong to the tenant that used them first: a KV bucket of request id -> owner.

The gateway claims every submit's id with KV `create` (first writer wins) before anything is
stored under it. A later submit of the same id is let through only as a redelivery: the same
owner (tenant, or None for a key that names none) with the same body, inside the stream's
dedupe window, so its events are stored once. Any other submit is refused: no event of another
tenant ever lands on a run it does not own, and no reuse ever starts a second run on one id.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable

import msgspec
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue


class RequestIdTaken(Exception):
    """The id is another tenant's (or another unauthenticated submit's)."""

    def __init__(self, request_id: str) -> None:
        super().__init__(
            f"request_id {request_id!r} is already used by another run; choose another id, or "
            "leave request_id out and the gateway assigns one"
        )
        self.request_id = request_id


class Owner(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    tenant: str | None = None  # None: the key named no tenant
    body_hash: str = ""
    created_ns: int = 0


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(Owner)


def body_hash(body: bytes) -> str:
    return "sha256:" + hashlib.sha256(body).hexdigest()


class RequestIds:
    def __init__(self, kv: KeyValue, clock: Callable[[], int] = time.time_ns) -> None:
        self.kv = kv
        self.clock = clock

    async def claim(
        self, request_id: str, tenant: str | None, digest: str, *, repeat_within_s: float
    ) -> bool:
        """Claim `request_id` for `tenant`; True when it is new, False for a repeat of the same
        submit (same owner and body) less than `repeat_within_s` after the claim. Raises
        RequestIdTaken for anything else."""
        owner = Owner(tenant=tenant, body_hash=digest, created_ns=self.clock())
        for _ in range(4):
            try:
                await self.kv.create(request_id, _encoder.encode(owner))
                return True
            except KeyWrongLastSequenceError:
                pass
            held = await self.owner(request_id)
            if held is None:  # expired or deleted between the two calls: claim again
                continue
            age_s = (self.clock() - held.created_ns) / 1e9
            if (held.tenant, held.body_hash) == (tenant, digest) and age_s < repeat_within_s:
                return False
            raise RequestIdTaken(request_id)
        raise RuntimeError(f"request id {request_id}: 4 claims lost to deletes")

    async def owner(self, request_id: str) -> Owner | None:
        try:
            entry = await self.kv.get(request_id)
        except KeyNotFoundError:
            return None
        return _decoder.decode(entry.value) if entry.value else None
