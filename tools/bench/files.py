"""Where a benchmark's results go: `<stem>.json` (every figure) and `<stem>.md` (the table)."""

from __future__ import annotations

import json
from pathlib import Path


def write_results(out: str | Path, stem: str, res: dict, table: str) -> None:
    """Write both files under `out` (created if missing) and print the table."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(res, indent=1) + "\n")
    (out / f"{stem}.md").write_text(table)
    print(table)
    print(f"wrote {out / f'{stem}.md'} and {out / f'{stem}.json'}")
