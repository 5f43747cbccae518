"""The pipeline benchmark's arithmetic on one synthetic request with known times."""

from __future__ import annotations

import pytest

from schemas.events import (
    ContextAssembled,
    Message,
    PromptTokenized,
    Request,
    RequestAccepted,
    RequestAuthorized,
    RunBilled,
    RunCompleted,
    RunFinished,
    TextGenerated,
    TokensGenerated,
)
from tools.bench.pipeline_report import Seen, analyse, pct

MS = 1_000_000
T0 = 1_000 * MS  # the client's send time


def at(ms: float) -> int:
    return T0 + int(ms * MS)


def synthetic() -> Seen:
    req = Request(messages=[Message(role="user", content="hi")])
    rid = dict(request_id="r")
    events = [
        (at(1.2), RequestAccepted(**rid, request=req, ts_ns=at(1.0), service_ns=int(0.1 * MS))),
        (at(2.2), RequestAuthorized(**rid, request=req, ts_ns=at(2.0), service_ns=int(0.2 * MS))),
        (at(3.2), ContextAssembled(**rid, request=req, ts_ns=at(3.0), service_ns=int(0.3 * MS))),
        (at(4.2), PromptTokenized(**rid, prompt_token_ids=[1], ts_ns=at(4.0), service_ns=int(0.4 * MS))),
        (at(100.5), TokensGenerated(**rid, seq=0, token_ids=[7], ts_ns=at(100.0))),
        (at(101.2), TextGenerated(**rid, seq=0, text="Hi", ts_ns=at(101.0), service_ns=int(0.05 * MS))),
        (at(150.4), RunFinished(**rid, finish_reason="length", last_seq=0, ts_ns=at(150.0))),
        (at(151.3), TextGenerated(**rid, seq=1, text="", ts_ns=at(151.0), service_ns=int(0.06 * MS))),
        (at(152.0), RunCompleted(**rid, finish_reason="length", last_seq=1, ts_ns=at(151.5))),
        (at(160.2), RunBilled(**rid, status="completed", ts_ns=at(160.0), service_ns=5 * MS)),
    ]  # fmt: skip
    return Seen(sent_ns=T0, events=events)


def test_one_request_gives_the_known_figures():
    out = analyse({"r": synthetic()})
    assert out["failed"] == 0 and out["token_ids"] == [[7]]
    assert out["overhead_ms"] == pytest.approx([4.0 + 2.0])  # to `tokenized`, `finished` -> client
    assert out["service_sum_ms"] == pytest.approx([0.1 + 0.2 + 0.3 + 0.4 + 0.06])
    assert out["token_trip_ms"] == pytest.approx([0.5])
    assert out["text_trip_ms"] == pytest.approx([1.2])
    assert out["ttft_ms"] == pytest.approx([101.2]) and out["e2e_ms"] == pytest.approx([152.0])
    queue = out["stage_queue_ms"]
    assert queue["gateway"] == pytest.approx([0.9])
    assert queue["auth"] == pytest.approx([0.8])
    assert queue["context"] == pytest.approx([0.7])
    assert queue["tokenize"] == pytest.approx([0.6])
    assert queue["detokenize"] == pytest.approx([0.95])
    assert queue["ledger"] == pytest.approx([3.5])
    assert out["stage_service_ms"]["detokenize"] == pytest.approx([0.05, 0.06])


def test_a_request_without_completed_counts_as_failed():
    seen = synthetic()
    seen.events = seen.events[:5]
    out = analyse({"r": seen})
    assert out["failed"] == 1 and out["overhead_ms"] == []


def test_percentiles_interpolate():
    assert pct([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    assert pct([1.0, 2.0, 3.0, 4.0], 0.95) == pytest.approx(3.85)
    assert pct([], 0.5) is None
