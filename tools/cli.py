"""The `brigade` command: one sub-command per module listed below, each with register() + run()."""

from __future__ import annotations

import argparse
import importlib
import sys

from tools import config

COMMANDS = [
    "tools.up",
    "tools.stage",
    "tools.ask",
    "tools.status",
    "tools.schema",
    "tools.kv_estimate",
    "tools.log.sql",
    "tools.log.report",
    "tools.log.trace",
    "tools.log.replay",
    "tools.keys",
    "tools.docs",
    "tools.usage",
    "tools.config",
    "tools.chaos",
]
BENCH = [
    "tools.bench.pipeline",
    "tools.bench.engine",
    "tools.bench.invariant",
    "tools.bench.prefix",
    "tools.bench.spec",
    "tools.bench.structured",
    "tools.bench.load",
    "tools.bench.hops",
    "tools.bench.quality",
    "tools.bench.peer",
    "tools.bench.rag",
    "tools.bench.serve",
    "tools.bench.overload",
]


def _register_all(subparsers, names: list[str]) -> None:
    for name in names:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:  # listed but not written yet: leave it out of --help
                continue
            raise
        module.register(subparsers)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="brigade", description="Brigade: an LLM serving pipeline on NATS JetStream."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _register_all(sub, COMMANDS)
    bench = sub.add_parser("bench", help="run a benchmark (writes markdown + JSON)")
    bench_sub = bench.add_subparsers(dest="bench", metavar="NAME")
    _register_all(bench_sub, BENCH)
    bench.set_defaults(func=lambda args: _usage(bench))
    return parser


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        return _usage(parser)
    if args.command != "config" and config.checked(args.command) is None:  # config says it itself
        return 2
    if args.command == "bench":  # benchmarks build engines in-process: the kernel settings apply
        from stages.engine_params import configure_kernels

        configure_kernels()
    try:
        return int(func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `brigade schema | head`: the reader left, nothing more to say
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
