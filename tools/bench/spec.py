"""`brigade bench spec`: n-gram speculative decoding on vs off, one greedy stream at a time.

Two chat prompts through the model's chat template: one whose answer repeats its prompt (the
model is asked to copy a passage, as in editing or quoting), one open-ended (little to look up).
Each runs through an engine with speculation off and one with it on, alternating, so machine
noise falls on both; the tokens must come out the same. Reported per prompt: decode tok/s (after
the first token), the ratio, and the share of draft tokens the model accepted.

Beside them, whether a self-speculative draft could pay on this model (LayerSkip's early exit,
Draft & Verify's skipped layers): teacher-forced over the quality corpus, how often a draft
model made of some of the model's own layers (the first L, or all but a skipped set, then the
final norm and LM head) picks the full model's top-1 token, and the best speed-up that agreement
allows. A draft of the layers' share c per token, verified in one step that costs at least a
plain step, gives at most (1 + p + ... + p^k) / (1 + k c) with agreement p and k drafts (p^i:
the chance the first i drafts all stand), the LM head's cost left out.
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


EXITS = (8, 16, 24, 29)  # draft = the first L layers
SKIPS = {  # draft = every layer but these (0-based), as Draft & Verify chooses
    "13-16": range(13, 17),
    "21, 23, 25, 27": range(21, 29, 2),
    "11-18": range(11, 19),
}
AGREEMENT_TOKENS = 512


def speedup_bound(p: float, c: float, max_k: int = 8) -> tuple[float, int]:
    """The best (1 + p + ... + p^k) / (1 + k c) over k = 1..max_k, and its k."""
    return max((sum(p**i for i in range(k + 1)) / (1 + k * c), k) for k in range(1, max_k + 1))


def draft_agreement(
    engine, ids: list[int], exits: tuple[int, ...] = EXITS, skips: dict = SKIPS
) -> list[dict]:
    """Each draft's top-1 agreement with the full model over `ids`, teacher-forced (one causal
    pass per draft through the model's own layers; K/V to the engine's idle cache)."""
    import torch
    import torch.nn.functional as F

    from engine.attention import AttentionMetadata, prepare_attention

    m, caches = engine.model, engine.kv_cache.kv_caches
    n, bs = len(ids), engine.config.block_size
    blocks = (n + bs - 1) // bs
    if blocks > caches[0][0].shape[0]:
        raise ValueError(f"{n} tokens need {blocks} KV blocks, the engine has fewer")
    attn = AttentionMetadata(
        slot_mapping=torch.arange(n),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        block_tables=torch.arange(blocks, dtype=torch.int32)[None],
        query_lens_cpu=[n],
        seq_lens_cpu=[n],
        block_size=bs,
    )
    layers = len(m.layers)
    with torch.inference_mode():
        plan = prepare_attention(attn, m.device, m.dtype)
        pos = torch.arange(n)
        cos, sin = m.rope_cos[pos].unsqueeze(1), m.rope_sin[pos].unsqueeze(1)

        def top1(keep: list[int]) -> torch.Tensor:
            x = F.embedding(torch.tensor(ids), m.embed_tokens)
            for i in keep:
                x = m.layers[i].forward(x, cos, sin, caches[i], plan)
            return m.compute_logits(x).argmax(-1)

        full = top1(list(range(layers)))
        drafts = [(f"first {e} layers", list(range(e))) for e in exits if e < layers]
        drafts += [
            (f"all but {name}", [i for i in range(layers) if i not in set(skip)])
            for name, skip in skips.items()
            if max(skip) < layers
        ]
        rows = []
        for name, keep in drafts:
            p = float((top1(keep) == full).float().mean())
            c = len(keep) / layers
            bound, k = speedup_bound(p, c)
            rows.append({"draft": name, "layers": len(keep), "agreement": round(p, 3),
                         "speedup_bound": round(bound, 2), "best_k": k})  # fmt: skip
    return rows


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
    from tools.bench.quality import load_corpus

    corpus = load_corpus(tok, AGREEMENT_TOKENS)
    print(f"self-speculative drafts: top-1 agreement over {len(corpus)} corpus tokens ...")
    res["self_draft_tokens"] = len(corpus)
    res["self_drafts"] = draft_agreement(engines["off"], corpus)
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
    drafts = res.get("self_drafts")
    if drafts:
        lines += [
            "",
            f"Self-speculative drafts (the model's own layers, then its LM head), teacher-forced "
            f"over {res['self_draft_tokens']} corpus tokens: how often each picks the full "
            "model's top-1, and the best speed-up that allows, (1 + p + ... + p^k) / (1 + k c) "
            "with c the draft's share of the layers:",
            "",
            "| draft | layers | top-1 agreement | speed-up at most | at k |",
            "|---|---|---|---|---|",
        ]
        for d in drafts:
            lines.append(
                f"| {d['draft']} | {d['layers']} | {d['agreement']:.1%} | "
                f"{d['speedup_bound']:.2f}x | {d['best_k']} |"
            )
    return "\n".join(lines) + "\n"
