"""`brigade bench spec`: n-gram speculative decoding on vs off, one greedy stream at a time.

Two chat prompts through the model's chat template: one whose answer repeats its prompt (the
model is asked to copy a passage, as in editing or quoting), one open-ended (little to look up).
Each runs through an engine with speculation off and one with it on, alternating, so machine
noise falls on both; the tokens must come out the same. Reported per prompt: decode tok/s (after
the first token), the ratio, and the share of draft tokens the model accepted.
Writes spec.md and spec.json.
"""

from __future__ import annotations

import argparse
import os
import time

from tools.bench.files import write_results

PASSAGE = (
    "The engine keeps a paged cache of keys and values. Each block holds sixteen tokens, and a "
    "sequence owns a table of blocks. When memory runs out, the last sequence to arrive is "
    "preempted and its blocks are freed; it is computed again when there is room."
)
PROMPTS = {
    "copy": f"Copy this passage exactly, word for word:\n\n{PASSAGE}",
    "open": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}


def register(subparsers) -> None:
    p = subparsers.add_parser("spec", help="n-gram speculative decoding on vs off, one stream")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="the engine's default, float32, unless given",
    )
    p.add_argument("--out", default=".brigade/bench", help="directory for spec.md/.json")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=2)
    p.set_defaults(func=run)


def decode(engine, ids: list[int], params, rid: str) -> tuple[list[int], float]:
    """One greedy request alone; -> its tokens, decode tok/s after the first token."""
    engine.add_request(rid, ids, params)
    tokens: list[int] = []
    t_first = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
        if t_first is None and tokens:
            t_first, n_first = time.perf_counter(), len(tokens)
    return tokens, (len(tokens) - n_first) / (time.perf_counter() - t_first)


def run(args: argparse.Namespace) -> int:
    import torch

    from engine import Engine, EngineConfig, SamplingParams

    k = args.num_speculative_tokens
    engines = {
        mode: Engine(
            EngineConfig(
                model=args.model, dtype=args.dtype, num_speculative_tokens=k if mode == "on" else 0
            )
        )
        for mode in ("off", "on")
    }
    tok = engines["off"].tokenizer
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    res: dict = {
        "model": args.model,
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "num_speculative_tokens": k,
        "max_tokens": args.max_tokens,
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "prompts": {},
    }
    for engine in engines.values():  # warm-up: first use of the shapes
        decode(engine, tok.encode("Hello"), SamplingParams(temperature=0.0, max_tokens=8), "w")
    for prompt_name, text in PROMPTS.items():
        ids = tok.encode_chat([{"role": "user", "content": text}])
        speeds: dict[str, list[float]] = {"off": [], "on": []}
        outputs: dict[str, list[int]] = {}
        drafted = accepted = 0
        for r in range(args.repeats):
            for mode, engine in engines.items():
                print(f"{prompt_name}: speculation {mode}, run {r + 1} ...", flush=True)
                before = engine.stats()
                tokens, speed = decode(engine, ids, params, f"{prompt_name}-{r}")
                after = engine.stats()
                speeds[mode].append(speed)
                outputs[mode] = tokens
                if mode == "on":
                    drafted += after.num_draft_tokens - before.num_draft_tokens
                    accepted += after.num_accepted_draft_tokens - before.num_accepted_draft_tokens
        off, on = max(speeds["off"]), max(speeds["on"])
        res["prompts"][prompt_name] = {
            "prompt_tokens": len(ids),
            "off_tok_per_s": round(off, 1),
            "on_tok_per_s": round(on, 1),
            "speedup": round(on / off, 2),
            "acceptance": round(accepted / drafted, 3) if drafted else None,
            "same_tokens": outputs["off"] == outputs["on"],
            "text": tok.decode(outputs["on"])[:200],
        }
    write_results(args.out, "spec", res, markdown(res))
    return 0


def markdown(res: dict) -> str:
    lines = [
        f"Speculative decoding (n-gram, {res['num_speculative_tokens']} draft tokens): "
        f"{res['model']} {res['dtype']}, {res['threads']} threads, one greedy stream, "
        f"{res['max_tokens']} tokens; best of the runs; load average at start "
        f"{res['load_average_at_start']}",
        "",
        "| prompt | off, tok/s | on, tok/s | speed-up | draft tokens accepted | same tokens |",
        "|---|---|---|---|---|---|",
    ]
    for name, p in res["prompts"].items():
        acceptance = "—" if p["acceptance"] is None else f"{p['acceptance']:.0%}"
        lines.append(
            f"| {name} ({p['prompt_tokens']} tokens) | {p['off_tok_per_s']} | "
            f"{p['on_tok_per_s']} | {p['speedup']:.2f}x | {acceptance} | "
            f"{'yes' if p['same_tokens'] else 'no'} |"
        )
    return "\n".join(lines) + "\n"
