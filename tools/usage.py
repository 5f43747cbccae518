"""`brigade usage [--tenant T]`: billed runs and tokens per tenant and status, from the ledger."""

from __future__ import annotations

import sys
from pathlib import Path

HEADER = ("tenant", "status", "runs", "prompt_tokens", "completion_tokens")


def register(subparsers) -> None:
    p = subparsers.add_parser("usage", help="billed usage per tenant (from the ledger)")
    p.add_argument("--tenant", help="only this tenant")
    p.add_argument(
        "--db",
        type=Path,
        help="ledger file (default: $BRIGADE_LEDGER_DB or .brigade/ledger.duckdb)",
    )
    p.set_defaults(func=run)


def table(rows: list[tuple]) -> str:
    cells = [HEADER, *[tuple(str(v) for v in row) for row in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(HEADER))]
    lines = []
    for n, row in enumerate(cells):
        lines.append(
            "  ".join(
                v.ljust(w) if i < 2 else v.rjust(w)
                for i, (v, w) in enumerate(zip(row, widths, strict=True))
            )
        )
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def run(args) -> int:
    from stages import ledger

    path = args.db or ledger.default_path()
    if not path.exists():
        print(
            f"brigade usage: no ledger at {path}; nothing billed yet (or set BRIGADE_LEDGER_DB)",
            file=sys.stderr,
        )
        return 1
    rows = ledger.usage_by_tenant(path, args.tenant)
    if not rows:
        who = f"tenant {args.tenant!r}" if args.tenant else "any tenant"
        print(f"no billed runs for {who} in {path}", file=sys.stderr)
        return 0
    print(table(rows))
    return 0
