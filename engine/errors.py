"""What a caller can get wrong about a request, as a type: `RequestRejected` carries a `code`, the
`field` at fault and a message with the numbers and the knob to change, so a caller (the engine
stage) reports it without reading the text. It is a ValueError for callers that catch that."""

from __future__ import annotations

from typing import Literal

RejectCode = Literal["context_length", "invalid_request"]


class RequestRejected(ValueError):
    """A request the engine can never run as asked (raised before it is queued)."""

    def __init__(self, code: RejectCode, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.code: RejectCode = code
        self.field = field
        self.message = message
