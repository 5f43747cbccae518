"""`brigade kv-estimate`: KV-cache bytes for a model, context length, batch size and dtype.

Reads only the model's shape (GGUF header or config.json), never its weights.
"""

from __future__ import annotations

import argparse
import json

DTYPE_NAMES = ("float32", "bfloat16", "float16")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "kv-estimate",
        help="KV-cache memory: 2 x layers x batch x kv_heads x tokens x head_dim x bytes",
    )
    p.add_argument("--model", default="smollm2-135m", help="registered name, .gguf or HF dir")
    p.add_argument("--tokens", type=int, required=True, help="tokens per sequence (context)")
    p.add_argument("--batch", type=int, default=1, help="concurrent sequences")
    p.add_argument("--dtype", default="bfloat16", choices=DTYPE_NAMES)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.set_defaults(func=run)


def model_config_for(model: str):
    """The ModelConfig of a registered name, .gguf path or HF directory, without its weights."""
    from engine.config import ModelConfig
    from engine.weights import model_format, read_gguf_header, resolve_model

    path = resolve_model(model)
    if model_format(path) == "hf":
        return ModelConfig.from_hf_config(json.loads((path / "config.json").read_text()))
    header = read_gguf_header(path)
    return ModelConfig.from_gguf_metadata(
        header.metadata, has_output_weight="output.weight" in header.tensors
    )


def run(args: argparse.Namespace) -> int:
    import torch

    from engine.kv_cache import estimate_kv_bytes

    for name in ("tokens", "batch"):
        if getattr(args, name) < 1:
            print(f"--{name}={getattr(args, name)}: must be >= 1")
            return 2
    try:
        config = model_config_for(args.model)
    except ValueError as exc:
        print(exc)
        return 2
    dtype = getattr(torch, args.dtype)
    total = estimate_kv_bytes(config, num_tokens=args.tokens, batch_size=args.batch, dtype=dtype)
    per_token = estimate_kv_bytes(config, num_tokens=1, dtype=dtype)
    result = {
        "model": args.model,
        "dtype": args.dtype,
        "tokens": args.tokens,
        "batch": args.batch,
        "num_layers": config.num_layers,
        "num_heads": config.num_heads,
        "num_kv_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "bytes_per_token": per_token,
        "bytes": total,
        "mib": round(total / 2**20, 2),
        "bytes_without_gqa": total * config.num_heads // config.num_kv_heads,
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(
        f"{args.model} {args.dtype}: 2 x {config.num_layers} layers x {args.batch} seqs x "
        f"{config.num_kv_heads} kv_heads x {args.tokens} tokens x {config.head_dim} head_dim x "
        f"{dtype.itemsize} bytes = {total:,} bytes ({total / 2**20:,.2f} MiB)"
    )
    print(
        f"{per_token:,} bytes per token; GQA saves {config.num_heads // config.num_kv_heads}x "
        f"vs {config.num_heads} full KV heads ({result['bytes_without_gqa'] / 2**20:,.2f} MiB)"
    )
    return 0
