"""`brigade bench structured`: what the grammar mask costs a decode step, and schema compiles.

For 1, 8 and 32 concurrent requests following one JSON schema, every decode step in which all of
them sample is timed, and within it the grammar's part: the masks computed and the matchers
advanced (EngineStats.grammar_s) plus the masks applied to the logits (apply_token_bitmask_ on
the step's real masks, timed apart). The same requests without the schema give the plain step
beside it. Each schema of a small set is compiled cold (to its first mask) and then looked up
in the cache. Writes structured.md and structured.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from tools.bench.files import write_results

# an array of strings that cannot close within max_tokens: every request decodes every step
STEADY_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "notes": {"type": "array", "items": {"type": "string"}, "minItems": 40},
    },
    "required": ["title", "notes"],
}
PROMPT = "List notes about a trip to the sea, as JSON with a title and the notes."


def _point() -> dict:
    return {
        "type": "object",
        "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
        "required": ["x", "y"],
    }


COMPILE_SCHEMAS = {
    "flat (2 fields)": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
        "required": ["name", "age"],
    },
    "nested objects": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer"},
                    "address": {
                        "type": "object",
                        "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                        "required": ["city"],
                    },
                },
                "required": ["id", "address"],
            }
        },
        "required": ["user"],
    },
    "array of objects + enum": {
        "type": "object",
        "properties": {
            "points": {"type": "array", "items": _point(), "maxItems": 10},
            "unit": {"enum": ["m", "km", "mi"]},
        },
        "required": ["points", "unit"],
    },
    "refs + anyOf": {
        "$defs": {"pt": _point()},
        "type": "object",
        "properties": {
            "start": {"$ref": "#/$defs/pt"},
            "end": {"anyOf": [{"$ref": "#/$defs/pt"}, {"type": "null"}]},
        },
        "required": ["start", "end"],
    },
    "wide (40 fields)": {
        "type": "object",
        "properties": {
            f"field_{k}": [{"type": "string"}, {"type": "integer"}, {"type": "boolean"}][k % 3]
            for k in range(40)
        },
        "required": [f"field_{k}" for k in range(0, 40, 2)],
    },
    "patterns and bounds": {
        "type": "object",
        "properties": {
            "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
            "price": {"type": "number", "minimum": 0, "maximum": 1000},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}},
        },
        "required": ["code", "price"],
    },
}


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "structured", help="grammar mask's share of a decode step; schema compile time"
    )
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--out", default=".brigade/bench", help="directory for structured.md/.json")
    p.add_argument("--concurrency", default="1,8,32", help="comma-separated request counts")
    p.add_argument("--max-tokens", type=int, default=40)
    p.set_defaults(func=run)


def measure_steps(engine, prompt: list[int], num_requests: int, params, tag: str) -> dict:
    """Run `num_requests` copies of one request; time each step in which all of them decode.
    -> median step time, median grammar time per step (ms), and the steps measured."""
    for k in range(num_requests):
        engine.add_request(f"{tag}-{k}", prompt, params)
    steps: list[float] = []
    grammar: list[float] = []
    masks = None
    while engine.has_unfinished_requests():
        before = engine.stats().grammar_s
        start = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - start
        # a decode: every request had output before this step and got one more token
        decoded = [o for o in outputs if o.new_token_ids and o.num_output_tokens > 1]
        if len(decoded) == num_requests and not any(o.finished for o in outputs):
            steps.append(elapsed)
            grammar.append(engine.stats().grammar_s - before)
            if masks is None and params.constraint is not None:
                masks = engine.grammars.fill_masks([s.grammar for s in engine.scheduler.running])
    result = {
        "steps": len(steps),
        "step_ms": 1e3 * statistics.median(steps[1:] or steps),  # the first: new shapes
        "grammar_ms": 1e3 * statistics.median(grammar[1:] or grammar),
    }
    if masks is not None:
        result["apply_ms"] = 1e3 * time_apply(masks, engine.model_config.vocab_size)
    return result


def time_apply(masks, vocab_size: int, repeats: int = 20) -> float:
    """Median seconds of apply_token_bitmask_ with these masks on logits of their rows."""
    import torch

    from engine.sampler import apply_token_bitmask_

    bitmask = torch.from_numpy(masks)
    rows = list(range(bitmask.shape[0]))
    logits = torch.randn(len(rows), vocab_size)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        apply_token_bitmask_(logits, rows, bitmask)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_compiles(tokenizer, vocab_size: int) -> dict:
    """The vocabulary's build, then per schema: a cold compile to its first mask, and a lookup
    of the compiled grammar (ms)."""
    from engine.grammar import GrammarCache
    from engine.params import Constraint

    start = time.perf_counter()
    cache = GrammarCache(tokenizer, vocab_size)
    res: dict = {"vocabulary_ms": 1e3 * (time.perf_counter() - start), "schemas": {}}
    for name, schema in COMPILE_SCHEMAS.items():
        constraint = Constraint.json_schema(schema)
        start = time.perf_counter()
        cache.compile(constraint)
        compiled = time.perf_counter()
        cache.fill_masks([cache.matcher(constraint)])
        first_mask = time.perf_counter()
        cache.matcher(constraint)
        cached = time.perf_counter()
        res["schemas"][name] = {
            "compile_ms": 1e3 * (compiled - start),
            "first_mask_ms": 1e3 * (first_mask - compiled),
            "cached_ms": 1e3 * (cached - first_mask),
        }
    return res


def run(args: argparse.Namespace) -> int:
    import dataclasses

    import torch

    from engine import Engine, EngineConfig, SamplingParams
    from engine.params import Constraint

    engine = Engine(EngineConfig(model=args.model, dtype=args.dtype))
    tok = engine.tokenizer
    res: dict = {
        "model": args.model,
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "max_tokens": args.max_tokens,
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "compile": measure_compiles(tok, engine.model_config.vocab_size),
        "concurrency": {},
    }
    prompt = tok.encode_chat([{"role": "user", "content": PROMPT}])
    plain = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    constrained = dataclasses.replace(
        plain, ignore_eos=False, constraint=Constraint.json_schema(STEADY_SCHEMA)
    )
    measure_steps(engine, prompt, 2, constrained, "warm")
    for n in [int(x) for x in args.concurrency.split(",")]:
        print(f"{n} concurrent requests ...", flush=True)
        with_mask = measure_steps(engine, prompt, n, constrained, f"c{n}")
        without = measure_steps(engine, prompt, n, plain, f"p{n}")
        mask_ms = with_mask["grammar_ms"] + with_mask["apply_ms"]
        res["concurrency"][str(n)] = {
            **with_mask,
            "mask_ms": mask_ms,
            "share": mask_ms / with_mask["step_ms"],
            "plain_step_ms": without["step_ms"],
        }
    write_results(args.out, "structured", res, markdown(res))
    return 0


def markdown(res: dict) -> str:
    lines = [
        f"Structured outputs (llguidance): {res['model']} {res['dtype']}, {res['threads']} "
        f"threads, greedy, {res['max_tokens']} tokens per request; medians over the decode "
        f"steps in which every request sampled; load average at start "
        f"{res['load_average_at_start']}",
        "",
        "| concurrent requests | decode step, ms | grammar mask, ms (compute + apply) | share "
        "of the step | step without a schema, ms |",
        "|---|---|---|---|---|",
    ]
    for n, c in res["concurrency"].items():
        lines.append(
            f"| {n} | {c['step_ms']:.1f} | {c['mask_ms']:.2f} ({c['grammar_ms']:.2f} + "
            f"{c['apply_ms']:.2f}) | {c['share']:.1%} | {c['plain_step_ms']:.1f} |"
        )
    comp = res["compile"]
    lines += [
        "",
        f"Schema compile (the vocabulary for llguidance, once per engine: "
        f"{comp['vocabulary_ms']:.0f} ms)",
        "",
        "| schema | compile, ms | first mask, ms | cached lookup, ms |",
        "|---|---|---|---|",
    ]
    for name, s in comp["schemas"].items():
        lines.append(
            f"| {name} | {s['compile_ms']:.2f} | {s['first_mask_ms']:.2f} | {s['cached_ms']:.3f} |"
        )
    return "\n".join(lines) + "\n"
