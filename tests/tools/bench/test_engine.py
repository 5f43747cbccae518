"""The batching modes of `brigade bench engine` on a tiny random Llama: the same requests give
the same counted tokens in every mode, in the steps each mode must take."""

from pathlib import Path

import pytest

from engine import Engine, EngineConfig, SamplingParams
from tests.engine.tiny_llama import write_tiny_llama
from tools.bench.engine import MODES, bench_shape, kv_memory, run_workload

# prompt lengths 5, 9, 4; max_tokens 3, 1, 2; two rows per batch
WORKLOAD = [([7] * 5, 3), ([8] * 9, 1), ([9] * 4, 2)]


def params_for(i: int, max_tokens: int) -> SamplingParams:
    return SamplingParams(
        temperature=0.8, top_p=0.95, seed=i, max_tokens=max_tokens, ignore_eos=True
    )


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Engine:
    model: Path = write_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama")
    return Engine(EngineConfig(model=str(model), dtype="float32", block_size=4, num_kv_blocks=256))


@pytest.mark.parametrize(
    ("mode", "steps", "peak_blocks"),
    [
        # blocks held after a step: ceil(KV entries / 4) over the unfinished requests.
        # 1: prefill r0 + r1 (r1 done; r0 holds 5 entries, 2 blocks); 2: r0 decodes (6 entries)
        # and r2 joins (4 entries, 1 block) -> 3 blocks; 3: both finish
        ("continuous", 3, 3),
        # batch 1 runs 3 steps (its longest), both rows padded to 9 entries (3 + 3 blocks);
        # batch 2 runs 2 steps
        ("static", 5, 6),
        # batch 1: r1 leaves after step 1, r0 (2 blocks) after step 3; then batch 2 alone
        ("static-admission", 5, 2),
    ],
)
def test_every_mode_counts_only_each_requests_own_tokens(engine, mode, steps, peak_blocks):
    original = engine.runner.run
    r = run_workload(engine, WORKLOAD, 2, mode, params_for)
    assert r["generated_tokens"] == 6  # 3 + 1 + 2, padding rows included in static's steps
    assert r["steps"] == steps
    assert r["peak_blocks"] == peak_blocks
    assert r["requests"] == 3 and r["tok_per_s"] > 0
    assert engine.runner.run == original  # the timing wrapper is taken off again
    assert not engine.has_unfinished_requests()


def test_bench_shape_runs_every_mode_on_one_drawn_workload(engine, monkeypatch):
    monkeypatch.setattr("tools.bench.engine.CONCURRENCY_QUICK", (2,))
    res = bench_shape(engine, "log-uniform", 5, True, params_for)
    assert list(res["batching"]) == [f"{m}_2" for m in MODES]
    tokens = {r["generated_tokens"] for r in res["batching"].values()}
    assert len(tokens) == 1  # the same 4 requests in every mode
    pad = res["padding"]["2"]
    assert pad["outputs_emax_over_emean"] == 1.224 and pad["prompts_emax_over_emean"] == 1.324
    kv = kv_memory(engine, res)
    assert kv["concurrency"] == 2
    assert (
        kv["paged_peak_bytes"]
        == res["batching"]["continuous_2"]["peak_blocks"] * 2 * 2 * 4 * 2 * 16 * 4
    )
