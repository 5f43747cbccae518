"""The capacity search's report: the table names the highest rate that held the SLA, and the plot
is drawn."""

from __future__ import annotations

from pathlib import Path

from tools.bench import capacity
from tools.log.sla import Sla


def test_capacity_table_names_the_highest_passing_rate(tmp_path: Path):
    def step(rate: float, passed: bool, ttft: float) -> dict:
        log = {"ttft_ms": {"p95": ttft}, "tps": {"p50": 50.0}, "error_rate": 0.0,
               "queue_depth_max": 1, "kv_usage_max": None}  # fmt: skip
        return {"rate": rate, "passed": passed, "client": {"requests_per_s": rate},
                "check": {"log": log}}  # fmt: skip

    steps = [step(0.5, False, 420.0), step(0.25, True, 180.0), step(0.375, True, 260.0)]
    text = capacity.table(steps)
    assert text.splitlines()[2].startswith("| 0.25 | 0.25 | 180.0 | 50.0 | 0.00 % | 1 | — | pass |")
    assert text.endswith("capacity: 0.375 req/s")
    assert capacity.plot(steps, tmp_path / "c.png", Sla()).stat().st_size > 5000
