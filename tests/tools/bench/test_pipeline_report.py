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


def test_each_stage_hop_runs_from_its_input_stamped_to_its_output_stamped():
    hop = analyse({"r": synthetic()})["stage_hop_ms"]
    assert hop["gateway"] == pytest.approx([1.0])  # the client's send -> accepted stamped
    assert hop["auth"] == pytest.approx([1.0]) and hop["tokenize"] == pytest.approx([1.0])
    assert hop["detokenize"] == pytest.approx([1.0])  # tokens stamped -> text stamped
    assert hop["ledger"] == pytest.approx([8.5])  # completed stamped -> billed stamped


def test_a_level_compares_every_stage_hop_with_the_bare_relay():
    from tools.bench.pipeline import level_result
    from tools.bench.pipeline_report import level_markdown, markdown

    pipe = analyse({"r": synthetic()})
    pipe["wall_s"], pipe["tokens"] = 0.152, 1
    alone = {"ttft_ms": [90.0], "e2e_ms": [140.0], "tokens": 1, "wall_s": 0.14, "token_ids": [[7]]}
    bare = {"messages": 200, "p50_ms": 0.6, "p95_ms": 0.9}
    res = level_result(alone, pipe, bare, 8)
    added = res["added_over_bare"]
    assert added["auth"]["added_p50_ms"] == pytest.approx(0.4)
    assert added["ledger"]["added_p50_ms"] == pytest.approx(7.9)
    assert res["targets"]["added_per_hop"] == {
        "gateway": True, "auth": True, "context": True, "tokenize": True,
        "detokenize": True, "ledger": False,
    }  # fmt: skip
    assert res["targets"]["text_trip"] is True  # 1.2 ms at 8 in flight
    assert res["same_token_ids"] is True
    table = markdown(
        {"requests": 1, "max_tokens": 1, "model": "m", "layout": "l", "machine": "x",
         "runs": {"8": res}}
    )  # fmt: skip
    assert "### 8 in flight" in table and "| ledger |" in table and "7.900 ✗" in table
    assert "Bare relay on the same server" in table and "P50 0.600 ms" in table
    # the relay's P95 is the text trip's floor: here 0.9 ms leaves room for the 2 ms target
    assert res["targets"]["text_trip_floor_p95_ms"] == 0.9
    assert (
        "the text trip's floor at this burst size: 0.90 ms, against the text trip's 1.20" in table
    )
    assert "the 2 ms target is above it" in table
    slow = level_result(alone, pipe, {"messages": 200, "p50_ms": 1.8, "p95_ms": 2.9}, 8)
    assert "the 2 ms target is below the floor" in "\n".join(level_markdown(slow))
