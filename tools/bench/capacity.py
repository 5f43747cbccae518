"""The capacity search of `brigade bench load --capacity`: the highest offered rate at which
the SLA holds, judged on the event log's figures for each step's requests."""

from __future__ import annotations

import sys
from pathlib import Path

from tools.bench.measure import fmt, measure
from tools.log.sla import Sla, holds


async def search(args, workload, rates: list[float]) -> list[dict]:
    """Rising rates until the SLA breaks (every rate with `--sweep`, for the whole curve), then
    `--bisect` steps between the last pass and the first failure. The SLA is judged on the log's
    figures (KV usage may be without data)."""
    from tools.log.report import sla_lines

    steps: list[dict] = []

    async def step(rate: float) -> bool:
        count = max(8, round(rate * args.duration))
        print(f"capacity: {rate:g} req/s, {count} requests", file=sys.stderr, flush=True)
        client, check, _ = await measure(args, workload, rate=rate, count=count, seed=args.seed)
        lines = sla_lines(check["log"], Sla())
        ok = holds(lines, allow_missing=True) and client["failed"] == 0
        steps.append({"rate": rate, "passed": ok, "client": client, "check": check, "sla": lines})
        return ok

    passed, failed = None, None
    for rate in rates:
        if await step(rate):
            passed = rate
        else:
            failed = rate if failed is None else failed
            if not args.sweep:
                break
    can_bisect = passed is not None and failed is not None and passed < failed
    for _ in range(args.bisect if can_bisect else 0):
        mid = round((passed + failed) / 2, 3)
        if await step(mid):
            passed = mid
        else:
            failed = mid
    return steps


def table(steps: list[dict]) -> str:
    lines = [
        "| rate (req/s) | achieved (req/s) | TTFT P95 (ms) | TPS P50 | error rate | queue max | KV max | SLA |",
        "|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for s in sorted(steps, key=lambda s: s["rate"]):
        log = s["check"]["log"]
        kv = log["kv_usage_max"]
        lines.append(
            f"| {s['rate']:g} | {s['client']['requests_per_s']:.2f} | {fmt(log['ttft_ms']['p95'])} "
            f"| {fmt(log['tps']['p50'])} | {fmt(None if log['error_rate'] is None else 100 * log['error_rate'], 2)} % "
            f"| {fmt(log['queue_depth_max'], 0)} | {'—' if kv is None else f'{100 * kv:.0f} %'} "
            f"| {'pass' if s['passed'] else 'FAIL'} |"
        )
    best = max((s["rate"] for s in steps if s["passed"]), default=None)
    lines += [
        "",
        f"capacity: {'no tested rate holds the SLA' if best is None else f'{best:g} req/s'}",
    ]
    return "\n".join(lines)


def plot(steps: list[dict], path: Path, sla: Sla) -> Path:
    from tools.log.plots import pyplot

    plt = pyplot()
    steps = sorted(steps, key=lambda s: s["rate"])
    rates = [s["rate"] for s in steps]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot(
        rates,
        [s["check"]["log"]["ttft_ms"]["p95"] or 0 for s in steps],
        "o-",
        label="TTFT P95 (ms)",
    )
    ax.axhline(sla.ttft_p95_ms, color="C0", linestyle=":")
    ax.set_xlabel("offered rate (requests/s)")
    ax.set_ylabel("TTFT P95 (ms, log scale)")
    ax.set_yscale("log")
    twin = ax.twinx()
    twin.plot(
        rates,
        [s["check"]["log"]["tps"]["p50"] or 0 for s in steps],
        "s-",
        color="C1",
        label="TPS P50",
    )
    twin.axhline(sla.tps_p50, color="C1", linestyle=":")
    twin.set_ylabel("decode tok/s per request (P50)")
    for s in steps:
        ax.annotate(
            "pass" if s["passed"] else "fail",
            (s["rate"], s["check"]["log"]["ttft_ms"]["p95"] or 0),
            fontsize=8,
        )
    ax.set_title("Capacity search (dotted: SLA targets)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
