"""`brigade bench invariant`: what the batch-invariant mode costs, side by side in one run.

Two engines on the same bf16 model: the default (int4 GEMVs for steps of at most 8 rows, dense
GEMMs above) and `batch_invariant=True` (dense GEMMs at every row count, a one-row input computed
as two). Both run attention in the compiled kernel. For each: prefill tok/s at 128 / 512 / 2048
tokens, single-stream decode,
continuous batching at 32 concurrent on a mixed workload, and a check of what the mode is for:
how many of 8 greedy requests come out the same alone as in a chunked, preempting batch.
The two engines alternate section by section, so machine noise falls on both.
Writes invariant.md and invariant.json.
"""

from __future__ import annotations

import argparse
import os
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
    p = subparsers.add_parser("invariant", help="batch-invariant mode vs the default, bf16")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--out", default=".brigade/bench", help="directory for invariant.md/.json")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--seed", type=int, default=0, help="seed of the mixed workload")
    p.add_argument("--check-tokens", type=int, default=64, help="greedy tokens per check request")
    p.set_defaults(func=run)


def same_alone_as_batched(engine, max_tokens: int) -> int:
    """Of the 8 check prompts run greedily together (chunked prefill, a KV pool small enough to
    preempt) and then one by one: how many give the same token ids both ways."""
    from engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    prompts = [engine.tokenizer.encode(t) for t in CHECK_TEXTS]

    def run(batch: list[tuple[str, list[int]]]) -> dict[str, list[int]]:
        for rid, ids in batch:
            engine.add_request(rid, ids, params)
        out: dict[str, list[int]] = {rid: [] for rid, _ in batch}
        while engine.has_unfinished_requests():
            for o in engine.step():
                out[o.request_id] += o.new_token_ids
        return out

    together = run([(f"b{i}", ids) for i, ids in enumerate(prompts)])
    return sum(run([(f"a{i}", ids)])[f"a{i}"] == together[f"b{i}"] for i, ids in enumerate(prompts))


def run(args: argparse.Namespace) -> int:
    import torch

    from engine import Engine, EngineConfig, SamplingParams

    def params_for(i: int, max_tokens: int):
        return SamplingParams(
            temperature=0.8, top_p=0.95, seed=i, max_tokens=max_tokens, ignore_eos=True
        )

    modes = {"default": {}, "batch_invariant": {"batch_invariant": True}}
    engines = {
        name: Engine(EngineConfig(model=args.model, dtype="bfloat16", **kw))
        for name, kw in modes.items()
    }
    # the check's own engines: small KV pools and token budgets force chunking and preemption
    small = {"num_kv_blocks": 16, "max_num_batched_tokens": 32, "max_num_seqs": 8}
    checkers = {
        name: Engine(EngineConfig(model=args.model, dtype="bfloat16", **kw, **small))
        for name, kw in modes.items()
    }
    vocab = engines["default"].model_config.vocab_size
    c = args.concurrency
    workload = make_workload(2 * c, args.seed + c, vocab, (32, 1024), (16, 256), "uniform")
    warm = make_workload(c, args.seed - 1, vocab, (32, 64), (4, 8))
    res: dict = {
        "model": args.model,
        "dtype": "bfloat16",
        "threads": torch.get_num_threads(),
        "concurrency": c,
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "modes": {name: {"quantization": e.model.quantization} for name, e in engines.items()},
    }
    t0 = time.perf_counter()
    for name, engine in engines.items():
        print(f"{name}: warm-up, prefill, single-stream decode ...", flush=True)
        run_workload(engine, warm, c, "continuous", params_for)
        res["modes"][name]["prefill_tok_per_s"] = bench_prefill(engine, vocab, repeats=2)
        res["modes"][name]["single_decode_tok_per_s"] = bench_single_decode(engine, vocab, 128)
    for name, engine in engines.items():
        print(f"{name}: {c} concurrent, continuous batching ...", flush=True)
        res["modes"][name]["continuous"] = run_workload(
            engine, workload, c, "continuous", params_for
        )
    for name, engine in checkers.items():
        print(f"{name}: greedy alone vs batched ...", flush=True)
        res["modes"][name]["same_alone_as_batched"] = same_alone_as_batched(
            engine, args.check_tokens
        )
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    write_results(args.out, "invariant", res, markdown(res))
    return 0


def markdown(res: dict) -> str:
    d, b = res["modes"]["default"], res["modes"]["batch_invariant"]
    c = res["concurrency"]

    def row(label: str, x: float, y: float) -> str:
        return f"| {label} | {x} | {y} | {y / x:.2f}x |"

    lines = [
        f"Batch-invariant mode vs the default: {res['model']} bfloat16, {res['threads']} threads; "
        f"load average at start {res['load_average_at_start']}; {res['wall_s']} s",
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
        row(
            f"{c} concurrent, decode steps, tok/s",
            d["continuous"]["decode_only_tok_per_s"],
            b["continuous"]["decode_only_tok_per_s"],
        ),
        row(
            f"{c} concurrent, wall incl. prefill, tok/s",
            d["continuous"]["tok_per_s"],
            b["continuous"]["tok_per_s"],
        ),
        f"| greedy requests the same alone as batched (of {len(CHECK_TEXTS)}) | "
        f"{d['same_alone_as_batched']} | {b['same_alone_as_batched']} | |",
        "",
    ]
    return "\n".join(lines)
