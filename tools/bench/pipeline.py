"""`brigade bench pipeline`: the same requests through the engine alone and through every stage,
in one run; Brigade's own overhead per request and per streamed token, from the events."""

from __future__ import annotations

import gc
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

from schemas import settings
from tools.bench.pipeline_report import Seen, analyse, markdown, pct

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colours.",
    "How many legs does a spider have?",
    "Give one word that rhymes with cat.",
    "What is 7 times 8?",
    "Say hello in Spanish.",
    "Which planet is closest to the sun?",
    "What colour is the sky on a clear day?",
]
TARGETS_MS = {
    "overhead_p50": 2.0,
    "overhead_p95": 5.0,
    "token_trip_p95": 1.0,
    "added_per_hop_p50": 0.5,  # a stage's hop over the bare relay's, in the same run
    "text_trip_p95": 2.0,  # engine publish -> the client has the text, at TEXT_TRIP_AT in flight
}
TEXT_TRIP_AT = 8


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "pipeline", help="full pipeline vs engine alone: per-stage overhead from the events"
    )
    p.add_argument("--requests", type=int, default=40, help="requests per side (default 40)")
    p.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        default=[1, 8, 20],
        help="requests in flight, one run per value (default 1 8 20)",
    )
    p.add_argument(
        "--no-hops",
        action="store_true",
        help="skip the bare relay (a JetStream hop through a Python relay with no stage code), "
        "which is measured on the same server at each concurrency",
    )
    p.add_argument("--max-tokens", type=int, default=16, help="output tokens per request")
    p.add_argument("--out", type=Path, default=Path(".brigade/bench"), help="output directory")
    p.add_argument("--quick", action="store_true", help="8 requests, 4 in flight, 8 tokens")
    p.add_argument(
        "--model",
        help="model for every stage (sets BRIGADE_MODEL): a registered name, a .gguf or an HF dir",
    )
    p.add_argument(
        "--in-process",
        action="store_true",
        help="the layout of `brigade up`: the engine and ledger in their own processes, the "
        "other stages in this one (default: one process per stage, as compose and `--procs`)",
    )
    p.set_defaults(func=run)


def workload(tokenizer, n: int, max_tokens: int) -> list[dict]:
    out = []
    for i in range(n):
        q = QUESTIONS[i % len(QUESTIONS)]
        ids = tokenizer.encode_chat([{"role": "user", "content": q}])
        out.append({"question": q, "prompt_ids": ids, "seed": 1000 + i, "max_tokens": max_tokens})
    return out


# ---- the engine alone ----


def engine_alone(engine, work: list[dict], concurrency: int) -> dict:
    """Closed loop on the core: `concurrency` requests in flight, wall-clock per request."""
    from engine import SamplingParams

    todo = list(enumerate(work))
    start, first, end, ids = {}, {}, {}, {}
    began = time.perf_counter_ns()
    while todo or engine.has_unfinished_requests():
        while todo and len(start) - len(end) < concurrency:
            i, w = todo.pop(0)
            params = SamplingParams(
                temperature=0.7, seed=w["seed"], max_tokens=w["max_tokens"], ignore_eos=True
            )
            engine.add_request(f"alone-{i}", w["prompt_ids"], params)
            start[i] = time.perf_counter_ns()
            ids[i] = []
        for out in engine.step():
            i = int(out.request_id.split("-")[1])
            now = time.perf_counter_ns()
            if out.new_token_ids:
                first.setdefault(i, now)
                ids[i] += out.new_token_ids
            if out.finished:
                end[i] = now
    wall = (time.perf_counter_ns() - began) / 1e9
    return {
        "ttft_ms": [(first[i] - start[i]) / 1e6 for i in start],
        "e2e_ms": [(end[i] - start[i]) / 1e6 for i in start],
        "tokens": sum(len(v) for v in ids.values()),
        "wall_s": wall,
        "token_ids": [ids[i] for i in sorted(ids)],
    }


# ---- the pipeline ----


async def through_pipeline(config, api_key: str, work: list[dict], concurrency: int) -> dict:
    import anyio
    import msgspec

    from schemas import subjects
    from schemas.events import Message, Submit, decode_event
    from stages.runtime.bus import Bus, publish_submit

    bus = await Bus.connect(config, name="brigade-bench")
    seen: dict[str, Seen] = {}

    async def received(msg) -> None:
        """Stamp the arrival and keep the bytes; decoding waits until the run is over, so one
        event's decode never delays the next one's receipt."""
        now = time.time_ns()
        _, _, rid, tag = msg.subject.split(".")[:4]  # a routed event has its model after
        rec = seen.get(rid)
        if rec is None:
            return
        rec.raw.append((now, msg.data))
        if tag in ("completed", "cancelled", "failed"):
            rec.done.set()

    sub = await bus.nc.subscribe(subjects.ALL_EVENTS, cb=received, pending_msgs_limit=1_000_000)
    await bus.nc.flush()
    limit = anyio.Semaphore(concurrency)
    began = time.perf_counter_ns()

    async def one(i: int, w: dict) -> None:
        async with limit:
            rid = f"bench{os.getpid()}c{concurrency}x{i}"  # new ids at each level
            rec = seen[rid] = Seen(done=anyio.Event())
            submit = Submit(
                request_id=rid,
                api_key=api_key,
                messages=[Message(role="user", content=w["question"])],
                temperature=0.7,
                seed=w["seed"],
                max_tokens=w["max_tokens"],
                ignore_eos=True,
            )
            rec.sent_ns = time.time_ns()
            await publish_submit(bus.js, submit)
            with anyio.fail_after(600):
                await rec.done.wait()
            await anyio.sleep(0.3)  # let the last deltas and the bill arrive

    async with anyio.create_task_group() as tg:
        for i, w in enumerate(work):
            tg.start_soon(one, i, w)
    wall = (time.perf_counter_ns() - began) / 1e9
    await sub.unsubscribe()
    await bus.close()
    for rec in seen.values():
        for now, data in rec.raw:
            try:
                rec.events.append((now, decode_event(data)))
            except (msgspec.DecodeError, msgspec.ValidationError):
                pass
    return {"seen": seen, "wall_s": wall}


async def _client_side(config, api_key, work, levels, here, progress) -> dict[int, dict]:
    """Stages `here` as tasks of this process (none with --procs), then the client at each
    level of requests in flight."""
    import anyio

    from tools.stage import serve_stage

    stop = anyio.Event()
    async with anyio.create_task_group() as tg:
        for name in here:
            ready = anyio.Event()
            tg.start_soon(
                lambda n=name, r=ready: serve_stage(
                    n, config=config, stop=stop, ready=r, handle_signals=False
                )
            )
            await ready.wait()
        progress(f"pipeline: stages up ({', '.join(here) or 'none'} in this process); sending")
        out = {}
        for concurrency in levels:
            out[concurrency] = await through_pipeline(config, api_key, work, concurrency)
            progress(f"pipeline: {concurrency} in flight done")
        stop.set()
    return out


def _pipeline_side(server, config, api_key, work, levels, in_process, progress) -> dict:
    """Every stage a `brigade stage NAME` process, as compose runs them; or, with --in-process,
    the layout of `brigade up`: the engine and ledger as children, the rest in this process."""
    import anyio

    from tools.stage import PIPELINE
    from tools.stage_procs import StageProcesses
    from tools.up import CHILD_STAGES

    own = tuple(n for n in PIPELINE if n in CHILD_STAGES or not in_process)
    here = tuple(n for n in PIPELINE if n not in own)
    children = StageProcesses(server.url, server.monitor_url)
    try:
        for name in own:
            children.start(name)
            children.wait_up(name, 300)
        return anyio.run(
            _client_side, config, api_key, work, levels, here, progress,
            backend="asyncio", backend_options={"use_uvloop": True},
        )  # fmt: skip
    finally:
        children.stop(timeout_s=20)


def bare_relay(url: str, levels: list[int], messages: int = 200) -> dict[int, dict]:
    """One JetStream hop through a Python relay with no stage code (tools/bench/hops.py), on
    the pipeline's own server: publish, stored, pulled by the relay, published on, received."""
    from tools.bench import hops

    hops.create_stream(url)
    chain = hops.run_chain(url, 1, "jetstream", levels, messages, pipelined=True)
    return {c: chain[str(c)] for c in levels}


def run(args) -> int:
    if args.quick:
        args.requests, args.concurrency, args.max_tokens = 8, [1, 4], 8
    levels = list(dict.fromkeys(args.concurrency))

    def progress(msg: str) -> None:
        print(f"  [{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    if args.model:
        os.environ["BRIGADE_MODEL"] = args.model
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="brigade-bench-") as tmp:
        os.environ["BRIGADE_DATA_DIR"] = tmp  # ledger, tenants and archive of this run only
        os.environ.pop("BRIGADE_TENANTS", None)
        from engine import Engine
        from stages.engine_params import engine_config_from_env
        from stages.runtime import natsd
        from stages.runtime.bus import BusConfig
        from stages.tenancy import tenants

        progress("loading the model")
        engine = Engine(engine_config_from_env())
        work = workload(engine.tokenizer, args.requests, args.max_tokens)
        engine_alone(engine, work[: min(4, len(work))], max(levels))  # warm-up
        alone = {}
        for c in levels:
            progress(f"engine alone: {args.requests} requests, {c} in flight")
            alone[c] = engine_alone(engine, work, c)
        server = natsd.start(Path(tmp) / "nats")
        try:
            bare = {}
            if not args.no_hops:
                progress("bare relay: one JetStream hop, no stage code, on the same server")
                bare = bare_relay(server.url, levels)
            api_key = tenants.add_key("bench")
            config = BusConfig(servers=(server.url,))
            progress("pipeline: starting every stage on a private nats-server")
            del engine  # the engine stage loads its own, in its own process
            gc.collect()
            piped = _pipeline_side(server, config, api_key, work, levels, args.in_process, progress)
        finally:
            natsd.stop(server)
    runs = {}
    for c in levels:
        pipe = analyse(piped[c]["seen"])
        pipe["wall_s"] = piped[c]["wall_s"]
        pipe["tokens"] = sum(len(x) for x in pipe["token_ids"])
        runs[c] = level_result(alone[c], pipe, bare.get(c), c)
    result = {
        "requests": args.requests,
        "levels": levels,
        "max_tokens": args.max_tokens,
        "layout": "as `brigade up`: engine and ledger in their own processes, the other stages "
        "in one with the client"
        if args.in_process
        else "one process per stage",
        "model": settings.MODEL.get(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"1-min load average {load_before:.1f} before and {os.getloadavg()[0]:.1f} after the run",
        "runs": {str(c): r for c, r in runs.items()},
    }
    table = markdown(result)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "pipeline.md").write_text(table + "\n")
    (args.out / "pipeline.json").write_text(json.dumps(result, indent=1))
    print(table)
    print(f"\nwrote {args.out / 'pipeline.md'} and {args.out / 'pipeline.json'}", file=sys.stderr)
    return 0 if all(r["pipeline"]["failed"] == 0 for r in runs.values()) else 1


def level_result(alone: dict, pipe: dict, bare: dict | None, concurrency: int) -> dict:
    """One level's figures and targets: the pipeline against the engine alone and, per stage,
    its hop (input stored -> output stamped) over the bare relay's."""
    added = {}
    if bare is not None:
        for stage, hops_ms in pipe["stage_hop_ms"].items():
            if hops_ms:
                added[stage] = {
                    "hop_p50_ms": pct(hops_ms, 0.5),
                    "hop_p95_ms": pct(hops_ms, 0.95),
                    "added_p50_ms": pct(hops_ms, 0.5) - bare["p50_ms"],
                }
    text_trip = pct(pipe["text_trip_ms"], 0.95)
    return {
        "concurrency": concurrency,
        "alone": {k: v for k, v in alone.items() if k != "token_ids"},
        "pipeline": {k: v for k, v in pipe.items() if k != "token_ids"},
        "bare_relay": bare,
        "added_over_bare": added,
        "same_token_ids": sorted(map(tuple, alone["token_ids"]))
        == sorted(map(tuple, pipe["token_ids"])),
        "targets": {
            "overhead": bool(pipe["overhead_ms"])
            and pct(pipe["overhead_ms"], 0.5) <= TARGETS_MS["overhead_p50"]
            and pct(pipe["overhead_ms"], 0.95) <= TARGETS_MS["overhead_p95"],
            "token_trip": bool(pipe["token_trip_ms"])
            and pct(pipe["token_trip_ms"], 0.95) <= TARGETS_MS["token_trip_p95"],
            "added_per_hop": {
                stage: a["added_p50_ms"] <= TARGETS_MS["added_per_hop_p50"]
                for stage, a in added.items()
            },
            "text_trip": None
            if concurrency != TEXT_TRIP_AT or text_trip is None
            else text_trip <= TARGETS_MS["text_trip_p95"],
            # a token's text crosses the bare relay's path (log, detokenize, log, edge): the
            # relay's P95 at this burst size, with no stage code and no engine, is its floor
            "text_trip_floor_p95_ms": None if bare is None else bare["p95_ms"],
            "text_trip_target_p95_ms": TARGETS_MS["text_trip_p95"],
        },
    }
