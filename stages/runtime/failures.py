"""How a stage names what went wrong: StageError for handlers, and readers of msgspec errors and
of a request id in input that did not decode (so even bad input fails its own request).
"""

from __future__ import annotations

import re
import uuid
from typing import Any

import msgspec

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
_FIELD_AT = re.compile(r"at `\$\.?([^`]*)`")
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
