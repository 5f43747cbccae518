"""The local three-node cluster: routed nodes on distinct loopback ports, one meta leader, R3
streams whose leader /jsz reports as JetStream's own stream info does, and a node killed and
started again on its ports and store, with the stream's messages still there; each consumer's
own leader too."""

from __future__ import annotations

import os
import signal

import anyio
import nats
import nats.js.errors
import pytest
from nats.js import api

from stages.runtime.natscluster import NatsCluster

pytestmark = [pytest.mark.anyio, pytest.mark.nats]


def test_a_cluster_needs_an_odd_size_of_three_or_more(tmp_path) -> None:
    for size in (1, 2, 4):
        with pytest.raises(ValueError, match="odd size"):
            NatsCluster(tmp_path, size=size)
    with pytest.raises(ValueError, match="3 per node"):
        NatsCluster(tmp_path, ports=[4222, 4223])


async def test_leaders_are_found_and_a_node_comes_back_on_its_ports_and_store(tmp_path) -> None:
    cluster = NatsCluster(tmp_path).start()
    try:
        ports = [p for n in cluster.nodes for p in (n.client_port, n.route_port, n.monitor_port)]
        assert len(set(ports)) == 9
        assert cluster.meta_leader() in {"n1", "n2", "n3"}
        nc = await nats.connect(servers=list(cluster.urls))
        js = nc.jetstream()
        await js.add_stream(api.StreamConfig(name="T", subjects=["t.>"], num_replicas=3))
        # a new R3 stream answers once its leader is elected and its interest has reached the
        # client's node: until then a publish has no responder (and nothing is stored)
        with anyio.fail_after(15):
            while True:
                try:
                    await js.publish("t.0", b"x")
                    break
                except nats.js.errors.NoStreamResponseError:
                    await anyio.sleep(0.1)
        for i in range(1, 5):
            await js.publish(f"t.{i}", b"x")
        info = await js.stream_info("T")
        assert cluster.stream_leader("T") == info.cluster.leader
        for name in ("d1", "d2"):
            config = api.ConsumerConfig(durable_name=name, ack_policy=api.AckPolicy.EXPLICIT)
            await js.add_consumer("T", config)
        ephemeral = await js.pull_subscribe("t.>", stream="T")  # a replay's: not counted
        consumers = cluster.consumer_leaders()
        assert set(consumers) == {"T/d1", "T/d2"}
        await ephemeral.unsubscribe()
        assert consumers["T/d1"] == (await js.consumer_info("T", "d1")).cluster.leader
        follower = cluster.follower("T")
        assert follower not in (info.cluster.leader, cluster.meta_leader())
        old_pid = cluster.node(follower).pid

        cluster.kill(follower)
        assert cluster.node(follower).pid is None and not cluster._running(follower)
        # two of three still make a quorum. The client may have been on the killed node: a
        # publish written to its dead socket is lost, so it goes again (its msg id stores it once)
        for attempt in range(10):
            try:
                await js.publish("t.5", b"x", headers={"Nats-Msg-Id": "t.5"})
                break
            except nats.errors.TimeoutError:
                assert attempt < 9, "no quorum of two answered"
        cluster.restart(follower)
        assert cluster.node(follower).pid not in (None, old_pid) and cluster.healthy()
        assert (await js.stream_info("T")).state.messages == 6
        await nc.close()
    finally:
        cluster.stop()
    assert all(n.pid is None for n in cluster.nodes)


def test_a_node_stopped_by_sigterm_is_gone_and_reaped(tmp_path) -> None:
    cluster = NatsCluster(tmp_path).start()
    try:
        pid = cluster.node("n2").pid
        cluster.kill("n2", signal.SIGTERM)
        assert cluster.node("n2").pid is None
        with pytest.raises(ProcessLookupError):  # exited and reaped: no zombie keeps its pid
            os.kill(pid, 0)
    finally:
        cluster.stop()
