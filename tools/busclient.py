"""A measuring client on the bus: submit to `llm.in` and watch each run's events live, stamping
the wall-clock receipt of every event (what a client would see, in `seq` order).

One plain subscription serves every watched run (events stream past; the log keeps them), so a
benchmark with many requests opens no consumer per request.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import msgspec

from schemas import subjects
from schemas.events import (
    AnyEvent,
    RequestFailed,
    RunCancelled,
    RunCompleted,
    Submit,
    TextGenerated,
    TokensGenerated,
    decode_event,
)
from stages.runtime.bus import publish_submit

TERMINAL = (RunCompleted, RunCancelled, RequestFailed)


@dataclass
class RunRecord:
    """One run as the client saw it. Times are wall-clock ns."""

    request_id: str
    sent_ns: int = 0
    texts: dict[int, tuple[int, str]] = field(default_factory=dict)  # seq -> (received, text)
    token_ids: dict[int, list[int]] = field(default_factory=dict)  # seq -> ids
    terminal: AnyEvent | None = None
    terminal_ns: int | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)

    def add(self, event: AnyEvent, received_ns: int) -> None:
        if isinstance(event, TextGenerated):
            self.texts.setdefault(event.seq, (received_ns, event.text))
        elif isinstance(event, TokensGenerated):
            self.token_ids.setdefault(event.seq, list(event.token_ids))
        elif isinstance(event, TERMINAL) and self.terminal is None:
            self.terminal, self.terminal_ns = event, received_ns
        if self.terminal is not None and self._text_complete():
            self.done.set()

    def _text_complete(self) -> bool:
        if not isinstance(self.terminal, RunCompleted):
            return True
        return all(seq in self.texts for seq in range(self.terminal.last_seq + 1))

    @property
    def ok(self) -> bool:
        return isinstance(self.terminal, RunCompleted)

    def deliveries(self) -> list[tuple[int, str]]:
        """(ns, text) of each delta as an in-order client delivers it: a delta waits for every
        earlier one, so its time is the latest receipt among seqs up to its own."""
        out, latest = [], 0
        for seq in sorted(self.texts):
            received, text = self.texts[seq]
            latest = max(latest, received)
            out.append((latest, text))
        return out

    @property
    def text(self) -> str:
        return "".join(text for _, text in self.deliveries())

    def all_token_ids(self) -> list[int]:
        return [t for seq in sorted(self.token_ids) for t in self.token_ids[seq]]

    def timings_ms(self) -> dict[str, float | None]:
        """Client-side TTFT (to the first non-empty delta), ITL samples' mean, TPOT and E2E."""
        shown = [ns for ns, text in self.deliveries() if text]
        end = max([self.terminal_ns or 0] + [ns for ns, _ in self.deliveries()])
        ttft = (shown[0] - self.sent_ns) / 1e6 if shown else None
        e2e = (end - self.sent_ns) / 1e6 if self.terminal is not None else None
        gaps = [(b - a) / 1e6 for a, b in zip(shown, shown[1:], strict=False)]
        num_out = len(self.all_token_ids()) or getattr(
            getattr(self.terminal, "usage", None), "completion_tokens", 0
        )
        tpot = (e2e - ttft) / (num_out - 1) if ttft is not None and e2e and num_out > 1 else None
        return {
            "ttft_ms": ttft,
            "itl_ms": sum(gaps) / len(gaps) if gaps else None,
            "tpot_ms": tpot,
            "tps": 1e3 / tpot if tpot else None,
            "e2e_ms": e2e,
        }

    def gaps_ms(self) -> list[float]:
        shown = [ns for ns, text in self.deliveries() if text]
        return [(b - a) / 1e6 for a, b in zip(shown, shown[1:], strict=False)]


class EventTap:
    """Watches runs by request id through one subscription on `subject`."""

    def __init__(self, nc, subject: str = subjects.ALL_EVENTS) -> None:
        self.nc = nc
        self.subject = subject
        self.runs: dict[str, RunRecord] = {}
        self.num_undecodable = 0
        self._sub = None

    async def start(self) -> None:
        async def received(msg) -> None:
            now = time.time_ns()
            run = self.runs.get(msg.subject.split(".")[2])
            if run is None:
                return
            try:
                event = decode_event(msg.data)
            except (msgspec.DecodeError, msgspec.ValidationError):
                self.num_undecodable += 1
                return
            run.add(event, now)

        self._sub = await self.nc.subscribe(
            self.subject, cb=received, pending_msgs_limit=1_000_000, pending_bytes_limit=2**30
        )
        await self.nc.flush()

    def watch(self, request_id: str) -> RunRecord:
        run = self.runs.setdefault(request_id, RunRecord(request_id=request_id))
        return run

    async def submit(self, js, submit: Submit) -> RunRecord:
        """Watch, then publish the submit (deduped by its request id) and stamp the send time."""
        assert submit.request_id is not None, "submit through the tap with a request_id"
        run = self.watch(submit.request_id)
        run.sent_ns = time.time_ns()
        await publish_submit(js, submit)  # deduped; its key in a header, never in the body
        return run

    async def stop(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None
