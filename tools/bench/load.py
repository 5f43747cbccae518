"""`brigade bench load`: open-loop Poisson or closed-loop load with a seeded mixed workload,
client-side TTFT / ITL / TPOT / E2E and goodput, cross-checked against the event log's figures;
`--capacity` searches the highest rate at which the SLA holds."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from tools.bench.measure import fmt, measure
from tools.log.sla import Sla


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
