"""Per-tenant requests/min, tokens/min and concurrent runs, shared by every auth worker
through JetStream KV.

Each tenant has one KV entry holding two token buckets (requests, tokens) that refill
continuously at limit/60 per second up to the limit, and a count of running runs. Admission
reserves 1 request, prompt + max_tokens tokens and one running slot in one compare-and-set; the
reservation is kept under the request id (so a redelivered admission reserves nothing twice),
and settling it at the run's end (once: the reservation entry is deleted by compare-and-set)
frees the slot and refunds or charges the difference to the actual usage.
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
    max_concurrent: int | None = None

    @property
    def unlimited(self) -> bool:
        return (self.requests_per_min, self.tokens_per_min, self.max_concurrent) == (None,) * 3


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
    running: int = 0


class Reservation(msgspec.Struct, frozen=True, kw_only=True):
    tenant: str
    tokens: int
    tokens_per_min: float | None = None
    concurrent: bool = False


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
    return Buckets(requests=req, tokens=tok, updated_ns=now_ns, running=b.running)


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
        if await self._reservation(request_id) is not None:
            return  # a redelivered admission: reserved already
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
            cap = limits.max_concurrent
            if cap is not None and b.running >= cap:
                raise RateLimited(
                    f"tenant {tenant!r} has {b.running} runs in flight, its max_concurrent is "
                    f"{cap}; retry when one finishes",
                    retry_after_s=1.0,
                )
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
            if cap is not None:
                b.running += 1
            if await self._write(key, b, revision):
                reservation = Reservation(
                    tenant=tenant, tokens=tokens, tokens_per_min=tpm, concurrent=cap is not None
                )
                await self.kv.put(f"r.{request_id}", _encoder.encode(reservation))
                return
        raise RuntimeError(f"tenant {tenant!r}: {MAX_CAS_RETRIES} compare-and-set retries lost")

    async def _reservation(self, request_id: str) -> KeyValue.Entry | None:
        try:
            entry = await self.kv.get(f"r.{request_id}")
        except KeyNotFoundError:
            return None
        return entry if entry.value else None

    async def settle(self, request_id: str, used_tokens: int) -> int | None:
        """Free the run's slot and refund (or charge) reserved - used, once.

        Returns the token correction, or None when no reservation is held (unlimited tenant,
        or settled already)."""
        entry = await self._reservation(request_id)
        if entry is None:
            return None
        held = _reservation.decode(entry.value)
        try:  # whoever deletes the reservation first settles it
            await self.kv.delete(f"r.{request_id}", last=entry.revision)
        except BadRequestError as err:
            if err.err_code in WRONG_LAST_SEQUENCE:
                return None
            raise
        refund = held.tokens - used_tokens
        tpm = held.tokens_per_min
        key = _tenant_key(held.tenant)
        limits = Limits(tokens_per_min=tpm)
        for _ in range(MAX_CAS_RETRIES):
            b, revision = await self._read(key, limits)  # no refill: that moves updated_ns
            if tpm is not None:
                b.tokens = min(tpm, b.tokens + refund)
            if held.concurrent:
                b.running = max(0, b.running - 1)
            if await self._write(key, b, revision):
                return refund
        raise RuntimeError(
            f"tenant {held.tenant!r}: {MAX_CAS_RETRIES} compare-and-set retries lost"
        )


def estimate_prompt_tokens(texts: list[str]) -> int:
    """Before tokenization: ~4 UTF-8 bytes per token plus the chat template's framing."""
    return sum(len(t.encode()) // 4 + 8 for t in texts)


def limits_of(tenant) -> Limits:
    """A `stages.tenancy.tenants.Tenant`'s limits."""
    return Limits(
        requests_per_min=tenant.requests_per_min,
        tokens_per_min=tenant.tokens_per_min,
        max_concurrent=tenant.max_concurrent,
    )


async def admit_authorized(limiter: RateLimiter, event, tenant) -> None:
    """Auth's check for a `RequestAuthorized` of `tenant`; raises StageError when refused."""
    from stages.runtime.failures import StageError

    limits = limits_of(tenant)
    if limits.unlimited:
        return
    request = event.request
    texts = [m.content for m in request.messages] + [d.content for d in request.documents]
    if request.system:
        texts.append(request.system)
    tokens = estimate_prompt_tokens(texts) + request.sampling.max_tokens
    try:
        await limiter.admit(event.tenant, event.request_id, tokens, limits)
    except RateLimited as err:
        raise StageError("rate_limited", str(err), retry_after_s=err.retry_after_s) from None
    except TooLarge as err:
        raise StageError("invalid_request", str(err), field="max_tokens") from None
