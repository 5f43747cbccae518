"""engine.md: both workload shapes side by side, ratios against continuous batching, the padding
theory per shape, and a dash where a shape did not run through transformers."""

from tools.bench.engine_report import markdown


def run(tok_per_s: float, tokens: int, steps: int) -> dict:
    return {
        "requests": 16,
        "generated_tokens": tokens,
        "wall_s": round(tokens / tok_per_s, 2),
        "tok_per_s": tok_per_s,
        "decode_only_tok_per_s": 150.0,
        "steps": steps,
        "overhead_cpu_ms_per_step": 6.5,
        "peak_blocks": 100,
        "mean_blocks": 50.0,
    }


def shape(cont: float, static: float, admission: float, outputs: float) -> dict:
    return {
        "prompt_lens": [32, 1024],
        "output_lens": [16, 256],
        "seed": 0,
        "padding": {
            "8": {
                "outputs_emax_over_emean": outputs,
                "outputs_drawn": 1.7,
                "prompts_emax_over_emean": 1.73,
                "prompts_drawn": 1.8,
                "output_mean": 136.0,
                "prompt_mean": 528.0,
            }
        },
        "batching": {
            "continuous_8": run(cont, 2000, 300),
            "static_8": run(static, 2000, 500),
            "static-admission_8": run(admission, 2000, 450),
        },
        "kv": {
            "concurrency": 8,
            "paged_peak_bytes": 2**20 * 10,
            "paged_mean_bytes": 2**20 * 5,
            "contiguous_max_model_len_bytes": 2**20 * 1440,
            "contiguous_workload_max_bytes": 2**20 * 225,
        },
    }


RES = {
    "model": "smollm2-135m",
    "dtype": "bfloat16",
    "quantization": "int4",
    "threads": 2,
    "max_num_batched_tokens": 512,
    "quick": False,
    "load_average_at_start": [0.5, 0.6, 0.7],
    "section_wall_s": {"engine_uniform": 500.0},
    "prefill_tok_per_s": {128: 1000.0},
    "single_decode_tok_per_s": 80.0,
    "transformers_fp32_decode_tok_per_s": 16.0,
    "transformers_shapes": ["uniform"],
    "workloads": {
        "uniform": shape(90.0, 45.0, 60.0, 1.69),
        "log-uniform": shape(120.0, 40.0, 80.0, 2.25),
    },
}
RES["workloads"]["uniform"]["transformers_fp32"] = {
    "static_8": {
        "requests": 16,
        "batches": 2,
        "generated_tokens": 2000,
        "wall_s": 100.0,
        "tok_per_s": 20.0,
    }
}


def test_shapes_side_by_side_with_ratios_theory_and_transformers():
    lines = markdown(RES).splitlines()
    for expected in [
        "| transformers fp32 generate, 1 stream | 16.0 (5.00x) |",
        "| aggregate tok/s (generated tokens / wall time) | uniform | log-uniform |",
        "| continuous batching, 8 concurrent | 90.0 | 120.0 |",
        "| continuous / static batching (padded, lockstep), 8 concurrent | 2.00x | 3.00x |",
        "| continuous / static admission only (rows leave early), 8 concurrent | 1.50x | 1.50x |",
        "| transformers fp32 generate (padded batches), 8 concurrent | 20.0 | — |",
        "| continuous / transformers fp32 generate (padded batches), 8 concurrent | 4.50x | — |",
        "| padded batch of 8 in theory, E[max] / E[mean]: outputs; prompts (drawn) "
        "| 1.69x (1.70x); 1.73x (1.80x) | 2.25x (1.70x); 1.73x (1.80x) |",
        "| KV held, paged, peak / mean (continuous, 8 concurrent) | 10.0 / 5.0 MiB | 10.0 / 5.0 MiB |",
        "| uniform | transformers | 8 | 16 | 2000 | 100.0 | 2 generate calls | — | — | — |",
        "| log-uniform | static | 8 | 16 | 2000 | 50.0 | 500 | 150.0 | 6.5 | 100 |",
    ]:
        assert expected in lines, expected
    assert not any(line.startswith("| log-uniform | transformers") for line in lines)
    assert "transformers fp32 generate ran the uniform workload as padded batches" in lines[-1]


def test_a_run_without_transformers_says_so():
    res = {k: v for k, v in RES.items() if not k.startswith("transformers")}
    res["workloads"] = {"uniform": {**RES["workloads"]["uniform"], "transformers_fp32": {}}}
    text = markdown(res)
    assert "transformers did not run (--no-transformers, or not installed)" in text
    assert "transformers fp32 generate (padded batches)" not in text
    assert "| aggregate tok/s (generated tokens / wall time) | uniform |" in text
