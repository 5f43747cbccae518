"""The serve benchmark's parts: CPU accounting from /proc, the engine-alone closed loop (on a tiny
real engine), the targets' arithmetic and the table."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine import Engine, EngineConfig
from tests.engine.tiny_llama import write_tiny_llama
from tools.bench import serve
from tools.bench.loadgen import Sample


def busy(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_cpu_seconds_counts_this_process_work():
    before = serve.cpu_seconds(os.getpid())
    busy(0.2)
    after = serve.cpu_seconds(os.getpid())
    assert before is not None and after is not None
    assert 0.15 <= after - before <= 1.0
    assert serve.cpu_seconds(2**22 + 12345) is None  # no such pid


def test_descendants_and_names_find_a_stage_child():
    code = "import time; time.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", code, "stage", "detokenize"])
    try:
        deadline = time.monotonic() + 5
        while child.pid not in serve.descendants(os.getpid()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert child.pid in serve.descendants(os.getpid())
        assert serve.process_name(child.pid) == "detokenize"
        meter = serve.CpuMeter([os.getpid()], os.getpid())
        meter.start()
        busy(0.1)
        used = meter.stop()
        assert used["client (this process)"] >= 0.05
        assert used["detokenize"] < 0.05  # the sleeping child used next to nothing
    finally:
        child.kill()
        child.wait()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Engine:
    model = write_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama")
    return Engine(EngineConfig(model=str(model), dtype="float32", block_size=4, num_kv_blocks=256))


def test_engine_alone_keeps_the_closed_loop_and_times_every_token(tiny):
    items = serve.work_items(6, 5)
    samples, wall = serve.engine_alone(tiny, items, 2)
    assert [s.index for s in samples] == list(range(6))
    assert all(s.ok and s.num_tokens == 5 and len(s.gaps_ms) == 4 for s in samples)
    assert all(s.ttft_ms is not None and 0 < s.ttft_ms < 1e3 * wall for s in samples)
    assert not tiny.has_unfinished_requests()
    res = serve.summary(samples, wall, {"client (this process)": 0.3})
    assert res["tokens"] == 30 and res["completed"] == 6
    assert res["aggregate_tps"] == pytest.approx(30 / wall)
    assert res["cpu_ms_per_token"]["client (this process)"] == pytest.approx(10.0)


def test_work_items_are_distinct_prompts():
    items = serve.work_items(16, 7)
    assert len({i.prompt for i in items}) == 16 and {i.max_tokens for i in items} == {7}


def side(tps: float, ttft_p95: float, itl_p50: float, itl_p95: float) -> dict:
    s = Sample(index=0, ok=True, num_tokens=100, ttft_ms=ttft_p95, tps=50.0)
    s.gaps_ms = [itl_p50] * 19 + [itl_p95]
    res = serve.summary([s], 100 / tps, None)
    res["ttft_ms"]["p95"] = ttft_p95
    res["itl_ms"]["p50"], res["itl_ms"]["p95"] = itl_p50, itl_p95
    return res


def test_targets_compare_sides_at_each_level():
    results = {
        "engine": {8: side(400, 100, 10, 12)},
        "pipeline": {8: side(380, 150, 11, 14), 32: side(500, 200, 30, 40)},
        "llama-server": {8: side(180, 400, 20, 30)},
    }
    t = serve.targets(results, [8, 32])
    assert t["8"]["of_engine"] == pytest.approx(0.95) and t["8"]["of_engine_ok"]
    assert t["8"]["of_llama_server"] == pytest.approx(380 / 180) and t["8"]["of_llama_server_ok"]
    assert t["8"]["ttft_p95_below_llama_server"] is True
    assert t["8"]["itl_p95_of_step"] == pytest.approx(1.4) and t["8"]["itl_ok"]
    assert t["32"] == {}  # nothing measured to compare with at 32
    table = serve.markdown(
        {
            "model": "m",
            "max_tokens": 100,
            "requests_per_client": 1,
            "machine": "x",
            "sides": results,
            "targets": t,
            "notes": ["llama-server not measured: none"],
        }
    )
    assert (
        "| pipeline | 8 | 380.0 |" in table
        and "| 1/1 | 0 |" in table
        and "| 8 | 0.95 | 2.11 | yes | 1.40 |" in table
    )
    assert table.endswith("llama-server not measured: none")


def test_the_cpu_ceiling_is_the_engines_cpu_per_token_over_the_pipelines():
    engine, pipeline = side(600, 100, 10, 12), side(330, 150, 20, 30)
    engine["cpu_ms_per_token_total"], pipeline["cpu_ms_per_token_total"] = 3.2, 5.76
    t = serve.targets({"engine": {8: engine}, "pipeline": {8: pipeline}}, [8])["8"]
    assert t["cpu_ceiling_of_engine"] == pytest.approx(3.2 / 5.76)  # 0.556
    assert t["of_engine"] == pytest.approx(0.55)
    assert t["cpu_ms_per_token_allowed_beyond_engine"] == pytest.approx(3.2 / 0.9 - 3.2)
    table = serve.markdown(
        {"model": "m", "max_tokens": 100, "requests_per_client": 1, "machine": "x",
         "sides": {"engine": {8: engine}, "pipeline": {8: pipeline}}, "targets": {"8": t},
         "notes": []}
    )  # fmt: skip
    assert "| 8 | 3.20 | 5.76 | 0.56 | 0.55 | 0.36 |" in table
    engine["cpu_ms_per_token_total"] = None  # no CPU accounting: no ceiling
    assert (
        "cpu_ceiling_of_engine"
        not in serve.targets({"engine": {8: engine}, "pipeline": {8: pipeline}}, [8])["8"]
    )


def test_the_floor_ceiling_adds_one_relay_hop_to_the_engines_cpu_per_token():
    engine, pipeline = side(600, 100, 10, 12), side(330, 150, 20, 30)
    engine["cpu_ms_per_token_total"], pipeline["cpu_ms_per_token_total"] = 3.6, 4.8
    hop = {"messages": 2400, "per_second": 400.0, "cpu_ms_per_message_total": 0.4,
           "cpu_ms_per_message": {"relay": 0.15, "nats-server": 0.1, "client": 0.15},
           "p50_ms": 1.75, "p95_ms": 2.97}  # fmt: skip
    sides = {"engine": {8: engine}, "pipeline": {8: pipeline}}
    t = serve.targets(sides, [8], floor={8: hop})["8"]
    assert t["floor_cpu_ms_per_token"] == 0.4
    assert t["floor_ceiling_of_engine"] == pytest.approx(3.6 / 4.0)  # 0.90: no room for stages
    assert t["cpu_ms_per_token_allowed_beyond_engine"] == pytest.approx(0.4)
    table = serve.markdown(
        {"model": "m", "max_tokens": 100, "requests_per_client": 1, "machine": "x",
         "sides": sides, "targets": {"8": t}, "relay_floor": {"8": hop}, "notes": []}
    )  # fmt: skip
    assert "| 8 | 3.60 | 4.80 | 0.75 | 0.55 | 0.40 | 0.40 | 0.90 |" in table
    assert "| 8 | 400.0 | 0.150 | 0.100 | 0.150 | 0.400 | 1.75 | 2.97 |" in table
    assert "floor_ceiling_of_engine" not in serve.targets(sides, [8])["8"]  # --no-floor


def test_alternated_rounds_report_the_median_rounds_sides_and_every_ratio():
    """--rounds: the engine alone and the pipeline alternate; the report takes both sides from
    the round whose ratio is the median (never one side's best against the other's worst) and
    lists every round's ratio in the order they ran."""
    rounds = [
        (side(400, 100, 10, 12), side(360, 150, 11, 14)),  # 0.90
        (side(300, 100, 10, 12), side(210, 150, 11, 14)),  # 0.70
        (side(500, 100, 10, 12), side(400, 150, 11, 14)),  # 0.80
    ]
    engine, pipeline = serve.median_round(rounds)
    assert (engine["aggregate_tps"], pipeline["aggregate_tps"]) == (500, 400)
    assert pipeline["rounds_of_engine"] == pytest.approx([0.9, 0.7, 0.8])
    assert serve.median_round(rounds[:2])[1]["aggregate_tps"] == 210  # even: the lower middle
    t = serve.targets({"engine": {8: engine}, "pipeline": {8: pipeline}}, [8])
    assert t["8"]["of_engine"] == pytest.approx(0.8)
    table = serve.markdown(
        {"model": "m", "max_tokens": 100, "requests_per_client": 1, "machine": "x",
         "sides": {"engine": {8: engine}, "pipeline": {8: pipeline}}, "targets": t, "notes": []}
    )  # fmt: skip
    assert "Every round's pipeline / engine: 8 streams 0.90, 0.70, 0.80." in table


def test_no_llama_server_says_why(tmp_path: Path):
    assert "no llama.cpp build under" in serve.llama_server_binary(tmp_path)


def test_a_lever_names_declared_settings_and_values_they_take():
    assert serve.parse_lever("flush-step:BRIGADE_STREAM_FLUSH=step") == (
        "flush-step",
        {"BRIGADE_STREAM_FLUSH": "step"},
    )
    assert serve.parse_lever("both:BRIGADE_EDGE_BATCH_SSE=1, BRIGADE_EDGE_HTTP=httptools")[1] == {
        "BRIGADE_EDGE_BATCH_SSE": "1",
        "BRIGADE_EDGE_HTTP": "httptools",
    }
    for bad, says in (
        ("nosettings", "NAME:VAR=VALUE"),
        ("pipeline:BRIGADE_STREAM_FLUSH=step", "not among"),
        ("x:BRIGADE_NO_SUCH=1", "not a Brigade setting"),
        ("x:BRIGADE_STREAM_FLUSH=sometimes", "allowed: step or event"),
        ("x:BRIGADE_STREAM_FLUSH", "not VAR=VALUE"),
    ):
        with pytest.raises(argparse.ArgumentTypeError, match=says):
            serve.parse_lever(bad)


def test_each_lever_is_reported_against_the_default_pipeline_of_the_run():
    default, lever = side(300, 100, 20, 30), side(330, 90, 18, 24)
    default["cpu_ms_per_token_total"], lever["cpu_ms_per_token_total"] = 6.0, 5.5
    table = serve.markdown(
        {"model": "m", "max_tokens": 100, "requests_per_client": 1, "machine": "x",
         "sides": {"pipeline": {8: default}, "flush-step": {8: lever}},
         "levers": {"flush-step": {"BRIGADE_STREAM_FLUSH": "step"}}, "targets": {},
         "notes": []}
    )  # fmt: skip
    assert (
        "| flush-step | `BRIGADE_STREAM_FLUSH=step` | 8 | 1.10 | 24.00 / 30.00 | 5.50 / 6.00 |"
        in table
    )


def test_a_deployment_is_its_brigade_stages_and_nats_servers_on_this_host():
    """--url's CPU owners: every `... stage NAME` process (compose runs each container so) and
    nats-server, found by their command lines; the client itself and other processes are not."""
    stage = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(30)", "stage", "detokenize"]
    )
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "stage"])
    try:
        time.sleep(0.2)
        found = serve.deployment_pids(os.getpid())
        assert stage.pid in found and other.pid not in found and os.getpid() not in found
        assert serve.process_name(stage.pid) == "detokenize"
    finally:
        for p in (stage, other):
            p.kill()
            p.wait()


def test_the_targets_read_a_deployment_where_no_pipeline_side_ran():
    results = {"engine": {8: side(400, 100, 10, 12)}, "deployment": {8: side(360, 150, 11, 14)}}
    t = serve.targets(results, [8], "deployment")["8"]
    assert t["of_engine"] == pytest.approx(0.9) and t["itl_p95_of_step"] == pytest.approx(1.4)
    assert serve.targets(results, [8]) == {}  # no pipeline side: nothing to compare


@pytest.mark.anyio
async def test_the_nats_meter_counts_each_connections_messages_by_name(nats_server):
    """30 messages published by one named connection, each delivered to two subscribers of
    another: 30 published, 60 delivered, and per token in the summary (10 tokens)."""
    import nats

    meter = serve.NatsMeter(nats_server.monitor_url)
    pub = await nats.connect(nats_server.url, name="brigade-engine")
    sub = await nats.connect(nats_server.url, name="brigade-edge")
    try:
        subs = [await sub.subscribe("bench.x") for _ in range(2)]
        await sub.flush()
        meter.start()
        for i in range(30):
            await pub.publish("bench.x", b"%d" % i)
        await pub.flush()
        for s in subs:
            for _ in range(30):
                await s.next_msg(timeout=5)
        counted = meter.stop()
    finally:
        await pub.close()
        await sub.close()
    # the flush's PING is no message; the subscriptions were made before the start
    assert counted["brigade-engine"] == {"published": 30, "delivered": 0}
    assert counted["brigade-edge"] == {"published": 0, "delivered": 60}
    sample = Sample(0, ok=True, num_tokens=10, ttft_ms=1.0, gaps_ms=[1.0] * 9, tps=10.0)
    res = serve.summary([sample], 1.0, {"nats-server": 0.009}, counted)
    assert res["nats_msgs_per_token"]["brigade-edge"] == {"published": 0.0, "delivered": 6.0}
    assert res["nats_msgs_per_token_total"] == 9.0
    assert res["nats_server_us_per_msg"] == pytest.approx(100.0)  # 9 ms over 90 messages
