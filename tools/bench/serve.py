"""`brigade bench serve`: what a streaming client gets from the whole pipeline behind the OpenAI
SSE edge, against the engine alone and against llama-server, in one run.

Every side answers the same chat requests (a fixed prompt set, `--max-tokens` tokens each with
`ignore_eos`, temperature 0) from a closed loop of 1, 8 and 32 concurrent clients:

- the engine alone: `Engine.step()` in this process, a request added as soon as a client is free;
- the pipeline: `brigade up` (default settings, private NATS and data dir) driven through its edge;
- the pipeline with one process per stage (`brigade up --procs`, at the middle concurrency): the
  same figures, plus CPU time per process, so each stage's cost has an owner;
- llama-server (`-np` = the concurrency), where llama.cpp is built or `LLAMA_CPP_DIR` is set.

CPU milliseconds per generated token come from `/proc/<pid>/stat` (utime + stime) of every
process of a side (the stages, nats-server, the edge, the client), read before and after each run.
NATS messages per generated token come from the pipeline's nats-server (`/connz` on its
monitoring port), by connection: what each stage published (events, acks, pull requests) and what
was delivered to it, so the server's own CPU per token reads as messages times the cost of one.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from schemas import settings
from stages.runtime import natsd
from stages.runtime.natsd import die_with_parent
from tools.bench.hops import cpu_seconds, relay_cost
from tools.bench.loadgen import Sample, SseTarget, run_load
from tools.bench.measure import percentiles
from tools.bench.workload import WorkItem

QUESTIONS = (
    "What is the capital of France?",
    "Explain how a bicycle stays upright.",
    "Write a short poem about the sea.",
    "Give three tips for learning a new language.",
    "Why is the sky blue?",
    "Describe a good breakfast.",
    "What does a compiler do?",
    "Tell me about the moon.",
)
SIDES = ("engine", "pipeline", "procs", "llama-server")
DEFAULT_SIDES = SIDES
RETRIES = 5  # a refused (503) request waits its Retry-After and is sent again, as SDKs do
# The targets, at 8 and 32 streams
TARGET_OF_ENGINE = 0.90  # pipeline aggregate / engine-alone aggregate
TARGET_OF_LLAMA = 2.0  # pipeline aggregate / llama-server aggregate
TARGET_ITL_OF_STEP = 1.5  # pipeline ITL P95 / engine-alone step time


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "serve",
        help="streamed chat through the edge vs the engine alone vs llama-server; CPU per token",
    )
    p.add_argument("--concurrency", default="1,8,32", help="closed-loop clients (default 1,8,32)")
    p.add_argument(
        "--requests", type=int, default=2, help="requests per client at each level (default 2)"
    )
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens per request")
    p.add_argument(
        "--sides",
        default=",".join(DEFAULT_SIDES),
        help=f"comma-separated subset of {','.join(SIDES)} (default: all)",
    )
    p.add_argument(
        "--lever",
        action="append",
        default=[],
        type=parse_lever,
        metavar="NAME:VAR=VALUE[,VAR=VALUE]",
        help="one more pipeline side, with these settings over the defaults, reported against "
        "the default pipeline of the same run (repeat it for more): "
        "--lever flush-step:BRIGADE_STREAM_FLUSH=step",
    )
    p.add_argument(
        "--procs-at", type=int, default=8, help="the concurrency of the --procs side (default 8)"
    )
    p.add_argument(
        "--url",
        default=None,
        help="one more side, `deployment`: an edge already serving there (docker compose up, "
        "a cluster), driven by the same client; its CPU per token counts every Brigade stage "
        "and nats-server this host's /proc shows (a compose host's containers)",
    )
    p.add_argument(
        "--api-key",
        default=settings.API_KEY.get(),
        help="the deployment's API key (default: $BRIGADE_API_KEY)",
    )
    p.add_argument(
        "--llama-cpp-dir",
        type=Path,
        default=settings.LLAMA_CPP_DIR.get(),
        help="a llama.cpp build with llama-server (default: $LLAMA_CPP_DIR or the build "
        "`brigade bench peer` cached)",
    )
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama-server -t")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="alternate the engine alone and the default pipeline this many times at each "
        "level (both kept loaded) and report the round of the median ratio, with every round's: "
        "on a machine whose speed swings, sides measured minutes apart are not comparable",
    )
    p.add_argument(
        "--no-floor",
        action="store_true",
        help="skip the floor: one JetStream hop through a relay with no stage code, at each "
        "level's burst size and the pipeline's token rate, and the CPU it costs a message",
    )
    p.add_argument("--quick", action="store_true", help="1 and 4 clients, 32 tokens")
    p.add_argument("--out", type=Path, default=Path(".brigade/bench"), help="output directory")
    p.set_defaults(func=run)


def parse_lever(text: str) -> tuple[str, dict[str, str]]:
    """ "name:VAR=VALUE,VAR=VALUE" -> (name, {VAR: VALUE}); every VAR a declared setting, its
    value one that setting takes."""
    name, sep, assignments = text.partition(":")
    env: dict[str, str] = {}
    for part in assignments.split(",") if sep else []:
        var, eq, value = part.partition("=")
        if not eq:
            raise argparse.ArgumentTypeError(f"{part!r} is not VAR=VALUE")
        found = next((st for st in settings.SETTINGS if st.name == var.strip()), None)
        if found is None:
            raise argparse.ArgumentTypeError(f"{var.strip()!r} is not a Brigade setting")
        try:
            found.parse(value.strip())
        except settings.InvalidSetting as err:
            raise argparse.ArgumentTypeError(str(err)) from None
        env[var.strip()] = value.strip()
    if not name.strip() or not env or name.strip() in SIDES:
        raise argparse.ArgumentTypeError(
            f"a lever is NAME:VAR=VALUE[,VAR=VALUE] with a name not among {', '.join(SIDES)}, "
            f"got {text!r}"
        )
    return name.strip(), env


def work_items(count: int, max_tokens: int) -> list[WorkItem]:
    """Distinct prompts (so no request is served from another's cached prefix)."""
    return [
        WorkItem(
            index=i,
            prompt=f"Question {i + 1}. {QUESTIONS[i % len(QUESTIONS)]}",
            num_prompt_words=0,
            max_tokens=max_tokens,
            seed=1000 + i,
        )
        for i in range(count)
    ]


# ---- CPU accounting from /proc ----


def deployment_pids(me: int) -> list[int]:
    """Every process on this host that is a Brigade stage (`brigade stage NAME`, as compose
    runs each container) or a nats-server, this one aside."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            words = [w for w in (entry / "cmdline").read_bytes().split(b"\0") if w]
        except OSError:
            continue
        if not words:
            continue
        if Path(words[0].decode(errors="replace")).name == "nats-server" or (
            b"stage" in words and words.index(b"stage") + 1 < len(words)
        ):
            found.append(int(entry.name))
    return found


def descendants(root: int) -> list[int]:
    """`root` and every process below it, from the parent pids in /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rpartition(")")[2].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def process_name(pid: int) -> str:
    """A short owner for a process: the stage it runs, nats-server, llama-server, the edge."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return f"pid {pid}"
    words = [a.decode(errors="replace") for a in argv if a]
    if not words:
        return f"pid {pid}"
    exe = Path(words[0]).name
    if exe in ("nats-server", "llama-server"):
        return exe
    if "stage" in words:
        return words[words.index("stage") + 1]
    if "up" in words:
        return "brigade up (edge and light stages)"
    return exe


class CpuMeter:
    """CPU seconds of a set of processes between `start()` and `stop()`, by owner name."""

    def __init__(self, roots: list[int], client_pid: int) -> None:
        self.roots, self.client_pid = roots, client_pid

    def _read(self) -> dict[int, float]:
        pids = {p for r in self.roots for p in descendants(r)}
        return {p: s for p in pids if (s := cpu_seconds(p)) is not None}

    def start(self) -> None:
        self.before = self._read()
        self.before_client = cpu_seconds(self.client_pid) or 0.0

    def stop(self) -> dict[str, float]:
        after = self._read()
        out: dict[str, float] = {}
        for pid, seconds in after.items():
            used = seconds - self.before.get(pid, 0.0)
            name = process_name(pid)
            out[name] = out.get(name, 0.0) + used
        out["client (this process)"] = (cpu_seconds(self.client_pid) or 0.0) - self.before_client
        return out


class NatsMeter:
    """Messages through a nats-server between `start()` and `stop()`, by connection name (a stage
    connects as `brigade-<stage>`), from its monitoring endpoint: `published` counts what the
    connection sent (events, acks, pull requests), `delivered` what the server sent it."""

    def __init__(self, monitor_url: str) -> None:
        self.url = monitor_url.rstrip("/") + "/connz?limit=4096"

    def _read(self) -> dict[int, tuple[str, int, int]]:
        with urllib.request.urlopen(self.url, timeout=10) as resp:
            conns = json.load(resp).get("connections") or []
        return {c["cid"]: (c.get("name") or "unnamed", c["in_msgs"], c["out_msgs"]) for c in conns}

    def start(self) -> None:
        self.before = self._read()

    def stop(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for cid, (name, published, delivered) in self._read().items():
            _, p0, d0 = self.before.get(cid, (name, 0, 0))
            row = out.setdefault(name, {"published": 0, "delivered": 0})
            row["published"] += published - p0
            row["delivered"] += delivered - d0
        return out


# ---- one side's figures ----


def summary(
    samples: list[Sample],
    wall_s: float,
    cpu_s: dict[str, float] | None,
    nats_msgs: dict[str, dict[str, int]] | None = None,
) -> dict:
    ok = [s for s in samples if s.ok]
    tokens = sum(s.num_tokens for s in ok)
    out = {
        "requests": len(samples),
        "completed": len(ok),
        "errors": sorted({s.error for s in samples if s.error})[:3],
        "tokens": tokens,
        "retried": sum(s.retries for s in samples),
        "wall_s": wall_s,
        "aggregate_tps": tokens / wall_s if wall_s > 0 else 0.0,
        "ttft_ms": percentiles([s.ttft_ms for s in ok if s.ttft_ms is not None]),
        "itl_ms": percentiles([g for s in ok for g in s.gaps_ms]),
        "stream_tps": percentiles([s.tps for s in ok if s.tps is not None]),
    }
    if cpu_s is not None:
        out["cpu_ms_per_token"] = {
            name: 1e3 * seconds / max(tokens, 1) for name, seconds in sorted(cpu_s.items())
        }
        out["cpu_ms_per_token_total"] = sum(out["cpu_ms_per_token"].values())
    if nats_msgs is not None:
        per = max(tokens, 1)
        out["nats_msgs_per_token"] = {
            name: {k: n / per for k, n in row.items()} for name, row in sorted(nats_msgs.items())
        }
        total = sum(r["published"] + r["delivered"] for r in nats_msgs.values())
        out["nats_msgs_per_token_total"] = total / per
        server_s = (cpu_s or {}).get("nats-server")
        if server_s is not None and total:
            out["nats_server_us_per_msg"] = 1e6 * server_s / total
    return out


def engine_alone(engine, items: list[WorkItem], concurrency: int) -> tuple[list[Sample], float]:
    """A closed loop on the engine's own step: a free client adds its next request at once."""
    from engine import SamplingParams

    todo = list(reversed(items))
    sent: dict[str, int] = {}
    stamps: dict[str, list[int]] = {}
    finished: set[str] = set()
    by_id = {f"serve-{it.index}": it for it in items}
    began = time.perf_counter_ns()
    while todo or engine.has_unfinished_requests():
        while todo and len(sent) - len(finished) < concurrency:
            item = todo.pop()
            rid = f"serve-{item.index}"
            ids = engine.tokenizer.encode_chat([{"role": "user", "content": item.prompt}])
            params = SamplingParams(temperature=0.0, max_tokens=item.max_tokens, ignore_eos=True)
            engine.add_request(rid, ids, params)
            sent[rid], stamps[rid] = time.perf_counter_ns(), []
        for out in engine.step():
            now = time.perf_counter_ns()
            stamps[out.request_id] += [now] * len(out.new_token_ids)
            if out.finished:
                finished.add(out.request_id)
    wall = (time.perf_counter_ns() - began) / 1e9
    samples = []
    for rid, times in stamps.items():
        item = by_id[rid]
        s = Sample(index=item.index, request_id=rid, ok=len(times) == item.max_tokens)
        s.num_tokens = len(times)
        s.ttft_ms = (times[0] - sent[rid]) / 1e6 if times else None
        s.gaps_ms = [(b - a) / 1e6 for a, b in zip(times, times[1:], strict=False)]
        s.e2e_ms = (times[-1] - sent[rid]) / 1e6 if times else None
        if len(times) > 1:
            s.tpot_ms = (times[-1] - times[0]) / 1e6 / (len(times) - 1)
            s.tps = 1e3 / s.tpot_ms if s.tpot_ms > 0 else None
        if not s.ok:
            s.error = f"{len(times)} of {item.max_tokens} tokens"
        samples.append(s)
    return sorted(samples, key=lambda s: s.index), wall


def drive_http(base_url: str, api_key: str | None, model: str, items, concurrency: int):
    """The same streaming client for the edge and for llama-server."""
    import anyio

    async def go():
        async with SseTarget(base_url, api_key, 600.0, model, retries_on_503=RETRIES) as target:
            return await run_load(target, items, concurrency=concurrency, show_progress=False)

    result = anyio.run(go)
    return result.samples, result.duration_s


# ---- servers ----


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, proc: subprocess.Popen, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode} while starting")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"{what} was not ready at {url} within {timeout_s:.0f} s")


def stop_process(proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@dataclass
class Pipeline:
    """`brigade up` in a child process on a private data dir, NATS and edge port."""

    procs: bool
    data_dir: Path
    api_key: str = "sk-brigade-bench-serve"
    env: dict[str, str] = field(default_factory=dict)  # settings of this side

    def __enter__(self) -> Pipeline:
        self.port = free_port()
        env = dict(
            os.environ,
            BRIGADE_DATA_DIR=str(self.data_dir),
            BRIGADE_EDGE_PORT=str(self.port),
            BRIGADE_API_KEY=self.api_key,
            **self.env,
        )
        for name in ("NATS_URL", "BRIGADE_TENANTS"):
            env.pop(name, None)
        argv = [sys.executable, "-m", "tools.cli", "up", *(["--procs"] if self.procs else [])]
        self.log = open(self.data_dir / "up.log", "wb")  # noqa: SIM115 - closed in __exit__
        self.proc = subprocess.Popen(
            argv, env=env, stdout=self.log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent
        )
        self.url = f"http://127.0.0.1:{self.port}"
        try:
            wait_http(self.url + "/health", self.proc, 600, "brigade up")
        except Exception as err:
            self.__exit__()
            tail = (self.data_dir / "up.log").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{err}; its output ended:\n{tail}") from None
        return self

    def nats_meter(self) -> NatsMeter | None:
        """The private nats-server's message counts (None without its monitoring port)."""
        server = natsd.find_running(self.data_dir)
        return NatsMeter(server.monitor_url) if server and server.monitor_url else None

    def __exit__(self, *exc) -> None:
        stop_process(self.proc)
        self.log.close()


@dataclass
class LlamaServer:
    binary: Path
    gguf: Path
    parallel: int
    threads: int
    ctx_per_slot: int

    def __enter__(self) -> LlamaServer:
        self.port = free_port()
        argv = [str(self.binary), "-m", str(self.gguf), "--host", "127.0.0.1"]
        argv += ["--port", str(self.port), "-np", str(self.parallel), "-t", str(self.threads)]
        argv += ["-c", str(self.parallel * self.ctx_per_slot), "--no-webui"]
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=die_with_parent
        )
        self.url = f"http://127.0.0.1:{self.port}"
        try:
            wait_http(self.url + "/health", self.proc, 300, "llama-server")
        except Exception:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        stop_process(self.proc)


# ---- the run ----


def run(args: argparse.Namespace) -> int:
    levels = [int(c) for c in str(args.concurrency).split(",") if c.strip()]
    if args.quick:
        levels, args.max_tokens = [1, 4], 32
        args.procs_at = 4
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    unknown = sorted(set(sides) - set(SIDES))
    if unknown or not levels or min(levels) < 1:
        print(f"bench serve: sides {unknown} unknown or no concurrency given", file=sys.stderr)
        return 2

    def progress(msg: str) -> None:
        print(f"  [{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    load_before = os.getloadavg()[0]
    me = os.getpid()
    results: dict[str, dict[int, dict]] = {}
    notes: list[str] = []
    model = settings.MODEL.get()
    eng = None
    if "engine" in sides:
        from engine import Engine
        from stages.engine_params import engine_config_from_env

        progress("engine alone: loading the model")
        eng = Engine(engine_config_from_env())
        engine_alone(eng, work_items(2, 8), 2)  # warm-up

    def engine_side(c: int) -> dict:
        items = work_items(c * args.requests, args.max_tokens)
        cpu = CpuMeter([], me)
        cpu.start()
        samples, wall = engine_alone(eng, items, c)
        return summary(samples, wall, cpu.stop())

    def pipeline_side(up: Pipeline, c: int) -> dict:
        items = work_items(c * args.requests, args.max_tokens)
        cpu, msgs = CpuMeter([up.proc.pid], me), up.nats_meter()
        cpu.start()
        if msgs is not None:
            msgs.start()
        samples, wall = drive_http(up.url, up.api_key, model, items, c)
        counted = msgs.stop() if msgs is not None else None
        return summary(samples, wall, cpu.stop(), counted)

    alternated = args.rounds > 1 and eng is not None and "pipeline" in sides
    if alternated:
        results["engine"], results["pipeline"] = {}, {}
        with tempfile.TemporaryDirectory(prefix="brigade-serve-") as tmp:
            progress(f"engine alone and pipeline, alternated {args.rounds} times")
            with Pipeline(procs=False, data_dir=Path(tmp)) as up:
                drive_http(up.url, up.api_key, model, work_items(2, 8), 2)  # warm-up
                for c in levels:
                    rounds = []
                    for r in range(args.rounds):
                        rounds.append((engine_side(c), pipeline_side(up, c)))
                        e, p = rounds[-1]
                        progress(f"{c} streams, round {r + 1}: engine {e['aggregate_tps']:.1f}, "
                                 f"pipeline {p['aggregate_tps']:.1f} tok/s")  # fmt: skip
                    e, p = median_round(rounds)
                    results["engine"][c], results["pipeline"][c] = e, p
    elif eng is not None:
        results["engine"] = {}
        for c in levels:
            results["engine"][c] = engine_side(c)
            progress(
                f"engine alone, {c} streams: {results['engine'][c]['aggregate_tps']:.1f} tok/s"
            )
    eng = None  # the model's memory back before the other sides start
    levers = dict(args.lever)
    for side in ("pipeline", *levers, "procs"):
        if side not in sides and side not in levers or (side == "pipeline" and alternated):
            continue
        at = [args.procs_at] if side == "procs" else levels
        env = levers.get(side, {})
        with tempfile.TemporaryDirectory(prefix="brigade-serve-") as tmp:
            progress(f"{side}: starting brigade up{' --procs' if side == 'procs' else ''}")
            with Pipeline(procs=side == "procs", data_dir=Path(tmp), env=env) as up:
                drive_http(up.url, up.api_key, model, work_items(2, 8), 2)  # warm-up
                results[side] = {}
                for c in at:
                    results[side][c] = pipeline_side(up, c)
                    progress(f"{side}, {c} streams: {results[side][c]['aggregate_tps']:.1f} tok/s")
    if args.url:
        pids = deployment_pids(me)
        results["deployment"] = {}
        drive_http(args.url, args.api_key, model, work_items(2, 8), 2)  # warm-up
        for c in levels:
            items = work_items(c * args.requests, args.max_tokens)
            cpu = CpuMeter(pids, me)
            cpu.start()
            samples, wall = drive_http(args.url, args.api_key, model, items, c)
            results["deployment"][c] = summary(samples, wall, cpu.stop())
            progress(
                f"deployment, {c} streams: {results['deployment'][c]['aggregate_tps']:.1f} tok/s"
            )
        notes.append(
            f"deployment: the edge at {args.url}; CPU of the {len(pids)} Brigade stage and "
            "nats-server processes this host shows"
        )
    floor: dict[int, dict] = {}
    pipe = results.get("pipeline", {})
    if not args.no_floor and pipe:
        progress(
            "the floor: one JetStream hop through a relay, no stage code, at each level's pace"
        )
        floor = relay_cost({c: pipe[c]["aggregate_tps"] for c in levels if c in pipe})
    if "llama-server" in sides:
        binary = llama_server_binary(args.llama_cpp_dir)
        if isinstance(binary, str):
            notes.append(f"llama-server not measured: {binary}")
            progress(notes[-1])
        else:
            from engine.weights import model_format, resolve_model

            gguf = resolve_model(model)
            if model_format(gguf) != "gguf":
                raise SystemExit(f"bench serve: llama-server needs a .gguf model, not {gguf}")
            results["llama-server"] = {}
            for c in levels:
                ctx = 64 + args.max_tokens + 64
                with LlamaServer(binary, gguf, c, args.threads, ctx) as ls:
                    drive_http(ls.url, None, model, work_items(2, 8), 2)  # warm-up
                    items = work_items(c * args.requests, args.max_tokens)
                    cpu = CpuMeter([ls.proc.pid], me)
                    cpu.start()
                    samples, wall = drive_http(ls.url, None, model, items, c)
                    results["llama-server"][c] = summary(samples, wall, cpu.stop())
                progress(
                    f"llama-server, {c} streams: "
                    f"{results['llama-server'][c]['aggregate_tps']:.1f} tok/s"
                )
    report = {
        "levels": levels,
        "max_tokens": args.max_tokens,
        "requests_per_client": args.requests,
        "model": model,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python "
        f"{platform.python_version()}, 1-min load average {load_before:.1f} before and "
        f"{os.getloadavg()[0]:.1f} after the run",
        "sides": results,
        "levers": levers,
        "relay_floor": {str(c): f for c, f in floor.items()},
        "targets": targets(
            results,
            [c for c in levels if c >= 8],
            "pipeline" if "pipeline" in results else "deployment",
            floor,
        ),
        "notes": notes,
    }
    table = markdown(report)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "serve.md").write_text(table + "\n")
    (args.out / "serve.json").write_text(json.dumps(report, indent=1))
    print(table)
    print(f"\nwrote {args.out / 'serve.md'} and {args.out / 'serve.json'}", file=sys.stderr)
    failed = sum(r["requests"] - r["completed"] for side in results.values() for r in side.values())
    return 0 if failed == 0 else 1


def median_round(rounds: list[tuple[dict, dict]]) -> tuple[dict, dict]:
    """(engine, pipeline) summaries of alternated rounds -> the round of the median ratio
    (the lower middle of an even count), its pipeline carrying every round's ratio in order."""
    ratios = [p["aggregate_tps"] / max(e["aggregate_tps"], 1e-9) for e, p in rounds]
    middle = sorted(range(len(rounds)), key=ratios.__getitem__)[(len(rounds) - 1) // 2]
    engine, pipeline = rounds[middle]
    return engine, {**pipeline, "rounds_of_engine": ratios}


def llama_server_binary(llama_cpp_dir: Path | None) -> Path | str:
    """The llama-server to run, or why there is none."""
    from tools.bench import llama_cpp

    found = (
        llama_cpp.find(llama_cpp_dir)
        if llama_cpp_dir is not None
        else llama_cpp.cached(settings.DATA_DIR.get())
    )
    if found is None:
        where = llama_cpp_dir or llama_cpp.cache_root(settings.DATA_DIR.get())
        return f"no llama.cpp build under {where} (run `brigade bench peer` once, or set LLAMA_CPP_DIR)"
    if found.server is None:
        return f"the llama.cpp build at {found.bench.parent} has no llama-server"
    return found.server


def targets(
    results: dict[str, dict[int, dict]],
    levels: list[int],
    side: str = "pipeline",
    floor: dict[int, dict] | None = None,
) -> dict[str, dict]:
    """Each target at each level where both sides it compares were measured; `side` is the
    pipeline's (a --url deployment's where no pipeline side ran); `floor`, one relay hop's
    cost at each level (hops.relay_cost)."""
    out: dict[str, dict] = {}
    pipe, eng, peer = (results.get(k, {}) for k in (side, "engine", "llama-server"))
    for c in levels:
        if c not in pipe:
            continue
        p, row = pipe[c], {}
        if c in eng:
            row["of_engine"] = p["aggregate_tps"] / max(eng[c]["aggregate_tps"], 1e-9)
            row["of_engine_ok"] = row["of_engine"] >= TARGET_OF_ENGINE
            if p.get("rounds_of_engine"):  # --rounds: the median round's, and every round's
                row["of_engine_rounds"] = p["rounds_of_engine"]
            cpu = cpu_ceiling(eng[c], p, (floor or {}).get(c))
            if cpu is not None:
                row.update(cpu)
            step = eng[c]["itl_ms"]["p50"]
            if step and p["itl_ms"]["p95"] is not None:
                row["itl_p95_of_step"] = p["itl_ms"]["p95"] / step
                row["itl_ok"] = row["itl_p95_of_step"] <= TARGET_ITL_OF_STEP
        if c in peer:
            row["of_llama_server"] = p["aggregate_tps"] / max(peer[c]["aggregate_tps"], 1e-9)
            row["of_llama_server_ok"] = row["of_llama_server"] >= TARGET_OF_LLAMA
            a, b = p["ttft_ms"]["p95"], peer[c]["ttft_ms"]["p95"]
            if a is not None and b is not None:
                row["ttft_p95_below_llama_server"] = a < b
        out[str(c)] = row
    return out


def cpu_ceiling(engine: dict, pipeline: dict, floor: dict | None = None) -> dict | None:
    """Where the engine alone keeps every core busy, the pipeline runs on the same cores, so its
    aggregate is at most the engine's times (the engine's CPU per token / the pipeline's): the
    ceiling its measured CPU sets. And the CPU per token the pipeline may spend beyond the
    engine alone's for the 0.90 target. With `floor` (one relay hop's cost at this level's pace,
    hops.relay_cost), the ceiling of a pipeline whose only cost beside the engine were that hop:
    every token crosses one, so no stage code can take the pipeline above it."""
    a, b = engine.get("cpu_ms_per_token_total"), pipeline.get("cpu_ms_per_token_total")
    if not a or not b:
        return None
    out = {
        "cpu_ceiling_of_engine": a / b,
        "cpu_ms_per_token_engine": a,
        "cpu_ms_per_token_pipeline": b,
        "cpu_ms_per_token_allowed_beyond_engine": a / TARGET_OF_ENGINE - a,
    }
    if floor is not None:
        hop = floor["cpu_ms_per_message_total"]
        out["floor_cpu_ms_per_token"] = hop
        out["floor_ceiling_of_engine"] = a / (a + hop)
    return out


def _f(value: float | None, digits: int = 1) -> str:
    return "—" if value is None else f"{value:,.{digits}f}"


def markdown(report: dict) -> str:
    sides = report["sides"]
    lines = [
        "# brigade bench serve",
        "",
        f"{report['model']}; {report['max_tokens']} output tokens per request (ignore_eos, "
        f"temperature 0), {report['requests_per_client']} requests per client; "
        f"{report['machine']}.",
        "",
        "| side | streams | aggregate tok/s | TTFT P50 ms | TTFT P95 ms | ITL P50 ms | "
        "ITL P95 ms | per-stream tok/s P50 | CPU ms/token | completed | 503s retried |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, by_level in sides.items():
        for c, r in sorted(by_level.items(), key=lambda kv: int(kv[0])):
            lines.append(
                f"| {name} | {c} | {_f(r['aggregate_tps'])} | {_f(r['ttft_ms']['p50'])} | "
                f"{_f(r['ttft_ms']['p95'])} | {_f(r['itl_ms']['p50'], 2)} | "
                f"{_f(r['itl_ms']['p95'], 2)} | {_f(r['stream_tps']['p50'])} | "
                f"{_f(r.get('cpu_ms_per_token_total'), 2)} | {r['completed']}/{r['requests']} | {r.get('retried', 0)} |"
            )
    if report["targets"]:
        lines += [
            "",
            "| streams | pipeline / engine (≥ 0.90) | pipeline / llama-server (≥ 2.0) | "
            "TTFT P95 below llama-server's | pipeline ITL P95 / engine step (≤ 1.5) |",
            "|---:|---:|---:|---|---:|",
        ]
        for c, t in report["targets"].items():
            ttft = t.get("ttft_p95_below_llama_server")
            lines.append(
                f"| {c} | {_f(t.get('of_engine'), 2)} | {_f(t.get('of_llama_server'), 2)} | "
                f"{'—' if ttft is None else ('yes' if ttft else 'no')} | "
                f"{_f(t.get('itl_p95_of_step'), 2)} |"
            )
        rounds = [(c, t["of_engine_rounds"]) for c, t in report["targets"].items()
                  if t.get("of_engine_rounds")]  # fmt: skip
        if rounds:
            lines += [
                "",
                "The engine alone and the pipeline alternated at each level, both loaded "
                "throughout; the rows above are the round of the median ratio. Every round's "
                "pipeline / engine: "
                + "; ".join(f"{c} streams {', '.join(f'{x:.2f}' for x in r)}" for c, r in rounds)
                + ".",
            ]
        cpu = [(c, t) for c, t in report["targets"].items() if "cpu_ceiling_of_engine" in t]
        if cpu:
            lines += [
                "",
                "The engine alone keeps both cores busy, so the pipeline's aggregate is bounded by"
                " the CPU it spends per token: at most the engine's times (the engine's CPU ms per"
                " token / the pipeline's).",
                "",
                "| streams | CPU ms/token engine alone | pipeline | ceiling from CPU | measured "
                "| CPU ms/token the 0.90 target allows beyond the engine alone | one relay hop, "
                "no stage code: CPU ms/token | ceiling with only that hop |",
                "|---:|---:|---:|---:|---:|---:|---:|---:|",
            ]
            for c, t in cpu:
                lines.append(
                    f"| {c} | {_f(t['cpu_ms_per_token_engine'], 2)} | "
                    f"{_f(t['cpu_ms_per_token_pipeline'], 2)} | "
                    f"{_f(t['cpu_ceiling_of_engine'], 2)} | {_f(t.get('of_engine'), 2)} | "
                    f"{_f(t['cpu_ms_per_token_allowed_beyond_engine'], 2)} | "
                    f"{_f(t.get('floor_cpu_ms_per_token'), 2)} | "
                    f"{_f(t.get('floor_ceiling_of_engine'), 2)} |"
                )
            if any("floor_cpu_ms_per_token" in t for _, t in cpu):
                lines += [
                    "",
                    "The last two columns: the relay hop below (no SSE, no archiver either), "
                    "and its ceiling, the engine's CPU per token over the engine's plus the hop's.",
                ]
    floor = report.get("relay_floor") or {}
    if floor:
        lines += [
            "",
            "One JetStream hop through a relay with no stage code (the floor of a streamed "
            "token's path: engine -> log -> detokenize -> log -> edge), bursts of one message a "
            "stream at the pipeline's token rate; CPU ms per message and its latency:",
            "",
            "| streams | messages/s | relay | nats-server | client (publish + receive) | total "
            "| P50 ms | P95 ms |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for c, f in sorted(floor.items(), key=lambda kv: int(kv[0])):
            per = f["cpu_ms_per_message"]
            lines.append(
                f"| {c} | {_f(f['per_second'])} | {_f(per.get('relay'), 3)} | "
                f"{_f(per.get('nats-server'), 3)} | {_f(per.get('client'), 3)} | "
                f"{_f(f['cpu_ms_per_message_total'], 3)} | {_f(f['p50_ms'], 2)} | "
                f"{_f(f['p95_ms'], 2)} |"
            )
    levers = report.get("levers") or {}
    if "pipeline" in sides and any(name in sides for name in levers):
        lines += [
            "",
            "Levers: each a pipeline side with the settings named, against the default pipeline "
            "of this run:",
            "",
            "| lever | settings | streams | aggregate, lever / default | ITL P95 ms, lever / "
            "default | CPU ms/token, lever / default |",
            "|---|---|---:|---:|---|---|",
        ]
        base = sides["pipeline"]
        for name, env in levers.items():
            given = " ".join(f"`{k}={v}`" for k, v in env.items())
            for c, on in sorted(sides.get(name, {}).items(), key=lambda kv: int(kv[0])):
                o = base.get(c)
                if o is None:
                    continue
                lines.append(
                    f"| {name} | {given} | {c} | "
                    f"{_f(on['aggregate_tps'] / max(o['aggregate_tps'], 1e-9), 2)} | "
                    f"{_f(on['itl_ms']['p95'], 2)} / {_f(o['itl_ms']['p95'], 2)} | "
                    f"{_f(on.get('cpu_ms_per_token_total'), 2)} / "
                    f"{_f(o.get('cpu_ms_per_token_total'), 2)} |"
                )
    for name, by_level in sides.items():
        for c, r in sorted(by_level.items(), key=lambda kv: int(kv[0])):
            if name in ("engine",) or "cpu_ms_per_token" not in r:
                continue
            lines += ["", f"CPU ms per generated token, {name} at {c} streams:", ""]
            lines += ["| process | CPU ms / token |", "|---|---:|"]
            for proc, ms in sorted(r["cpu_ms_per_token"].items(), key=lambda kv: -kv[1]):
                if ms >= 0.005:
                    lines.append(f"| {proc} | {ms:.2f} |")
            lines.append(f"| **total** | **{r['cpu_ms_per_token_total']:.2f}** |")
            msgs = r.get("nats_msgs_per_token")
            if msgs:
                cost = r.get("nats_server_us_per_msg")
                lines += [
                    "",
                    f"NATS messages per generated token, {name} at {c} streams: "
                    f"{r['nats_msgs_per_token_total']:.2f} in all"
                    + (f", {cost:.1f} us of nats-server CPU each" if cost else "")
                    + ":",
                    "",
                    "| connection | published | delivered |",
                    "|---|---:|---:|",
                ]
                for conn, row in sorted(msgs.items(), key=lambda kv: -sum(kv[1].values())):
                    if row["published"] + row["delivered"] >= 0.005:
                        lines.append(
                            f"| {conn} | {row['published']:.2f} | {row['delivered']:.2f} |"
                        )
    lines += [f"\n{n}" for n in report["notes"]]
    return "\n".join(lines)
