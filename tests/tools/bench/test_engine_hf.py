"""The transformers baseline on a tiny random Llama: a left-padded row decodes as it would alone
(and as the engine decodes it), eos ends no row early, only a row's own tokens are counted."""

from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from tests.engine.tiny_llama import write_tiny_llama
from tools.bench import engine_hf as bench_engine_hf
from tools.bench.engine_hf import SAMPLING, generate_padded, load_model, run_workload

pytest.importorskip("transformers")  # the `reference` extra

SHORT, LONG = [5, 17, 42, 9], [11, 3, 250, 64, 64, 7, 120, 33, 8]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama")


@pytest.fixture(scope="module")
def hf(tiny_dir):
    return load_model(str(tiny_dir))


def greedy(hf, prompts, steps, **kw):
    return generate_padded(hf, prompts, steps, seed=0, do_sample=False, **kw).tolist()


def test_left_padded_row_decodes_as_alone_and_as_the_engine(hf, tiny_dir):
    batch = greedy(hf, [SHORT, LONG], 6)
    assert batch[0] == greedy(hf, [SHORT], 6)[0]
    assert batch[1] == greedy(hf, [LONG], 6)[0]
    llm = LLM(model=str(tiny_dir), dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    assert [o.token_ids for o in llm.generate([SHORT, LONG], params)] == batch


def test_eos_does_not_end_a_row_before_the_batch_is_done(hf):
    first = greedy(hf, [SHORT], 1)[0][0]
    out = greedy(hf, [SHORT], 5, eos_token_id=first)  # the token it would pick first is eos
    assert len(out[0]) == 5 and first not in out[0]


def test_sampling_is_seeded_like_the_engines_run(hf):
    a = generate_padded(hf, [SHORT, LONG], 8, seed=4, **SAMPLING).tolist()
    assert a == generate_padded(hf, [SHORT, LONG], 8, seed=4, **SAMPLING).tolist()
    assert a != generate_padded(hf, [SHORT, LONG], 8, seed=5, **SAMPLING).tolist()


def test_workload_counts_only_each_rows_own_tokens(hf, monkeypatch):
    calls = []
    real = bench_engine_hf.generate_padded

    def spy(hf, prompts, steps, seed, **sampling):
        calls.append(([len(p) for p in prompts], steps, seed))
        return real(hf, prompts, steps, seed, **sampling)

    monkeypatch.setattr(bench_engine_hf, "generate_padded", spy)
    workload = [([7] * 5, 3), ([8] * 9, 1), ([9] * 4, 2)]
    r = run_workload(hf, workload, 2, seed=10)
    assert calls == [([5, 9], 3, 10), ([4], 2, 11)]  # unpadded prompts; the batch's longest output
    assert (r["requests"], r["batches"], r["generated_tokens"], r["padded_row_steps"]) == (
        3,
        2,
        6,
        8,
    )
    assert r["tok_per_s"] > 0
