"""`brigade sql "SELECT ..."`: plain SQL over the event log, with the views of tools/log/views.sql."""

from __future__ import annotations

import argparse
import csv
import sys

EXAMPLES = """views: events (raw rows), ev (deduplicated), requests, token_gaps, stage_hops,
       request_stages, stage_latency, engine_gauges, queue_depth

examples:
  brigade sql "SELECT stage, queue_p95_ms, service_p95_ms FROM stage_latency"
  brigade sql "SELECT request_id, ttft_ms, tps, e2e_ms FROM requests ORDER BY e2e_ms DESC LIMIT 5"
  brigade sql "SELECT tenant, count(*), quantile_cont(ttft_ms, 0.95) FROM requests GROUP BY 1"
"""


def register(subparsers) -> None:
    from tools.log.views import add_source_args

    p = subparsers.add_parser(
        "sql",
        help="run SQL over the event log (DuckDB, with latency views)",
        description="Run SQL over the event log with DuckDB.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("query", nargs="?", help="SQL; read from stdin when omitted")
    p.add_argument("--since", help="only requests that started within this duration, e.g. 10m")
    p.add_argument("--tenant", help="only this tenant's requests")
    p.add_argument("--csv", action="store_true", help="print CSV instead of a table")
    p.add_argument("--max-rows", type=int, default=200, help="rows shown in table form")
    add_source_args(p)
    p.set_defaults(func=run)


def run(args) -> int:
    import duckdb

    from tools.log.views import open_log, since_cutoff_ns

    query = args.query if args.query is not None else sys.stdin.read()
    if not query.strip():
        print("no query given\n\n" + EXAMPLES, file=sys.stderr)
        return 2
    try:
        con = open_log(args, since_ns=since_cutoff_ns(args.since), tenant=args.tenant)
    except ValueError as err:
        print(f"brigade sql: {err}", file=sys.stderr)
        return 2
    try:
        rel = con.sql(query)
    except duckdb.Error as err:
        print(f"brigade sql: {err}\n\n{EXAMPLES}", file=sys.stderr)
        return 1
    if rel is None:  # a statement without a result (CREATE VIEW ...)
        return 0
    if args.csv:
        writer = csv.writer(sys.stdout, lineterminator="\n")
        writer.writerow(rel.columns)
        writer.writerows(rel.fetchall())
    else:
        rel.show(max_rows=args.max_rows, max_width=200)
    return 0
