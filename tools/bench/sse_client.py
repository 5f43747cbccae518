"""A lean streaming HTTP client for the benchmarks: one POST on its own connection, the response
parsed by httptools (uvicorn's C parser, chunked encoding included), each body piece stamped as
it arrives and split into SSE events only after the answer is complete.

Why not httpx: the benchmark's client runs on the same two cores as what it measures, and httpx
spends ~0.17 ms of CPU a streamed token (its line decoder, anyio streams and a JSON parse per
chunk, all while the tokens flow); here a token costs a read and a stamp while it streams.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httptools


@dataclass
class StreamedResponse:
    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)  # lower-case names
    pieces: list[tuple[int, bytes]] = field(default_factory=list)  # (time_ns, body bytes)
    complete: bool = False

    @property
    def body(self) -> bytes:
        return b"".join(p for _, p in self.pieces)

    def events(self) -> list[tuple[int, str]]:
        """Each SSE event's data with the time its last byte arrived: a piece may hold several
        events, an event may span pieces."""
        out: list[tuple[int, str]] = []
        buf = b""
        for stamp, piece in self.pieces:
            buf += piece
            *done, buf = buf.replace(b"\r\n", b"\n").split(b"\n\n")
            for event in done:
                data = [ln[5:].lstrip() for ln in event.split(b"\n") if ln.startswith(b"data:")]
                if data:
                    out.append((stamp, b"\n".join(data).decode("utf-8", errors="replace")))
        return out


class _Protocol(asyncio.Protocol):
    def __init__(self, response: StreamedResponse, done: asyncio.Future) -> None:
        self.response, self.done = response, done
        self.parser = httptools.HttpResponseParser(self)
        self._name = ""

    # asyncio.Protocol
    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as err:
            if not self.done.done():
                self.done.set_exception(ConnectionError(f"bad HTTP response: {err}"))

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_exception(
                exc or ConnectionError("the server closed the connection mid-response")
            )

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self.response.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.response.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        self.response.pieces.append((time.time_ns(), body))

    def on_message_complete(self) -> None:
        self.response.complete = True
        if not self.done.done():
            self.done.set_result(None)


async def post_stream(
    url: str, body: dict, headers: dict[str, str], timeout_s: float
) -> StreamedResponse:
    """POST `body` as JSON to `url` and read the whole (streamed) response."""
    parts = urlsplit(url)
    if parts.scheme != "http":
        raise ValueError(f"{url}: the bench client speaks plain http only")
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    payload = json.dumps(body).encode()
    head = [
        f"POST {parts.path or '/'} HTTP/1.1",
        f"Host: {host}:{port}",
        "Content-Type: application/json",
        "Accept: text/event-stream",
        f"Content-Length: {len(payload)}",
        "Connection: close",
        *(f"{k}: {v}" for k, v in headers.items()),
    ]
    loop = asyncio.get_running_loop()
    response = StreamedResponse()
    done = loop.create_future()
    transport, _ = await asyncio.wait_for(
        loop.create_connection(lambda: _Protocol(response, done), host, port), timeout_s
    )
    try:
        transport.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + payload)
        await asyncio.wait_for(done, timeout_s)
    finally:
        transport.close()
    return response
