"""`brigade bench invariant`: what the batch-invariant mode costs, side by side in one run.

Two engines on the same model and dtype (by default the engine's own, float32): the default
(float32: the block GEMV up to 32 rows, the block GEMM above, torch's SDPA; bfloat16: int4 GEMVs
up to 8 rows, dense GEMMs above) and `batch_invariant=True` (float32: the block GEMV at every
row count and attention one query token at a time; bfloat16: dense GEMMs at every row count, a
one-row input computed as two). For each: prefill tok/s at 128 / 512 / 2048 tokens,
single-stream decode, continuous batching at 8 and 32 streams on a mixed workload (each the median
of `--rounds` rounds in which the two engines alternate), and a check
of what the mode is for: of 8 greedy requests, how many come out the same alone as in a chunked,
preempting batch (token ids, and every logprob bit for bit). Writes invariant.md and
invariant.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from tools.bench.engine import bench_prefill, bench_single_decode, run_workload
from tools.bench.engine_workload import make_workload
from tools.bench.files import write_results

CHECK_TEXTS = (
    "Once upon a time, in a small village at the edge of a great forest, there lived",
    "The capital of France is",
    "Write a haiku about the sea. It goes",
    "1, 2, 3, 4,",
    "def fibonacci(n):",
    "The three primary colors are",
    "Hello",
    "A list of fruits: apple, banana,",
)


def register(subparsers) -> None:
    p = subparsers.add_parser("invariant", help="batch-invariant mode vs the default")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default=None, help="default: the engine's (float32)")
    p.add_argument("--out", default=".brigade/bench", help="directory for invariant.md/.json")
    p.add_argument("--streams", default="8,32", help="comma-separated concurrencies")
    p.add_argument("--seed", type=int, default=0, help="seed of the mixed workload")
    p.add_argument("--check-tokens", type=int, default=64, help="greedy tokens per check request")
    p.add_argument("--rounds", type=int, default=3, help="alternations of the two engines")
    p.set_defaults(func=run)


def same_alone_as_batched(engine, max_tokens: int) -> dict[str, int]:
    """Of the 8 check prompts run greedily together (chunked prefill, a KV pool small enough to
    preempt) and then one by one: how many give the same token ids both ways, and how many the
    same logprobs too, bit for bit."""
    from engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)
    prompts = [engine.tokenizer.encode(t) for t in CHECK_TEXTS]

    def run(batch: list[tuple[str, list[int]]]) -> dict[str, list]:
        for rid, ids in batch:
            engine.add_request(rid, ids, params)
        out: dict[str, list] = {rid: [] for rid, _ in batch}
        while engine.has_unfinished_requests():
            for o in engine.step():
                out[o.request_id] += zip(o.new_token_ids, o.new_logprobs, strict=True)
        return out

    together = run([(f"b{i}", ids) for i, ids in enumerate(prompts)])
    alone = [run([(f"a{i}", ids)])[f"a{i}"] for i, ids in enumerate(prompts)]
    pairs = [(a, together[f"b{i}"]) for i, a in enumerate(alone)]
    return {
        "tokens": sum([t for t, _ in a] == [t for t, _ in b] for a, b in pairs),
        "logprobs": sum(a == b for a, b in pairs),
    }


def run(args: argparse.Namespace) -> int:
    import torch

    from engine import Engine, EngineConfig, SamplingParams

    def params_for(i: int, max_tokens: int):
        return SamplingParams(
            temperature=0.8, top_p=0.95, seed=i, max_tokens=max_tokens, ignore_eos=True
        )

    dtype = args.dtype or EngineConfig().dtype
    streams = [int(c) for c in args.streams.split(",")]
    modes = {"default": {}, "batch_invariant": {"batch_invariant": True}}
    engines = {
        name: Engine(EngineConfig(model=args.model, dtype=dtype, **kw))
        for name, kw in modes.items()
    }
    # the check's own engines: small KV pools and token budgets force chunking and preemption
    small = {"num_kv_blocks": 16, "max_num_batched_tokens": 32, "max_num_seqs": 8}
    checkers = {
        name: Engine(EngineConfig(model=args.model, dtype=dtype, **kw, **small))
        for name, kw in modes.items()
    }
    vocab = engines["default"].model_config.vocab_size
    warm = make_workload(8, args.seed - 1, vocab, (32, 64), (4, 8))
    res: dict = {
        "model": args.model,
        "dtype": dtype,
        "threads": torch.get_num_threads(),
        "streams": streams,
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "modes": {name: {"quantization": e.model.quantization} for name, e in engines.items()},
    }
    t0 = time.perf_counter()
    for engine in engines.values():
        run_workload(engine, warm, 8, "continuous", params_for)
    # every measure alternates the two engines round by round; each mode's figure is the median
    # of its rounds, so a burst of other load falls on both
    rounds: dict = {name: {"prefill": [], "single": []} for name in engines}
    for r in range(args.rounds):
        for name, engine in engines.items():
            print(f"round {r + 1}: {name}: prefill, single-stream decode ...", flush=True)
            rounds[name]["prefill"].append(bench_prefill(engine, vocab, repeats=1))
            rounds[name]["single"].append(bench_single_decode(engine, vocab, 64))
    for name in engines:
        got = rounds[name]["prefill"]
        res["modes"][name]["prefill_tok_per_s"] = {
            n: round(statistics.median(p[n] for p in got), 1) for n in got[0]
        }
        single = statistics.median(rounds[name]["single"])
        res["modes"][name]["single_decode_tok_per_s"] = round(single, 1)
    for c in streams:
        workload = make_workload(c, args.seed + c, vocab, (32, 512), (16, 128), "uniform")
        runs: dict = {name: [] for name in engines}
        for r in range(args.rounds):
            for name, engine in engines.items():
                print(f"round {r + 1}: {name}: {c} streams ...", flush=True)
                runs[name].append(run_workload(engine, workload, c, "continuous", params_for))
        for name, got in runs.items():
            res["modes"][name][f"streams_{c}"] = {
                key: round(statistics.median(g[key] for g in got), 1)
                for key in ("decode_only_tok_per_s", "tok_per_s")
            }
    for name, engine in checkers.items():
        print(f"{name}: greedy alone vs batched ...", flush=True)
        res["modes"][name]["same_alone_as_batched"] = same_alone_as_batched(
            engine, args.check_tokens
        )
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    res["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    write_results(args.out, "invariant", res, markdown(res))
    return 0


def markdown(res: dict) -> str:
    d, b = res["modes"]["default"], res["modes"]["batch_invariant"]

    def row(label: str, x: float, y: float) -> str:
        return f"| {label} | {x} | {y} | {y / x:.2f}x |"

    def streams(c: int) -> list[str]:
        x, y = d[f"streams_{c}"], b[f"streams_{c}"]
        return [
            row(f"{c} streams, decode steps, tok/s", x["decode_only_tok_per_s"],
                y["decode_only_tok_per_s"]),
            row(f"{c} streams, wall incl. prefill, tok/s", x["tok_per_s"], y["tok_per_s"]),
        ]  # fmt: skip

    n = len(CHECK_TEXTS)
    same_d, same_b = d["same_alone_as_batched"], b["same_alone_as_batched"]
    lines = [
        f"Batch-invariant mode vs the default: {res['model']} {res['dtype']}, "
        f"{res['threads']} threads; load average {res['load_average_at_start']} at the start, "
        f"{res.get('load_average_at_end', '?')} at the end; {res['wall_s']} s",
        "",
        "| measure | default | batch-invariant | ratio |",
        "|---|---|---|---|",
        *(
            row(f"prefill {n} tokens, tok/s", d["prefill_tok_per_s"][n], b["prefill_tok_per_s"][n])
            for n in d["prefill_tok_per_s"]
        ),
        row(
            "single-stream decode, tok/s",
            d["single_decode_tok_per_s"],
            b["single_decode_tok_per_s"],
        ),
        *(line for c in res["streams"] for line in streams(c)),
        f"| greedy requests the same alone as batched (of {n}): tokens | "
        f"{same_d['tokens']} | {same_b['tokens']} | |",
        f"| ... and every logprob, bit for bit | {same_d['logprobs']} | {same_b['logprobs']} | |",
        "",
    ]
    return "\n".join(lines)
