"""`brigade bench hops` on a real nats-server: relay processes, both transports, the report."""

import json
from pathlib import Path

import pytest

from tools.bench import hops as bench_hops
from tools.cli import main


def test_pct_picks_the_rank():
    values = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert bench_hops.pct(values, 0.5) == 3.0
    assert bench_hops.pct(values, 0.95) == 5.0


def test_a_two_relay_chain_reports_every_transport_and_burst(tmp_path: Path):
    out = tmp_path / "bench"
    rc = main(
        [
            "bench",
            "hops",
            "--relays",
            "2",
            "--inflight",
            "1",
            "4",
            "--messages",
            "8",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    res = json.loads((out / "hops.json").read_text())
    assert res["hops"] == 3 and res["relays"] == 2
    for mode in ("jetstream", "core"):
        assert set(res["modes"][mode]) == {"1", "4"}
        one, four = res["modes"][mode]["1"], res["modes"][mode]["4"]
        assert one["messages"] == 8 and four["messages"] == 8  # every message came through
        assert 0 < one["p50_ms"] <= one["p95_ms"] < 1000
    md = (out / "hops.md").read_text()
    assert "| JetStream (stored, acked) | 4 | 8 |" in md
    assert "| core NATS (not stored) | 1 | 8 |" in md


def test_bad_arguments_are_refused(tmp_path: Path, capsys):
    assert main(["bench", "hops", "--relays", "-1", "--out", str(tmp_path)]) == 2
    assert "--relays must be >= 0, --inflight and --messages >= 1" in capsys.readouterr().err


def test_one_hop_with_pipelined_bursts(tmp_path: Path):
    out = tmp_path / "bench"
    argv = ["bench", "hops", "--relays", "0", "--inflight", "5", "--messages", "10"]
    assert main([*argv, "--pipelined", "--out", str(out)]) == 0
    res = json.loads((out / "hops.json").read_text())
    assert res["hops"] == 1 and res["pipelined"] is True
    assert res["modes"]["jetstream"]["5"]["messages"] == 10
    assert "JetStream bursts published pipelined" in (out / "hops.md").read_text()


def test_the_relay_cost_is_paced_and_counts_each_process_cpu_per_message():
    cost = bench_hops.relay_cost({4: 400.0, 1: 200.0}, seconds=1.0)
    assert set(cost) == {4, 1}
    four, one = cost[4], cost[1]
    assert four["messages"] == 400 and one["messages"] == 200  # a second of each pace
    # paced: bursts of 4 every 10 ms and single messages every 5 ms, not as fast as it goes
    assert 200 <= four["per_second"] <= 440 and 100 <= one["per_second"] <= 220
    for c in (four, one):
        per = c["cpu_ms_per_message"]
        assert set(per) == {"relay", "nats-server", "client"}
        assert per["relay"] > 0 and per["client"] > 0  # each message moved through both
        assert c["cpu_ms_per_message_total"] == pytest.approx(sum(per.values()))
        assert 0 < c["p50_ms"] <= c["p95_ms"] < 1000
