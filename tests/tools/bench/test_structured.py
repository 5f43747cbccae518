"""`brigade bench structured`: decode steps timed with their grammar part, compiles, the table."""

import dataclasses

from engine import Engine, EngineConfig, SamplingParams, load_tokenizer
from engine.params import Constraint
from tests.engine.test_grammar import write_tiny_smollm_vocab
from tools.bench.structured import (
    COMPILE_SCHEMAS,
    STEADY_SCHEMA,
    markdown,
    measure_compiles,
    measure_steps,
)


def test_steps_are_timed_with_their_grammar_part(tmp_path):
    model = write_tiny_smollm_vocab(tmp_path / "llama")
    engine = Engine(EngineConfig(model=str(model), dtype="float32", block_size=4))
    plain = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    constrained = dataclasses.replace(
        plain, ignore_eos=False, constraint=Constraint.json_schema(STEADY_SCHEMA)
    )
    res = measure_steps(engine, [5, 6, 7], 3, constrained, "c")
    assert res["steps"] == 6  # 8 tokens each: the first and the last step are not decodes
    assert 0 < res["grammar_ms"] < res["step_ms"] and res["apply_ms"] > 0
    res = measure_steps(engine, [5, 6, 7], 3, plain, "p")
    assert res["steps"] == 6 and res["grammar_ms"] == 0 and "apply_ms" not in res


def test_every_schema_compiles_and_is_found_cached():
    tok = load_tokenizer("smollm2-135m")
    res = measure_compiles(tok, tok.vocab_size)
    assert set(res["schemas"]) == set(COMPILE_SCHEMAS) and res["vocabulary_ms"] > 0
    for s in res["schemas"].values():
        assert s["compile_ms"] > 0 and s["first_mask_ms"] > 0 and s["cached_ms"] < s["compile_ms"]


def test_table_rows_per_concurrency_and_schema():
    res = {
        "model": "m",
        "dtype": "bfloat16",
        "threads": 2,
        "max_tokens": 40,
        "load_average_at_start": [0.5],
        "concurrency": {
            "1": {
                "step_ms": 6.0,
                "grammar_ms": 0.08,
                "apply_ms": 0.02,
                "mask_ms": 0.1,
                "share": 0.0167,
                "plain_step_ms": 5.9,
                "steps": 38,
            },
            "32": {
                "step_ms": 40.0,
                "grammar_ms": 1.5,
                "apply_ms": 0.5,
                "mask_ms": 2.0,
                "share": 0.05,
                "plain_step_ms": 38.0,
                "steps": 38,
            },
        },  # fmt: skip
        "compile": {
            "vocabulary_ms": 228.0,
            "schemas": {"flat": {"compile_ms": 0.96, "first_mask_ms": 0.36, "cached_ms": 0.005}},
        },
    }
    table = markdown(res)
    assert "| 1 | 6.0 | 0.10 (0.08 + 0.02) | 1.7% | 5.9 |" in table
    assert "| 32 | 40.0 | 2.00 (1.50 + 0.50) | 5.0% | 38.0 |" in table
    assert "| flat | 0.96 | 0.36 | 0.005 |" in table and "228 ms" in table
