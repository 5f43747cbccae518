"""The edge's HTTP/1.1 connection bounds, on either of uvicorn's protocols (httptools, the
default, or h11: BRIGADE_EDGE_HTTP): a request's headers must arrive within `header_timeout_s` and
hold at most `max_header_bytes`, its body within `body_timeout_s` after them. Past a bound the
client gets 408 or 431 (OpenAI's error shape, an X-Request-Id) and the connection is closed; a
431 is sent while the rest of the oversized headers is read and dropped for a moment, so the
client reads the answer instead of a reset. The bounds are one mixin over the two protocols,
which differ only in how they say where a request is (reading headers, its body, or done).
"""

from __future__ import annotations

import abc
import asyncio
import json
import uuid
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

HEADERS_END = b"\r\n\r\n"
LINGER_S = 2.0  # after a 431: how long the rest of the request is read and dropped
LINGER_MAX_BYTES = 16 << 20  # and at most this much of it


@dataclass(frozen=True, kw_only=True)
class HttpLimits:
    max_header_bytes: int = 16 << 10
    header_timeout_s: float = 10.0  # from connect (or the end of the last response) to the headers
    body_timeout_s: float = 30.0  # from the headers to the body's last byte

    def __post_init__(self) -> None:
        if self.max_header_bytes < 1 or self.header_timeout_s <= 0 or self.body_timeout_s <= 0:
            raise ValueError(f"HttpLimits need positive bounds, got {self}")


def refusal(status: int, reason: str, code: str, message: str) -> bytes:
    """A whole HTTP/1.1 response that closes the connection: OpenAI's error body."""
    body = json.dumps(
        {
            "error": {
                "message": message,
                "type": "invalid_request_error",
                "param": None,
                "code": code,
            }
        }
    ).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\n"
        "content-type: application/json\r\n"
        f"content-length: {len(body)}\r\n"
        f"x-request-id: {uuid.uuid4().hex}\r\n"
        "connection: close\r\n\r\n"
    ).encode()
    return head + body


PROTOCOLS = ("h11", "httptools")


def bounded_protocol(limits: HttpLimits, http: str = "httptools") -> type[asyncio.Protocol]:
    """uvicorn's `http` protocol class ("h11" or "httptools") with `limits`
    (uvicorn.Config(http=...))."""
    if http == "h11":
        base: type = BoundedH11Protocol
    elif http == "httptools":
        base = bounded_httptools()
    else:
        raise ValueError(f"http must be one of {', '.join(PROTOCOLS)}, not {http!r}")
    return type(f"Bounded{base.__name__}", (base,), {"limits": limits})


class _Bounds(abc.ABC):
    """The bounds, mixed in before a uvicorn protocol class. The protocol says where the
    current request is: `_reading_headers()` (before its headers end) and `_reading_body()`."""

    limits = HttpLimits()
    transport: asyncio.Transport
    loop: asyncio.AbstractEventLoop
    cycle: Any

    @abc.abstractmethod
    def _reading_headers(self) -> bool:
        """The current request's headers have not ended yet (or no request has begun)."""

    @abc.abstractmethod
    def _reading_body(self) -> bool:
        """The current request's headers have ended and its body has not."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        self._head = bytearray()  # the current request's bytes until its headers end
        self._header_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._lingering = 0  # bytes dropped after a 431; 0: not lingering
        self._closing_timer: asyncio.TimerHandle | None = None

    # ---- the connection's life ----

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)  # type: ignore[misc]
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        if self._closing_timer is not None:
            self._closing_timer.cancel()
        super().connection_lost(exc)  # type: ignore[misc]

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        if not self.transport.is_closing():
            self._arm_header_timer()  # the next request's headers (beside uvicorn's keep-alive)

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            self._lingering += len(data)
            if self._lingering > LINGER_MAX_BYTES:
                self.transport.close()
            return
        if self._reading_headers() and self._too_long(data):
            return
        super().data_received(data)  # type: ignore[misc]
        if self.transport.get_protocol() is not self:  # upgraded to a websocket
            self._cancel_timers()
            return
        if self._reading_headers():
            return  # still reading headers: the header timer runs
        self._head.clear()
        self._cancel(self._header_timer)
        self._header_timer = None
        if self._reading_body():
            if self._body_timer is None:
                self._body_timer = self.loop.call_later(
                    self.limits.body_timeout_s, self._body_timed_out
                )
        else:
            self._cancel(self._body_timer)
            self._body_timer = None

    # ---- the bounds ----

    def _too_long(self, data: bytes) -> bool:
        """Count the request's header bytes; past the limit answer 431 and linger."""
        start = max(0, len(self._head) - len(HEADERS_END) + 1)
        self._head += data
        end = self._head.find(HEADERS_END, start)
        size = len(self._head) if end < 0 else end + len(HEADERS_END)
        limit = self.limits.max_header_bytes
        if size <= limit:
            if end >= 0:
                self._head.clear()
            elif len(self._head) > limit:
                self._head = self._head[-len(HEADERS_END) :]
            return False
        self._head.clear()
        self._refuse(
            431,
            "Request Header Fields Too Large",
            "headers_too_large",
            f"the request's headers are over {limit} bytes (BRIGADE_EDGE_MAX_HEADERS)",
            linger=True,
        )
        return True

    def _header_timed_out(self) -> None:
        self._header_timer = None
        self._refuse(
            408,
            "Request Timeout",
            "request_timeout",
            f"the request's headers did not arrive within {self.limits.header_timeout_s:g} s "
            "(BRIGADE_EDGE_HEADER_TIMEOUT_S)",
        )

    def _body_timed_out(self) -> None:
        self._body_timer = None
        if self.cycle is not None and self.cycle.response_started:
            self.transport.close()
            return
        self._refuse(
            408,
            "Request Timeout",
            "request_timeout",
            f"the request's body did not arrive within {self.limits.body_timeout_s:g} s of its "
            "headers (BRIGADE_EDGE_BODY_TIMEOUT_S; a Content-Length above the bytes sent waits "
            "for them)",
        )

    def _refuse(self, status: int, reason: str, code: str, message: str, *, linger=False) -> None:
        self._cancel_timers()
        if self.transport.is_closing():
            return
        self.transport.write(refusal(status, reason, code, message))
        if not linger:
            self.transport.close()
            return
        self._lingering = 1
        try:
            self.transport.write_eof()  # the answer, then end of stream: the client reads both
        except (NotImplementedError, RuntimeError, OSError):
            self.transport.close()
            return
        self._closing_timer = self.loop.call_later(LINGER_S, self.transport.close)

    # ---- timers ----

    def _arm_header_timer(self) -> None:
        self._cancel(self._header_timer)
        self._header_timer = self.loop.call_later(
            self.limits.header_timeout_s, self._header_timed_out
        )

    def _cancel_timers(self) -> None:
        for timer in (self._header_timer, self._body_timer):
            self._cancel(timer)
        self._header_timer = self._body_timer = None

    @staticmethod
    def _cancel(timer: asyncio.TimerHandle | None) -> None:
        if timer is not None:
            timer.cancel()


class BoundedH11Protocol(_Bounds, H11Protocol):
    def _reading_headers(self) -> bool:
        return self.conn.their_state is h11.IDLE

    def _reading_body(self) -> bool:
        return self.conn.their_state is h11.SEND_BODY


def bounded_httptools() -> type:
    """The bounds over uvicorn's httptools protocol (imported here: with BRIGADE_EDGE_HTTP=h11
    the edge runs without the httptools package). Its parser's callbacks say where the request
    is."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError as err:
        raise RuntimeError(
            f"BRIGADE_EDGE_HTTP=httptools needs the httptools package ({err}); install it, or "
            "set BRIGADE_EDGE_HTTP=h11"
        ) from err

    class BoundedHttpToolsProtocol(_Bounds, HttpToolsProtocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            # "headers" until they end, "body" until the message ends, "done" until answered
            self._phase = "headers"

        def _reading_headers(self) -> bool:
            return self._phase == "headers"

        def _reading_body(self) -> bool:
            return self._phase == "body"

        def on_message_begin(self) -> None:
            self._phase = "headers"
            super().on_message_begin()

        def on_headers_complete(self) -> None:
            self._phase = "body"
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._phase = "done"
            super().on_message_complete()

        def on_response_complete(self) -> None:
            if self._phase == "done":
                self._phase = "headers"  # the next request's, on a kept-alive connection
            super().on_response_complete()

    return BoundedHttpToolsProtocol
