"""`brigade up`: a private NATS (unless NATS_URL), every stage, the dev tenant; Ctrl-C stops all.

One process runs every stage as tasks by default; `--procs` runs one `brigade stage NAME`
process per stage, exactly as compose does.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass


def register(subparsers) -> None:
    p = subparsers.add_parser("up", help="run the whole pipeline (embedded NATS unless NATS_URL)")
    p.add_argument("--procs", action="store_true", help="one process per stage (as compose)")
    p.add_argument(
        "--nats-url", help="use this NATS (comma-separated cluster) instead of a private one"
    )
    p.add_argument(
        "--stages", help="comma-separated subset of stages to run (default: every one present)"
    )
    p.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING (default WARNING)")
    p.set_defaults(func=run)


class Progress:
    """One status line per long start-up step, with a live elapsed time on a terminal."""

    def __init__(self, stream=sys.stderr) -> None:
        self.stream = stream
        self.live = stream.isatty()

    def begin(self, what: str) -> float:
        self._what = what
        self.stream.write(f"  {what} ..." + ("" if self.live else "\n"))
        self.stream.flush()
        return time.monotonic()

    def tick(self, started: float) -> None:
        if self.live:
            self.stream.write(f"\r  {self._what} ... {time.monotonic() - started:4.1f} s")
            self.stream.flush()

    def end(self, started: float, note: str = "done") -> None:
        took = time.monotonic() - started
        prefix = "\r" if self.live else ""
        self.stream.write(f"{prefix}  {self._what} ... {note} ({took:.1f} s)\n")
        self.stream.flush()


@dataclass
class Plan:
    stages: tuple[str, ...]
    url: str
    server: object | None  # natsd.NatsServer when we started it


def _choose_stages(arg: str | None) -> tuple[str, ...]:
    from tools.stage import available

    present = available()
    if not arg:
        return present
    wanted = tuple(s.strip() for s in arg.split(",") if s.strip())
    unknown = [s for s in wanted if s not in present]
    if unknown:
        raise ValueError(f"unknown stage(s) {unknown}; choose from {', '.join(present)}")
    return wanted


async def _prepare_bus(config) -> None:
    """Streams, consumers' streams and KV buckets exist before any stage starts (idempotent)."""
    from stages.bus import Bus

    bus = await Bus.connect(config, name="brigade-up")
    try:
        await bus.ensure_streams()
        await bus.ensure_kv()
    finally:
        await bus.close()


async def _wait_ready(progress: Progress, name: str, ready, what: str) -> None:
    import anyio

    started = progress.begin(what)
    while not ready.is_set():
        progress.tick(started)
        with anyio.move_on_after(0.2):
            await ready.wait()
    progress.end(started)


async def _serve_in_process(plan: Plan, config, progress: Progress) -> None:
    import anyio

    from tools.stage import serve_stage

    stop = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(_stop_on_signals, stop)
        for name in plan.stages:
            ready = anyio.Event()
            tg.start_soon(
                lambda n=name, r=ready: serve_stage(
                    n, config=config, stop=stop, ready=r, handle_signals=False
                )
            )
            what = "engine: loading the model" if name == "engine" else f"starting {name}"
            await _wait_ready(progress, name, ready, what)
        _banner(plan)
        await stop.wait()
        print("\nstopping: finishing in-flight work ...", file=sys.stderr)


async def _stop_on_signals(stop) -> None:
    import anyio

    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for _ in signals:
            stop.set()
            return


def _connected(monitor_url: str | None, name: str) -> bool | None:
    """Whether a client named brigade-<name> is connected (None: cannot tell)."""
    import json
    import urllib.request

    if not monitor_url:
        return None
    try:
        with urllib.request.urlopen(f"{monitor_url}/connz?limit=1024", timeout=2) as r:
            conns = json.load(r).get("connections", [])
    except OSError:
        return None
    return any(c.get("name") == f"brigade-{name}" for c in conns)


def _serve_procs(plan: Plan, progress: Progress, log_level: str) -> int:
    from tools.stage import command

    env = dict(os.environ, NATS_URL=plan.url)
    monitor = getattr(plan.server, "monitor_url", None)
    procs: dict[str, subprocess.Popen] = {}
    stopping = False

    def on_signal(signum, frame) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        for name in plan.stages:
            argv = [sys.executable, "-m", "tools.cli", *command(name)[1:], "--log-level", log_level]
            procs[name] = subprocess.Popen(argv, env=env)
            what = "engine: loading the model" if name == "engine" else f"starting {name}"
            started = progress.begin(f"{what} (pid {procs[name].pid})")
            while _connected(monitor, name) is False and not stopping:
                if procs[name].poll() is not None:
                    progress.end(started, f"exited with code {procs[name].returncode}")
                    return 1
                progress.tick(started)
                time.sleep(0.2)
            progress.end(started)
            if stopping:
                return 130
        _banner(plan)
        while not stopping:
            for name, proc in procs.items():
                if proc.poll() is not None:
                    print(f"stage {name} exited with code {proc.returncode}", file=sys.stderr)
                    return 1
            time.sleep(0.5)
        print("\nstopping: finishing in-flight work ...", file=sys.stderr)
        return 0
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        for proc in procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _banner(plan: Plan) -> None:
    lines = [f"Brigade is up: {len(plan.stages)} stages on {plan.url}"]
    if "edge" in plan.stages:
        port = os.environ.get("BRIGADE_EDGE_PORT", "8080")
        lines.append(
            f"  edge:   http://127.0.0.1:{port}/v1/chat/completions  ws://127.0.0.1:{port}/v1/stream"
        )
    lines += [
        '  try:    brigade ask "What is the capital of France?"   (from another terminal)',
        "  status: brigade status        stop: Ctrl-C",
    ]
    print("\n".join(lines), file=sys.stderr)


def run(args) -> int:
    import logging

    from stages import natsd, tenants
    from stages.bus import BusConfig

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        stages = _choose_stages(args.stages)
    except ValueError as err:
        print(f"brigade up: {err}", file=sys.stderr)
        return 2
    progress = Progress()
    url = args.nats_url or os.environ.get("NATS_URL")
    server = None
    if not url:
        running = natsd.find_running()
        if running is not None:
            print(
                f"brigade up: a Brigade NATS (pid {running.pid}) already runs from "
                f"{running.data_dir}; stop that `brigade up` first or set BRIGADE_DATA_DIR",
                file=sys.stderr,
            )
            return 1
        started = progress.begin("starting NATS (JetStream)")
        server = natsd.start()
        url = server.url
        progress.end(started, f"{url}, data in {server.data_dir}")
    try:
        config = BusConfig.from_env(url)
        import anyio

        started = progress.begin("creating streams, consumers' stream and KV buckets")
        anyio.run(_prepare_bus, config)
        progress.end(started)
        key, generated = tenants.provision_dev()
        source = "generated" if generated else "from BRIGADE_API_KEY or the saved dev key"
        print(f"  dev tenant API key ({source}): {key}", file=sys.stderr)
        plan = Plan(stages=stages, url=url, server=server)
        if args.procs:
            return _serve_procs(plan, progress, args.log_level)
        anyio.run(
            _serve_in_process, plan, config, progress,
            backend="asyncio", backend_options={"use_uvloop": True},
        )  # fmt: skip
        return 0
    finally:
        if server is not None:
            natsd.stop(server)
            print("  NATS stopped", file=sys.stderr)
