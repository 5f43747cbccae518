"""`brigade bench hops`: the latency floor of a chain of Python relays on NATS, no stage code.

A client publishes timestamps into `hop.0`; relay process i moves each message from `hop.i` to
`hop.i+1`; the client receives `hop.N` (N relays = N + 1 hops, the path a request takes through
the pipeline's stages is six). Over JetStream the relays are durable push consumers that
publish (acknowledged) and ack; over core NATS they only republish. Bursts of `inflight`
messages, as `brigade bench pipeline` sends its requests. Writes hops.md and hops.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

STREAM = "HOPBENCH"
CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float | None:
    """utime + stime of a live process, in seconds (None once it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rpartition(")")[2].split()  # after "pid (comm)": state is fields[0]
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def register(subparsers) -> None:
    p = subparsers.add_parser("hops", help="latency floor of N Python relays on NATS, no stages")
    p.add_argument(
        "--relays", type=int, default=5, help="relay processes (hops = relays + 1; 0: one hop)"
    )
    p.add_argument("--inflight", type=int, nargs="+", default=[1, 20], help="burst sizes")
    p.add_argument("--messages", type=int, default=400, help="messages per burst size")
    p.add_argument(
        "--pipelined",
        action="store_true",
        help="publish each JetStream burst without waiting for each ack (as the engine "
        "publishes a step's tokens events), not one acknowledged publish after another",
    )
    p.add_argument("--out", type=Path, default=Path(".brigade/bench"), help="output directory")
    p.set_defaults(func=run)


async def relay(url: str, index: int, mode: str) -> None:
    """Move every message from hop.<index> to hop.<index + 1> until killed."""
    import nats
    from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

    nc = await nats.connect(url)
    js = nc.jetstream()
    target = f"hop.{index + 1}"
    if mode == "jetstream":

        async def forward_js(msg) -> None:
            await js.publish(target, msg.data)
            await msg.ack()

        config = ConsumerConfig(
            deliver_policy=DeliverPolicy.NEW, ack_policy=AckPolicy.EXPLICIT, max_ack_pending=256
        )
        name = f"relay{index}"
        await js.subscribe(
            f"hop.{index}", queue=name, durable=name, cb=forward_js, manual_ack=True, config=config
        )
    else:

        async def forward_core(msg) -> None:
            await nc.publish(target, msg.data)

        await nc.subscribe(f"hop.{index}", cb=forward_core)
    await nc.flush()
    print("ready", flush=True)
    await asyncio.Event().wait()


async def measure(
    url: str,
    relays: int,
    mode: str,
    inflight: int,
    messages: int,
    pipelined: bool = False,
    interval_s: float | None = None,
) -> list[float]:
    """Per message: ms from the client's publish into hop.0 to its receipt from hop.<relays>.
    A burst starts 20 ms after the last one arrived, or with `interval_s` every interval_s (as
    an engine's steps publish: a burst of one event per stream each step)."""
    import nats

    nc = await nats.connect(url)
    js = nc.jetstream()
    latencies: list[float] = []
    arrived: asyncio.Queue[None] = asyncio.Queue()

    async def received(msg) -> None:
        latencies.append((time.perf_counter_ns() - int(msg.data)) / 1e6)
        arrived.put_nowait(None)

    await nc.subscribe(f"hop.{relays}", cb=received)
    await nc.flush()

    async def send() -> None:
        stamp = str(time.perf_counter_ns()).encode()
        if mode == "jetstream":
            await js.publish("hop.0", stamp)
        else:
            await nc.publish("hop.0", stamp)

    for _ in range(3):  # warm every connection and consumer
        await send()
        await arrived.get()
    latencies.clear()
    began = time.monotonic()
    for burst in range(max(1, messages // inflight)):
        if interval_s is not None:
            await asyncio.sleep(max(0.0, began + burst * interval_s - time.monotonic()))
        if pipelined and mode == "jetstream":  # every publish out before any ack comes back
            acks = [
                await js.publish_async("hop.0", str(time.perf_counter_ns()).encode())
                for _ in range(inflight)
            ]
            await asyncio.gather(*acks)
        else:
            for _ in range(inflight):  # a burst, as concurrent requests start together
                await send()
        for _ in range(inflight):
            await arrived.get()
        if interval_s is None:
            await asyncio.sleep(0.02)
    await nc.close()
    return latencies


def create_stream(url: str) -> None:
    """The benchmark's stream (hop.>) on the server at `url`."""
    import nats
    import uvloop
    from nats.js.api import StreamConfig

    async def create() -> None:
        nc = await nats.connect(url)
        await nc.jetstream().add_stream(StreamConfig(name=STREAM, subjects=["hop.>"]))
        await nc.close()

    uvloop.run(create())


def relay_cost(rates: dict[int, float], seconds: float = 6.0) -> dict[int, dict]:
    """The CPU one message costs on one JetStream hop with no stage code, at a pipeline's pace:
    for each (burst size, messages a second), bursts published pipelined, each message stored,
    pulled by a relay process that publishes it on (acknowledged) and acks it, and received.
    This is the path every streamed token takes from the engine through detokenize to the edge,
    so its CPU per message is what one token costs beside the engine at the least, before any
    stage's own work and before the log's archiver reads it."""
    from stages.runtime import natsd

    out: dict[int, dict] = {}
    with tempfile.TemporaryDirectory(prefix="brigade-relay-") as tmp:
        server = natsd.start(Path(tmp))
        try:
            create_stream(server.url)
            with relay_processes(server.url, 1, "jetstream") as (relay,):
                pids = {"relay": relay.pid, "nats-server": server.pid, "client": os.getpid()}
                for inflight, rate in rates.items():
                    out[inflight] = _paced_cost(server.url, pids, inflight, rate, seconds)
        finally:
            natsd.stop(server)
    return out


def _paced_cost(url: str, pids: dict[str, int], inflight: int, rate: float, seconds: float) -> dict:
    """One pace of relay_cost: bursts of `inflight` at `rate` messages a second for `seconds`."""
    import uvloop

    messages = max(inflight * 20, int(rate * seconds) // inflight * inflight)
    before = {name: cpu_seconds(pid) or 0.0 for name, pid in pids.items()}
    t0 = time.monotonic()
    lat = uvloop.run(measure(url, 1, "jetstream", inflight, messages, True, inflight / rate))
    wall = time.monotonic() - t0
    used = {name: (cpu_seconds(pid) or 0.0) - before[name] for name, pid in pids.items()}
    return {
        "messages": len(lat),
        "per_second": len(lat) / wall,
        "cpu_ms_per_message": {name: 1e3 * s / len(lat) for name, s in used.items()},
        "cpu_ms_per_message_total": 1e3 * sum(used.values()) / len(lat),
        "p50_ms": pct(lat, 0.5),
        "p95_ms": pct(lat, 0.95),
    }


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_chain(
    url: str, relays: int, mode: str, inflights: list[int], messages: int, pipelined: bool
) -> dict:
    import uvloop

    with relay_processes(url, relays, mode):
        result = {}
        for inflight in inflights:
            lat = uvloop.run(measure(url, relays, mode, inflight, messages, pipelined))
            result[str(inflight)] = {
                "messages": len(lat),
                "p50_ms": round(pct(lat, 0.5), 3),
                "p95_ms": round(pct(lat, 0.95), 3),
            }
        return result


@contextlib.contextmanager
def relay_processes(url: str, relays: int, mode: str) -> Iterator[list[subprocess.Popen]]:
    """`relays` relay processes (hop.i -> hop.i+1), ready; terminated on exit."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tools.bench.hops", "relay", url, str(i), mode],
            stdout=subprocess.PIPE,
            text=True,
        )
        for i in range(relays)
    ]
    try:
        for p in procs:
            if p.stdout is None or p.stdout.readline().strip() != "ready":
                raise RuntimeError(f"a relay process failed to start (exit {p.poll()})")
        yield procs
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=10)


def run(args: argparse.Namespace) -> int:
    from stages.runtime import natsd

    if args.relays < 0 or min(args.inflight) < 1 or args.messages < 1:
        print("--relays must be >= 0, --inflight and --messages >= 1", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="brigade-hops-") as tmp:
        server = natsd.start(Path(tmp))
        try:
            create_stream(server.url)
            res = {
                "hops": args.relays + 1,
                "relays": args.relays,
                "pipelined": args.pipelined,
                "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
                "modes": {
                    mode: run_chain(
                        server.url, args.relays, mode, args.inflight, args.messages, args.pipelined
                    )
                    for mode in ("jetstream", "core")
                },
            }
        finally:
            natsd.stop(server)
    table = markdown(res)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "hops.json").write_text(json.dumps(res, indent=1) + "\n")
    (args.out / "hops.md").write_text(table)
    print(table)
    print(f"wrote {args.out / 'hops.md'} and {args.out / 'hops.json'}")
    return 0


def markdown(res: dict) -> str:
    lines = [
        f"{res['relays']} relay processes, {res['hops']} hops, no stage code"
        + ("; JetStream bursts published pipelined" if res.get("pipelined") else "")
        + f"; load average at start {res['load_average_at_start']}",
        "",
        "| transport | in flight (burst) | messages | P50 ms | P95 ms |",
        "|---|---:|---:|---:|---:|",
    ]
    labels = {"jetstream": "JetStream (stored, acked)", "core": "core NATS (not stored)"}
    for mode, by_inflight in res["modes"].items():
        for inflight, r in by_inflight.items():
            lines.append(
                f"| {labels[mode]} | {inflight} | {r['messages']} | {r['p50_ms']} | {r['p95_ms']} |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__" and len(sys.argv) == 5 and sys.argv[1] == "relay":
    import uvloop

    from stages.runtime.natsd import die_with_parent

    die_with_parent()  # never outlive the benchmark
    uvloop.run(relay(sys.argv[2], int(sys.argv[3]), sys.argv[4]))
