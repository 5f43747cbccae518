"""`brigade report`: per-stage latency, TTFT / ITL / E2E, throughput, errors, queue depth, KV usage
and the SLA table with pass/fail per line, from the event log; `--png DIR` adds the plots."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tools.log.sla import Sla, SlaLine, check, holds

PERCENTILES = (0.5, 0.95, 0.99)


def register(subparsers) -> None:
    from tools.log.views import add_source_args

    p = subparsers.add_parser("report", help="latency / SLA report from the event log")
    p.add_argument("--since", help="only requests that started within this duration, e.g. 10m")
    p.add_argument("--tenant", help="only this tenant's requests")
    p.add_argument("--png", type=Path, metavar="DIR", help="write the plots into DIR")
    p.add_argument("--json", type=Path, metavar="FILE", help="also write the figures as JSON")
    p.add_argument("--slowest", type=int, default=10, help="requests in the waterfall plot")
    p.add_argument("--check", action="store_true", help="exit 1 unless every SLA line passes")
    add_source_args(p)
    p.set_defaults(func=run)


def dicts(con, sql: str, params: list | None = None) -> list[dict]:
    cur = con.execute(sql, params or [])
    names = [d[0] for d in cur.description]
    return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]


def _pcts(con, expr: str, source: str) -> dict[str, float | None]:
    qs = ", ".join(f"quantile_cont({expr}, {q})" for q in PERCENTILES)
    row = con.execute(f"SELECT count({expr}), {qs} FROM {source}").fetchone()
    out = {f"p{round(q * 100)}": v for q, v in zip(PERCENTILES, row[1:], strict=True)}
    out["n"] = row[0]
    return out


def summarize(con) -> dict:
    """Every figure of the report, from the views (see tools/log/views.sql)."""
    done = "(SELECT * FROM requests WHERE status = 'completed')"
    counts = dicts(
        con,
        "SELECT count(*) AS requests, count(*) FILTER (status = 'completed') AS completed, "
        "count(*) FILTER (status = 'failed') AS failed, "
        "count(*) FILTER (status = 'cancelled') AS cancelled, "
        "count(*) FILTER (status IS NULL) AS in_flight, "
        "coalesce(sum(tokens_in), 0) AS tokens_in, "
        "coalesce(sum(tokens_out) FILTER (status IS NOT NULL), 0) AS tokens_out, "
        "min(arrival_ns) AS first_ns, max(end_ns) AS last_ns FROM requests",
    )[0]
    span_s = (
        (counts["last_ns"] - counts["first_ns"]) / 1e9
        if counts["last_ns"] and counts["first_ns"]
        else None
    )
    finished = counts["completed"] + counts["failed"] + counts["cancelled"]
    gauges = con.execute(
        "SELECT max(num_waiting), max(kv_usage), quantile_cont(kv_usage, 0.95) FROM engine_gauges"
    ).fetchone()
    depth = con.execute("SELECT max(depth), quantile_cont(depth, 0.95) FROM queue_depth").fetchone()
    return {
        **{k: v for k, v in counts.items() if k not in ("first_ns", "last_ns")},
        "span_s": span_s,
        "requests_per_s": counts["completed"] / span_s if span_s else None,
        "tokens_out_per_s": counts["tokens_out"] / span_s if span_s else None,
        "error_rate": counts["failed"] / finished if finished else None,
        "errors": dicts(
            con,
            "SELECT error_code AS code, error_stage AS stage, count(*) AS n FROM requests "
            "WHERE status = 'failed' GROUP BY ALL ORDER BY n DESC",
        ),
        "ttft_ms": _pcts(con, "ttft_ms", done),
        "engine_ttft_ms": _pcts(con, "engine_ttft_ms", done),
        "itl_ms": _pcts(
            con,
            "gap_ms",
            "(SELECT g.gap_ms FROM token_gaps g JOIN requests r USING (request_id) "
            "WHERE r.status = 'completed')",
        ),
        "tpot_ms": _pcts(con, "tpot_ms", done),
        "e2e_ms": _pcts(con, "e2e_ms", done),
        "tps": _pcts(con, "tps", done),
        "stages": dicts(con, "SELECT * FROM stage_latency"),
        "queue_depth_max": depth[0],
        "queue_depth_p95": depth[1],
        "engine_waiting_max": gauges[0],
        "kv_usage_max": gauges[1],
        "kv_usage_p95": gauges[2],
        "retrieval": {
            "requests": con.execute("SELECT count(*) FROM retrievals").fetchone()[0],
            **{
                key: _pcts(con, key, "retrievals")
                for key in ("search_ms", "rerank_ms", "num_candidates", "num_kept", "num_tokens")
            },
        },
    }


def sla_lines(summary: dict, sla: Sla) -> list[SlaLine]:
    return check(
        sla,
        ttft_p95_ms=summary["ttft_ms"]["p95"],
        tps_p50=summary["tps"]["p50"],
        error_rate=summary["error_rate"],
        kv_usage_max=summary["kv_usage_max"],
        queue_depth_max=summary["queue_depth_max"],
    )


def _f(value: float | None, digits: int = 1) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def _retrieval_lines(r: dict) -> list[str]:
    if not r["requests"]:
        return []
    out = [
        "",
        f"## Retrieval ({r['requests']} requests)",
        "",
        "| figure | P50 | P95 | P99 |",
        "|---|---:|---:|---:|",
    ]
    names = {
        "search_ms": "search (ms)",
        "rerank_ms": "rerank (ms)",
        "num_candidates": "candidates",
        "num_kept": "chunks kept",
        "num_tokens": "retrieved tokens",
    }
    for key, label in names.items():
        p = r[key]
        out.append(f"| {label} | {_f(p['p50'])} | {_f(p['p95'])} | {_f(p['p99'])} |")
    return out


def format_report(summary: dict, lines: list[SlaLine]) -> str:
    s = summary
    out = [
        f"# Brigade report — {s['requests']} requests ({s['completed']} completed, "
        f"{s['failed']} failed, {s['cancelled']} cancelled, {s['in_flight']} in flight) "
        f"over {_f(s['span_s'], 1)} s",
        "",
        "## Per-stage latency (ms; one hop per request, per token for detokenize)",
        "",
        "| stage | hops | queue P50 | queue P95 | queue P99 | service P50 | service P95 | service P99 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in s["stages"]:
        values = " | ".join(
            _f(r[f"{kind}_p{p}_ms"], 2) for kind in ("queue", "service") for p in (50, 95, 99)
        )
        out.append(f"| {r['stage']} | {r['num_hops']} | {values} |")
    out += [
        "",
        "## Request latency (completed requests)",
        "",
        "| figure | n | P50 | P95 | P99 |",
        "|---|---:|---:|---:|---:|",
    ]
    names = {
        "ttft_ms": "TTFT (ms)",
        "engine_ttft_ms": "engine first token (ms)",
        "itl_ms": "inter-token latency (ms)",
        "tpot_ms": "time per output token (ms)",
        "e2e_ms": "end-to-end (ms)",
        "tps": "decode speed (tok/s)",
    }
    for key, label in names.items():
        p = s[key]
        out.append(f"| {label} | {p['n']} | {_f(p['p50'])} | {_f(p['p95'])} | {_f(p['p99'])} |")
    errors = ", ".join(f"{e['code']} at {e['stage']}: {e['n']}" for e in s["errors"]) or "none"
    out += [
        "",
        "## Load",
        "",
        f"- throughput: {_f(s['requests_per_s'], 2)} requests/s, "
        f"{_f(s['tokens_out_per_s'], 1)} output tok/s ({s['tokens_in']} tokens in, "
        f"{s['tokens_out']} out)",
        f"- error rate: {_f(None if s['error_rate'] is None else 100 * s['error_rate'], 3)} % "
        f"({errors})",
        f"- queue depth (waiting for a first token): max {_f(s['queue_depth_max'], 0)}, "
        f"P95 {_f(s['queue_depth_p95'], 1)}; engine waiting max {_f(s['engine_waiting_max'], 0)}",
        f"- KV usage: max {_f(None if s['kv_usage_max'] is None else 100 * s['kv_usage_max'])} %, "
        f"P95 {_f(None if s['kv_usage_p95'] is None else 100 * s['kv_usage_p95'])} %",
    ]
    out += _retrieval_lines(s["retrieval"])
    out += [
        "",
        "## SLA",
        "",
        "| line | target | measured | verdict |",
        "|---|---|---:|---|",
    ]
    for line in lines:
        out.append(f"| {line.name} | {line.target} | {line.measured_text()} | {line.verdict} |")
    out += ["", f"SLA {'holds' if holds(lines) else 'does not hold'}."]
    return "\n".join(out)


def slowest_hops(con, limit: int) -> list[tuple[str, list]]:
    """The `limit` slowest completed requests (by E2E), each with its hops in ms from arrival."""
    from tools.log.plots import Hop

    rows = dicts(
        con,
        "SELECT h.request_id, h.stage, (h.in_ns - r.arrival_ns) / 1e6 AS in_ms, "
        "(h.start_ns - r.arrival_ns) / 1e6 AS start_ms, (h.end_ns - r.arrival_ns) / 1e6 AS end_ms, "
        "r.e2e_ms FROM stage_hops h JOIN requests r USING (request_id) WHERE r.request_id IN "
        "(SELECT request_id FROM requests WHERE status = 'completed' "
        f"ORDER BY e2e_ms DESC LIMIT {int(limit)}) ORDER BY r.e2e_ms DESC, h.stage_order, h.seq",
    )
    by_request: dict[str, list] = {}
    for r in rows:
        hop = Hop(stage=r["stage"], in_ms=r["in_ms"], start_ms=r["start_ms"], end_ms=r["end_ms"])
        by_request.setdefault(r["request_id"], []).append(hop)
    return list(by_request.items())


def write_plots(con, summary: dict, sla: Sla, out_dir: Path, slowest: int = 10) -> list[Path]:
    from tools.log import plots

    out_dir.mkdir(parents=True, exist_ok=True)
    ttfts = [
        r[0]
        for r in con.execute(
            "SELECT ttft_ms FROM requests WHERE status = 'completed' AND ttft_ms IS NOT NULL"
        ).fetchall()
    ]
    slow = slowest_hops(con, slowest)
    ttft_of = dict(
        con.execute("SELECT request_id, ttft_ms FROM requests WHERE ttft_ms IS NOT NULL").fetchall()
    )
    return [
        plots.stage_latency_bars(summary["stages"], out_dir / "stage_latency.png"),
        plots.ttft_histogram(ttfts, sla.ttft_p95_ms, out_dir / "ttft_histogram.png"),
        plots.waterfall(
            slow,
            out_dir / "waterfall_slowest.png",
            f"The {len(slow)} slowest requests",
            {rid: ttft_of[rid] for rid, _ in slow if rid in ttft_of},
        ),
    ]


def run(args) -> int:
    from tools.log.views import open_log, since_cutoff_ns

    try:
        con = open_log(args, since_ns=since_cutoff_ns(args.since), tenant=args.tenant)
    except ValueError as err:
        print(f"brigade report: {err}", file=sys.stderr)
        return 2
    sla = Sla()
    summary = summarize(con)
    lines = sla_lines(summary, sla)
    print(format_report(summary, lines))
    if args.png is not None:
        for path in write_plots(con, summary, sla, args.png, args.slowest):
            print(f"wrote {path}")
    if args.json is not None:
        doc = {**summary, "sla": [line.__dict__ | {"verdict": line.verdict} for line in lines]}
        args.json.write_text(json.dumps(doc, indent=2, default=str))
    return 1 if args.check and not holds(lines) else 0
