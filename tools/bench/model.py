"""Time the bare model over the paged cache: a 512-token prefill and decode steps at batch 1-32.

Usage: python -m tools.bench.model [--dtype bfloat16] [--quantization auto|none|int8|int4|...]
       [--threads N] [--hf]
Prints medians of forward + logits per step as wall time and as process CPU time; on a shared
machine the CPU time (with --threads 1) is the figure that other jobs do not inflate.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine.attention import AttentionMetadata
from engine.loader import load_model


def _metadata(qlens: list[int], slens: list[int], blocks_per_seq: int, block_size: int):
    slots = []
    for i, (ql, sl) in enumerate(zip(qlens, slens, strict=True)):
        slots += [i * blocks_per_seq * block_size + p for p in range(sl - ql, sl)]
    table = torch.arange(len(qlens) * blocks_per_seq, dtype=torch.int32).view(len(qlens), -1)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_start_loc=torch.tensor(
            [0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32
        ),
        seq_lens=torch.tensor(slens, dtype=torch.int32),
        block_tables=table,
        query_lens_cpu=qlens,
        seq_lens_cpu=slens,
        block_size=block_size,
    )


def time_step(
    model, config, qlens: list[int], slens: list[int], *, repeats: int, block_size: int = 16
) -> tuple[float, float]:
    """Median (wall, CPU) seconds of forward + compute_logits (last token of each sequence)."""
    blocks_per_seq = -(-max(slens) // block_size)
    shape = (len(qlens) * blocks_per_seq, block_size, config.num_kv_heads, config.head_dim)
    caches = [
        (torch.zeros(shape, dtype=model.dtype), torch.zeros(shape, dtype=model.dtype))
        for _ in range(config.num_layers)
    ]
    attn = _metadata(qlens, slens, blocks_per_seq, block_size)
    ids = torch.randint(0, config.vocab_size, (sum(qlens),))
    positions = torch.cat([torch.arange(sl - ql, sl) for ql, sl in zip(qlens, slens, strict=True)])
    last = torch.tensor(qlens).cumsum(0) - 1
    wall, cpu = [], []
    for _ in range(repeats + 1):
        w0, c0 = time.perf_counter(), time.process_time()
        hidden = model(ids, positions, caches, attn)
        model.compute_logits(hidden[last])
        wall.append(time.perf_counter() - w0)
        cpu.append(time.process_time() - c0)
    return statistics.median(wall[1:]), statistics.median(cpu[1:])


def hf_decode_tok_s(model_name: str, context: int, new_tokens: int = 32) -> float:
    """transformers fp32 `generate` decode speed (wall) on the same context, for comparison."""
    from transformers import AutoModelForCausalLM

    from engine.weights import resolve_model

    path = resolve_model(model_name)
    hf = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    ids = torch.randint(0, hf.config.vocab_size, (1, context))

    def run(n: int) -> float:
        t0 = time.perf_counter()
        hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return time.perf_counter() - t0

    run(2)
    return new_tokens / (run(new_tokens + 1) - run(1))


CASES = [  # (label, query lens, seq lens)
    ("decode batch  1 @  256", [1], [256]),
    ("decode batch  8 @  256", [1] * 8, [256] * 8),
    ("decode batch 32 @  256", [1] * 32, [256] * 32),
    ("decode batch 32 @ 1024", [1] * 32, [1024] * 32),
    ("prefill 512 tokens    ", [512], [512]),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quantization", default="auto", help="auto, none, int8, int4, ...")
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument("--hf", action="store_true", help="also time transformers fp32 decode")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    quant = None if args.quantization == "none" else args.quantization
    model, config = load_model(args.model, dtype=args.dtype, quantization=quant)
    print(
        f"{args.model} dtype={args.dtype} quantization={model.quantization} "
        f"threads={torch.get_num_threads()}"
    )
    print("case                      wall ms/step  tok/s | cpu ms/step  tok/s")
    for label, qlens, slens in CASES:
        repeats = args.repeats if sum(qlens) * max(slens) < 10_000 else max(2, args.repeats // 4)
        wall, cpu = time_step(model, config, qlens, slens, repeats=repeats)
        n = sum(qlens)
        print(f"{label}  {wall * 1e3:10.1f} {n / wall:7.1f} | {cpu * 1e3:10.1f} {n / cpu:7.1f}")
    if args.hf:
        tok_s = hf_decode_tok_s(args.model, 256)
        print(f"transformers fp32 generate, batch 1 @ 256: {tok_s:7.1f} tok/s (wall)")


if __name__ == "__main__":
    main()
