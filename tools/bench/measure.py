"""One measured load run for `brigade bench load` and its capacity search: the load generator's
samples summarized client-side (TTFT / ITL / TPOT / E2E, goodput) and cross-checked per request
against the event log's figures for the same requests."""

from __future__ import annotations

import statistics

from tools.log.sla import Sla


def percentiles(values: list[float]) -> dict[str, float | None]:
    import numpy as np

    if not values:
        return {"p50": None, "p95": None, "p99": None}
    p50, p95, p99 = np.percentile(np.asarray(values, dtype=float), [50, 95, 99])
    return {"p50": float(p50), "p95": float(p95), "p99": float(p99)}


def client_summary(result, sla: Sla) -> dict:
    samples = result.samples
    ok = [s for s in samples if s.ok]
    good = [s for s in samples if sla.request_meets(ok=s.ok, ttft_ms=s.ttft_ms, tps=s.tps)]
    out = {
        "requests": len(samples),
        "completed": len(ok),
        "failed": len(samples) - len(ok),
        "duration_s": result.duration_s,
        "requests_per_s": len(ok) / result.duration_s,
        "tokens_out": sum(s.num_tokens for s in ok),
        "tokens_out_per_s": sum(s.num_tokens for s in ok) / result.duration_s,
        "goodput_rps": len(good) / result.duration_s,
        "errors": sorted({s.error for s in samples if s.error})[:5],
        "itl_ms": percentiles([g for s in ok for g in s.gaps_ms]),
    }
    for key in ("ttft_ms", "tpot_ms", "e2e_ms", "tps"):
        out[key] = percentiles([getattr(s, key) for s in ok if getattr(s, key) is not None])
    return out


async def read_log(request_ids: set[str], start_seq: int) -> list[dict]:
    from tools.log.source import connect, read_rows

    bus = await connect("brigade-bench-log")
    try:
        return await read_rows(bus.js, start_seq=start_seq, request_ids=request_ids)
    finally:
        await bus.close()


def cross_check(result, rows: list[dict]) -> dict:
    """Client figures vs the log's for the same requests: per-request differences (client − log,
    ms) for TTFT and E2E, and the log's own percentiles of every figure."""
    from tools.log.report import summarize
    from tools.log.views import connect

    con = connect(rows=rows)
    log = {
        rid: dict(zip(("ttft_ms", "e2e_ms", "status"), rest, strict=True))
        for rid, *rest in con.execute(
            "SELECT request_id, ttft_ms, e2e_ms, status FROM requests"
        ).fetchall()
    }
    # ttft / e2e: client − log per request. first_to_end: how much longer the client's first
    # token -> end took than the log's; the way in (all that happens before the log's first
    # event: the edge, the bus hop to the gateway) cancels out of it.
    diffs: dict[str, list[float]] = {"ttft_ms": [], "e2e_ms": [], "first_to_end_ms": []}
    missing = 0
    for s in result.samples:
        mine = log.get(s.request_id or "")
        if mine is None:
            missing += 1
            continue
        if not s.ok or None in (s.ttft_ms, s.e2e_ms, mine["ttft_ms"], mine["e2e_ms"]):
            continue
        ttft, e2e = s.ttft_ms - mine["ttft_ms"], s.e2e_ms - mine["e2e_ms"]
        diffs["ttft_ms"].append(ttft)
        diffs["e2e_ms"].append(e2e)
        diffs["first_to_end_ms"].append(e2e - ttft)
    summary = summarize(con)
    return {
        "log": summary,
        "missing_in_log": missing,
        "diff_ms": {
            key: {
                "n": len(v),
                "median": statistics.median(v) if v else None,
                "max_abs": max((abs(x) for x in v), default=None),
            }
            for key, v in diffs.items()
        },
    }


def fmt(value: float | None, digits: int = 1) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def target_for(args, timeout_s: float):
    """The load generator's target: `llm.in` on the bus, or the edge by SSE or websocket."""
    from stages.tenancy.tenants import dev_key
    from tools.bench.loadgen import BusTarget, SseTarget, WsTarget

    key = args.api_key or dev_key()
    if args.target == "sse":
        return SseTarget(args.edge_url, key, timeout_s, args.model)
    if args.target == "ws":
        return WsTarget(args.edge_url, key, timeout_s, args.model)
    return BusTarget(key, timeout_s)


async def measure(args, workload, *, rate=None, concurrency=None, count: int, seed: int):
    """One run plus its cross-check: (client summary, cross-check, result)."""
    from tools.bench.loadgen import run_load
    from tools.log.source import connect, last_seq

    bus = await connect("brigade-bench-seq")
    try:
        start_seq = await last_seq(bus.js) + 1
    finally:
        await bus.close()
    async with target_for(args, args.timeout) as target:
        result = await run_load(
            target,
            workload.items(count),
            rate=rate,
            concurrency=concurrency,
            seed=seed,
            show_progress=not args.quiet,
        )
    ids = {s.request_id for s in result.samples if s.request_id}
    rows = await read_log(ids, start_seq)
    return client_summary(result, Sla()), cross_check(result, rows), result
