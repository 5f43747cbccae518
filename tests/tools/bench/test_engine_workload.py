"""The benchmark's workloads: seeded draws in both shapes, the padded static layout, and the
padding theory (E[max] / E[mean]) checked exactly and against the generator's own draws."""

import random
from collections import Counter

import pytest

from tools.bench.engine_workload import (
    PAD_TOKEN_ID,
    draw_length,
    drawn_padding_factor,
    expected_max,
    length_cdf,
    make_workload,
    padded_batches,
    padding_context,
    padding_factor,
)


def test_padded_batches_pad_prompts_and_outputs_to_the_longest():
    workload = [([5, 6], 3), ([7, 8, 9, 10], 1), ([11], 2)]
    batches = list(padded_batches(workload, concurrency=2))
    pad = PAD_TOKEN_ID
    assert batches == [
        [(0, [pad, pad, 5, 6], 3, 3), (1, [7, 8, 9, 10], 3, 1)],
        [(2, [11], 2, 2)],
    ]


def test_uniform_workload_is_the_one_the_benchmark_always_drew():
    # the README's runs: 2174 output tokens at 8 concurrent, 8901 at 32 (seed 0 + concurrency)
    for c, tokens in ((8, 2174), (32, 8901)):
        w = make_workload(2 * c, c, 49152, (32, 1024), (16, 256), "uniform")
        assert sum(m for _, m in w) == tokens


def test_log_uniform_workload_bounds_and_seed():
    w = make_workload(400, 7, 50, (32, 1024), (16, 256), "log-uniform")
    prompts, outputs = [len(ids) for ids, _ in w], [m for _, m in w]
    assert all(32 <= n <= 1024 for n in prompts) and all(16 <= m <= 256 for m in outputs)
    assert all(3 <= t < 50 for ids, _ in w for t in ids)
    # a fixed seed gives these exact requests (and a prefix of a longer run)
    assert prompts[:6] == [98, 665, 86, 486, 134, 188]
    assert outputs[:6] == [78, 114, 136, 185, 138, 19]
    assert make_workload(6, 7, 50, (32, 1024), (16, 256), "log-uniform") == w[:6]
    assert make_workload(400, 7, 50, (32, 1024), (16, 256), "log-uniform") == w
    assert make_workload(400, 8, 50, (32, 1024), (16, 256), "log-uniform") != w
    # heavy-tailed: most requests below the arithmetic middle of the range, a few near the top
    assert sum(m < 136 for m in outputs) > 0.7 * len(outputs)
    assert max(outputs) > 200 and max(prompts) > 800


def test_log_uniform_draws_follow_the_cdf_the_theory_uses():
    rng = random.Random(3)
    n = 40_000
    counts = Counter(draw_length(rng, 2, 9, "log-uniform") for _ in range(n))
    assert set(counts) == set(range(2, 10))
    for k in range(2, 10):
        p = length_cdf(k, 2, 9, "log-uniform") - length_cdf(k - 1, 2, 9, "log-uniform")
        assert counts[k] / n == pytest.approx(p, abs=0.01)
    assert length_cdf(2, 2, 9, "log-uniform") == pytest.approx(0.14836, abs=1e-5)  # ln 1.25/ln 4.5


def test_expected_max_exact_on_small_ranges():
    assert expected_max(1, 2, "uniform", 1) == pytest.approx(1.5)
    assert expected_max(1, 2, "uniform", 2) == pytest.approx(1.75)  # 1/4 * 1 + 3/4 * 2
    assert padding_factor(1, 2, "uniform", 2) == pytest.approx(7 / 6)
    assert padding_factor(5, 5, "log-uniform", 32) == 1.0
    # the benchmark's ranges: log-uniform pads far more than uniform at the same batch
    assert padding_factor(16, 256, "uniform", 32) == pytest.approx(1.8322, abs=1e-4)
    assert padding_factor(16, 256, "log-uniform", 32) == pytest.approx(2.7278, abs=1e-4)
    assert expected_max(16, 256, "log-uniform", 1) == pytest.approx(86.56, abs=0.01)


def test_drawn_padding_factor_and_context():
    assert drawn_padding_factor([1, 3, 2, 2], 2) == 10 / 8  # (2*3 + 2*2) / 8
    assert drawn_padding_factor([4, 1, 1], 2) == 9 / 6  # (2*4 + 1*1) / 6: a short last batch
    ctx = padding_context([([9] * 4, 1), ([9] * 2, 3)], 2, (2, 4), (1, 3), "uniform")
    assert ctx["outputs_drawn"] == 1.5 and ctx["prompts_drawn"] == pytest.approx(1.333)
    assert ctx["output_mean"] == 2.0 and ctx["prompt_mean"] == 3.0


def test_bad_shape_and_range_are_refused():
    with pytest.raises(ValueError, match="'zipf' is unknown; allowed: uniform, log-uniform"):
        make_workload(1, 0, 50, (1, 4), (1, 4), "zipf")
    with pytest.raises(ValueError, match=r"\(9, 3\) is invalid"):
        draw_length(random.Random(0), 9, 3, "uniform")
