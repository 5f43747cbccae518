"""The views of tools/log/views.sql on a synthetic log with hand-computed answers (see synthlog.py)."""

from __future__ import annotations

import pytest

from tests.tools.log.synthlog import at, example_rows
from tools.log.views import connect, parse_duration_ns


@pytest.fixture(scope="module")
def con():
    return connect(rows=example_rows())


def one(con, sql: str):
    rows = con.execute(sql).fetchall()
    assert len(rows) == 1, rows
    return rows[0]


def test_request_figures(con):
    row = one(
        con,
        "SELECT tenant, status, finish_reason, tokens_in, tokens_out, ttft_ms, engine_ttft_ms, "
        "e2e_ms, itl_ms, tpot_ms, tps, num_deltas, seed FROM requests WHERE request_id = 'req-a'",
    )
    (
        tenant,
        status,
        reason,
        tokens_in,
        tokens_out,
        ttft,
        engine_ttft,
        e2e,
        itl,
        tpot,
        tps,
        n,
        seed,
    ) = row
    assert (tenant, status, reason, tokens_in, tokens_out, n, seed) == (
        "acme", "completed", "stop", 5, 3, 3, 7,
    )  # fmt: skip
    assert ttft == pytest.approx(59.0)  # first non-empty text at 59 ms, arrival at 0
    assert engine_ttft == pytest.approx(58.0)
    assert e2e == pytest.approx(102.0)  # `completed` at 102 ms
    assert itl == pytest.approx((101 - 59) / 2)  # three non-empty deltas: 59, 79, 101 ms
    assert tpot == pytest.approx((102 - 59) / 2)
    assert tps == pytest.approx(1000 / 21.5)


def test_failed_request(con):
    row = one(
        con,
        "SELECT tenant, status, error_code, error_stage, error_message, tokens_out, ttft_ms, "
        "e2e_ms, tps FROM requests WHERE request_id = 'req-b'",
    )
    assert row[:7] == ("zeta", "failed", "unauthorized", "auth", "unknown API key", 0, None)
    assert row[7] == pytest.approx(12 - 9.5)
    assert row[8] is None


def test_request_stages(con):
    rows = con.execute(
        "SELECT stage, num_hops, round(queue_ms, 6), round(service_ms, 6) FROM request_stages "
        "WHERE request_id = 'req-a' ORDER BY stage_order"
    ).fetchall()
    assert rows == [
        ("gateway", 1, 0.5, 0.5),  # accepted: start 1.0 - 0.5 = 0.5 after receipt at 0
        ("auth", 1, 1.0, 1.0),  # accepted at 1, authorized at 3 after 1 ms of work
        ("context", 1, 1.0, 2.0),
        ("tokenize", 1, 1.0, 1.0),
        ("engine", 1, 12.0, 80.0),  # tokenized at 8, finished at 100 after 40 + 40 ms
        (
            "detokenize",
            4,
            3.1,
            0.9,
        ),  # seq 0-2: 0.8 ms each after `tokens`; seq 3: 0.7 after `finished`
        ("ledger", 1, 1.0, 1.0),  # completed at 102, billed at 104 after 1 ms
    ]


def test_token_gaps_skip_empty_deltas_and_duplicates(con):
    gaps = con.execute(
        "SELECT seq, round(gap_ms, 6) FROM token_gaps WHERE request_id = 'req-a' ORDER BY seq"
    ).fetchall()
    assert gaps == [(0, None), (1, 20.0), (3, 22.0)]


def test_stage_latency_percentiles(con):
    rows = {
        r[0]: r[1:]
        for r in con.execute("SELECT * EXCLUDE (stage_order) FROM stage_latency").fetchall()
    }
    assert rows["auth"][0] == 1  # req-b failed at auth: no `authorized`, no hop
    assert rows["gateway"][0] == 2
    hops, q50, q95, q99, s50, s95, s99 = rows["gateway"]
    # gateway queue: req-a 0.5 ms, req-b (10 - 0.3) - 9.5 = 0.2 ms; service 0.5 and 0.3 ms
    assert (q50, q95, q99) == pytest.approx((0.35, 0.485, 0.497))
    assert (s50, s95, s99) == pytest.approx((0.4, 0.49, 0.498))


def test_queue_depth_and_engine_gauges(con):
    depths = con.execute("SELECT ts_ns, depth FROM queue_depth ORDER BY ts_ns").fetchall()
    assert depths == [(at(0), 1), (at(9.5), 2), (at(12), 1), (at(58), 0)]
    gauges = con.execute(
        "SELECT type, num_waiting, num_running, kv_usage FROM engine_gauges ORDER BY ts_ns"
    ).fetchall()
    assert gauges == [("tokens", 1, 1, 0.25), ("finished", 0, 0, 0.3125)]


def test_filters_keep_whole_requests():
    by_tenant = connect(rows=example_rows(), tenant="zeta")
    assert by_tenant.execute("SELECT request_id FROM requests").fetchall() == [("req-b",)]
    assert by_tenant.execute("SELECT count(*) FROM events").fetchone() == (3,)
    late = connect(rows=example_rows(), since_ns=at(5))
    assert late.execute("SELECT request_id FROM requests").fetchall() == [("req-b",)]
    assert connect(rows=example_rows(), since_ns=at(200)).execute(
        "SELECT count(*) FROM requests"
    ).fetchone() == (0,)


def test_empty_archive_has_every_view(tmp_path):
    con = connect(tmp_path)
    for view in ("requests", "stage_latency", "queue_depth", "engine_gauges", "request_stages"):
        assert con.execute(f"SELECT count(*) FROM {view}").fetchone() == (0,)


def test_parse_duration():
    assert parse_duration_ns("10m") == 600 * 10**9
    assert parse_duration_ns("90s") == 90 * 10**9
    assert parse_duration_ns("1.5h") == 5400 * 10**9
    with pytest.raises(ValueError, match="10m"):
        parse_duration_ns("ten minutes")
