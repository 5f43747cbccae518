"""`brigade bench peer`: Brigade's engine and llama.cpp side by side on the same GGUF, in one run.

Both sides are measured the same way: prefill of a 512-token prompt (llama-bench pp512),
single-stream decode of 128 tokens from an empty context (tg128), and aggregate decode of 128
tokens at 1, 8 and 32 streams after a 128-token prompt each, counting only decode steps
(llama-batched-bench's S_TG = streams x 128 / decode time). llama.cpp comes from --llama-cpp-dir /
LLAMA_CPP_DIR, or is built from the llama-cpp-python sdist under the data dir (tools/bench/
llama_cpp.py); where it cannot be had, the run says why and measures Brigade alone.

Beside them, the floor under single-stream decode: a decode step at batch 1 reads every weight
once (the GGUF's tensor data: the linears and the tied LM head), so no engine reading those
bytes from memory decodes faster than the machine's read bandwidth over them. The bench measures
that bandwidth (a sum over a buffer far larger than the caches, on the same threads) and says
whether the single-stream target sits above the ceiling. And the ceiling over prefill in fp32:
a prompt token costs 2 flops a weight of the layers' projections, so no fp32 engine prefills
faster than the CPU's FMA peak (kernels/cpu_fma_peak.py) over them; the bench says whether the
prefill target sits above it. Where the engine's prefill GEMMs run on AMX tiles
(kernels/cpu_amx_gemm.py), the FMA peak does not bound them: the tiles' own peak over the three
bf16 products an fp32 term costs there (x to 16 bits) is that path's ceiling, reported beside it.
Writes peer.md and peer.json.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

from tools.bench import llama_cpp
from tools.bench.files import write_results

N_PROMPT, N_GEN, N_PROMPT_BATCHED = 512, 128, 128
STREAMS, STREAMS_QUICK = (1, 8, 32), (1, 8)
# metric -> (what it is, the ratio Brigade / llama.cpp to reach, or None)
METRICS = {
    "pp512": ("prefill of 512 tokens, tok/s", 5.0),
    "tg128": ("single-stream decode of 128 tokens, tok/s", 1.3),
    "decode_1": ("decode, 1 stream after a 128-token prompt, tok/s", None),
    "decode_8": ("decode, 8 streams together, total tok/s", 2.0),
    "decode_32": ("decode, 32 streams together, total tok/s", 3.0),
}


BANDWIDTH_BYTES = 1 << 30  # read per pass: far past any L3 a 2-core VM is given


def weight_bytes(gguf: Path) -> int:
    """Bytes a batch-1 decode step reads from the weights: the file's tensor data (it starts
    at the first tensor's offset; every tensor is read once a token, the tied LM head included;
    the norms are a few KiB)."""
    from engine.weights import read_gguf_header

    header = read_gguf_header(gguf)
    start = min(t.offset for t in header.tensors.values())
    return gguf.stat().st_size - start


def read_bandwidth(threads: int, repetitions: int = 5, nbytes: int = BANDWIDTH_BYTES) -> float:
    """Bytes a second that `threads` threads read from memory: the best of `repetitions` sums
    over one buffer of `nbytes` (touched first, so its pages are resident)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buf = torch.ones(nbytes // 4, dtype=torch.float32)
        float(buf.sum())  # warm: pages mapped, threads started
        best = float("inf")
        for _ in range(repetitions):
            t0 = time.perf_counter()
            float(buf.sum())
            best = min(best, time.perf_counter() - t0)
        return buf.numel() * 4 / best
    finally:
        torch.set_num_threads(before)


def floor_row(weights: int, bandwidth: float, llama: dict[str, float] | None) -> dict:
    """The single-stream ceiling (bandwidth / weight bytes a token) against the target."""
    ceiling = bandwidth / weights
    target = None if llama is None or not llama.get("tg128") else 1.3 * llama["tg128"]
    return {
        "weight_mib": round(weights / 2**20, 1),
        "bandwidth_gb_s": round(bandwidth / 1e9, 2),
        "ceiling_tok_s": round(ceiling, 1),
        "target_tok_s": None if target is None else round(target, 1),
        "target_above_ceiling": None if target is None else target > ceiling,
    }


def prefill_ceiling_row(
    config, flops_s: float, llama: dict[str, float] | None, amx_flops_s: float | None = None
) -> dict:
    """The fp32 prefill ceiling: the layers' projections alone at the FMA units' peak `flops_s`
    (kernels/cpu_fma_peak.py), against the prefill target (5x llama.cpp's pp512). Attention,
    dequantizing the weights and the rest only lower it. `amx_flops_s`: the tiles' bf16 peak,
    where the prefill GEMMs run on them (PIECE_PRODUCTS bf16 products an fp32 term)."""
    c = config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    per_layer = c.hidden_size * (q + 2 * kv) + q * c.hidden_size
    per_layer += 3 * c.hidden_size * c.intermediate_size
    flops_per_token = 2 * per_layer * c.num_layers
    ceiling = flops_s / flops_per_token
    target = None if llama is None or not llama.get("pp512") else 5.0 * llama["pp512"]
    row = {
        "gflop_per_token": round(flops_per_token / 1e9, 4),
        "fma_peak_gflop_s": round(flops_s / 1e9, 1),
        "ceiling_tok_s": round(ceiling, 1),
        "target_tok_s": None if target is None else round(target, 1),
        "target_above_ceiling": None if target is None else target > ceiling,
    }
    if amx_flops_s:
        from kernels.cpu_amx_gemm import PIECE_PRODUCTS

        amx = amx_flops_s / PIECE_PRODUCTS / flops_per_token
        row["amx_peak_gflop_s"] = round(amx_flops_s / 1e9, 1)
        row["amx_ceiling_tok_s"] = round(amx, 1)
        row["target_above_amx_ceiling"] = None if target is None else target > amx
    return row


def register(subparsers) -> None:
    p = subparsers.add_parser("peer", help="Brigade's engine vs llama.cpp, same GGUF, ratios")
    p.add_argument("--model", default="smollm2-135m", help="a registered name or a .gguf file")
    p.add_argument("--out", default=".brigade/bench", help="directory for peer.md/peer.json")
    p.add_argument(
        "--llama-cpp-dir",
        type=Path,
        default=None,
        help="a built llama.cpp (default: $LLAMA_CPP_DIR, else built under the data dir)",
    )
    p.add_argument(
        "--skip-build",
        action="store_true",
        help="never download or build llama.cpp: use --llama-cpp-dir or an earlier build",
    )
    p.add_argument("--quick", action="store_true", help="1 repetition, 1 and 8 streams")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="llama.cpp's and Brigade's measurements alternated this many times; each figure is "
        "the median of its rounds and each ratio the median of the rounds' ratios, so a machine "
        "that slows for one side's turn moves one round, not the table (default 1)",
    )
    p.add_argument("--threads", type=int, default=2, help="threads of both engines (-t)")
    p.add_argument(
        "--dtype",
        default=None,
        choices=("float32", "bfloat16", "float16"),
        help="Brigade's dtype (default: the engine's default, the one that meets the quality "
        "targets: float32 with block-GEMV decode)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        default=None,
        choices=("auto", "float32", "bfloat16", "float16"),
        help="Brigade's KV cache (default: the engine's default; float16 under float32 halves "
        "the bytes attention reads)",
    )
    p.add_argument(
        "--quantization",
        default="auto",
        choices=("auto", "none", "int8", "int4"),
        help="Brigade's weights (auto: int4 for bf16 on the CPU)",
    )
    p.set_defaults(func=run)


def find_llama_cpp(
    llama_cpp_dir: Path | None, data_dir: Path, *, skip_build: bool
) -> llama_cpp.Binaries:
    """The binaries to run; Unavailable says why there are none."""
    if llama_cpp_dir is not None:
        found = llama_cpp.find(llama_cpp_dir)
        if found is None:
            raise llama_cpp.Unavailable(
                f"no llama-bench and llama-batched-bench under {llama_cpp_dir} (looked in "
                "build/bin, bin and the folder itself); build them, or unset LLAMA_CPP_DIR"
            )
        return found
    if skip_build:
        found = llama_cpp.cached(data_dir)
        if found is None:
            raise llama_cpp.Unavailable(
                f"--skip-build and no earlier build under {llama_cpp.cache_root(data_dir)}; "
                "give --llama-cpp-dir, or run without --skip-build to build it (~6 min, 2 cores)"
            )
        return found
    return llama_cpp.build(data_dir, jobs=max(1, os.cpu_count() or 1))


def skip_message(reason: str) -> str:
    return f"llama.cpp is not available, so only Brigade is measured: {reason}"


def brigade_prefill(engine, n_prompt: int, repetitions: int) -> float:
    """Mean tok/s of one prompt's prefill, as llama-bench's pp averages its repetitions."""
    from engine import SamplingParams

    rng, vocab = random.Random(1), engine.model_config.vocab_size
    rates = []
    for r in range(repetitions + 1):  # the first warms up
        ids = [rng.randrange(3, vocab) for _ in range(n_prompt)]
        engine.add_request(f"pp{r}", ids, SamplingParams(temperature=0.0, max_tokens=1))
        t = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        if r:
            rates.append(n_prompt / (time.perf_counter() - t))
    return statistics.fmean(rates)


def brigade_decode(engine, streams: int, n_prompt: int, n_gen: int, seed: int = 0) -> float:
    """Total decode tok/s of `streams` sequences, each with its own n_prompt-token prompt: all
    are prefilled first (untimed), then n_gen steps of one token per stream are timed."""
    from engine import SamplingParams

    rng, vocab = random.Random(seed), engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=2 * n_gen + 16, ignore_eos=True)
    request_ids = [f"tg{seed}-{streams}-{i}" for i in range(streams)]
    for rid in request_ids:
        engine.add_request(rid, [rng.randrange(3, vocab) for _ in range(n_prompt)], params)
    started: set[str] = set()
    while len(started) < streams:  # prefill every prompt (and whatever decodes ride along)
        started.update(o.request_id for o in engine.step() if o.new_token_ids)
    tokens, t = 0, time.perf_counter()
    for _ in range(n_gen):
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    elapsed = time.perf_counter() - t
    for rid in request_ids:
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()
    assert tokens == streams * n_gen, f"{tokens} tokens in {n_gen} steps of {streams} streams"
    return tokens / elapsed


def measure_brigade(engine, streams: tuple[int, ...], repetitions: int) -> dict[str, float]:
    res = {"pp512": brigade_prefill(engine, N_PROMPT, repetitions)}
    brigade_decode(engine, 1, 1, 8)  # warm-up
    res["tg128"] = statistics.fmean(
        brigade_decode(engine, 1, 1, N_GEN, seed=r) for r in range(repetitions)
    )
    for b in streams:
        brigade_decode(engine, b, N_PROMPT_BATCHED, 4, seed=100 + b)  # warm-up of the shapes
        res[f"decode_{b}"] = brigade_decode(engine, b, N_PROMPT_BATCHED, N_GEN, seed=b)
    return res


def measure_llama_cpp(
    binaries: llama_cpp.Binaries, gguf: Path, threads: int, streams: tuple[int, ...], reps: int
) -> dict[str, float]:
    bench = llama_cpp.run_llama_bench(
        binaries.bench, gguf, threads=threads, repetitions=reps, n_prompt=N_PROMPT, n_gen=N_GEN
    )
    res = {"pp512": bench[f"pp{N_PROMPT}"], "tg128": bench[f"tg{N_GEN}"]}
    batched = llama_cpp.run_batched_bench(
        binaries.batched_bench,
        gguf,
        threads=threads,
        streams=streams,
        n_prompt=N_PROMPT_BATCHED,
        n_gen=N_GEN,
    )
    res.update({f"decode_{b}": batched[b]["s_tg"] for b in streams})
    return res


def ratio_rows(
    brigade: dict[str, float] | list[dict[str, float]],
    llama: dict[str, float] | list[dict[str, float]] | None,
) -> list[dict]:
    """One row per metric Brigade measured: both figures, Brigade / llama.cpp and its target.
    Given rounds (lists, measured alternately), each figure is the median of its rounds, the
    ratio the median of the rounds' ratios, and `ratios` holds each round's."""
    b_rounds = brigade if isinstance(brigade, list) else [brigade]
    l_rounds = llama if isinstance(llama, list) or llama is None else [llama]
    rows = []
    for name, (what, target) in METRICS.items():
        if name not in b_rounds[0]:
            continue
        mine = [r[name] for r in b_rounds]
        peers = None if l_rounds is None else [r.get(name) for r in l_rounds]
        ratios = None
        if peers is not None and all(peers):
            ratios = [m / p for m, p in zip(mine, peers, strict=True)]
        ratio = None if ratios is None else statistics.median(ratios)
        rows.append(
            {
                "metric": name,
                "what": what,
                "brigade": round(statistics.median(mine), 1),
                "llama_cpp": None
                if not peers or None in peers
                else round(statistics.median(peers), 1),
                "ratio": None if ratio is None else round(ratio, 2),
                "ratios": None if ratios is None else [round(r, 2) for r in ratios],
                "target": target,
                "meets_target": None if ratio is None or target is None else ratio >= target,
            }
        )
    return rows


def markdown(res: dict) -> str:
    threads, load, rounds = res["threads"], res["load_average_at_start"], res.get("rounds", 1)
    lines = [
        f"# Brigade vs llama.cpp on {res['gguf']}",
        "",
        f"{threads} thread{'s' if threads != 1 else ''}; load average at start {load}"
        + ("; quick run" if res["quick"] else ""),
        "",
        f"Brigade: {res.get('dtype', '?')}, weights {res.get('quantization') or 'dense'}, "
        f"KV cache {res.get('kv_cache_dtype', '?')}"
        + (
            f"; {rounds} rounds, llama.cpp's and Brigade's alternated: the medians, and each "
            "round's ratio"
            if rounds > 1
            else ""
        ),  # fmt: skip
        "",
        "| metric | llama.cpp | Brigade | Brigade / llama.cpp | target | |"
        + (" each round |" if rounds > 1 else ""),
        "|---|---|---|---|---|---|" + ("---|" if rounds > 1 else ""),
    ]
    for r in res["rows"]:
        peer = "—" if r["llama_cpp"] is None else f"{r['llama_cpp']:,.1f}"
        ratio = "—" if r["ratio"] is None else f"{r['ratio']:.2f}x"
        target = "—" if r["target"] is None else f">= {r['target']:g}x"
        verdict = {True: "pass", False: "FAIL", None: ""}[r["meets_target"]]
        line = f"| {r['what']} | {peer} | {r['brigade']:,.1f} | {ratio} | {target} | {verdict} |"
        if rounds > 1:
            each = r.get("ratios")
            line += " — |" if not each else " " + ", ".join(f"{x:.2f}" for x in each) + " |"
        lines.append(line)
    floor = res.get("floor")
    if floor:
        lines += [
            "",
            f"Single-stream floor: a decode step reads {floor['weight_mib']:,} MiB of weights; "
            f"this machine reads {floor['bandwidth_gb_s']} GB/s on {threads} thread"
            f"{'s' if threads != 1 else ''}, so no engine reading them decodes one stream faster "
            f"than {floor['ceiling_tok_s']:,.1f} tok/s.",
        ]
        if floor["target_tok_s"] is not None:
            where = "above" if floor["target_above_ceiling"] else "below"
            lines[-1] += (
                f" The target (1.3x llama.cpp's tg128) is {floor['target_tok_s']:,.1f} tok/s: "
                f"{where} that ceiling."
            )
    pre = res.get("prefill_ceiling")
    if pre:
        lines += [
            "",
            f"Prefill ceiling in fp32: a token's projections are {pre['gflop_per_token']} GFLOP; "
            f"this CPU's FMA units issue at most {pre['fma_peak_gflop_s']:,} fp32 GFLOP/s on "
            f"{threads} thread{'s' if threads != 1 else ''}, so no fp32 engine prefills faster "
            f"than {pre['ceiling_tok_s']:,.1f} tok/s.",
        ]
        if pre["target_tok_s"] is not None:
            where = "above" if pre["target_above_ceiling"] else "below"
            lines[-1] += (
                f" The target (5x llama.cpp's pp512, whose int8 dot products do 4x the work per "
                f"instruction) is {pre['target_tok_s']:,.1f} tok/s: {where} that ceiling."
            )
        if pre.get("amx_ceiling_tok_s"):
            lines[-1] += (
                f" Brigade's prefill GEMMs run on AMX tiles here, three bf16 products an fp32 "
                f"term, which the FMA ceiling does not bound: the tiles issue at most "
                f"{pre['amx_peak_gflop_s']:,} bf16 GFLOP/s, so that path prefills at most "
                f"{pre['amx_ceiling_tok_s']:,.1f} tok/s"
            )
            if pre["target_above_amx_ceiling"] is not None:
                where = "above" if pre["target_above_amx_ceiling"] else "below"
                lines[-1] += f", the target {where} it"
            lines[-1] += "."
    if load[0] > threads:
        busy = "The machine was busy (load average above the threads): a smoke run, not figures"
        lines += ["", f"{busy} to quote."]
    if res["llama_cpp_skipped"]:
        lines += ["", skip_message(res["llama_cpp_skipped"])]
    elif res["llama_cpp_build_flags"]:
        lines += ["", f"llama.cpp built with `{' '.join(res['llama_cpp_build_flags'])}`"]
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    import torch

    from engine import Engine, EngineConfig
    from engine.gguf_linear import GGUFLinear
    from engine.weights import model_format, resolve_model
    from schemas import settings

    gguf = resolve_model(args.model)
    if args.rounds < 1:
        print(f"brigade bench peer: --rounds {args.rounds}: give 1 or more", file=sys.stderr)
        return 2
    streams, reps = (STREAMS_QUICK, 1) if args.quick else (STREAMS, 5)
    res: dict = {
        "model": args.model,
        "gguf": gguf.name,
        "threads": args.threads,
        "quick": args.quick,
        "rounds": args.rounds,
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "llama_cpp_skipped": None,
        "llama_cpp_build_flags": [],
    }
    binaries = None
    try:
        if model_format(gguf) != "gguf":
            raise llama_cpp.Unavailable(f"{args.model} is not a GGUF file, which llama.cpp needs")
        binaries = find_llama_cpp(
            args.llama_cpp_dir or settings.LLAMA_CPP_DIR.get(),
            settings.DATA_DIR.get(),
            skip_build=args.skip_build,
        )
        res["llama_cpp_build_flags"] = list(binaries.build_flags)
        print(f"llama.cpp: llama-bench and llama-batched-bench from {binaries.bench.parent}")
    except (llama_cpp.Unavailable, RuntimeError) as err:
        res["llama_cpp_skipped"] = str(err)
        print(f"brigade bench peer: {skip_message(str(err))}", flush=True)
    torch.set_num_threads(args.threads)
    from kernels import cpu_amx_gemm, cpu_fma_peak  # here: kernels import torch, --help not

    # the machine's own limits first, in a process nothing has run in yet: measured after the
    # rounds, beside the engine's idle OpenMP pool, the FMA peak came out at 102.6 GFLOP/s where a
    # fresh process measured 182-189 on the same CPU
    bandwidth, peak = read_bandwidth(args.threads), cpu_fma_peak.fma_peak(args.threads)
    amx_peak = cpu_amx_gemm.tile_peak(args.threads)
    quantization = None if args.quantization == "none" else args.quantization
    dtype = {"dtype": args.dtype} if args.dtype else {}  # else EngineConfig's defaults
    if args.kv_cache_dtype:
        dtype["kv_cache_dtype"] = args.kv_cache_dtype
    engine = Engine(EngineConfig(model=args.model, quantization=quantization, **dtype))
    res["dtype"] = engine.config.dtype
    res["kv_cache_dtype"] = engine.config.kv_dtype
    res["quantization"] = getattr(engine.model, "quantization", None)
    uses_amx = any(getattr(m, "amx", None) is not None for m in engine.model.modules())
    amx_peak = amx_peak if uses_amx else None  # the tiles bound prefill only where it uses them
    if any(isinstance(m, GGUFLinear) for m in engine.model.modules()):
        res["quantization"] = "GGUF blocks: GEMV up to 32 rows, GEMM above"
        if uses_amx:
            res["quantization"] += " (on AMX tiles)"
        if getattr(engine.model, "fused", None) is not None:
            res["quantization"] += "; steps up to 32 tokens fused"
    brigade: list[dict[str, float]] = []
    llama: list[dict[str, float]] | None = None if binaries is None else []
    for k in range(args.rounds):
        if binaries is not None and llama is not None:
            try:
                print(f"llama.cpp, round {k + 1} of {args.rounds} ...", flush=True)
                llama.append(measure_llama_cpp(binaries, gguf, args.threads, streams, reps))
            except (llama_cpp.Unavailable, RuntimeError) as err:
                res["llama_cpp_skipped"], llama = str(err), None
                print(f"brigade bench peer: {skip_message(str(err))}", flush=True)
        print(f"Brigade, round {k + 1} of {args.rounds}: prefill, single-stream and batched "
              "decode ...", flush=True)  # fmt: skip
        brigade.append(measure_brigade(engine, streams, reps))
    res["brigade"] = [{k: round(v, 1) for k, v in r.items()} for r in brigade]
    res["llama_cpp"] = None if llama is None else [{k: round(v, 1) for k, v in r.items()}
                                                   for r in llama]  # fmt: skip
    res["rows"] = ratio_rows(brigade, llama)
    llama_row = None if llama is None else {m["metric"]: m["llama_cpp"] for m in res["rows"]}
    res["floor"] = floor_row(weight_bytes(gguf), bandwidth, llama_row)
    if peak is not None:
        res["prefill_ceiling"] = prefill_ceiling_row(engine.model_config, peak, llama_row, amx_peak)
    write_results(args.out, "peer", res, markdown(res))
    return 0
