"""`brigade status`: the NATS server, Brigade's streams, each stage's durable and its workers."""

from __future__ import annotations

import json
import sys
import urllib.request
from collections import Counter


def register(subparsers) -> None:
    p = subparsers.add_parser("status", help="server, streams, consumers (pending) and workers")
    p.add_argument("--nats-url", help="NATS server(s), comma-separated (default: $NATS_URL)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.set_defaults(func=run)


def _workers(monitor_url: str | None) -> Counter[str] | None:
    """Connections per client name ('brigade-tokenize' -> 2) from the monitoring port, if any."""
    if not monitor_url:
        return None
    try:
        with urllib.request.urlopen(f"{monitor_url.rstrip('/')}/connz?limit=1024", timeout=2) as r:
            conns = json.load(r).get("connections", [])
    except OSError:
        return None
    return Counter(c.get("name") or "?" for c in conns)


async def collect(config, monitor_url: str | None) -> dict:
    import anyio
    from nats.js.errors import NotFoundError

    from schemas import subjects
    from stages.runtime.bus import Bus

    with anyio.fail_after(config.connect_timeout_s + 1):  # a dead server must not hang status
        bus = await Bus.connect(config, name="brigade-status")
    try:
        server = bus.nc._server_info  # the INFO the server sent on connect
        out: dict = {
            "server": {
                "url": bus.nc.connected_url.geturl() if bus.nc.connected_url else None,
                "version": server.get("version"),
                "jetstream": bool(server.get("jetstream")),
                "cluster": server.get("cluster"),
            },
            "streams": [],
            "consumers": [],
        }
        for name in (subjects.EVENTS_STREAM, subjects.SUBMIT_STREAM):
            try:
                info = await bus.js.stream_info(name)
            except NotFoundError:
                out["streams"].append({"name": name, "missing": True})
                continue
            out["streams"].append(
                {
                    "name": name,
                    "messages": info.state.messages,
                    "bytes": info.state.bytes,
                    "first_seq": info.state.first_seq,
                    "last_seq": info.state.last_seq,
                    "replicas": info.config.num_replicas,
                }
            )
            for c in await bus.js.consumers_info(name):
                out["consumers"].append(
                    {
                        "stream": name,
                        "durable": c.name,
                        "filter": c.config.filter_subject
                        or ",".join(c.config.filter_subjects or []),
                        "pending": c.num_pending,
                        "ack_pending": c.num_ack_pending,
                        "redelivered": c.num_redelivered,
                        "waiting_pulls": c.num_waiting,
                    }
                )
        workers = _workers(monitor_url)
        out["workers"] = None if workers is None else dict(sorted(workers.items()))
        return out
    finally:
        await bus.close()


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )


def render(status: dict) -> str:
    s = status["server"]
    lines = [f"server   {s['url']}  nats-server {s['version']}  jetstream={s['jetstream']}"]
    if s.get("cluster"):
        lines[0] += f"  cluster={s['cluster']}"
    rows = [["stream", "messages", "bytes", "seq", "replicas"]]
    for st in status["streams"]:
        if st.get("missing"):
            rows.append([st["name"], "(not created yet)", "", "", ""])
        else:
            seq = f"{st['first_seq']}..{st['last_seq']}"
            rows.append(
                [st["name"], str(st["messages"]), str(st["bytes"]), seq, str(st["replicas"])]
            )
    lines += ["", _table(rows)]
    rows = [["durable", "filter", "pending", "ack pending", "redelivered", "waiting pulls"]]
    for c in status["consumers"]:
        rows.append(
            [
                c["durable"],
                c["filter"] or "",
                str(c["pending"]),
                str(c["ack_pending"]),
                str(c["redelivered"]),
                str(c["waiting_pulls"]),
            ]
        )
    lines += ["", _table(rows)]
    if status["workers"] is not None:
        rows = [["connection", "count"]] + [[k, str(v)] for k, v in status["workers"].items()]
        lines += ["", _table(rows)]
    else:
        lines += ["", "workers: no monitoring port known (waiting pulls show idle workers)"]
    return "\n".join(lines)


def run(args) -> int:
    import anyio

    from stages.runtime import natsd
    from stages.runtime.bus import BusConfig

    try:
        config = BusConfig.from_env(args.nats_url)
    except (RuntimeError, ValueError) as err:
        print(f"brigade status: {err}", file=sys.stderr)
        return 2
    running = natsd.find_running()
    monitor = running.monitor_url if running and running.url in config.servers else None
    try:
        status = anyio.run(collect, config, monitor)
    except Exception as err:  # noqa: BLE001 - a status command reports, it does not crash
        print(f"brigade status: cannot read {', '.join(config.servers)}: {err}", file=sys.stderr)
        return 1
    print(json.dumps(status, indent=2) if args.json else render(status))
    return 0
