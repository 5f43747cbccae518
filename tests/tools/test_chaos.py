"""`brigade chaos` at a small scale: its own deployment (a nats-server and `brigade up --procs`),
two streams per fault while detokenize is killed, the engine is killed mid-decode and poison
lands on every subject; nothing is lost, billed twice or billed after its client was told it
failed. Plus the table and the stall arithmetic."""

from __future__ import annotations

import argparse
import json

import anyio
import pytest

from schemas import models, subjects
from stages.runtime.bus import Bus
from stages.runtime.natscluster import NatsCluster
from tools import chaos


def test_the_longest_stall_is_the_widest_gap_between_pieces() -> None:
    o = chaos.Outcome(prompt=0, arrivals=[10.0, 10.5, 13.0, 13.1])
    assert o.longest_stall_s == pytest.approx(2.5)
    assert chaos.Outcome(prompt=0).longest_stall_s == 0.0


def test_the_table_has_a_row_per_fault_and_every_column() -> None:
    rows = [chaos.Row(fault="none (baseline)", sent=2, completed=2, longest_stall_s=0.25),
            chaos.Row(fault="kill:engine", sent=2, completed=1, failed_clear=1)]  # fmt: skip
    lines = chaos.table(rows).splitlines()
    assert lines[0] == "| " + " | ".join(chaos.COLUMNS) + " |"
    assert lines[2] == "| none (baseline) | 2 | 2 | 0 | 0 | 0 | 0 | 0 | 0 | 0.2 |"
    assert lines[3].startswith("| kill:engine | 2 | 1 | 1 |")


def test_poison_reaches_llm_in_and_every_event_subject() -> None:
    found = {subject for subject, _ in chaos.poisons()}
    assert subjects.SUBMIT in found
    for tag in chaos.EVENT_SUBJECT_TAGS:  # a routed one on the default model's subject
        route = models.default().token if tag in subjects.ROUTED_EVENTS else None
        assert subjects.event_subject("chaos-x", tag, route) in found


@pytest.mark.nats
def test_a_small_chaos_run_loses_nothing_and_bills_nothing_wrongly(tmp_path) -> None:
    deploy = chaos.Deployment(tmp_path, ack_wait_s=3.0)
    try:
        deploy.start()
        rows = anyio.run(
            lambda: chaos.run_faults(deploy, ("kill:detokenize", "kill:engine", "poison"), 2, 6),
            backend="asyncio", backend_options={"use_uvloop": True},
        )  # fmt: skip
    finally:
        deploy.stop()
    assert [r.fault for r in rows] == ["none (baseline)", "kill:detokenize", "kill:engine",
                                       "poison"]  # fmt: skip
    for row in rows:
        assert row.sent == 2 and row.completed == 2, row  # a killed stage comes back: resumed
        assert (row.lost, row.billed_twice, row.told_failed_but_billed) == (0, 0, 0), row
        assert row.duplicated_text == 0, row


def test_node_faults_need_the_cluster(capsys) -> None:
    args = argparse.Namespace(faults="nats-node:meta-leader", cluster=False, requests=2,
                              max_tokens=4, node_down=1.0, ack_wait=5.0, data_dir=None,
                              json=None)  # fmt: skip
    assert chaos.run(args) == 2
    assert "need --cluster" in capsys.readouterr().err
    assert set(chaos.NODE_FAULTS) < set(chaos.CLUSTER_FAULTS)


@pytest.mark.nats
def test_each_node_fault_picks_the_node_that_leads_what_it_names(tmp_path) -> None:
    """On a three-node cluster with Brigade's R3 streams: the follower leads no stream and not
    the meta group (made so when three nodes lead the three), the others lead what their name
    says, as JetStream's own stream info reports it."""
    deploy = chaos.Deployment(tmp_path, ack_wait_s=3.0, cluster=True)
    deploy.cluster = NatsCluster(tmp_path / "nats-cluster").start()

    async def check() -> None:
        bus = await Bus.connect(deploy.config())
        try:
            assert bus.config.replicas == 3
            await bus.ensure_streams()
            streams = (subjects.EVENTS_STREAM, subjects.SUBMIT_STREAM)
            # the meta group and both streams led by three nodes: none leads nothing yet
            others = [n.name for n in deploy.cluster.nodes
                      if n.name != deploy.cluster.meta_leader()]  # fmt: skip
            for stream, node in zip(streams, others, strict=True):
                await bus.nc.request(f"$JS.API.STREAM.LEADER.STEPDOWN.{stream}",
                                     json.dumps({"placement": {"preferred": node}}).encode())  # fmt: skip
            with anyio.fail_after(10):
                while len({deploy.cluster.meta_leader(), *map(deploy.cluster.stream_leader,
                                                               streams)} - {None}) < 3:  # fmt: skip
                    await anyio.sleep(0.05)
            node, what = await deploy.node_to_kill("nats-node:follower")
            led = {s: (await bus.js.stream_info(s)).cluster.leader for s in streams}
            meta = deploy.cluster.meta_leader()
            assert what.startswith("no stream; ") and node not in {meta, *led.values()}
            assert (await deploy.node_to_kill("nats-node:meta-leader"))[0] == meta
            node, what = await deploy.node_to_kill("nats-node:events-leader")
            assert node == led[subjects.EVENTS_STREAM] and subjects.EVENTS_STREAM in what
            in_leader = (await deploy.node_to_kill("nats-node:in-leader"))[0]
            assert in_leader == led[subjects.SUBMIT_STREAM]
        finally:
            await bus.close()

    try:
        anyio.run(check)
    finally:
        deploy.stop()


def test_a_strike_that_fails_is_noted_and_the_load_goes_on() -> None:
    failures: list[str] = []

    async def strike() -> None:
        raise RuntimeError("no worker of edge beats on this host")

    anyio.run(chaos._noting(strike, failures))
    assert failures == ["RuntimeError: no worker of edge beats on this host"]
