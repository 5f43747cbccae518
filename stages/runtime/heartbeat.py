"""Liveness and readiness of every stage worker: each one puts a `Beat` into the `brigade_stages`
KV bucket every `PERIOD_S`, under `<stage>.<host>-<pid>-<n>`; the bucket keeps an entry for
`TTL_S`, so a worker whose beats stopped (killed, hung, cut off) drops out by itself.

A beat says whether the worker serves (`ready`: it consumes its input) and what its service
reports of itself (`Service.health()`: the engine's model and free KV blocks). Readers are the
edge's /health, `brigade status` and `brigade up`, which prints "up" only once every stage it
started beats ready, whichever NATS it runs on.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import msgspec
import nats.errors
from nats.js.errors import KeyDeletedError, KeyNotFoundError
from nats.js.kv import KeyValue

from schemas.bounded import decode_bounded

log = logging.getLogger("brigade.heartbeat")
PERIOD_S = 1.0
TTL_S = 5.0  # a worker is gone after this many seconds without a beat
_counter = itertools.count()


class Beat(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    stage: str
    worker: str  # <host>-<pid>-<n>: one process may run several workers of several stages
    host: str
    pid: int
    ready: bool = False
    started_ns: int = 0
    ts_ns: int = 0
    detail: dict[str, Any] = {}


_decoder = msgspec.json.Decoder(Beat)


def worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{next(_counter)}"


class Heart:
    """The beats of one worker: `run()` until cancelled; `stop()` removes its entry at once."""

    def __init__(
        self,
        open_kv: Callable[[], Awaitable[KeyValue]],
        stage: str,
        health: Callable[[], dict[str, Any]],
    ) -> None:
        self._open_kv = open_kv
        self.kv: KeyValue | None = None
        self.stage = stage
        self.health = health
        self.worker = worker_id()
        self.key = f"{stage}.{self.worker}"
        self.started_ns = time.time_ns()
        self.ready = False
        self._wake = anyio.Event()

    def beat(self) -> Beat:
        try:
            detail = self.health()
        except Exception as err:  # noqa: BLE001 - a beat says what broke, it does not stop
            detail = {"health_error": f"{type(err).__name__}: {err}"}
        return Beat(
            stage=self.stage,
            worker=self.worker,
            host=socket.gethostname(),
            pid=os.getpid(),
            ready=self.ready,
            started_ns=self.started_ns,
            ts_ns=time.time_ns(),
            detail=detail,
        )

    async def put(self) -> None:
        if self.kv is None:
            self.kv = await self._open_kv()
        await self.kv.put(self.key, msgspec.json.encode(self.beat()))

    def mark_ready(self) -> None:
        """The worker serves now: say so at once, not at the next period."""
        self.ready = True
        self._wake.set()

    async def run(self) -> None:
        """Beat every PERIOD_S (and at once when it turns ready); a beat lost to the bus is
        only a missed one."""
        while True:
            self._wake = anyio.Event()
            try:
                await self.put()
            except Exception as err:  # noqa: BLE001 - NATS away: the next beat tries again
                log.debug("%s: beat not stored: %s", self.key, err)
            with anyio.move_on_after(PERIOD_S):
                await self._wake.wait()

    async def stop(self) -> None:
        """Say at once that this worker is gone (else its entry ages out after TTL_S)."""
        if self.kv is None:
            return
        try:
            with anyio.fail_after(1.0):
                await self.kv.delete(self.key)
        except Exception:  # noqa: BLE001 - it ages out anyway
            pass


async def beats(kv: KeyValue, timeout_s: float = 2.0) -> list[Beat]:
    """Every live worker's latest beat (entries older than TTL_S are already gone): the
    bucket's keys from its stream's state, then each key's last value. Not a watch: nats-py's
    watch puts its end-of-data marker first when the consumer's info reports nothing pending
    before the values it already delivered have reached the watcher, and such a read then
    misses live workers (a /health flapping to 503 under load)."""
    with anyio.fail_after(timeout_s):
        info = await kv._js.stream_info(kv._stream, subjects_filter=f"{kv._pre}>")
    found: list[Beat] = []
    for subject in sorted(info.state.subjects or {}):
        key = subject.removeprefix(kv._pre)
        try:
            with anyio.fail_after(timeout_s):
                entry = await kv.get(key)
        except (KeyNotFoundError, KeyDeletedError, TimeoutError, nats.errors.TimeoutError):
            continue  # gone (stopped, or aged out) since the state was read
        if not entry.value:
            continue
        try:
            found.append(decode_bounded(_decoder, entry.value))
        except (msgspec.DecodeError, msgspec.ValidationError):
            log.warning("beat %s does not decode; skipped", key)
    return found


def by_stage(found: list[Beat]) -> dict[str, dict[str, Any]]:
    """{stage: {workers, ready, detail of each ready worker}} for /health and `brigade status`."""
    out: dict[str, dict[str, Any]] = {}
    for beat in sorted(found, key=lambda b: (b.stage, b.worker)):
        row = out.setdefault(beat.stage, {"workers": 0, "ready": 0, "pids": [], "detail": []})
        row["workers"] += 1
        row["ready"] += int(beat.ready)
        row["pids"].append(beat.pid)
        if beat.detail:
            row["detail"].append(beat.detail)
    return out
