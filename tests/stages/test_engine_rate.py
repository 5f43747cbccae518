"""The engine's compute rate from its steps' sizes and times: the slope of a step's time over its
tokens (what an added token costs), the steps' mean rate without spread, clamped between that
mean rate and MAX_SPEEDUP times it."""

from __future__ import annotations

import pytest

from stages.engine_rate import MAX_SPEEDUP, ComputeRate

FIXED_S, PER_TOKEN_S = 0.0064, 0.0012  # 32 decoding rows: 44.8 ms a step


def stepped(sizes: list[int], took_s) -> ComputeRate:
    rate = ComputeRate()
    for n in sizes:
        rate.observe(n, int(took_s(n) * 1e9))
    return rate


def test_no_step_no_rate_and_an_empty_step_measures_nothing():
    rate = ComputeRate()
    assert rate.tok_s is None
    rate.observe(0, 5_000_000)  # a step that only reported aborts
    assert rate.tok_s is None and rate.num_steps == 0


def test_the_rate_is_the_slope_not_the_steps_mean():
    """32 decoding rows, and now and then a 40-token prompt beside them: a token costs 1.2 ms,
    so prompts are computed at 833 tokens/s, though a step's 72 tokens take 92.8 ms (776/s)
    and the mean step computes ~746/s."""
    rate = stepped([32, 32, 72] * 40, lambda n: FIXED_S + PER_TOKEN_S * n)
    assert rate.tok_s == pytest.approx(1 / PER_TOKEN_S, rel=1e-6)
    assert rate.mean_n / rate.mean_t == pytest.approx(746, abs=5)


def test_steps_of_one_size_give_their_mean_rate():
    rate = stepped([32] * 100, lambda n: FIXED_S + PER_TOKEN_S * n)
    assert rate.tok_s == pytest.approx(32 / 0.0448)  # 714 tokens/s: no slope to fit


def test_a_lone_decode_and_a_prompt_fit_the_slope_too():
    """One stream decoding at 7.6 ms a step, one 40-token prompt now and then: the slope, not
    the 1 token a step that most steps compute (131 tokens/s)."""
    rate = stepped([1] * 30 + [41] + [1] * 30 + [41], lambda n: FIXED_S + PER_TOKEN_S * n)
    assert rate.tok_s == pytest.approx(1 / PER_TOKEN_S, rel=1e-6)


def test_steps_that_take_as_long_whatever_their_size_are_capped():
    """Bigger steps no slower (a GPU far from its compute bound): an added token costs too little
    to measure, so the rate is MAX_SPEEDUP times the steps' mean rate."""
    rate = stepped([32, 72] * 50, lambda n: 0.010)
    assert rate.tok_s == pytest.approx(MAX_SPEEDUP * rate.mean_n / rate.mean_t)
    assert rate.tok_s == pytest.approx(MAX_SPEEDUP * 52 / 0.010, rel=0.01)  # 83,200 tokens/s


def test_a_slope_slower_than_the_mean_rate_is_the_mean_rate():
    """A step's fixed cost is never negative, so no token costs more than a step's mean share."""
    rate = stepped([10, 100] * 50, lambda n: 0.0001 * n * n)  # superlinear in its size
    assert rate.tok_s == pytest.approx(rate.mean_n / rate.mean_t)


def test_the_fit_follows_the_recent_steps():
    """An engine that became three times slower a token: 200 steps later the old ones weigh
    2 %, and the rate reads the new cost."""
    rate = stepped([32, 72] * 100, lambda n: FIXED_S + PER_TOKEN_S * n)
    for n in [32, 72] * 100:
        rate.observe(n, int((FIXED_S + 3 * PER_TOKEN_S * n) * 1e9))
    assert rate.tok_s == pytest.approx(1 / (3 * PER_TOKEN_S), rel=0.02)
