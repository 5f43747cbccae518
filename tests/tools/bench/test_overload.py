"""bench overload's report: answers sorted into admitted, refused and failed, their percentiles,
Retry-After counts, and the PASS/FAIL of each target."""

from __future__ import annotations

from tools.bench.overload import Answer, markdown, pct, summarize


def answers() -> list[Answer]:
    admitted = [Answer(index=i, sent_s=i, status=200, ttft_ms=100.0 * (i + 1)) for i in range(10)]
    refused = [
        Answer(index=10 + i, sent_s=i, status=503, answer_ms=2.0 + i, retry_after_s=1 + i % 2,
               code="overloaded")
        for i in range(4)
    ]  # fmt: skip
    failed = [Answer(index=20, sent_s=0, status=200, error="RemoteProtocolError: cut")]
    return admitted + refused + failed


def test_answers_are_counted_and_their_percentiles_taken():
    found = summarize(answers())
    assert (found["admitted"], found["refused"], found["failed"]) == (10, 4, 1)
    assert found["refusals_by_code"] == {"503 overloaded": 4}
    assert found["ttft_ms"] == {"p50": 500.0, "p95": 1000.0, "p99": 1000.0}
    assert found["refusal_ms"]["max"] == 5.0 and found["retry_after_s"] == {"1": 2, "2": 2}
    assert pct([], 0.5) is None


def test_the_table_says_which_target_passed():
    result = {
        **summarize(answers()),
        "factor": 2.5, "duration_s": 60.0, "date": "today", "machine": "m",
        "load_average_before_after": [1.0, 2.0], "capacity_rps": 1.0, "rate_rps": 2.5,
        "max_tokens": 32,
        "engine_rss_mib": {"start": 1.0, "baseline": 2.0, "peak": 3.0, "after": 2.0},
    }  # fmt: skip
    table = markdown(result)
    assert (
        "| admitted TTFT P50 / P95 / P99 (ms) | 500.0 / 1000.0 / 1000.0 | P95 <= 1000 (PASS)"
        in table
    )
    assert "P95 <= 20 (PASS)" in table and "1: 2, 2: 2" in table
