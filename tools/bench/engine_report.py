"""engine.md from engine.json: the headline table, the batching comparison with the workload
shapes side by side (each with its padding theory), and one detail row per run."""

from __future__ import annotations

from tools.bench.engine_workload import PAD_TOKEN_ID

MIB = 2**20
LABELS = {
    "continuous": "continuous batching",
    "static": "static batching (padded, lockstep)",
    "static-admission": "static admission only (rows leave early)",
    "transformers": "transformers fp32 generate (padded batches)",
}


def _concurrencies(workloads: dict) -> list[int]:
    return sorted({int(k.rsplit("_", 1)[1]) for w in workloads.values() for k in w["batching"]})


def _run(w: dict, mode: str, c: int) -> dict | None:
    if mode == "transformers":
        return (w.get("transformers_fp32") or {}).get(f"static_{c}")
    return w["batching"].get(f"{mode}_{c}")


def _ratio(w: dict, mode: str, c: int) -> str:
    cont, other = _run(w, "continuous", c), _run(w, mode, c)
    if not cont or not other:
        return "—"
    return f"{cont['tok_per_s'] / other['tok_per_s']:.2f}x"


def comparison(res: dict) -> list[str]:
    """Aggregate tok/s per mode and concurrency, one column per workload shape."""
    ws = list(res["workloads"].values())
    lines = [
        "| aggregate tok/s (generated tokens / wall time) | " + " | ".join(res["workloads"]) + " |",
        "|---" * (len(ws) + 1) + "|",
    ]

    def row(label: str, cells: list[str]) -> None:
        lines.append(f"| {label} | " + " | ".join(cells) + " |")

    concurrencies = _concurrencies(res["workloads"])
    for c in concurrencies:
        for mode in LABELS:
            if not any(_run(w, mode, c) for w in ws):
                continue
            row(f"{LABELS[mode]}, {c} concurrent", [_tok_s(_run(w, mode, c)) for w in ws])
            if mode != "continuous":
                row(
                    f"continuous / {LABELS[mode]}, {c} concurrent",
                    [_ratio(w, mode, c) for w in ws],
                )
        row(
            f"padded batch of {c} in theory, E[max] / E[mean]: outputs; prompts (drawn)",
            [_padding(w["padding"][str(c)]) for w in ws],
        )
    first = [w["padding"][str(concurrencies[0])] for w in ws]
    row(
        "E[output] / E[prompt] tokens per request",
        [f"{p['output_mean']} / {p['prompt_mean']}" for p in first],
    )
    kv = [w["kv"] for w in ws]
    row(
        f"KV held, paged, peak / mean (continuous, {kv[0]['concurrency']} concurrent)",
        [f"{k['paged_peak_bytes'] / MIB:.1f} / {k['paged_mean_bytes'] / MIB:.1f} MiB" for k in kv],
    )
    row(
        "KV if reserved contiguously: max_model_len / workload max",
        [
            f"{k['contiguous_max_model_len_bytes'] / MIB:.1f} / "
            f"{k['contiguous_workload_max_bytes'] / MIB:.1f} MiB"
            for k in kv
        ],
    )
    return lines


def _tok_s(r: dict | None) -> str:
    return "—" if r is None else str(r["tok_per_s"])


def _padding(p: dict) -> str:
    return (
        f"{p['outputs_emax_over_emean']:.2f}x ({p['outputs_drawn']:.2f}x); "
        f"{p['prompts_emax_over_emean']:.2f}x ({p['prompts_drawn']:.2f}x)"
    )


def details(res: dict) -> list[str]:
    """Every run with its counts: tokens, wall time, steps, decode-only speed, overhead."""
    lines = [
        "| shape | mode | concurrent | requests | tokens | wall s | steps | decode-only tok/s "
        "| outside the runner, CPU ms/step | peak KV blocks |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for shape, w in res["workloads"].items():
        for c in _concurrencies(res["workloads"]):
            for mode in LABELS:
                r = _run(w, mode, c)
                if r is None:
                    continue
                steps = r.get("steps", f"{r.get('batches')} generate calls")
                lines.append(
                    f"| {shape} | {mode} | {c} | {r['requests']} | {r['generated_tokens']} | "
                    f"{r['wall_s']} | {steps} | {r.get('decode_only_tok_per_s', '—')} | "
                    f"{r.get('overhead_cpu_ms_per_step', '—')} | {r.get('peak_blocks', '—')} |"
                )
    return lines


def _transformers_note(res: dict) -> str:
    shapes = res.get("transformers_shapes")
    if shapes is None:
        return "transformers did not run (--no-transformers, or not installed). "
    return (
        f"transformers fp32 generate ran the {' and '.join(shapes)} workload as padded batches "
        "(left padding with an attention mask, each batch decoding its longest output; "
        "--transformers-shapes picks the shapes). "
    )


def markdown(res: dict) -> str:
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
    lines += ["", *comparison(res), "", *details(res), ""]
    for shape, w in res["workloads"].items():
        lines.append(
            f"Workload {shape}: prompts {w['prompt_lens'][0]}-{w['prompt_lens'][1]} tokens, "
            f"outputs {w['output_lens'][0]}-{w['output_lens'][1]} tokens, seed {w['seed']} + "
            "concurrency, 2 x concurrency requests."
        )
    lines += [
        "",
        "Every run samples at temperature 0.8 / top-p 0.95 and ignores eos; padded static rows "
        f"(ours and transformers') count only their own tokens; pad prompt positions hold token "
        f"id {PAD_TOKEN_ID}. Theory: E[max] / E[mean] of a batch's lengths is the row-steps "
        "(outputs) or prompt positions a padded batch computes per real one; in parentheses the "
        "same ratio over the requests drawn. "
        + _transformers_note(res)
        + "Wall seconds per part: "
        + ", ".join(f"{k} {v}" for k, v in res["section_wall_s"].items())
        + ".",
        "",
    ]
    return "\n".join(lines)
