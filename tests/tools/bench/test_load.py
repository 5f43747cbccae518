"""`brigade bench load`: a seeded workload, and on the real pipeline (every stage, the real
model, a real nats-server) client-side figures that agree with the event log's within a few ms."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools.bench.workload import Workload, parse_lengths, poisson_arrivals
from tools.cli import main

# Client vs log, per request (median): "within a few milliseconds". The difference is the way
# in (send -> the gateway's receipt) plus one hop out, i.e. two process wake-ups. Measured on the
# shared 2-core machine: ~2.5 ms at a load average of 6, 8-13 ms at 10-14 (every wake-up then
# waits for a time slice), and once 17.1 ms in a full suite run; the bound leaves room for that,
# and stays far below the figures compared (TTFT and end-to-end: hundreds of ms).
AGREE_MS = 25.0


def test_workload_is_seeded_and_mixed():
    a = Workload(seed=3, prompt_words=(4, 32), output_tokens=(2, 8)).items(40)
    b = Workload(seed=3, prompt_words=(4, 32), output_tokens=(2, 8)).items(40)
    c = Workload(seed=4, prompt_words=(4, 32), output_tokens=(2, 8)).items(40)
    assert a == b and a != c
    assert {i.num_prompt_words for i in a} == {4, 32} and {i.max_tokens for i in a} == {2, 8}
    assert all(len(i.prompt.split()) == i.num_prompt_words + 3 for i in a)  # "Continue this text:"
    with pytest.raises(ValueError, match="1..8192"):
        Workload(output_tokens=(0,))
    with pytest.raises(ValueError, match="comma-separated"):
        parse_lengths("16,x", "--prompt-words")


def test_poisson_arrivals_have_the_asked_rate():
    offsets = poisson_arrivals(4.0, 4001, seed=1)
    assert offsets[0] == 0.0 and offsets == sorted(offsets)
    assert offsets == poisson_arrivals(4.0, 4001, seed=1)
    assert 4000 / offsets[-1] == pytest.approx(4.0, rel=0.05)
    with pytest.raises(ValueError, match="> 0"):
        poisson_arrivals(0.0, 3, seed=1)


def run_bench(out: Path, *extra: str) -> dict:
    argv = ["bench", "load", "--requests", "4", "--concurrency", "2", "--prompt-words", "8,24",
            "--output-tokens", "4,8", "--quiet", "--out", str(out), *extra]  # fmt: skip
    assert main(argv) == 0
    [doc] = [json.loads(p.read_text()) for p in out.glob("load-*.json")]
    return doc


def assert_agree(doc: dict, *, through_edge: bool = False) -> None:
    """The client's figures agree with the log's. Through the edge, the edge's own handling of
    the request comes before the log's first event, so only what follows it is compared: the
    first token -> end span and the inter-token gaps (the way in is reported, not bounded)."""
    client, check = doc["client"], doc["cross_check"]
    assert (client["completed"], client["failed"], check["missing_in_log"]) == (4, 0, 0)
    assert client["errors"] == []
    log, diff = check["log"], check["diff_ms"]
    assert (log["completed"], log["tokens_out"]) == (4, client["tokens_out"])
    figures = ("first_to_end_ms",) if through_edge else ("ttft_ms", "e2e_ms", "first_to_end_ms")
    for figure in figures:
        # the client's receipts trail the log's publish stamps by a bus hop each: a few ms,
        # more only when the shared CPU stalls a process (hence the loose bound on the worst)
        assert diff[figure]["n"] == 4 and abs(diff[figure]["median"]) < AGREE_MS, (figure, diff)
        assert diff[figure]["max_abs"] < 10 * AGREE_MS, (figure, diff)
    assert diff["ttft_ms"]["median"] > -1.0  # the client never sees a token before it is sent
    assert abs(client["itl_ms"]["p50"] - log["itl_ms"]["p50"]) < AGREE_MS
    if not through_edge:
        for figure in ("ttft_ms", "e2e_ms"):
            assert abs(client[figure]["p50"] - log[figure]["p50"]) < AGREE_MS, figure


def test_bus_client_figures_agree_with_the_log(brigade_up, tmp_path: Path, monkeypatch):
    brigade_up.env(monkeypatch)
    assert_agree(run_bench(tmp_path / "bus"))


def test_sse_client_figures_agree_with_the_log(brigade_up, tmp_path: Path, monkeypatch):
    brigade_up.env(monkeypatch)
    doc = run_bench(tmp_path / "sse", "--target", "sse", "--edge-url", brigade_up.edge_url)
    assert_agree(doc, through_edge=True)


def test_websocket_client_figures_agree_with_the_log(brigade_up, tmp_path: Path, monkeypatch):
    brigade_up.env(monkeypatch)
    doc = run_bench(tmp_path / "ws", "--target", "ws", "--edge-url", brigade_up.edge_url)
    assert_agree(doc, through_edge=True)
