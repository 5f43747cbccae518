"""The measuring client's bookkeeping: in-order delivery times, completion, client timings."""

from __future__ import annotations

import pytest

from schemas import events as ev
from tools.busclient import RunRecord

MS = 1_000_000


def text(seq: int, value: str) -> ev.TextGenerated:
    return ev.TextGenerated(request_id="r", seq=seq, text=value)


def test_out_of_order_deltas_are_delivered_in_seq_order():
    run = RunRecord(request_id="r", sent_ns=0)
    run.add(ev.TokensGenerated(request_id="r", seq=0, token_ids=[5]), 90 * MS)
    run.add(text(1, " world"), 130 * MS)  # arrives before seq 0
    run.add(text(0, "hello"), 150 * MS)
    run.add(ev.TokensGenerated(request_id="r", seq=1, token_ids=[6]), 120 * MS)
    run.add(text(2, ""), 170 * MS)  # the final flush, empty
    done = ev.RunCompleted(request_id="r", finish_reason="length", last_seq=3)
    run.add(done, 175 * MS)
    assert not run.done.is_set()  # seq 3 not received yet
    run.add(text(3, "!"), 200 * MS)
    assert run.done.is_set() and run.ok
    assert run.deliveries() == [
        (150 * MS, "hello"),
        (150 * MS, " world"),
        (170 * MS, ""),
        (200 * MS, "!"),
    ]
    assert run.text == "hello world!" and run.all_token_ids() == [5, 6]
    timings = run.timings_ms()
    assert timings["ttft_ms"] == 150.0 and timings["e2e_ms"] == 200.0
    assert run.gaps_ms() == [0.0, 50.0]
    assert timings["itl_ms"] == 25.0
    assert timings["tpot_ms"] == pytest.approx(50.0)  # (200 - 150) / (2 tokens - 1)


def test_a_failed_run_ends_at_once_and_is_not_ok():
    run = RunRecord(request_id="r", sent_ns=0)
    run.add(ev.RequestFailed(request_id="r", stage="auth", code="unauthorized", message="no"), MS)
    assert run.done.is_set() and not run.ok
    assert run.timings_ms()["ttft_ms"] is None and run.timings_ms()["e2e_ms"] == 1.0
