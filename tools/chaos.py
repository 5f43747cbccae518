"""`brigade chaos`: streamed load through the edge while faults strike in turn, one row per fault.

It starts its own deployment (a nats-server on a fixed loopback port with a persistent store,
or with `--cluster` a local three-node JetStream cluster with R3 streams, and `brigade up
--procs` on it), streams an uninterrupted baseline, then for each fault streams the same prompts
and strikes once the first tokens flow (the stages ahead of the engine and the submit queue's
leader: just before the load): SIGKILL of a stage's process (found by its heartbeat;
`kill:engine` is the engine mid-decode), a whole NATS restart on its port and store, a poison
on llm.in and on every event subject, or (on the cluster) SIGKILL of one node of three, chosen
by what it leads when the fault strikes, started again on its ports and store `--node-down`
seconds later while the load goes on. Each row counts, from what the client saw and what the
log holds: requests sent, completed, failed with a clear error (an OpenAI
error with a code), lost (accepted, never terminal), duplicated text (the client got more than
the log's text), text differing from the baseline, billed twice, told failed but billed, and
the longest stall between two pieces of one stream.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

STAGE_FAULTS = ("gateway", "auth", "context", "tokenize", "engine", "detokenize", "ledger",
                "archiver", "sweeper", "edge")  # fmt: skip
FAULTS = (*(f"kill:{s}" for s in STAGE_FAULTS), "nats-restart", "poison")
# One node of the three-node cluster: one that leads neither the meta group nor Brigade's
# streams, the meta leader, and the leaders of the event log and of the submit queue (chosen at
# the strike).
NODE_FAULTS = ("nats-node:follower", "nats-node:meta-leader", "nats-node:events-leader",
               "nats-node:in-leader")  # fmt: skip
CLUSTER_FAULTS = (*NODE_FAULTS, *FAULTS)
# Struck just before the load: the stages ahead of the engine pass a request in milliseconds,
# so their requests wait in the durable for the restarted worker. The rest strike mid-decode.
# The submit queue's leader matters when a request is submitted: its node dies just before the
# load, so the submits meet the election.
EARLY_FAULTS = ("kill:gateway", "kill:auth", "kill:context", "kill:tokenize",
                "nats-node:in-leader")  # fmt: skip
PROMPTS = ("Count to ten.", "Name three colors.", "What is the capital of France?",
           "Write a haiku about the sea.", "List four fruits.", "Say hello in Spanish.")  # fmt: skip
EVENT_SUBJECT_TAGS = ("accepted", "authorized", "assembled", "tokenized", "started", "tokens",
                      "finished", "text", "cancel", "completed", "cancelled", "failed",
                      "billed")  # fmt: skip
API_KEY = "brg-chaos-dev-key-0000000000000000000"
END_TIMEOUT_S = 240.0
# The edge's admission may wait this long for a first token: the load measures faults, so the
# edge must not refuse it as overload (BRIGADE_EDGE_MAX_WAIT_S, 0.5 s by default).
ADMISSION_WAIT_S = 120.0


def register(subparsers) -> None:
    p = subparsers.add_parser("chaos", help="streamed load while each fault strikes; a table")
    p.add_argument("--faults",
                   help=f"comma-separated, in order (default: all of {', '.join(FAULTS)}; with "
                   f"--cluster also {', '.join(NODE_FAULTS)}, first)")  # fmt: skip
    p.add_argument("--cluster", action="store_true",
                   help="run on a local three-node JetStream cluster (R3 streams) from the "
                   "nats-server wheel instead of one server")  # fmt: skip
    p.add_argument("--node-down", type=float, default=5.0,
                   help="seconds a killed cluster node stays down before it starts again")  # fmt: skip
    p.add_argument("--requests", type=int, default=6, help="concurrent streams per fault")
    p.add_argument("--max-tokens", type=int, default=32, help="max_tokens of each request")
    p.add_argument("--ack-wait", type=float, default=5.0,
                   help="the deployment's BRIGADE_ACK_WAIT_S: how soon a dead worker's input "
                   "comes back (default 5)")  # fmt: skip
    p.add_argument("--data-dir", type=Path, help="where the deployment lives (default: a temp dir)")
    p.add_argument("--json", type=Path, help="also write the rows as JSON here")
    p.set_defaults(func=run)


@dataclass
class Outcome:
    """What one client saw of one streamed request."""

    prompt: int
    rid: str | None = None
    status: int | None = None
    text: str = ""
    error: dict | None = None  # the OpenAI error, as an HTTP body or an SSE error event
    done: bool = False  # [DONE] arrived
    arrivals: list[float] = field(default_factory=list)  # monotonic times: start, each piece

    @property
    def completed(self) -> bool:
        return self.status == 200 and self.done and self.error is None

    @property
    def longest_stall_s(self) -> float:
        gaps = [b - a for a, b in zip(self.arrivals, self.arrivals[1:], strict=False)]
        return max(gaps, default=0.0)


@dataclass
class Row:
    fault: str
    sent: int = 0
    completed: int = 0
    failed_clear: int = 0
    lost: int = 0
    duplicated_text: int = 0
    differing_text: int = 0
    billed_twice: int = 0
    told_failed_but_billed: int = 0
    longest_stall_s: float = 0.0
    errors: dict[str, int] = field(default_factory=dict)  # what the failed ones were told


class Deployment:
    """A nats-server on a fixed port and persistent store (or, `cluster`, three nodes with R3
    streams, each on fixed ports and its own store), and `brigade up --procs` on it."""

    def __init__(self, data_dir: Path, ack_wait_s: float, *, cluster: bool = False,
                 node_down_s: float = 5.0) -> None:  # fmt: skip
        self.data_dir = data_dir
        self.ack_wait_s = ack_wait_s
        self.server = None
        self.cluster = None
        self.clustered = cluster
        self.node_down_s = node_down_s
        self.proc: subprocess.Popen | None = None
        self.edge_port = _free_port()
        # Servers are started again from one thread that lives as long as the deployment: each
        # server dies with the thread that started it (natsd.die_with_parent), and a pool's
        # idle threads exit.
        self._nats_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="chaos-nats")

    async def off_loop(self, fn: Callable[[], None]) -> None:
        """Run a blocking server start or stop on the deployment's own thread."""
        import asyncio

        await asyncio.get_running_loop().run_in_executor(self._nats_thread, fn)

    @property
    def nats_url(self) -> str:
        return self.cluster.url if self.cluster is not None else self.server.url

    @property
    def edge_url(self) -> str:
        return f"http://127.0.0.1:{self.edge_port}"

    def start(self, timeout_s: float = 600.0) -> None:
        from stages.runtime import natsd
        from stages.runtime.natscluster import NatsCluster

        if self.clustered:
            self.cluster = NatsCluster(self.data_dir / "nats-cluster").start()
        else:
            self.server = natsd.start(self.data_dir / "nats")
        env = {k: v for k, v in os.environ.items() if k not in ("NATS_URL", "BRIGADE_ARCHIVE_DIR")}
        env.update(BRIGADE_DATA_DIR=str(self.data_dir), BRIGADE_EDGE_PORT=str(self.edge_port),
                   BRIGADE_API_KEY=API_KEY, BRIGADE_ACK_WAIT_S=str(self.ack_wait_s),
                   BRIGADE_EDGE_MAX_WAIT_S=str(ADMISSION_WAIT_S),
                   BRIGADE_STREAM_REPLICAS="3" if self.clustered else "1")  # fmt: skip
        log_path = self.data_dir / "up.log"
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tools.cli", "up", "--procs", "--nats-url", self.nats_url],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while b"Brigade is up" not in log_path.read_bytes():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"brigade up did not come up; see {log_path}")
            time.sleep(0.2)

    def config(self):
        from stages.runtime.bus import BusConfig

        if self.cluster is not None:
            return BusConfig(servers=self.cluster.urls, replicas=3)
        return BusConfig(servers=(self.server.url,))

    def restart_nats(self, down_s: float = 1.0) -> None:
        """Every server down, then up again on its ports and store (all nodes of a cluster)."""
        from urllib.parse import urlparse

        from stages.runtime import natsd

        if self.cluster is not None:
            self.cluster.stop()
            time.sleep(down_s)
            self.cluster.start()
            return
        port = urlparse(self.server.url).port
        natsd.stop(self.server)
        time.sleep(down_s)
        self.server = natsd.start(self.data_dir / "nats", port=port)

    async def node_to_kill(self, fault: str) -> tuple[str, str]:
        """(node, what it leads) for a `nats-node:*` fault, read from the nodes as it strikes: the
        meta group, Brigade's streams and how many consumers (each consumer has its own leader,
        and a stage's input stalls while its consumer elects one)."""
        import anyio

        from schemas import subjects

        c = self.cluster
        if c is None:
            raise RuntimeError(f"{fault} needs the cluster: run brigade chaos --cluster")
        streams = {"events": subjects.EVENTS_STREAM, "in": subjects.SUBMIT_STREAM}
        which = fault.removeprefix("nats-node:")
        node, led = None, []
        with anyio.move_on_after(30.0):
            while node is None:  # a leader just killed is being replaced: wait for the election
                if which == "follower":
                    node = await self._follower(tuple(streams.values()))
                elif which == "meta-leader":
                    node = c.meta_leader()
                else:
                    node = c.stream_leader(streams[which.removesuffix("-leader")])
                if node is not None:
                    led = [name for name, leader in (("meta", c.meta_leader()),
                           *((s, c.stream_leader(s)) for s in streams.values())) if leader == node]  # fmt: skip
                    if which == "follower" and led:  # a late election moved a leader onto it
                        node = None
                if node is None:
                    await anyio.sleep(0.1)
        if node is None:
            raise RuntimeError(f"{fault}: no running node leads it after 30 s")
        consumers = c.consumer_leaders()
        num_led = sum(leader == node for leader in consumers.values())
        return node, f"{', '.join(led) or 'no stream'}; {num_led} of {len(consumers)} consumers"

    async def _follower(self, streams: tuple[str, ...]) -> str | None:
        """A node leading neither the meta group nor `streams`. When the three are led by three
        nodes, the streams' leadership moves to the meta leader first (a leader stepdown with a
        preferred successor: a transfer of milliseconds, no election timeout)."""
        import anyio

        from stages.runtime.bus import Bus

        c = self.cluster
        assert c is not None, "node faults run on the cluster"
        try:
            return c.follower(*streams)
        except RuntimeError:
            pass
        meta = c.meta_leader()
        if meta is None:
            return None
        bus = await Bus.connect(self.config())
        try:
            for stream in streams:
                if c.stream_leader(stream) not in (meta, None):
                    await bus.nc.request(f"$JS.API.STREAM.LEADER.STEPDOWN.{stream}",
                                         json.dumps({"placement": {"preferred": meta}}).encode(),
                                         timeout=5.0)  # fmt: skip
        finally:
            await bus.close()
        with anyio.move_on_after(5.0):
            while any(c.stream_leader(s) != meta for s in streams):
                await anyio.sleep(0.05)
        try:
            return c.follower(*streams)
        except RuntimeError:
            return None

    async def kill_node(self, node: str) -> Future:
        """SIGKILL one node now; it is started again on its ports and store node_down_s later,
        on the deployment's thread, while the load goes on (the future says when it is back)."""
        cluster = self.cluster
        assert cluster is not None, "node faults run on the cluster"
        await self.off_loop(lambda: cluster.kill(node))

        def restart() -> None:
            time.sleep(self.node_down_s)
            cluster.restart(node)

        return self._nats_thread.submit(restart)

    def stop(self) -> None:
        from stages.runtime import natsd

        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)  # the group it leads: its stages
                self.proc.wait()
        if self.server is not None:
            natsd.stop(self.server)
        if self.cluster is not None:
            self.cluster.stop()
        self._nats_thread.shutdown(wait=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def poisons() -> list[tuple[str, bytes]]:
    """(subject, payload): too deep, truncated, wrong types, not UTF-8, huge, on every subject."""
    from schemas import models, subjects

    deep = b"[" * 1000 + b"]" * 1000
    out = []
    for tag in ("submit", *EVENT_SUBJECT_TAGS):
        # a routed event's poison goes where its consumers read: the default model's subject
        route = models.default().token if tag in subjects.ROUTED_EVENTS else None
        subject = (
            subjects.SUBMIT if tag == "submit" else subjects.event_subject("chaos-x", tag, route)
        )
        t = tag.encode()
        out += [
            (subject, b'{"request_id": "chaos-deep-' + t + b'", "x": ' + deep + b"}"),
            (subject, b'{"type": "' + t + b'", "seq": 1, "token_ids": [1, 2'),
            (
                subject,
                b'{"request_id": "chaos-types-'
                + t
                + b'", "type": "'
                + t
                + b'", "seq": "one", "tenant": 5, "usage": []}',
            ),  # fmt: skip
            (subject, b"\xff\xfe\x00{"),
        ]
    out.append(
        (subjects.event_subject("chaos-x", "tokens"), b'{"pad": "' + b"a" * (2 << 20) + b'"}')
    )
    return out


async def stream_one(http, i: int, max_tokens: int) -> Outcome:
    out = Outcome(prompt=i % len(PROMPTS), arrivals=[time.monotonic()])
    body = {"model": "smollm2-135m", "stream": True, "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": PROMPTS[out.prompt]}]}  # fmt: skip
    headers = {"Authorization": f"Bearer {API_KEY}"}
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
            out.rid, out.status = r.headers.get("x-request-id"), r.status_code
            if r.status_code != 200:
                out.error = _error_of(await r.aread())
                return out
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue  # keep-alive comments are not pieces
                if line == "data: [DONE]":
                    out.arrivals.append(time.monotonic())
                    out.done = True
                    continue
                chunk = json.loads(line.removeprefix("data: "))
                if "error" in chunk:
                    out.arrivals.append(time.monotonic())
                    out.error = chunk["error"]
                    continue
                # Only text or an end is a piece: the role chunk may come early, with the 200
                # the edge answers once a keep-alive is due, and a stall still goes on after it.
                text = "".join(c["delta"].get("content") or "" for c in chunk["choices"])
                if text or any(c.get("finish_reason") for c in chunk["choices"]):
                    out.arrivals.append(time.monotonic())
                out.text += text
    except Exception as err:  # noqa: BLE001 - a cut connection is an outcome, not a crash
        out.error = out.error or {"code": None, "message": f"{type(err).__name__}: {err}"}
    return out


def _error_of(body: bytes) -> dict:
    try:
        return json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        return {"code": None, "message": body[:200].decode(errors="replace")}


async def drive(edge_url: str, config, n: int, max_tokens: int,
                strike: Callable[[], Awaitable[None]] | None,
                early: bool = False) -> list[Outcome]:  # fmt: skip
    """`n` concurrent streams; `strike()` once some run's first tokens are stored, or, `early`,
    just before the streams start (a stage ahead of the engine is passed in milliseconds)."""
    import anyio
    import httpx

    results: list[Outcome] = []

    async def one(i: int) -> None:
        results.append(await stream_one(http, i, max_tokens))

    async with httpx.AsyncClient(base_url=edge_url, timeout=END_TIMEOUT_S) as http:
        if strike is not None and early:
            await strike()
        async with anyio.create_task_group() as tg:
            for i in range(n):
                tg.start_soon(one, i)
            if strike is not None and not early:
                await _first_tokens(config)
                await strike()
    return sorted(results, key=lambda o: o.prompt)


async def _first_tokens(config, timeout_s: float = 60.0) -> None:
    import anyio

    from schemas import subjects
    from stages.runtime.bus import Bus

    bus = await Bus.connect(config)
    try:
        start = (await bus.js.stream_info(subjects.EVENTS_STREAM)).state.last_seq
        with anyio.move_on_after(timeout_s):
            while True:
                info = await bus.js.stream_info(
                    subjects.EVENTS_STREAM, subjects_filter=subjects.all_events("tokens")
                )
                if info.state.last_seq > start and info.state.subjects:
                    return
                await anyio.sleep(0.02)
    finally:
        await bus.close()


async def _accepted_ids(config) -> set[str] | None:
    """The request ids with an `accepted` event in the log now (None: the log cannot say)."""
    from schemas import subjects
    from stages.runtime.bus import Bus

    try:
        bus = await Bus.connect(config)
        try:
            info = await bus.js.stream_info(
                subjects.EVENTS_STREAM, subjects_filter=subjects.all_events("accepted")
            )
        finally:
            await bus.close()
    except Exception:  # noqa: BLE001 - mid-election: this fault's unseen runs are not counted
        return None
    return {subject.split(".")[2] for subject in info.state.subjects or {}}


async def _replayed(bus, rid: str) -> list:
    """The run's events as the log holds them now (asking again while a node is down)."""
    import anyio

    from stages.runtime.failures import bus_unavailable

    with anyio.move_on_after(60.0):
        while True:
            try:
                return await bus.replay(rid)
            except Exception as err:  # noqa: BLE001 - a node still down: its election, ask again
                if not bus_unavailable(err):
                    raise
                await anyio.sleep(0.5)
    return []


async def _settled(bus, rid: str, refused: bool = False) -> list:
    """The run's events once it has an end and its bill (or 60 s); `refused`: its client got an
    HTTP error, and a run with no event at all is settled too."""
    import anyio

    from schemas.events import RequestFailed, RunBilled, RunCancelled, RunCompleted

    events: list = []
    with anyio.move_on_after(60.0):
        while True:
            events = await _replayed(bus, rid)
            ends = [e for e in events if isinstance(e, RunCompleted | RunCancelled | RequestFailed)]
            if ends and any(isinstance(e, RunBilled) for e in events) or (refused and not events):
                return events
            await anyio.sleep(0.5)
    return events


async def audit(fault: str, config, outcomes: list[Outcome], baseline: dict[int, str],
                unseen: set[str] | None = None) -> Row:  # fmt: skip
    """Each outcome against what the log holds for its run (waiting up to 60 s for its end).
    `unseen`: runs accepted while this load ran, whose clients never learnt their id (cut
    before the answer's headers): each client was told it failed, so each of them billed as
    completed counts as told failed but billed, and one never ended as lost."""
    from schemas.events import (
        RequestAccepted,
        RequestFailed,
        RunBilled,
        RunCancelled,
        RunCompleted,
        TextGenerated,
    )
    from stages.runtime.bus import Bus

    row = Row(fault=fault, sent=len(outcomes))
    bus = await Bus.connect(config)
    try:
        for o in outcomes:
            row.longest_stall_s = max(row.longest_stall_s, o.longest_stall_s)
            if o.completed:
                row.completed += 1
                row.differing_text += int(o.prompt in baseline and o.text != baseline[o.prompt])
            elif o.error is not None and o.error.get("code"):
                row.failed_clear += 1
            if o.error is not None:
                told = f"{o.status} {o.error.get('code')}: {str(o.error.get('message'))[:80]}"
                row.errors[told] = row.errors.get(told, 0) + 1
            if o.rid is None:
                continue
            events = await _settled(bus, o.rid, refused=o.status not in (200, None))
            ends = [e for e in events if isinstance(e, RunCompleted | RunCancelled | RequestFailed)]
            accepted = any(type(e).__name__ == "RequestAccepted" for e in events)
            row.lost += int(accepted and not ends)
            texts: dict[int, str] = {}
            for e in events:
                if isinstance(e, TextGenerated):
                    texts.setdefault(e.seq, e.text)
            logged = "".join(texts[s] for s in sorted(texts))
            row.duplicated_text += int(len(o.text) > len(logged))
            billed = {(e.billing_key, e.status) for e in events if isinstance(e, RunBilled)}
            row.billed_twice += int(len({key for key, _ in billed}) > 1)
            told_failed = not o.completed
            row.told_failed_but_billed += int(told_failed and any(s == "completed"
                                                                   for _, s in billed))  # fmt: skip
        for rid in sorted((unseen or set()) - {o.rid for o in outcomes}):
            # its `accepted` subject holds a message: a run's decodes at once, a poison's never
            if not any(isinstance(e, RequestAccepted) for e in await _replayed(bus, rid)):
                continue  # a poison on an `accepted` subject, not a run: nothing to wait for
            events = await _settled(bus, rid)
            ends = [e for e in events if isinstance(e, RunCompleted | RunCancelled | RequestFailed)]
            row.lost += int(not ends)
            billed = {(e.billing_key, e.status) for e in events if isinstance(e, RunBilled)}
            row.billed_twice += int(len({key for key, _ in billed}) > 1)
            row.told_failed_but_billed += int(any(s == "completed" for _, s in billed))
    finally:
        await bus.close()
    return row


async def _kill(config, stage: str, killed: set[int]) -> None:
    """SIGKILL every worker of `stage` on this host (from their heartbeats); adds to `killed`."""
    import anyio

    from schemas import subjects
    from stages.runtime import heartbeat
    from stages.runtime.bus import Bus

    bus = await Bus.connect(config)
    pids: set[int] = set()
    try:
        kv = await bus.kv(subjects.STAGES_BUCKET, ttl_s=heartbeat.TTL_S)
        host = socket.gethostname()
        with anyio.move_on_after(15.0):  # a busy bus may answer one read partly: ask again
            while not pids:
                found = await heartbeat.beats(kv)
                pids = {b.pid for b in found if b.stage == stage and b.host == host}
                if not pids:
                    await anyio.sleep(0.5)
    finally:
        await bus.close()
    if not pids:
        raise RuntimeError(f"no worker of {stage} beats on this host (looked for 15 s)")
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
        killed.add(pid)


async def _poison(config) -> None:
    from stages.runtime.bus import Bus

    bus = await Bus.connect(config)
    try:
        for subject, payload in poisons():
            await bus.js.publish(subject, payload)
    finally:
        await bus.close()


async def _wait_ready(deploy: Deployment, stages: tuple[str, ...], killed: set[int],
                      timeout_s: float = 300.0) -> None:  # fmt: skip
    """Until every stage beats ready from a process not `killed` (`up` restarts a killed one;
    the dead one's last beat lingers for the bucket's TTL) and the edge answers."""
    import anyio
    import httpx

    from schemas import subjects
    from stages.runtime import heartbeat
    from stages.runtime.bus import Bus

    with anyio.fail_after(timeout_s):
        while True:
            try:
                bus = await Bus.connect(deploy.config())
                try:
                    kv = await bus.kv(subjects.STAGES_BUCKET, ttl_s=heartbeat.TTL_S)
                    found = await heartbeat.beats(kv)
                finally:
                    await bus.close()
                ready = {b.stage for b in found if b.ready and b.pid not in killed}
                async with httpx.AsyncClient(base_url=deploy.edge_url, timeout=2) as http:
                    edge_up = (await http.get("/healthz")).status_code == 200
                if set(stages) <= ready and edge_up:
                    return
            except Exception:  # noqa: BLE001 - the bus or the edge still restarting: ask again
                pass
            await anyio.sleep(0.5)


async def run_faults(deploy: Deployment, faults: tuple[str, ...], n: int, max_tokens: int,
                     report: Callable[[Row], None] = lambda row: None) -> list[Row]:  # fmt: skip
    """The baseline row, then one row per fault, each after every stage beats ready again."""
    import asyncio

    from tools.stage import available

    stages = available()
    config = deploy.config()
    killed: set[int] = set()
    restarts: list[Future] = []
    await _wait_ready(deploy, stages, killed)
    before = await _accepted_ids(config)
    outcomes = await drive(deploy.edge_url, config, n, max_tokens, None)
    baseline = {o.prompt: o.text for o in outcomes if o.completed}
    rows = [await audit("none (baseline)", config, outcomes, baseline,
                        _new(before, await _accepted_ids(config)))]  # fmt: skip
    report(rows[-1])
    for fault in faults:
        if fault.startswith("kill:"):
            stage = fault.removeprefix("kill:")

            async def strike(s: str = stage) -> None:
                await _kill(config, s, killed)
        elif fault == "nats-restart":

            async def strike() -> None:
                await deploy.off_loop(deploy.restart_nats)
        elif fault == "poison":

            async def strike() -> None:
                await _poison(config)
        elif fault in NODE_FAULTS:
            node, led = await deploy.node_to_kill(fault)
            label = f"{fault} ({node}: leads {led})"

            async def strike(node: str = node) -> None:
                restarts.append(await deploy.kill_node(node))
        else:
            raise ValueError(f"unknown fault {fault!r}; choose from {', '.join(CLUSTER_FAULTS)}")
        early = fault in EARLY_FAULTS
        before = await _accepted_ids(config)
        failures: list[str] = []
        outcomes = await drive(deploy.edge_url, config, n, max_tokens, _noting(strike, failures),
                               early)  # fmt: skip
        while restarts:  # a killed node is back before the log is audited and the next fault
            await asyncio.wrap_future(restarts.pop())
        rows.append(await audit(label if fault in NODE_FAULTS else fault, config, outcomes,
                                baseline, _new(before, await _accepted_ids(config))))  # fmt: skip
        for failure in failures:  # the fault itself could not be struck: say so in its row
            rows[-1].errors[f"strike failed: {failure}"] = 1
        report(rows[-1])
        await _wait_ready(deploy, stages, killed)
    return rows


def _new(before: set[str] | None, after: set[str] | None) -> set[str] | None:
    return None if before is None or after is None else after - before


def _noting(strike: Callable[[], Awaitable[None]],
            failures: list[str]) -> Callable[[], Awaitable[None]]:  # fmt: skip
    """`strike`, whose failure is noted instead of ending the whole run (the load goes on)."""

    async def noted() -> None:
        try:
            await strike()
        except Exception as err:  # noqa: BLE001 - one fault that cannot strike is one row's note
            failures.append(f"{type(err).__name__}: {err}")

    return noted


COLUMNS = ("fault", "sent", "completed", "failed_clear", "lost", "duplicated_text",
           "differing_text", "billed_twice", "told_failed_but_billed", "longest_stall_s")  # fmt: skip


def table(rows: list[Row]) -> str:
    head = "| " + " | ".join(COLUMNS) + " |"
    lines = [head, "|" + "|".join("---" for _ in COLUMNS) + "|"]
    for row in rows:
        values = asdict(row)
        cells = [f"{values[c]:.1f}" if c == "longest_stall_s" else str(values[c]) for c in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run(args) -> int:
    import anyio

    known = CLUSTER_FAULTS if args.cluster else FAULTS
    faults = tuple(f.strip() for f in (args.faults or ",".join(known)).split(",") if f.strip())
    unknown = [f for f in faults if f not in known]
    if unknown or args.requests < 1 or args.max_tokens < 1 or args.node_down < 0:
        hint = "" if args.cluster else f" ({', '.join(NODE_FAULTS)} need --cluster)"
        print(f"brigade chaos: unknown fault(s) {unknown} (choose from {', '.join(known)}){hint}; "
              "--requests and --max-tokens must be >= 1, --node-down >= 0", file=sys.stderr)  # fmt: skip
        return 2
    with tempfile.TemporaryDirectory(prefix="brigade-chaos-") as tmp:
        data_dir = args.data_dir or Path(tmp)
        data_dir.mkdir(parents=True, exist_ok=True)
        deploy = Deployment(data_dir, args.ack_wait, cluster=args.cluster,
                            node_down_s=args.node_down)  # fmt: skip
        print(f"brigade chaos: starting a deployment in {data_dir} ...", file=sys.stderr)
        try:
            deploy.start()
            rows = anyio.run(
                lambda: run_faults(deploy, faults, args.requests, args.max_tokens,
                                   lambda r: print(f"  {r.fault}: done", file=sys.stderr)),
                backend="asyncio", backend_options={"use_uvloop": True},
            )  # fmt: skip
        finally:
            deploy.stop()
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=2))
    bad = [r.fault for r in rows if r.lost or r.billed_twice or r.told_failed_but_billed
           or any(told.startswith("strike failed") for told in r.errors)]  # fmt: skip
    for r in rows:  # what the failed ones were told, and faults that could not strike
        for told, count in r.errors.items():
            print(f"  {r.fault}: {count} x {told}", file=sys.stderr)
    return 1 if bad else 0
