"""`brigade up`: a private NATS (unless NATS_URL), every stage (the sweeper too: it shares this
process), the dev tenant; Ctrl-C stops all.

By default the request path's light stages share this process as tasks, while the engine and
the background recorders (ledger, archiver) run as `brigade stage NAME` children so that their
CPU work neither holds this process's GIL nor outranks it; `--procs` runs every stage as a child.
"""

from __future__ import annotations

import signal
import sys
import time
from dataclasses import dataclass

from schemas import settings
from tools.stage_procs import StageProcesses

# Run as child processes even without --procs: the engine's steps would hold this process's GIL,
# and the recorders' file work is off the request's path (they run at low CPU priority).
CHILD_STAGES = ("engine", "ledger", "archiver")
CHILD_START_TIMEOUT_S = 600.0


def register(subparsers) -> None:
    p = subparsers.add_parser("up", help="run the whole pipeline (embedded NATS unless NATS_URL)")
    p.add_argument(
        "--procs",
        action="store_true",
        help="one process per stage, as compose (default: the engine, ledger and archiver in "
        "their own processes, the other stages in this one)",
    )
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
    from stages.runtime.bus import Bus

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


async def _serve_in_process(
    plan: Plan, names: tuple[str, ...], config, progress: Progress, children: StageProcesses
) -> int:
    import anyio

    from tools.stage import serve_stage

    stop = anyio.Event()
    code = 0
    async with anyio.create_task_group() as tg:
        tg.start_soon(_stop_on_signals, stop)
        for name in names:
            ready = anyio.Event()
            tg.start_soon(
                lambda n=name, r=ready: serve_stage(
                    n, config=config, stop=stop, ready=r, handle_signals=False
                )
            )
            await _wait_ready(progress, name, ready, f"starting {name}")
        _banner(plan)
        while not stop.is_set():
            gone = children.exited()
            if gone is not None:
                print(f"stage {gone[0]} exited with code {gone[1]}", file=sys.stderr)
                code = 1
                break
            with anyio.move_on_after(0.5):
                await stop.wait()
        else:
            print("\nstopping: finishing in-flight work ...", file=sys.stderr)
        stop.set()
    return code


async def _stop_on_signals(stop) -> None:
    import anyio

    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for _ in signals:
            stop.set()
            return


def _start_children(
    children: StageProcesses, names: tuple[str, ...], progress: Progress, stopping
) -> int | None:
    """Start `names` as child processes one after the other, each connected before the next;
    an exit code when one failed or a signal came first."""
    for name in names:
        proc = children.start(name)
        what = "engine: loading the model" if name == "engine" else f"starting {name}"
        started = progress.begin(what)
        try:
            children.wait_up(
                name, CHILD_START_TIMEOUT_S, lambda s=started: progress.tick(s), stopping
            )
        except RuntimeError as err:
            progress.end(started, str(err))
            return 1
        progress.end(started, f"done, pid {proc.pid}")
        if stopping():
            return 130
    return None


def _serve_procs(plan: Plan, progress: Progress, log_level: str) -> int:
    children = StageProcesses(plan.url, getattr(plan.server, "monitor_url", None), log_level)
    stopping = _SignalFlag()
    try:
        failed = _start_children(children, plan.stages, progress, stopping.is_set)
        if failed is not None:
            return failed
        _banner(plan)
        while not stopping.is_set():
            gone = children.exited()
            if gone is not None:
                print(f"stage {gone[0]} exited with code {gone[1]}", file=sys.stderr)
                return 1
            time.sleep(0.5)
        print("\nstopping: finishing in-flight work ...", file=sys.stderr)
        return 0
    finally:
        children.stop()


def _serve_mixed(plan: Plan, config, progress: Progress, log_level: str) -> int:
    """The engine and background stages as children, the rest as tasks of this process."""
    import anyio

    own = tuple(n for n in plan.stages if n in CHILD_STAGES)
    here = tuple(n for n in plan.stages if n not in CHILD_STAGES)
    children = StageProcesses(plan.url, getattr(plan.server, "monitor_url", None), log_level)
    stopping = _SignalFlag()
    try:
        failed = _start_children(children, own, progress, stopping.is_set)
        if failed is not None:
            return failed
        stopping.restore()  # from here the event loop owns SIGINT/SIGTERM
        return anyio.run(
            _serve_in_process, plan, here, config, progress, children,
            backend="asyncio", backend_options={"use_uvloop": True},
        )  # fmt: skip
    finally:
        children.stop()


class _SignalFlag:
    """SIGINT/SIGTERM set a flag while children start (their start-up is a blocking loop)."""

    def __init__(self) -> None:
        self._set = False
        self._previous = {
            sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)
        }

    def _on_signal(self, signum, frame) -> None:
        self._set = True

    def is_set(self) -> bool:
        return self._set

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _banner(plan: Plan) -> None:
    lines = [f"Brigade is up: {len(plan.stages)} stages on {plan.url}"]
    if "edge" in plan.stages:
        port = settings.EDGE_PORT.get()
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

    from stages.runtime import natsd
    from stages.runtime.bus import BusConfig
    from stages.tenancy import tenants

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        stages = _choose_stages(args.stages)
    except ValueError as err:
        print(f"brigade up: {err}", file=sys.stderr)
        return 2
    progress = Progress()
    url = args.nats_url or ",".join(settings.NATS_URL.get())
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
        return _serve_mixed(plan, config, progress, args.log_level)
    finally:
        if server is not None:
            natsd.stop(server)
            print("  NATS stopped", file=sys.stderr)
