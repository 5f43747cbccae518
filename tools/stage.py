"""`brigade stage NAME`: one service of the pipeline, exactly as compose runs it.

Each stage module offers `SPEC` (a runtime.StageSpec: a handler or a long-running service,
served by the shared runtime), or `async def serve(*, config, stop, ready)` where it needs
arguments of its own before it calls runtime.serve (the edge).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
import sys

# The request's path, in order; `brigade up` and compose run every one of these.
PIPELINE = ("gateway", "auth", "context", "tokenize", "engine", "detokenize", "ledger")
# Services beside the path, run when their module exists.
EXTRAS = ("edge", "archiver", "sweeper", "ingest")
# Each service's module: the request's path is flat under stages/, the rest in its room.
MODULES = {name: f"stages.{name}" for name in PIPELINE} | {
    "edge": "stages.edge.app",
    "archiver": "stages.eventlog.archiver",
    "sweeper": "stages.eventlog.sweeper",
    "ingest": "stages.ingest",
}
# Off the request's path: their whole process runs at BRIGADE_BACKGROUND_CPU_PRIORITY.
BACKGROUND = ("ledger", "archiver", "ingest")


def available() -> tuple[str, ...]:
    """Every stage whose module is present, pipeline first."""
    return tuple(
        name for name in PIPELINE + EXTRAS if importlib.util.find_spec(MODULES[name]) is not None
    )


def command(name: str) -> list[str]:
    """The command line that runs one stage: what compose, `up --procs` and the tests start."""
    return ["brigade", "stage", name]


async def serve_stage(name: str, *, config, stop, ready=None, handle_signals=True) -> None:
    """Serve stage `name` until `stop` is set; `ready` is set once it consumes its input.

    `handle_signals=False` when several stages share a process and its owner handles signals.
    """
    from stages.runtime import worker as runtime

    module = importlib.import_module(MODULES[name])
    serve = getattr(module, "serve", None)
    if serve is not None:
        kwargs = {"config": config, "stop": stop, "ready": ready}
        if "handle_signals" in inspect.signature(serve).parameters:
            kwargs["handle_signals"] = handle_signals
        await serve(**kwargs)
        return
    spec = getattr(module, "SPEC", None)
    if spec is None:
        raise RuntimeError(f"{MODULES[name]} defines neither SPEC nor serve()")
    await runtime.serve(spec, config=config, stop=stop, ready=ready, handle_signals=handle_signals)


def register(subparsers) -> None:
    p = subparsers.add_parser("stage", help="run one service of the pipeline (as compose does)")
    p.add_argument("name", help=f"one of: {', '.join(PIPELINE + EXTRAS)}")
    p.add_argument("--nats-url", help="NATS server(s), comma-separated (default: $NATS_URL)")
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING (default INFO)")
    p.set_defaults(func=run)


def run(args) -> int:
    if args.name not in available():
        known = ", ".join(available())
        print(
            f"brigade stage: unknown stage {args.name!r}; choose one of: {known}", file=sys.stderr
        )
        return 2
    import anyio

    from stages.runtime.bus import BusConfig

    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s {args.name} %(levelname)s %(name)s: %(message)s",
    )
    try:
        config = BusConfig.from_env(args.nats_url)
        if args.name in BACKGROUND:  # before any thread starts: every later one inherits it
            from stages.runtime.cpu_priority import (
                BACKGROUND_ENV,
                CpuPriority,
                apply_to_current_thread,
            )

            apply_to_current_thread(CpuPriority.from_env(BACKGROUND_ENV))
    except (RuntimeError, ValueError) as err:
        print(f"brigade stage {args.name}: {err}", file=sys.stderr)
        return 2

    async def main() -> None:
        stop = anyio.Event()
        await serve_stage(args.name, config=config, stop=stop)

    anyio.run(main, backend="asyncio", backend_options={"use_uvloop": True})
    return 0
