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

from schemas import models, settings
from tools.stage_procs import StageProcesses, child_key, split_key

# Run as child processes even without --procs: the engine's steps would hold this process's GIL,
# and the recorders' file work is off the request's path (they run at low CPU priority).
CHILD_STAGES = ("engine", "ledger", "archiver", "ingest")
CHILD_START_TIMEOUT_S = 600.0
MODEL_STAGES = {"tokenize", "engine", "detokenize"}  # the stages that read the served models
NATS_STOP_TIMEOUT_S = 2.0  # after the stages: nothing is left to drain, SIGKILL past it


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
    p.add_argument(
        "--model",
        action="append",
        metavar="[ID=]MODEL",
        help="serve this model (a registered name, a .gguf file or a Hugging Face directory; "
        "ID= names it); repeat for several, the first the default; one engine worker each "
        "(default: BRIGADE_MODEL)",
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


async def _ready_pids(kv) -> dict[str, set[int]]:
    """{stage: pids of its workers that beat ready} from the heartbeat bucket; none when the
    read times out (this process's own stages importing as they start can hold its loop past
    the read's bound: the caller asks again, within its own start bound)."""
    import nats.errors

    from stages.runtime.heartbeat import beats

    ready: dict[str, set[int]] = {}
    try:
        found = await beats(kv)
    except (TimeoutError, nats.errors.TimeoutError):
        return ready
    for beat in found:
        if beat.ready:
            ready.setdefault(beat.stage, set()).add(beat.pid)
    return ready


async def _wait_ready(
    progress: Progress, kv, key: str, pid: int, stop, proc, launched: float
) -> bool:
    """Until stage `key` (or `engine@<model>`) beats ready from process `pid` (True), or `stop`
    is set (False); raises RuntimeError when the child `proc` (None: a stage of this process)
    exits first or takes CHILD_START_TIMEOUT_S from `launched`."""
    import anyio

    name, model = split_key(key)
    what = f"starting {name}"
    if name == "engine":
        what = f"engine: loading {model or models.default().id}"
    progress.begin(what)
    while not stop.is_set():
        if pid in (await _ready_pids(kv)).get(name, set()):
            progress.end(launched, "done" if proc is None else f"done, pid {pid}")
            return True
        if proc is not None and proc.poll() is not None:
            progress.end(launched, f"exited with code {proc.returncode}")
            raise RuntimeError(f"stage {name} exited with code {proc.returncode}")
        if time.monotonic() - launched > CHILD_START_TIMEOUT_S:
            progress.end(launched, "timed out")
            raise RuntimeError(f"stage {name} was not ready within {CHILD_START_TIMEOUT_S:.0f} s")
        progress.tick(launched)
        with anyio.move_on_after(0.2):
            await stop.wait()
    progress.end(launched, "interrupted")
    return False


async def _stop_on_signals(stop) -> None:
    import anyio

    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for _ in signals:
            stop.set()
            return


async def _serve(plan: Plan, config, progress: Progress, log_level: str, procs: bool) -> int:
    """Start the children and the stages of this process all at once; print "up" once every
    one beats ready (a line for each, in order); supervise until a signal; stop
    everything within BRIGADE_SHUTDOWN_TIMEOUT_S of it."""
    import anyio

    from schemas import subjects
    from stages.runtime import heartbeat
    from stages.runtime.bus import Bus

    own = plan.stages if procs else tuple(n for n in plan.stages if n in CHILD_STAGES)
    here = tuple(n for n in plan.stages if n not in own)
    served = models.served()
    if len(served) > 1:  # one engine worker per served model, each bound to its own
        own = tuple(
            key
            for n in own
            for key in ([child_key(n, m.id) for m in served] if n == "engine" else [n])
        )
    children = StageProcesses(plan.url, getattr(plan.server, "monitor_url", None), log_level)
    stop = anyio.Event()
    bus = await Bus.connect(config, name="brigade-up")
    # the stages' share of the bound; the private NATS stops in what is left of it
    shutdown = _Shutdown(max(1.0, settings.SHUTDOWN_TIMEOUT_S.get() - NATS_STOP_TIMEOUT_S))
    try:
        kv = await bus.kv(subjects.STAGES_BUCKET, ttl_s=heartbeat.TTL_S)
        async with anyio.create_task_group() as tg:
            tg.start_soon(_stop_on_signals, stop)
            try:
                code = await _run_stages(plan, config, progress, kv, children, own, here, stop,
                                         shutdown)  # fmt: skip
            except RuntimeError as err:
                print(f"brigade up: {err}", file=sys.stderr)
                code = 1
            tg.cancel_scope.cancel()
        return code
    finally:
        shutdown.begin()
        children.stop(timeout_s=max(0.5, shutdown.remaining_s()))
        with anyio.move_on_after(1.0, shield=True):
            await bus.close()


class _Shutdown:
    """The one bound on stopping: it starts at the first Ctrl-C (or failure)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.deadline: float | None = None

    def begin(self) -> None:
        if self.deadline is None:
            self.deadline = time.monotonic() + self.timeout_s

    def remaining_s(self) -> float:
        self.begin()
        return max(0.0, self.deadline - time.monotonic())  # type: ignore[operator]


async def _run_stages(plan, config, progress, kv, children, own, here, stop, shutdown) -> int:
    import os

    import anyio

    from tools.stage import serve_stage
    from tools.supervise import ProcessSupervisor, supervise_task

    supervisor = ProcessSupervisor(children)
    launched = time.monotonic()
    procs = {}
    for name in own:  # all at once: the light stages start while the engine loads its model
        procs[name] = children.start(name)
        supervisor.started(name)
    async with anyio.create_task_group() as stages:
        for name in here:

            async def serve_once(n: str = name) -> None:
                await serve_stage(n, config=config, stop=stop, handle_signals=False)

            stages.start_soon(supervise_task, name, serve_once, stop)
        code, failure = 0, None
        waits = [(name, procs[name].pid, procs[name]) for name in own]
        waits += [(name, os.getpid(), None) for name in here]
        try:
            for name, pid, proc in waits:  # each line: how long after the launch it was ready
                if not await _wait_ready(progress, kv, name, pid, stop, proc, launched):
                    code = 130
                    break
            else:
                _banner(plan)
        except RuntimeError as err:  # a child that died or hung while starting: stop the rest
            failure = err
            stages.cancel_scope.cancel()
        else:
            while not stop.is_set():
                supervisor.poll()
                with anyio.move_on_after(0.5):
                    await stop.wait()
            print("\nstopping: finishing in-flight work ...", file=sys.stderr)
            shutdown.begin()
            children.terminate()  # the children drain beside this process's stages
            stages.cancel_scope.deadline = anyio.current_time() + shutdown.remaining_s()
    if failure is not None:  # raised here, out of the task group: _serve reports it
        raise failure
    return code


def _unloadable(served) -> str | None:
    """What is wrong with the first served model whose tokenizer cannot be read (a missing
    path, not a GGUF file, an incomplete Hugging Face directory), before any stage starts:
    else every stage that reads it, started at once, would fail with the same traceback."""
    from stages.tokenize import tokenizer_for

    for model in served:
        try:
            tokenizer_for(model.artifact)
        except (OSError, ValueError, KeyError) as err:
            return f"model {model.id}: {err}"
    return None


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
        if args.model:  # every stage (and child) reads the served models from the environment
            import os

            os.environ[settings.MODEL.name] = ",".join(args.model)
        served = models.served()
    except ValueError as err:
        print(f"brigade up: {err}", file=sys.stderr)
        return 2
    if len(served) > 1:
        print(f"  models: {', '.join(m.id for m in served)} (default {served[0].id})",
              file=sys.stderr)  # fmt: skip
    if set(stages) & MODEL_STAGES and (refused := _unloadable(served)):
        print(f"brigade up: {refused}", file=sys.stderr)
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
        return anyio.run(
            _serve, plan, config, progress, args.log_level, args.procs,
            backend="asyncio", backend_options={"use_uvloop": True},
        )  # fmt: skip
    finally:
        if server is not None:
            natsd.stop(server, timeout_s=NATS_STOP_TIMEOUT_S)
            print("  NATS stopped", file=sys.stderr)
