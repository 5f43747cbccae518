"""Per-tenant requests/min and tokens/min, shared by every auth worker through JetStream KV.

Each tenant has one KV entry holding two token buckets (requests, tokens) that refill
continuously at limit/60 per second up to the limit. Admission reserves 1 request and
prompt + max_tokens tokens in one compare-and-set; the reservation is kept under the request id,
and settling it at the run's end (once: the reservation entry is deleted by compare-and-set)
refunds or charges the difference to the actual usage.
"""

from __future__ import annotations

import hashlib
import math
import time
from dataclasses import dataclass

import msgspec
from nats.js.errors import BadRequestError, KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

MAX_CAS_RETRIES = 32
WRONG_LAST_SEQUENCE = (10071, 10164)  # JetStream err_codes of a failed compare-and-set


@dataclass(frozen=True, kw_only=True)
class Limits:
    requests_per_min: float | None = None  # None: unlimited
    tokens_per_min: float | None = None


class RateLimited(Exception):
    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class TooLarge(Exception):
    """The request alone needs more than a whole minute's tokens: waiting would never help."""


class Buckets(msgspec.Struct, kw_only=True):
    requests: float
    tokens: float
    updated_ns: int


class Reservation(msgspec.Struct, frozen=True, kw_only=True):
    tenant: str
    tokens: int


_buckets = msgspec.json.Decoder(Buckets)
_reservation = msgspec.json.Decoder(Reservation)
_encoder = msgspec.json.Encoder()


def refill(b: Buckets, limits: Limits, now_ns: int) -> Buckets:
    """The buckets at `now_ns`: each gains limit/60 per second, capped at its limit."""
    elapsed = max(0, now_ns - b.updated_ns) / 1e9
    req = b.requests
    tok = b.tokens
    if limits.requests_per_min is not None:
        req = min(limits.requests_per_min, req + elapsed * limits.requests_per_min / 60)
    if limits.tokens_per_min is not None:
        tok = min(limits.tokens_per_min, tok + elapsed * limits.tokens_per_min / 60)
    return Buckets(requests=req, tokens=tok, updated_ns=now_ns)


def _wait_s(missing: float, per_min: float) -> float:
    return missing * 60 / per_min


def _tenant_key(tenant: str) -> str:
    return "t." + hashlib.sha256(tenant.encode()).hexdigest()[:32]


class RateLimiter:
    def __init__(self, kv: KeyValue, clock=time.time_ns) -> None:
        self.kv = kv
        self.clock = clock

    async def _read(self, key: str, limits: Limits) -> tuple[Buckets, int]:
        try:
            entry = await self.kv.get(key)
        except KeyNotFoundError:
            entry = None
        if entry is None or not entry.value:
            full = Buckets(
                requests=limits.requests_per_min or 0.0,
                tokens=limits.tokens_per_min or 0.0,
                updated_ns=self.clock(),
            )
            return full, 0
        return _buckets.decode(entry.value), entry.revision

    async def _write(self, key: str, b: Buckets, revision: int) -> bool:
        try:
            if revision == 0:
                await self.kv.create(key, _encoder.encode(b))
            else:
                await self.kv.update(key, _encoder.encode(b), last=revision)
            return True
        except KeyWrongLastSequenceError:
            return False

    async def admit(self, tenant: str, request_id: str, tokens: int, limits: Limits) -> None:
        """Reserve one request and `tokens`; raises RateLimited (with retry-after) or TooLarge."""
        tpm = limits.tokens_per_min
        if tpm is not None and tokens > tpm:
            raise TooLarge(
                f"this request reserves {tokens} tokens (prompt + max_tokens) but tenant "
                f"{tenant!r} may use {tpm:g} tokens/min; lower max_tokens or raise tokens_per_min"
            )
        key = _tenant_key(tenant)
        for _ in range(MAX_CAS_RETRIES):
            stored, revision = await self._read(key, limits)
            b = refill(stored, limits, self.clock())
            waits = []
            if limits.requests_per_min is not None and b.requests < 1:
                waits.append(("requests/min", _wait_s(1 - b.requests, limits.requests_per_min),
                              limits.requests_per_min))  # fmt: skip
            if tpm is not None and b.tokens < tokens:
                waits.append(("tokens/min", _wait_s(tokens - b.tokens, tpm), tpm))
            if waits:
                which, wait, limit = max(waits, key=lambda w: w[1])
                raise RateLimited(
                    f"tenant {tenant!r} is over its {limit:g} {which}; retry in {wait:.1f} s",
                    retry_after_s=math.ceil(wait * 10) / 10,
                )
            if limits.requests_per_min is not None:
                b.requests -= 1
            if tpm is not None:
                b.tokens -= tokens
            if await self._write(key, b, revision):
                reservation = Reservation(tenant=tenant, tokens=tokens)
                await self.kv.put(f"r.{request_id}", _encoder.encode(reservation))
                return
        raise RuntimeError(f"tenant {tenant!r}: {MAX_CAS_RETRIES} compare-and-set retries lost")

    async def settle(self, request_id: str, used_tokens: int, limits: Limits) -> int | None:
        """Refund (or charge) reserved - used once; returns the correction, None if none held."""
        try:
            entry = await self.kv.get(f"r.{request_id}")
        except KeyNotFoundError:
            return None
        if not entry.value:
            return None
        held = _reservation.decode(entry.value)
        try:  # whoever deletes the reservation first settles it
            await self.kv.delete(f"r.{request_id}", last=entry.revision)
        except BadRequestError as err:
            if err.err_code in WRONG_LAST_SEQUENCE:
                return None
            raise
        refund = held.tokens - used_tokens
        if limits.tokens_per_min is None or refund == 0:
            return refund
        key = _tenant_key(held.tenant)
        for _ in range(MAX_CAS_RETRIES):
            stored, revision = await self._read(key, limits)
            b = refill(stored, limits, self.clock())
            b.tokens = min(limits.tokens_per_min, b.tokens + refund)
            if await self._write(key, b, revision):
                return refund
        raise RuntimeError(
            f"tenant {held.tenant!r}: {MAX_CAS_RETRIES} compare-and-set retries lost"
        )


def estimate_prompt_tokens(texts: list[str]) -> int:
    """Before tokenization: ~4 UTF-8 bytes per token plus the chat template's framing."""
    return sum(len(t.encode()) // 4 + 8 for t in texts)
