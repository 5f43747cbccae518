"""`brigade bench prefix`: prefix caching on a shared-system-prompt workload, on vs off.

Every request is one long system prompt (the same for all) plus its own short question, as a
chat service sends them. The requests arrive in waves of `concurrency`; each wave runs to the
end before the next. With the cache, only the first wave computes the system prompt's blocks.
Both engines run the same waves, alternating, so machine noise falls on both. Reported:
time to first token (mean and P95 over requests, from their wave's start), wall time,
aggregate tok/s and the cache's hit rate. Writes prefix.md and prefix.json.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

from tools.bench.files import write_results


def register(subparsers) -> None:
    p = subparsers.add_parser("prefix", help="prefix caching on a shared system prompt, on vs off")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--out", default=".brigade/bench", help="directory for prefix.md/.json")
    p.add_argument("--system-tokens", type=int, default=1024)
    p.add_argument("--question-tokens", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--waves", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)


def run_wave(engine, requests: list[tuple[str, list[int]]], params) -> tuple[list[float], int]:
    """Add the wave, step it to the end; -> each request's time to first token (s), tokens."""
    start = time.perf_counter()
    for rid, ids in requests:
        engine.add_request(rid, ids, params)
    first: dict[str, float] = {}
    tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += len(out.new_token_ids)
            first.setdefault(out.request_id, time.perf_counter() - start)
    return [first[rid] for rid, _ in requests], tokens


def run(args: argparse.Namespace) -> int:
    import torch

    from engine import Engine, EngineConfig, SamplingParams

    rng = random.Random(args.seed)
    engines = {
        mode: Engine(
            EngineConfig(model=args.model, dtype=args.dtype, enable_prefix_caching=mode == "on")
        )
        for mode in ("off", "on")
    }
    vocab = engines["off"].model_config.vocab_size
    system = [rng.randrange(3, vocab) for _ in range(args.system_tokens)]
    waves = [
        [
            (f"w{w}-{i}", system + [rng.randrange(3, vocab) for _ in range(args.question_tokens)])
            for i in range(args.concurrency)
        ]
        for w in range(args.waves)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    warm = [("warm", [rng.randrange(3, vocab) for _ in range(64)])]  # unrelated to the system
    ttft: dict[str, list[float]] = {"off": [], "on": []}
    wall = dict.fromkeys(ttft, 0.0)
    tokens = dict.fromkeys(ttft, 0)
    for engine in engines.values():
        run_wave(engine, warm, params)
    for w, wave in enumerate(waves):
        for mode, engine in engines.items():
            print(f"wave {w + 1}/{len(waves)}, prefix caching {mode} ...", flush=True)
            t = time.perf_counter()
            firsts, n = run_wave(engine, [(f"{mode}-{rid}", ids) for rid, ids in wave], params)
            wall[mode] += time.perf_counter() - t
            ttft[mode] += firsts
            tokens[mode] += n
    res: dict = {
        "model": args.model,
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "workload": {
            "system_tokens": args.system_tokens,
            "question_tokens": args.question_tokens,
            "max_tokens": args.max_tokens,
            "concurrency": args.concurrency,
            "waves": args.waves,
        },
        "modes": {},
    }
    for mode, engine in engines.items():
        stats = engine.stats()
        times = sorted(ttft[mode])
        res["modes"][mode] = {
            "ttft_mean_ms": round(1000 * statistics.fmean(times), 1),
            "ttft_p95_ms": round(1000 * times[min(len(times) - 1, int(0.95 * len(times)))], 1),
            "wall_s": round(wall[mode], 2),
            "tok_per_s": round(tokens[mode] / wall[mode], 1),
            "prefix_hit_rate": round(stats.num_prefix_hits / max(stats.num_prefix_queries, 1), 3),
        }
    write_results(args.out, "prefix", res, markdown(res))
    return 0


def markdown(res: dict) -> str:
    off, on = res["modes"]["off"], res["modes"]["on"]
    w = res["workload"]

    def row(label: str, key: str, better: str) -> str:
        ratio = off[key] / on[key] if better == "lower" else on[key] / off[key]
        return f"| {label} | {off[key]} | {on[key]} | {ratio:.2f}x |"

    return "\n".join(
        [
            f"Prefix caching: {res['model']} {res['dtype']}, {res['threads']} threads; "
            f"{w['waves']} waves of {w['concurrency']} requests, each a shared "
            f"{w['system_tokens']}-token system prompt + {w['question_tokens']} own tokens, "
            f"{w['max_tokens']} greedy tokens out; load average at start "
            f"{res['load_average_at_start']}",
            "",
            "| measure | cache off | cache on | gain |",
            "|---|---|---|---|",
            row("time to first token, mean (ms)", "ttft_mean_ms", "lower"),
            row("time to first token, P95 (ms)", "ttft_p95_ms", "lower"),
            row("wall time (s)", "wall_s", "lower"),
            row("aggregate tok/s", "tok_per_s", "higher"),
            f"| prompt tokens found in the cache | {off['prefix_hit_rate']:.1%} | "
            f"{on['prefix_hit_rate']:.1%} | |",
            "",
        ]
    )
