"""`brigade bench load`: open-loop Poisson or closed-loop load with a seeded mixed workload,
client-side TTFT / ITL / TPOT / E2E and goodput, cross-checked against the event log's figures;
`--capacity` searches the highest rate at which the SLA holds."""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

from tools.log.sla import Sla

FIGURES = ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms")


def register(subparsers) -> None:
    p = subparsers.add_parser("load", help="load generator: latency, goodput, capacity")
    loop = p.add_mutually_exclusive_group()
    loop.add_argument("--rate", type=float, help="open loop: Poisson arrivals per second")
    loop.add_argument("--concurrency", type=int, help="closed loop: clients sending back to back")
    p.add_argument("--requests", type=int, default=20, help="requests per run (default 20)")
    p.add_argument("--seed", type=int, default=0, help="workload and arrival seed")
    p.add_argument("--prompt-words", default="16,64,256", help="prompt lengths to mix")
    p.add_argument("--output-tokens", default="16,32,64", help="output lengths to mix")
    p.add_argument(
        "--target", choices=("bus", "sse", "ws"), default="bus", help="llm.in or the edge"
    )
    p.add_argument("--edge-url", default="http://127.0.0.1:8080", help="--target sse / ws")
    p.add_argument("--model", default="smollm2-135m", help="model name sent to the edge")
    p.add_argument("--api-key", help="default: $BRIGADE_API_KEY or the dev key of brigade up")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    p.add_argument("--capacity", action="store_true", help="search the highest passing rate")
    p.add_argument("--rates", default="0.25,0.5,1,2,4", help="--capacity: rates to try, rising")
    p.add_argument("--bisect", type=int, default=2, help="--capacity: refinement steps")
    p.add_argument(
        "--sweep", action="store_true", help="--capacity: try every rate, even after a failure"
    )
    p.add_argument("--duration", type=float, default=60.0, help="--capacity: seconds per rate")
    p.add_argument("--out", type=Path, default=Path(".brigade/bench"), help="output directory")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.set_defaults(func=run)


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


def format_run(title: str, client: dict, check: dict | None, sla: Sla) -> str:
    lines = [
        f"## {title}",
        "",
        f"{client['completed']}/{client['requests']} completed in {client['duration_s']:.1f} s: "
        f"{client['requests_per_s']:.2f} req/s, {client['tokens_out_per_s']:.1f} output tok/s, "
        f"goodput {client['goodput_rps']:.2f} req/s (TTFT < {sla.ttft_p95_ms:g} ms and "
        f"> {sla.tps_p50:g} tok/s)",
        "",
        "| figure | client P50 | client P95 | client P99 | log P50 | log P95 | log P99 |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    log = check["log"] if check else None
    for key, label in (
        ("ttft_ms", "TTFT (ms)"),
        ("itl_ms", "ITL (ms)"),
        ("tpot_ms", "TPOT (ms)"),
        ("e2e_ms", "E2E (ms)"),
        ("tps", "decode tok/s"),
    ):
        c = client[key]
        g = log[key] if log else {"p50": None, "p95": None, "p99": None}
        lines.append(
            f"| {label} | {fmt(c['p50'])} | {fmt(c['p95'])} | {fmt(c['p99'])} | "
            f"{fmt(g['p50'])} | {fmt(g['p95'])} | {fmt(g['p99'])} |"
        )
    if check:
        d = check["diff_ms"]
        lines += [
            "",
            f"client − log, per request: TTFT median {fmt(d['ttft_ms']['median'], 2)} ms, max "
            f"|{fmt(d['ttft_ms']['max_abs'], 2)}| ms; E2E median {fmt(d['e2e_ms']['median'], 2)} "
            f"ms, max |{fmt(d['e2e_ms']['max_abs'], 2)}| ms; first token -> end median "
            f"{fmt(d['first_to_end_ms']['median'], 2)} ms ({check['missing_in_log']} missing "
            "in the log)",
        ]
    if client["errors"]:
        lines += ["", "errors: " + "; ".join(client["errors"])]
    return "\n".join(lines)


def _target(args, timeout_s: float):
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
    async with _target(args, args.timeout) as target:
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


def run(args) -> int:

    from tools.bench.workload import Workload, parse_lengths

    try:
        workload = Workload(
            seed=args.seed,
            prompt_words=parse_lengths(args.prompt_words, "--prompt-words"),
            output_tokens=parse_lengths(args.output_tokens, "--output-tokens"),
        )
        rates = [float(r) for r in args.rates.split(",")] if args.capacity else []
    except ValueError as err:
        print(f"brigade bench load: {err}", file=sys.stderr)
        return 2
    try:
        return _run(args, workload, rates)
    except RuntimeError as err:  # no NATS, or it went away
        print(f"brigade bench load: {err}", file=sys.stderr)
        return 1


def _run(args, workload, rates: list[float]) -> int:
    import anyio

    from tools.bench import capacity

    args.out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    sla = Sla()
    if args.capacity:
        steps = anyio.run(capacity.search, args, workload, rates)
        text = "# brigade bench load --capacity\n\n" + capacity.table(steps)
        png = capacity.plot(steps, args.out / f"capacity-{stamp}.png", sla)
        doc = [{k: v for k, v in s.items() if k != "sla"} for s in steps]
        text += f"\n\nplot: {png}"
        name = f"capacity-{stamp}"
    else:
        rate = args.rate if args.rate or args.concurrency else 1.0
        client, check, _ = anyio.run(
            lambda: measure(
                args, workload, rate=rate if not args.concurrency else None,
                concurrency=args.concurrency, count=args.requests, seed=args.seed,
            )
        )  # fmt: skip
        how = f"concurrency {args.concurrency}" if args.concurrency else f"Poisson {rate:g} req/s"
        text = "# brigade bench load\n\n" + format_run(
            f"{args.requests} requests, {how}, target {args.target}, seed {args.seed}",
            client,
            check,
            sla,
        )
        doc = {"client": client, "cross_check": check}
        name = f"load-{stamp}"
    (args.out / f"{name}.md").write_text(text + "\n")
    (args.out / f"{name}.json").write_text(json.dumps(doc, indent=2, default=str))
    print(text)
    print(f"\nwrote {args.out / (name + '.md')} and .json")
    return 0
