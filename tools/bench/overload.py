"""`brigade bench overload`: the edge's admission under a sustained overload, end to end.

`brigade up --procs` on a private data dir and port; a closed loop of `--calibrate-clients`
streamed chats measures the pipeline's capacity (completed requests per second); then an open
loop of Poisson arrivals at `--factor` times that rate runs for `--duration` seconds. Per request
the client records the answer: streamed (TTFT), refused (status, time to the refusal,
Retry-After) or failed. The engine's resident memory is read from /proc before the calibration,
after it (the baseline), every second of the overload and `--settle` seconds after it.

The targets it reports against: admitted requests' TTFT P95 <= 1 s, refusals within 20 ms, the
engine's memory back to its baseline. Figures are client-side and the load average is recorded:
on a shared machine they are noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import anyio

from tools.bench.files import write_results
from tools.bench.serve import QUESTIONS, Pipeline, descendants, process_name
from tools.bench.workload import poisson_arrivals

TTFT_P95_TARGET_MS = 1000.0
REFUSAL_TARGET_MS = 20.0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "overload", help="sustained overload through the edge: admitted TTFT, refusals, memory"
    )
    p.add_argument("--factor", type=float, default=2.5, help="arrivals per capacity (default 2.5)")
    p.add_argument("--duration", type=float, default=60.0, help="overload seconds (default 60)")
    p.add_argument("--calibrate-s", type=float, default=30.0, help="capacity run seconds")
    p.add_argument("--calibrate-clients", type=int, default=8, help="capacity run clients")
    p.add_argument("--capacity", type=float, help="requests/s: skip the capacity run")
    p.add_argument("--max-tokens", type=int, default=32, help="output tokens per request")
    p.add_argument("--settle", type=float, default=15.0, help="seconds before the last RSS")
    p.add_argument("--seed", type=int, default=0, help="prompts and arrivals")
    p.add_argument("--quick", action="store_true", help="10 s calibration, 20 s overload")
    p.add_argument("--out", type=Path, default=Path(".brigade/bench"), help="output directory")
    p.set_defaults(func=run)


@dataclass
class Answer:
    index: int
    sent_s: float  # since the overload began
    status: int | None = None
    ttft_ms: float | None = None  # streamed: the first content
    answer_ms: float | None = None  # the response's headers (a refusal's whole answer)
    retry_after_s: int | None = None
    code: str | None = None
    error: str | None = None


def body(index: int, max_tokens: int, seed: int) -> dict:
    question = QUESTIONS[index % len(QUESTIONS)]
    return {
        "model": "smollm2-135m",
        "messages": [{"role": "user", "content": f"Request {seed}-{index}. {question}"}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }


async def one(client, url: str, key: str, index: int, max_tokens: int, seed: int, t0: float):
    answer = Answer(index=index, sent_s=time.monotonic() - t0)
    sent = time.monotonic()
    headers = {"Authorization": f"Bearer {key}"}
    try:
        async with client.stream(
            "POST", url, json=body(index, max_tokens, seed), headers=headers
        ) as resp:
            answer.status = resp.status_code
            answer.answer_ms = (time.monotonic() - sent) * 1e3
            if resp.status_code != 200:
                raw = await resp.aread()
                try:
                    answer.code = json.loads(raw)["error"]["code"]
                except (ValueError, KeyError, TypeError):
                    answer.code = raw[:100].decode(errors="replace")
                if "retry-after" in resp.headers:
                    answer.retry_after_s = int(resp.headers["retry-after"])
                return answer
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    answer.error = str(chunk["error"])[:200]
                    return answer
                delta = ((chunk.get("choices") or [{}])[0].get("delta")) or {}
                if delta.get("content") and answer.ttft_ms is None:
                    answer.ttft_ms = (time.monotonic() - sent) * 1e3
    except Exception as err:  # noqa: BLE001 - a failed request is an answer, not a crash
        answer.error = f"{type(err).__name__}: {err}"[:200]
    return answer


async def closed_loop(url: str, key: str, clients: int, seconds: float, max_tokens: int) -> float:
    """Completed streamed chats per second from `clients` back-to-back clients."""
    import httpx

    done = 0
    deadline = time.monotonic() + seconds
    t0 = time.monotonic()
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=200)) as http:

        async def client(c: int) -> None:
            nonlocal done
            i = 0
            while time.monotonic() < deadline:
                found = await one(http, url, key, c * 100_000 + i, max_tokens, -1, t0)
                i += 1
                if found.status == 200 and found.error is None:
                    done += 1

        async with anyio.create_task_group() as tg:
            for c in range(clients):
                tg.start_soon(client, c)
    return done / (time.monotonic() - t0)


async def open_loop(url, key, rate, seconds, max_tokens, seed, rss) -> tuple[list[Answer], list]:
    import httpx

    count = max(1, int(rate * seconds))
    arrivals = poisson_arrivals(rate, count, seed)
    answers: list[Answer] = []
    samples: list[tuple[float, int | None]] = []
    t0 = time.monotonic()
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=2000)) as http:

        async def sample_rss() -> None:
            while True:
                samples.append((time.monotonic() - t0, rss()))
                await anyio.sleep(1.0)

        async def send(i: int, at: float) -> None:
            await anyio.sleep(max(0.0, at - (time.monotonic() - t0)))
            answers.append(await one(http, url, key, i, max_tokens, seed, t0))

        async with anyio.create_task_group() as tg:
            tg.start_soon(sample_rss)
            async with anyio.create_task_group() as sends:
                for i, at in enumerate(arrivals):
                    sends.start_soon(send, i, at)
            tg.cancel_scope.cancel()
    return sorted(answers, key=lambda a: a.index), samples


def engine_rss(root: int):
    """A reader of the engine process's resident set size (bytes) under `root`."""

    def read() -> int | None:
        for pid in descendants(root):
            if process_name(pid) == "engine":
                try:
                    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                        if line.startswith("VmRSS:"):
                            return int(line.split()[1]) * 1024
                except OSError:
                    return None
        return None

    return read


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def summarize(answers: list[Answer]) -> dict:
    admitted = [a for a in answers if a.status == 200 and a.error is None]
    refused = [a for a in answers if a.status is not None and a.status != 200]
    failed = [a for a in answers if a.error is not None]
    ttft = [a.ttft_ms for a in admitted if a.ttft_ms is not None]
    refusal = [a.answer_ms for a in refused if a.answer_ms is not None]
    retry = [a.retry_after_s for a in refused if a.retry_after_s is not None]
    codes: dict[str, int] = {}
    for a in refused:
        key = f"{a.status} {a.code}"
        codes[key] = codes.get(key, 0) + 1
    return {
        "requests": len(answers),
        "admitted": len(admitted),
        "refused": len(refused),
        "failed": len(failed),
        "refusals_by_code": codes,
        "ttft_ms": {q: pct(ttft, p) for q, p in (("p50", 0.5), ("p95", 0.95), ("p99", 0.99))},
        "refusal_ms": {q: pct(refusal, p) for q, p in (("p50", 0.5), ("p95", 0.95), ("p99", 0.99))}
        | {"max": max(refusal) if refusal else None},
        "retry_after_s": {str(v): retry.count(v) for v in sorted(set(retry))},
        "errors": sorted({a.error for a in failed if a.error})[:5],
    }


def run(args: argparse.Namespace) -> int:
    if args.quick:
        args.calibrate_s, args.duration, args.settle = 10.0, 20.0, 10.0
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="brigade-bench-overload-") as tmp:
        with Pipeline(procs=True, data_dir=Path(tmp)) as up:
            url = up.url + "/v1/chat/completions"
            rss = engine_rss(up.proc.pid)
            rss_start = rss()
            if args.capacity is None:
                print(f"calibrating: {args.calibrate_clients} clients, {args.calibrate_s:g} s",
                      file=sys.stderr)  # fmt: skip
                capacity = anyio.run(
                    closed_loop, url, up.api_key, args.calibrate_clients, args.calibrate_s,
                    args.max_tokens,
                )  # fmt: skip
            else:
                capacity = args.capacity
            time.sleep(2.0)
            rss_baseline = rss()
            rate = capacity * args.factor
            print(f"overload: {rate:.2f} requests/s ({args.factor:g}x {capacity:.2f}) for "
                  f"{args.duration:g} s", file=sys.stderr)  # fmt: skip
            answers, samples = anyio.run(
                open_loop, url, up.api_key, rate, args.duration, args.max_tokens,
                args.seed, rss,
            )  # fmt: skip
            time.sleep(args.settle)
            rss_after = rss()
    load_after = os.getloadavg()
    found = summarize(answers)
    peak = max((b for _, b in samples if b is not None), default=None)
    mib = 1 << 20
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python "
        f"{platform.python_version()}",
        "load_average_before_after": [round(load_before[0], 2), round(load_after[0], 2)],
        "capacity_rps": round(capacity, 3),
        "factor": args.factor,
        "rate_rps": round(rate, 3),
        "duration_s": args.duration,
        "max_tokens": args.max_tokens,
        **found,
        "engine_rss_mib": {
            "start": rss_start and round(rss_start / mib, 1),
            "baseline": rss_baseline and round(rss_baseline / mib, 1),
            "peak": peak and round(peak / mib, 1),
            "after": rss_after and round(rss_after / mib, 1),
        },
        "targets": {
            "ttft_p95_ms<=": TTFT_P95_TARGET_MS,
            "refusal_p95_ms<=": REFUSAL_TARGET_MS,
        },
        "answers": [asdict(a) for a in answers],
    }
    write_results(args.out, "overload", result, markdown(result))
    return 0


def _f(value, digits: int = 1) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def markdown(r: dict) -> str:
    ttft, refusal, mem = r["ttft_ms"], r["refusal_ms"], r["engine_rss_mib"]
    ok_ttft = ttft["p95"] is not None and ttft["p95"] <= TTFT_P95_TARGET_MS
    ok_refusal = refusal["p95"] is None or refusal["p95"] <= REFUSAL_TARGET_MS
    by_code = ", ".join(f"{k}: {v}" for k, v in r["refusals_by_code"].items())
    retry = ", ".join(f"{k}: {v}" for k, v in r["retry_after_s"].items())
    lines = [
        f"### Overload: {r['factor']:g}x capacity for {r['duration_s']:g} s ({r['date']})",
        "",
        f"{r['machine']}; load average {r['load_average_before_after'][0]} before, "
        f"{r['load_average_before_after'][1]} after. Capacity {r['capacity_rps']} requests/s "
        f"(streamed chats of {r['max_tokens']} tokens), offered {r['rate_rps']} requests/s.",
        "",
        "| what | figure | target |",
        "|---|---|---|",
        f"| requests: admitted / refused / failed | {r['admitted']} / {r['refused']} / "
        f"{r['failed']} | |",
        f"| refusals by answer | {by_code or '—'} | |",
        f"| admitted TTFT P50 / P95 / P99 (ms) | {_f(ttft['p50'])} / {_f(ttft['p95'])} / "
        f"{_f(ttft['p99'])} | P95 <= {TTFT_P95_TARGET_MS:g} ({'PASS' if ok_ttft else 'FAIL'}) |",
        f"| refusal answered in P50 / P95 / max (ms) | {_f(refusal['p50'])} / "
        f"{_f(refusal['p95'])} / {_f(refusal['max'])} | P95 <= {REFUSAL_TARGET_MS:g} "
        f"({'PASS' if ok_refusal else 'FAIL'}) |",
        f"| Retry-After (s: count) | {retry or '—'} | |",
        f"| engine RSS start / baseline / peak / after (MiB) | {_f(mem['start'])} / "
        f"{_f(mem['baseline'])} / {_f(mem['peak'])} / {_f(mem['after'])} | after ≈ baseline |",
        "",
    ]
    return "\n".join(lines)
