"""A request's deadline: how long it may wait for its first token (for an engine to take it)
before it is cancelled. The request's own (`X-Brigade-Deadline-S`, else the body's
`deadline_s`), else its tenant's (`deadline_s` in tenants.toml), else BRIGADE_EDGE_DEADLINE_S.
While a stream waits it gets keep-alives: SSE comments, websocket `response.waiting` events.
"""

from __future__ import annotations

import math

from schemas.events import MAX_DEADLINE_S
from stages.edge.errors import RequestError

DEADLINE_HEADER = "X-Brigade-Deadline-S"
SSE_KEEPALIVE = b": keep-alive\n\n"  # an SSE comment: clients skip it, proxies see traffic


def requested(header: str | None, body: float | None) -> float | None:
    """The request's own deadline in seconds, the header before the body's field; a value
    that is not a number in (0, MAX_DEADLINE_S] is a 400 naming where it came from."""
    if header is None:
        return body
    try:
        value = float(header)
    except ValueError:
        value = math.nan
    if not 0.0 < value <= MAX_DEADLINE_S:  # NaN fails too
        raise RequestError(
            "invalid_request",
            f"{DEADLINE_HEADER} must be seconds in (0, {MAX_DEADLINE_S:g}], got {header[:32]!r}",
            DEADLINE_HEADER,
        )
    return value


def deadline_for(own: float | None, tenant: float | None, default: float) -> float:
    return own if own is not None else tenant if tenant is not None else default
