"""`brigade bench engine`: prefill and decode speed, continuous vs static batching on two
workload shapes, KV memory, and transformers `generate` on the same weights and requests.

Static batching runs on the same engine and model in two forms. "static" is what a padded
`generate` batch computes: each batch of `concurrency` requests prefills its longest prompt for
every row (pad tokens) and decodes every row until its longest member is done (finished rows go
on decoding as padding; only each request's own tokens count). "static-admission" only delays
admission: a batch starts when the previous one has fully finished, but rows leave as they end.
Writes engine.md and engine.json.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

from tools.bench import engine_hf as bench_engine_hf
from tools.bench.engine_report import markdown
from tools.bench.engine_workload import SHAPES, make_workload, padded_batches, padding_context
from tools.bench.files import write_results

PREFILL_LENS = (128, 512, 2048)
MODES = ("continuous", "static", "static-admission")
CONCURRENCY, CONCURRENCY_QUICK = (8, 32), (8,)


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
    p.add_argument("--seed", type=int, default=0, help="seed of the mixed workloads")
    p.add_argument("--quick", action="store_true", help="short run: smaller workload, 1 repeat")
    p.add_argument(
        "--no-transformers",
        action="store_true",
        help="skip transformers (its padded fp32 batches take about 7 minutes per shape)",
    )
    p.add_argument(
        "--transformers-shapes",
        nargs="+",
        choices=SHAPES,
        default=["uniform"],
        help="workload shapes that also run through transformers generate (default: uniform, "
        "the issue's workload; each shape adds about 7 minutes to a full run)",
    )
    p.set_defaults(func=run)


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
        run = self._run = engine.runner.run

        def timed_run(scheduled, **kw):
            self._decode_only = all(s.num_new_tokens == 1 for s in scheduled)
            t = time.process_time()
            out = run(scheduled, **kw)
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

    def close(self) -> None:
        """Put the runner back, so the next run does not step through this one's wrapper."""
        self.engine.runner.run = self._run


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
    timed.close()
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


def bench_shape(engine, shape: str, seed: int, quick: bool, params_for) -> dict:
    """The batching comparison on one workload shape: every mode at every concurrency on the
    same 2 x concurrency requests, with the padding a static batch pays in theory."""
    prompt_lens, output_lens = ((32, 256), (16, 64)) if quick else ((32, 1024), (16, 256))
    res: dict = {
        "shape": shape,
        "prompt_lens": prompt_lens,
        "output_lens": output_lens,
        "seed": seed,
        "padding": {},
        "batching": {},
    }
    for c in CONCURRENCY_QUICK if quick else CONCURRENCY:
        workload = make_workload(
            2 * c, seed + c, engine.model_config.vocab_size, prompt_lens, output_lens, shape
        )
        res["padding"][str(c)] = padding_context(workload, c, prompt_lens, output_lens, shape)
        for mode in MODES:
            print(f"{shape}: {mode} batching, {c} concurrent ...", flush=True)
            res["batching"][f"{mode}_{c}"] = run_workload(engine, workload, c, mode, params_for)
    return res


def kv_memory(engine, shape_res: dict) -> dict:
    """KV bytes the paged cache held under continuous batching at the top concurrency, vs a
    contiguous reservation per sequence (max_model_len, or the workload's longest)."""
    from engine.kv_cache import estimate_kv_bytes

    mc, dt = engine.model_config, engine.dtype
    per_block = estimate_kv_bytes(mc, num_tokens=engine.config.block_size, dtype=dt)
    top_c = max(int(k.rsplit("_", 1)[1]) for k in shape_res["batching"])
    cont = shape_res["batching"][f"continuous_{top_c}"]
    longest = shape_res["prompt_lens"][1] + shape_res["output_lens"][1]
    return {
        "concurrency": top_c,
        "paged_peak_bytes": cont["peak_blocks"] * per_block,
        "paged_mean_bytes": round(cont["mean_blocks"] * per_block),
        "contiguous_max_model_len_bytes": estimate_kv_bytes(
            mc, num_tokens=engine.max_model_len, batch_size=top_c, dtype=dt
        ),
        "contiguous_workload_max_bytes": estimate_kv_bytes(
            mc, num_tokens=longest, batch_size=top_c, dtype=dt
        ),
    }


def bench_transformers(args, vocab: int, decode_n: int, res: dict) -> None:
    """transformers fp32 `generate`: one stream, then the same requests as padded batches."""
    hf = bench_engine_hf.load_model(args.model)
    if hf is None:
        res["transformers"] = "not installed"
        return
    res["transformers_shapes"] = args.transformers_shapes
    print("transformers fp32 generate, 1 stream ...", flush=True)
    res["transformers_fp32_decode_tok_per_s"] = bench_engine_hf.single_decode(hf, vocab, decode_n)
    for shape in args.transformers_shapes:
        w = res["workloads"][shape]
        w["transformers_fp32"] = {}
        for c in sorted({int(k.rsplit("_", 1)[1]) for k in w["batching"]}):
            print(f"{shape}: transformers fp32 padded batches, {c} concurrent ...", flush=True)
            workload = make_workload(
                2 * c, w["seed"] + c, vocab, w["prompt_lens"], w["output_lens"], shape
            )
            w["transformers_fp32"][f"static_{c}"] = bench_engine_hf.run_workload(
                hf, workload, c, seed=w["seed"] + c
            )


def run(args: argparse.Namespace) -> int:
    import torch

    from engine import Engine, EngineConfig, SamplingParams

    quick = args.quick
    quantization = None if args.quantization == "none" else args.quantization
    engine = Engine(EngineConfig(model=args.model, dtype=args.dtype, quantization=quantization))
    vocab = engine.model_config.vocab_size
    res: dict = {
        "model": args.model,
        "dtype": args.dtype,
        "quantization": getattr(engine.model, "quantization", None),
        "threads": torch.get_num_threads(),
        "max_num_batched_tokens": engine.config.max_num_batched_tokens,
        "quick": quick,
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "section_wall_s": {},
    }
    clock = time.perf_counter()

    def section_done(name: str) -> None:
        nonlocal clock
        res["section_wall_s"][name] = round(time.perf_counter() - clock, 1)
        clock = time.perf_counter()

    print("prefill ...", flush=True)
    res["prefill_tok_per_s"] = bench_prefill(engine, vocab, repeats=1 if quick else 2)
    decode_n = 32 if quick else 128
    print("single-stream decode ...", flush=True)
    res["single_decode_tok_per_s"] = bench_single_decode(engine, vocab, decode_n)
    section_done("prefill_and_single_stream")

    def params_for(i: int, max_tokens: int):
        return SamplingParams(
            temperature=0.8, top_p=0.95, seed=i, max_tokens=max_tokens, ignore_eos=True
        )

    print("batched warm-up ...", flush=True)
    for c in CONCURRENCY_QUICK if quick else CONCURRENCY:  # untimed: first use of batch shapes
        warm = make_workload(c, args.seed - 1, vocab, (32, 64), (4, 8))
        run_workload(engine, warm, c, "continuous", params_for)
    section_done("batched_warm_up")
    res["workloads"] = {}
    for shape in SHAPES:
        w = res["workloads"][shape] = bench_shape(engine, shape, args.seed, quick, params_for)
        w["kv"] = kv_memory(engine, w)
        section_done(f"engine_{shape}")
    if not args.no_transformers:
        del engine  # its KV pools are not needed any more
        bench_transformers(args, vocab, decode_n, res)
        section_done("transformers")
    write_results(args.out, "engine", res, markdown(res))
    return 0
