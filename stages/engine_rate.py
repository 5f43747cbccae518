"""The engine's compute rate: what one more token costs a step, learned from the steps' own
sizes and times (a line `time = fixed + size / rate` fitted over the recent steps).

A run's own prefill time is no measure of it under continuous batching: a prompt prefilled in a
step shared with 31 decoding rows reads as slow. The fitted slope is the rate a waiting prompt's
tokens are computed at; the fixed part (the step's own cost) is the wait for a step, which the
edge learns from first tokens. It rides on `tokens` and `finished` (`compute_tok_s`).
"""

from __future__ import annotations

from dataclasses import dataclass

RATE_WEIGHT = 0.02  # each step's share of the fit (an EWMA: about the last 50 steps)
MIN_SPREAD = 0.1  # the fit's sizes must spread this much of their mean (and a token) for a slope
MAX_SPEEDUP = 16.0  # the slope's rate is at most this many times the steps' mean rate


@dataclass
class ComputeRate:
    """Exponentially weighted moments of (tokens, seconds) over the steps that computed any."""

    num_steps: int = 0
    mean_n: float = 0.0  # tokens a step computed
    mean_t: float = 0.0  # seconds a step took
    mean_nn: float = 0.0
    mean_nt: float = 0.0

    def observe(self, num_tokens: int, took_ns: int) -> None:
        if num_tokens <= 0 or took_ns <= 0:
            return  # an empty step (only aborts) measures nothing
        n, t = float(num_tokens), took_ns / 1e9
        self.num_steps += 1
        w = max(RATE_WEIGHT, 1.0 / self.num_steps)  # a plain mean until the window fills
        self.mean_n += w * (n - self.mean_n)
        self.mean_t += w * (t - self.mean_t)
        self.mean_nn += w * (n * n - self.mean_nn)
        self.mean_nt += w * (n * t - self.mean_nt)

    @property
    def tok_s(self) -> float | None:
        """Tokens per second of step time an added token is computed at; None before any step.
        With too little spread in the steps' sizes for a slope, the steps' mean rate. The slope
        is kept between that mean rate (a step's fixed cost is never negative) and MAX_SPEEDUP
        times it (where bigger steps took no longer, added tokens cost too little to measure)."""
        if not self.num_steps:
            return None
        mean_rate = self.mean_n / self.mean_t
        var = self.mean_nn - self.mean_n**2
        cov = self.mean_nt - self.mean_n * self.mean_t
        spread = max(1.0, MIN_SPREAD * self.mean_n)
        if var < spread**2:
            return mean_rate
        if cov <= var / (MAX_SPEEDUP * mean_rate):
            return MAX_SPEEDUP * mean_rate
        return max(var / cov, mean_rate)
