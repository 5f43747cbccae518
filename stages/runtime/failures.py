"""How a stage names what went wrong: StageError for handlers, readers of msgspec errors and of
a request id in input that did not decode (so even bad input fails its own request), and which
NATS errors mean the bus is away for a while (an election, a restart) rather than a mistake.
"""

from __future__ import annotations

import re
import uuid
from typing import Any

import msgspec
import nats.errors
import nats.js.errors

from schemas import subjects
from schemas.bounded import without_deep_values

_REQUEST_ID = re.compile(subjects.REQUEST_ID_PATTERN)


class StageError(Exception):
    """Raised by a handler to fail its request with a precise code, message and field."""

    def __init__(
        self,
        code: str,
        message: str,
        *,
        field: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.field = field
        self.retry_after_s = retry_after_s


class _Envelope(msgspec.Struct):
    request_id: Any = None
    tenant: Any = None


_envelope_decoder = msgspec.json.Decoder(_Envelope)
_FIELD_AT = re.compile(r"(?:at|in) `\$\.?([^`]*)`")  # "at `key` in `$.x`": a dict key of x
_MISSING = re.compile(r"missing required field `([^`]+)`")


def error_field(err: Exception) -> str | None:
    """The field a msgspec error names: 'Expected ... - at `$.top_p`' -> 'top_p'."""
    text = str(err)
    at = _FIELD_AT.search(text)
    path = at.group(1) if at else ""
    missing = _MISSING.search(text)
    if missing:
        path = f"{path}.{missing.group(1)}" if path else missing.group(1)
    return path or None


def read_envelope(data: bytes) -> tuple[str | None, str | None]:
    """Best-effort request id and tenant from any JSON object; (None, None) if unreadable."""
    try:
        env = _envelope_decoder.decode(without_deep_values(data))  # never past msgspec's stack
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None, None
    rid = env.request_id if isinstance(env.request_id, str) else None
    if rid is not None and not _REQUEST_ID.match(rid):
        rid = None
    tenant = env.tenant if isinstance(env.tenant, str) else None
    return rid, tenant


def new_request_id() -> str:
    return uuid.uuid4().hex


# JetStream answers that mean the request is wrong, not that the bus is away.
_NOT_TRANSIENT = (nats.js.errors.NotFoundError, nats.js.errors.BadRequestError)


def duckdb_file_busy(exc: BaseException) -> bool:
    """Whether a DuckDB IOException opening a file says another process has it for a moment:
    it holds the file's lock, or is creating the file (it exists, its header not yet
    written). The ledger and the retrieval store wait these out."""
    text = str(exc).lower()
    return "lock" in text or "not a valid duckdb database file" in text


def bus_unavailable(exc: BaseException) -> bool:
    """Whether `exc` says the bus is away for now: no responders, a timeout, a closed or
    reconnecting connection, JetStream unavailable during an election. Retry it after a pause."""
    if isinstance(exc, _NOT_TRANSIENT):
        return False
    return isinstance(exc, nats.errors.Error | nats.js.errors.Error | TimeoutError)


def bus_away_delay_s(num_delivered: int) -> float:
    """How long a stage hands a message back for when the bus was away on its `num_delivered`th
    try: 1, 2, 4, 8 s ... up to 30 s, so the default five deliveries span a server restart or an
    election (15 s)."""
    return min(0.5 * 2.0**num_delivered, 30.0)


def bus_away_span_s(max_deliver: int) -> float:
    """How long after its first try a message handed back for the bus being away may still be
    handled: the sum of its waits over every delivery but the last."""
    return sum(bus_away_delay_s(d) for d in range(1, max_deliver))


class Backoff:
    """Bounded exponential waits for retrying the bus: 0.1 s doubling to `max_s`."""

    def __init__(self, initial_s: float = 0.1, max_s: float = 5.0) -> None:
        self.initial_s, self.max_s = initial_s, max_s
        self.next_s = initial_s

    def delay(self) -> float:
        delay, self.next_s = self.next_s, min(self.next_s * 2, self.max_s)
        return delay

    def reset(self) -> None:
        self.next_s = self.initial_s
