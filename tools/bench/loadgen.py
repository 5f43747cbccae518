"""The load generator's engine room: targets (the bus's `llm.in`, the edge's SSE), open-loop
Poisson and closed-loop runs, and progress while they go. Every figure is client-side."""

from __future__ import annotations

import json
import sys
import time
import uuid
from dataclasses import dataclass, field

import anyio

from tools.bench.workload import WorkItem, poisson_arrivals


@dataclass
class Sample:
    """One request as the client measured it (ms; None where it does not apply)."""

    index: int
    request_id: str | None = None
    ok: bool = False
    error: str | None = None
    ttft_ms: float | None = None
    itl_ms: float | None = None
    tpot_ms: float | None = None
    tps: float | None = None
    e2e_ms: float | None = None
    num_tokens: int = 0
    gaps_ms: list[float] = field(default_factory=list)
    retries: int = 0  # 503s answered by waiting Retry-After and sending again


class BusTarget:
    """Submits to `llm.in` and watches `llm.ev.<id>.>` live, as `brigade ask` does."""

    name = "bus"

    def __init__(self, api_key: str | None, timeout_s: float) -> None:
        self.api_key = api_key
        self.timeout_s = timeout_s

    async def __aenter__(self) -> BusTarget:
        from tools.busclient import EventTap
        from tools.log.source import connect

        self.bus = await connect("brigade-bench-load")
        self.tap = EventTap(self.bus.nc)
        await self.tap.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.tap.stop()
        await self.bus.close()

    async def run_one(self, item: WorkItem, request_id: str) -> Sample:
        from schemas.events import Message, Submit

        submit = Submit(
            request_id=request_id,
            api_key=self.api_key,
            messages=[Message(role="user", content=item.prompt)],
            max_tokens=item.max_tokens,
            ignore_eos=True,
            temperature=0.0,
            seed=item.seed,
        )
        sample = Sample(index=item.index, request_id=request_id)
        record = await self.tap.submit(self.bus.js, submit)
        try:
            with anyio.fail_after(self.timeout_s):
                await record.done.wait()
        except TimeoutError:
            sample.error = f"no end within {self.timeout_s:g} s (--timeout)"
            return sample
        finally:
            self.tap.runs.pop(request_id, None)
        timings = record.timings_ms()
        sample.ok = record.ok
        if not record.ok:
            sample.error = f"{type(record.terminal).__name__}: {record.terminal}"
        sample.ttft_ms, sample.itl_ms = timings["ttft_ms"], timings["itl_ms"]
        sample.tpot_ms, sample.tps, sample.e2e_ms = (
            timings["tpot_ms"],
            timings["tps"],
            timings["e2e_ms"],
        )
        sample.num_tokens = len(record.all_token_ids())
        sample.gaps_ms = record.gaps_ms()
        return sample


class SseTarget:
    """POST /v1/chat/completions with stream=true at the edge; reads the SSE chunks (with the
    lean client of tools/bench/sse_client.py: a chunk is stamped as it arrives and parsed after
    the answer ends, so the client's own CPU stays off the cores it measures)."""

    name = "sse"

    def __init__(
        self,
        base_url: str,
        api_key: str | None,
        timeout_s: float,
        model: str,
        *,
        retries_on_503: int = 0,
    ) -> None:
        self.url = base_url.rstrip("/") + "/v1/chat/completions"
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.model = model
        # as the openai SDK does (max_retries): a 503 is waited out for its retry-after-ms
        self.retries_on_503 = retries_on_503

    async def __aenter__(self) -> SseTarget:
        return self

    async def __aexit__(self, *exc) -> None:
        return None

    async def run_one(self, item: WorkItem, request_id: str) -> Sample:
        from tools.bench.sse_client import post_stream

        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": item.prompt}],
            "max_tokens": item.max_tokens,
            "temperature": 0.0,
            "seed": item.seed,
            "ignore_eos": True,
            "stream": True,
        }
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        sample = Sample(index=item.index)
        sent = time.time_ns()
        try:
            while True:
                resp = await post_stream(self.url, body, headers, self.timeout_s)
                sample.request_id = resp.headers.get("x-request-id")
                if resp.status == 503 and sample.retries < self.retries_on_503:
                    sample.retries += 1
                    await anyio.sleep(min(_retry_after_s(resp.headers), 60.0))
                    continue
                break
        except Exception as err:  # noqa: BLE001 - a failed request is a sample, not a crash
            sample.error = f"{type(err).__name__}: {err}"
            return sample
        if resp.status != 200:
            sample.error = f"HTTP {resp.status}: {resp.body[:300]!r}"
            return sample
        deltas: list[tuple[int, str]] = []
        finish = None
        for now, data in resp.events():
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                sample.error = str(chunk["error"])
                return sample
            choice = (chunk.get("choices") or [{}])[0]
            content = (choice.get("delta") or {}).get("content")
            if content:
                deltas.append((now, content))
            finish = choice.get("finish_reason") or finish
        end = resp.pieces[-1][0] if resp.pieces else time.time_ns()
        sample = _finish(sample, item, sent, end, deltas)
        if finish not in ("stop", "length"):
            sample.ok, sample.error = False, f"finish_reason {finish}"
        return sample


class WsTarget:
    """One websocket session per request at the edge's `/v1/stream` (Realtime-style events)."""

    name = "ws"

    def __init__(self, base_url: str, api_key: str | None, timeout_s: float, model: str) -> None:
        self.url = base_url.replace("http://", "ws://").replace("https://", "wss://").rstrip("/")
        self.url += "/v1/stream"
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.model = model

    async def __aenter__(self) -> WsTarget:
        return self

    async def __aexit__(self, *exc) -> None:
        return None

    async def run_one(self, item: WorkItem, request_id: str) -> Sample:
        import websockets

        create = {
            "type": "response.create",
            "response": {
                "model": self.model,
                "messages": [{"role": "user", "content": item.prompt}],
                "max_tokens": item.max_tokens,
                "temperature": 0.0,
                "seed": item.seed,
                "ignore_eos": True,
            },
        }
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        sample = Sample(index=item.index)
        deltas: dict[int, tuple[int, str]] = {}
        sent = time.time_ns()
        try:
            with anyio.fail_after(self.timeout_s):
                async with websockets.connect(self.url, additional_headers=headers) as ws:
                    await ws.send(json.dumps(create))
                    async for frame in ws:
                        now = time.time_ns()
                        event = json.loads(frame)
                        kind = event.get("type")
                        sample.request_id = event.get("request_id") or sample.request_id
                        if kind == "response.output_text.delta":
                            deltas.setdefault(event["seq"], (now, event["text"]))
                        elif kind == "error":
                            sample.error = str(event.get("error"))
                            return sample
                        elif kind == "response.done":
                            break
        except Exception as err:  # noqa: BLE001 - a failed request is a sample, not a crash
            sample.error = f"{type(err).__name__}: {err}"
            return sample
        return _finish(sample, item, sent, time.time_ns(), [deltas[k] for k in sorted(deltas)])


def _retry_after_s(headers) -> float:
    """A refusal's wait as the openai SDK reads it: `retry-after-ms` first, then `retry-after`
    in seconds, else 1 s."""
    for name, scale in (("retry-after-ms", 1e-3), ("retry-after", 1.0)):
        try:
            return float(headers[name]) * scale
        except (KeyError, TypeError, ValueError):
            continue
    return 1.0


def _finish(
    sample: Sample, item: WorkItem, sent: int, end: int, deltas: list[tuple[int, str]]
) -> Sample:
    """Client figures from (received ns, text) deltas in seq order and the end of the run."""
    shown, latest = [], 0
    for received, text in deltas:
        latest = max(latest, received)  # an in-order client shows a delta after the earlier ones
        if text:
            shown.append(latest)
    sample.ok = True
    sample.num_tokens = item.max_tokens
    sample.gaps_ms = [(b - a) / 1e6 for a, b in zip(shown, shown[1:], strict=False)]
    sample.e2e_ms = (end - sent) / 1e6
    if shown:
        sample.ttft_ms = (shown[0] - sent) / 1e6
        sample.itl_ms = sum(sample.gaps_ms) / len(sample.gaps_ms) if sample.gaps_ms else None
        if item.max_tokens > 1:
            sample.tpot_ms = (sample.e2e_ms - sample.ttft_ms) / (item.max_tokens - 1)
            sample.tps = 1e3 / sample.tpot_ms if sample.tpot_ms > 0 else None
    return sample


@dataclass
class RunResult:
    samples: list[Sample]
    started_ns: int
    ended_ns: int

    @property
    def duration_s(self) -> float:
        return (self.ended_ns - self.started_ns) / 1e9


class Progress:
    """A status line every `every_s` seconds on stderr while a run goes."""

    def __init__(self, total: int, every_s: float = 2.0) -> None:
        self.total, self.every_s = total, every_s
        self.sent = self.done = self.failed = 0
        self.ttfts: list[float] = []
        self.tokens = 0
        self.t0 = time.monotonic()

    def line(self) -> str:
        elapsed = time.monotonic() - self.t0
        ttft = sorted(self.ttfts)[len(self.ttfts) // 2] if self.ttfts else None
        return (
            f"[{elapsed:6.1f}s] sent {self.sent}/{self.total}  done {self.done}  failed "
            f"{self.failed}  in flight {self.sent - self.done - self.failed}  TTFT P50 "
            f"{'—' if ttft is None else f'{ttft:.0f} ms'}  {self.tokens / max(elapsed, 1e-9):.1f} tok/s"
        )

    async def report(self) -> None:
        while True:
            await anyio.sleep(self.every_s)
            print(self.line(), file=sys.stderr, flush=True)


async def run_load(
    target,
    items: list[WorkItem],
    *,
    rate: float | None = None,
    concurrency: int | None = None,
    seed: int = 0,
    show_progress: bool = True,
) -> RunResult:
    """Open loop (`rate`: Poisson arrivals, never waiting for answers) or closed loop
    (`concurrency` clients, each sending its next request when the last one ended)."""
    if (rate is None) == (concurrency is None):
        raise ValueError("give exactly one of rate (open loop) or concurrency (closed loop)")
    tag = uuid.uuid4().hex[:8]
    samples: list[Sample] = []
    progress = Progress(len(items))

    async def one(item: WorkItem) -> None:
        progress.sent += 1
        sample = await target.run_one(item, f"load-{tag}-{item.index:05d}")
        samples.append(sample)
        if sample.ok:
            progress.done += 1
            progress.tokens += sample.num_tokens
            if sample.ttft_ms is not None:
                progress.ttfts.append(sample.ttft_ms)
        else:
            progress.failed += 1

    started = time.time_ns()
    async with anyio.create_task_group() as outer:
        if show_progress:
            outer.start_soon(progress.report)
        async with anyio.create_task_group() as tg:
            if rate is not None:
                t0 = time.monotonic()
                for item, offset in zip(
                    items, poisson_arrivals(rate, len(items), seed), strict=True
                ):
                    await anyio.sleep(max(0.0, t0 + offset - time.monotonic()))
                    tg.start_soon(one, item)
            else:
                queue = list(reversed(items))

                async def client() -> None:
                    while queue:
                        await one(queue.pop())

                for _ in range(concurrency or 0):
                    tg.start_soon(client)
        outer.cancel_scope.cancel()
    ended = time.time_ns()
    if show_progress:
        print(progress.line(), file=sys.stderr, flush=True)
    samples.sort(key=lambda s: s.index)
    return RunResult(samples=samples, started_ns=started, ended_ns=ended)
