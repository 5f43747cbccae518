"""A measured run's client summary: counts, rates, goodput against the SLA and percentiles.
(The cross-check against the log on the real pipeline: test_load.py.)"""

from __future__ import annotations

import pytest

from tools.bench.loadgen import RunResult, Sample
from tools.bench.measure import client_summary, fmt, percentiles
from tools.log.sla import Sla


def test_percentiles_of_nothing_are_none():
    assert percentiles([]) == {"p50": None, "p95": None, "p99": None}
    assert percentiles([1.0, 2.0, 3.0, 4.0, 5.0]) == pytest.approx(
        {"p50": 3.0, "p95": 4.8, "p99": 4.96}
    )


def test_client_summary_counts_goodput_against_the_sla():
    def ok(index: int, ttft_ms: float, tps: float | None, num_tokens: int) -> Sample:
        return Sample(index=index, request_id=f"r{index}", ok=True, ttft_ms=ttft_ms, tps=tps,
                      tpot_ms=10.0, e2e_ms=ttft_ms + 100.0, num_tokens=num_tokens,
                      gaps_ms=[10.0] * (num_tokens - 1))  # fmt: skip

    samples = [
        ok(0, 100.0, 80.0, 8),  # good
        ok(1, 400.0, 80.0, 8),  # completed, but its first token came too late
        ok(2, 50.0, None, 1),  # one token: judged on TTFT alone, good
        Sample(index=3, request_id="r3", error="HTTP 429"),
        Sample(index=4, request_id="r4", error="HTTP 429"),
    ]
    out = client_summary(RunResult(samples, started_ns=0, ended_ns=2_000_000_000), Sla())
    assert (out["requests"], out["completed"], out["failed"]) == (5, 3, 2)
    assert (out["duration_s"], out["requests_per_s"], out["goodput_rps"]) == (2.0, 1.5, 1.0)
    assert (out["tokens_out"], out["tokens_out_per_s"]) == (17, 8.5)
    assert out["errors"] == ["HTTP 429"]
    assert out["ttft_ms"]["p50"] == 100.0 and out["itl_ms"]["p99"] == 10.0
    assert out["tps"] == {"p50": 80.0, "p95": 80.0, "p99": 80.0}


def test_fmt_shows_a_dash_for_no_data():
    assert (fmt(None), fmt(1.25), fmt(3.14159, 2), fmt(7.0, 0)) == ("—", "1.2", "3.14", "7")
