"""`brigade bench engine`: prefill and decode speed, continuous vs static batching, KV memory.

Static batching runs on the same engine and model in two forms. "static" is what a padded
`generate` batch computes: each batch of `concurrency` requests prefills its longest prompt for
every row (pad tokens) and decodes every row until its longest member is done (finished rows go
on decoding as padding; only each request's own tokens count). "static-admission" only delays
admission: a batch starts when the previous one has fully finished, but rows leave as they end.
Writes engine.md and engine.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path

PREFILL_LENS = (128, 512, 2048)


def register(subparsers) -> None:
    p = subparsers.add_parser("engine", help="engine prefill/decode/batching benchmark")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--out", default=".brigade/bench", help="directory for engine.md/engine.json")
    p.add_argument(
        "--quantization",
        default="auto",
        choices=("auto", "none", "int8", "int4"),
        help="weights (auto: int4 for bf16 on the CPU)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the mixed workload")
    p.add_argument("--quick", action="store_true", help="short run: smaller workload, 1 repeat")
    p.add_argument("--no-transformers", action="store_true", help="skip the transformers run")
    p.set_defaults(func=run)


def make_workload(n: int, seed: int, vocab: int, prompt_lens, output_lens):
    """n (prompt_token_ids, max_tokens) pairs drawn with a fixed seed."""
    rng = random.Random(seed)
    return [
        (
            [rng.randrange(3, vocab) for _ in range(rng.randint(*prompt_lens))],
            rng.randint(*output_lens),
        )
        for _ in range(n)
    ]


class Timed:
    """Steps an engine and splits its time: inside the model runner vs everything else
    (schedule, sample, update), in process CPU time so other processes do not blur it."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.runner_cpu = self.step_cpu = 0.0
        self.steps = 0
        self.decode_only_s, self.decode_only_tokens = 0.0, 0
        self.used_blocks: list[int] = []
        self._decode_only = False
        run = engine.runner.run

        def timed_run(scheduled):
            self._decode_only = all(s.num_new_tokens == 1 for s in scheduled)
            t = time.process_time()
            out = run(scheduled)
            self.runner_cpu += time.process_time() - t
            return out

        engine.runner.run = timed_run

    def step(self):
        self._decode_only = False
        t, c = time.perf_counter(), time.process_time()
        outs = self.engine.step()
        self.step_cpu += time.process_time() - c
        if self._decode_only:  # a step of decodes only: no prompt tokens in it
            self.decode_only_s += time.perf_counter() - t
            self.decode_only_tokens += sum(len(o.new_token_ids) for o in outs)
        self.steps += 1
        bm = self.engine.block_manager
        self.used_blocks.append(bm.num_blocks - bm.num_free_blocks)
        return outs


MODES = ("continuous", "static", "static-admission")
PAD_TOKEN_ID = 0  # what padded prompt positions hold; its compute is what counts


def padded_batches(workload, concurrency: int):
    """Static batches as a padded `generate` runs them: [(index, ids, max_tokens, own_tokens)]
    per batch, every prompt left-padded to the batch's longest and every max_tokens raised to
    the batch's largest (own_tokens: how many of the row's tokens are real output)."""
    for start in range(0, len(workload), concurrency):
        batch = list(enumerate(workload))[start : start + concurrency]
        width = max(len(ids) for _, (ids, _) in batch)
        steps = max(m for _, (_, m) in batch)
        yield [(i, [PAD_TOKEN_ID] * (width - len(ids)) + ids, steps, m) for i, (ids, m) in batch]


def run_workload(engine, workload, concurrency: int, mode: str, params_for) -> dict:
    """continuous: keep `concurrency` requests in flight, refill as each ends. static: padded
    lockstep batches (see the module docstring). static-admission: admit a batch of
    `concurrency` only when the previous batch has fully finished."""
    timed = Timed(engine)
    generated = 0
    t0 = time.perf_counter()
    if mode == "static":
        for batch in padded_batches(workload, concurrency):
            own = {f"w{i}": own_tokens for i, _, _, own_tokens in batch}
            produced = dict.fromkeys(own, 0)
            for i, ids, steps, _ in batch:
                engine.add_request(f"w{i}", ids, params_for(i, steps))
            while engine.has_unfinished_requests():
                for out in timed.step():
                    rid = out.request_id
                    real = min(len(out.new_token_ids), own[rid] - produced[rid])
                    produced[rid] += len(out.new_token_ids)
                    generated += max(real, 0)
    else:
        pending = list(enumerate(workload))
        in_flight = 0
        while pending or in_flight:
            if mode == "continuous" or in_flight == 0:
                while pending and in_flight < concurrency:
                    i, (ids, max_tokens) = pending.pop(0)
                    engine.add_request(f"w{i}", ids, params_for(i, max_tokens))
                    in_flight += 1
            for out in timed.step():
                generated += len(out.new_token_ids)
                in_flight -= out.finished
    wall = time.perf_counter() - t0
    decode_s = timed.decode_only_s
    return {
        "requests": len(workload),
        "generated_tokens": generated,
        "wall_s": round(wall, 2),
        "tok_per_s": round(generated / wall, 1),
        "decode_only_tok_per_s": round(timed.decode_only_tokens / decode_s, 1)
        if decode_s
        else None,
        "steps": timed.steps,
        "overhead_cpu_ms_per_step": round(
            1000 * (timed.step_cpu - timed.runner_cpu) / timed.steps, 2
        ),
        "peak_blocks": max(timed.used_blocks),
        "mean_blocks": round(statistics.fmean(timed.used_blocks), 1),
    }


def bench_prefill(engine, vocab: int, repeats: int) -> dict[int, float]:
    from engine import SamplingParams

    rng = random.Random(1)
    result = {}
    for n in PREFILL_LENS:
        times = []
        for r in range(repeats + 1):  # the first run warms up
            ids = [rng.randrange(3, vocab) for _ in range(n)]
            engine.add_request(
                f"prefill{n}-{r}", ids, SamplingParams(temperature=0.0, max_tokens=1)
            )
            t = time.perf_counter()
            while engine.has_unfinished_requests():
                engine.step()
            times.append(time.perf_counter() - t)
        result[n] = round(n / statistics.median(times[1:]), 1)
    return result


def bench_single_decode(engine, vocab: int, num_tokens: int) -> float:
    from engine import SamplingParams

    ids = [random.Random(2).randrange(3, vocab) for _ in range(32)]
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    engine.add_request("single", ids, params)
    engine.step()  # prefill + first token
    t = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return round((num_tokens - 1) / (time.perf_counter() - t), 1)


def bench_transformers(model: str, vocab: int, num_tokens: int) -> float | None:
    """Single-stream greedy decode tok/s of transformers fp32 `generate` on the same GGUF."""
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except ImportError:
        return None
    from engine.weights import resolve_model

    path = resolve_model(model)
    kw = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
    root = path.parent if path.suffix == ".gguf" else path
    hf = AutoModelForCausalLM.from_pretrained(str(root), dtype=torch.float32, **kw).eval()
    ids = torch.tensor([[random.Random(2).randrange(3, vocab) for _ in range(32)]])

    def generate(n: int) -> float:
        t = time.perf_counter()
        with torch.inference_mode():
            hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        return time.perf_counter() - t

    generate(2)  # warm-up
    return round((num_tokens - 1) / (generate(num_tokens) - generate(1)), 1)


def run(args: argparse.Namespace) -> int:
    import torch

    from engine import Engine, EngineConfig, SamplingParams
    from engine.kv_cache import estimate_kv_bytes

    quick = args.quick
    quantization = None if args.quantization == "none" else args.quantization
    engine = Engine(EngineConfig(model=args.model, dtype=args.dtype, quantization=quantization))
    mc, vocab = engine.model_config, engine.model_config.vocab_size
    res: dict = {
        "model": args.model,
        "dtype": args.dtype,
        "quantization": getattr(engine.model, "quantization", None),
        "threads": torch.get_num_threads(),
        "max_num_batched_tokens": engine.config.max_num_batched_tokens,
        "quick": quick,
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
    }
    print("prefill ...", flush=True)
    res["prefill_tok_per_s"] = bench_prefill(engine, vocab, repeats=1 if quick else 2)
    decode_n = 32 if quick else 128
    print("single-stream decode ...", flush=True)
    res["single_decode_tok_per_s"] = bench_single_decode(engine, vocab, decode_n)

    def params_for(i: int, max_tokens: int):
        return SamplingParams(
            temperature=0.8, top_p=0.95, seed=i, max_tokens=max_tokens, ignore_eos=True
        )

    prompt_lens, output_lens = ((32, 256), (16, 64)) if quick else ((32, 1024), (16, 256))
    res["workload"] = {"prompt_lens": prompt_lens, "output_lens": output_lens, "seed": args.seed}
    res["batching"] = {}
    for c in (8,) if quick else (8, 32):
        workload = make_workload(2 * c, args.seed + c, vocab, prompt_lens, output_lens)
        for mode in MODES:
            print(f"{mode} batching, {c} concurrent ...", flush=True)
            res["batching"][f"{mode}_{c}"] = run_workload(engine, workload, c, mode, params_for)
    dt = engine.dtype
    per_block = estimate_kv_bytes(mc, num_tokens=engine.config.block_size, dtype=dt)
    top_c = max(int(k.split("_")[1]) for k in res["batching"])
    cont = res["batching"][f"continuous_{top_c}"]
    res["kv"] = {
        "concurrency": top_c,
        "paged_peak_bytes": cont["peak_blocks"] * per_block,
        "paged_mean_bytes": round(cont["mean_blocks"] * per_block),
        "contiguous_max_model_len_bytes": estimate_kv_bytes(
            mc, num_tokens=engine.max_model_len, batch_size=top_c, dtype=dt
        ),
        "contiguous_workload_max_bytes": estimate_kv_bytes(
            mc, num_tokens=prompt_lens[1] + output_lens[1], batch_size=top_c, dtype=dt
        ),
    }
    if not args.no_transformers:
        print("transformers fp32 generate ...", flush=True)
        res["transformers_fp32_decode_tok_per_s"] = bench_transformers(args.model, vocab, decode_n)
    table = markdown(res)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "engine.json").write_text(json.dumps(res, indent=1) + "\n")
    (out / "engine.md").write_text(table)
    print(table)
    print(f"wrote {out / 'engine.md'} and {out / 'engine.json'}")
    return 0


def markdown(res: dict) -> str:
    mib = 2**20
    q = res["quantization"] or "dense"
    lines = [
        f"Engine benchmark: {res['model']} {res['dtype']} ({q} weights), "
        f"{res['threads']} threads, max_num_batched_tokens {res['max_num_batched_tokens']}"
        + (" (quick run)" if res["quick"] else "")
        + f"; load average at start {res['load_average_at_start']}",
        "",
        "| measure | value |",
        "|---|---|",
    ]
    for n, v in res["prefill_tok_per_s"].items():
        lines.append(f"| prefill tok/s @ {n} prompt tokens | {v} |")
    single = res["single_decode_tok_per_s"]
    lines.append(f"| decode tok/s, 1 stream | {single} |")
    hf = res.get("transformers_fp32_decode_tok_per_s")
    if hf:
        lines.append(f"| transformers fp32 generate, 1 stream | {hf} ({single / hf:.2f}x) |")
    w = res["workload"]
    labels = {
        "continuous": "continuous batching",
        "static": "static batching (padded, lockstep)",
        "static-admission": "static admission only (rows leave early)",
    }
    for key, r in res["batching"].items():
        mode, c = key.split("_")
        lines.append(
            f"| {labels[mode]}, {c} concurrent ({r['requests']} requests) | {r['tok_per_s']} "
            f"tok/s ({r['generated_tokens']} tokens in {r['wall_s']} s, {r['steps']} steps); "
            f"decode-only steps {r['decode_only_tok_per_s']} tok/s; outside the model runner "
            f"{r['overhead_cpu_ms_per_step']} CPU ms/step |"
        )
        if mode != "continuous":
            ratio = res["batching"][f"continuous_{c}"]["tok_per_s"] / r["tok_per_s"]
            lines.append(f"| continuous / {labels[mode]}, {c} concurrent | {ratio:.2f}x |")
    kv = res["kv"]
    lines += [
        f"| KV held, paged, peak / mean ({kv['concurrency']} concurrent) | "
        f"{kv['paged_peak_bytes'] / mib:.1f} / {kv['paged_mean_bytes'] / mib:.1f} MiB |",
        f"| KV if reserved contiguously: max_model_len / workload max | "
        f"{kv['contiguous_max_model_len_bytes'] / mib:.1f} / "
        f"{kv['contiguous_workload_max_bytes'] / mib:.1f} MiB |",
        "",
        f"Workload: prompts {w['prompt_lens'][0]}-{w['prompt_lens'][1]} tokens, outputs "
        f"{w['output_lens'][0]}-{w['output_lens'][1]} tokens, seed {w['seed']}, 2 x concurrency "
        "requests, temperature 0.8 / top-p 0.95; tok/s = generated tokens / wall time (padded "
        "static rows count only their own tokens; pad prompt positions hold token id "
        f"{PAD_TOKEN_ID}).",
        "",
    ]
    return "\n".join(lines)
