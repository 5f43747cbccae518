"""`brigade status`: the NATS server, Brigade's streams, each stage's durable and its workers,
and each stage's live and ready workers from their heartbeats (the engine's KV room with them).
`--ready STAGE` answers only whether a worker of STAGE on this host beats ready (exit 0, else
1): compose's healthcheck."""

from __future__ import annotations

import json
import sys
import urllib.request
from collections import Counter


def register(subparsers) -> None:
    p = subparsers.add_parser("status", help="server, streams, consumers (pending) and workers")
    p.add_argument("--nats-url", help="NATS server(s), comma-separated (default: $NATS_URL)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument(
        "--ready",
        metavar="STAGE",
        help="exit 0 when a worker of STAGE on this host beats ready, else 1 (a healthcheck)",
    )
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
    from stages.runtime import heartbeat
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
        out["stages"] = heartbeat.by_stage(await _beats(bus))
        return out
    finally:
        await bus.close()


async def _beats(bus) -> list:
    """The live workers' beats; none when no stage has beaten yet (no bucket)."""
    from nats.js.errors import BucketNotFoundError, NotFoundError

    from schemas import subjects
    from stages.runtime import heartbeat

    try:
        kv = await bus.js.key_value(subjects.STAGES_BUCKET)
    except (BucketNotFoundError, NotFoundError):
        return []
    return await heartbeat.beats(kv)


async def ready_here(config, stage: str) -> bool:
    """Whether a worker of `stage` on this host beats ready."""
    import socket

    import anyio

    from stages.runtime.bus import Bus

    with anyio.fail_after(config.connect_timeout_s + 1):
        bus = await Bus.connect(config, name="brigade-status")
    try:
        host = socket.gethostname()
        return any(b.stage == stage and b.host == host and b.ready for b in await _beats(bus))
    finally:
        await bus.close()


def _engine_detail(detail: list[dict]) -> str:
    parts = []
    for d in detail:
        if "num_free_blocks" in d:
            model = f"model {d['model']}" if "model" in d else "model"  # the one it serves
            parts.append(
                f"{model} loaded, {d['num_free_blocks']}/{d['num_total_blocks']} KV blocks free, "
                f"{d.get('num_running', 0)} running"
            )
    return "; ".join(parts)


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
    rows = [["stage", "workers", "ready", "pids", "detail"]]
    for name, st in status.get("stages", {}).items():
        rows.append([name, str(st["workers"]), str(st["ready"]),
                     ",".join(map(str, st["pids"])), _engine_detail(st["detail"])])  # fmt: skip
    if len(rows) > 1:
        lines += ["", _table(rows)]
    else:
        lines += ["", "stages: no worker beats (none is running, or none has started yet)"]
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
    if args.ready:
        try:
            ok = anyio.run(ready_here, config, args.ready)
        except Exception as err:  # noqa: BLE001 - not ready is the answer
            print(
                f"brigade status: cannot read {', '.join(config.servers)}: {err}", file=sys.stderr
            )
            return 1
        print(f"{args.ready}: {'ready' if ok else 'not ready'}")
        return 0 if ok else 1
    running = natsd.find_running()
    monitor = running.monitor_url if running and running.url in config.servers else None
    try:
        status = anyio.run(collect, config, monitor)
    except Exception as err:  # noqa: BLE001 - a status command reports, it does not crash
        print(f"brigade status: cannot read {', '.join(config.servers)}: {err}", file=sys.stderr)
        return 1
    print(json.dumps(status, indent=2) if args.json else render(status))
    return 0
