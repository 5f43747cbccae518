"""The engine benchmark's mixed workloads: seeded (prompt, output length) draws in two shapes,
the padded static-batch layout, and the padding a static batch pays in theory.

"uniform" draws every length in [lo, hi] equally often; "log-uniform" draws
round(exp(uniform(ln lo, ln hi))), heavy-tailed like chat traffic (many short, few long).
"""

from __future__ import annotations

import math
import random

SHAPES = ("uniform", "log-uniform")
PAD_TOKEN_ID = 0  # what padded prompt positions hold; its compute is what counts
FIRST_TOKEN_ID = 3  # prompt token ids are drawn from [3, vocab): no bos / eos / pad


def _check_range(lo: int, hi: int) -> None:
    if not 1 <= lo <= hi:
        raise ValueError(f"length range ({lo}, {hi}) is invalid; need 1 <= lo <= hi")


def draw_length(rng: random.Random, lo: int, hi: int, shape: str) -> int:
    """One length in [lo, hi] (both included) drawn from `shape`."""
    _check_range(lo, hi)
    if shape == "uniform":
        return rng.randint(lo, hi)
    if shape == "log-uniform":
        # exp(ln hi) may round a hair above hi; round() brings it back to hi
        return round(math.exp(rng.uniform(math.log(lo), math.log(hi))))
    raise ValueError(f"workload shape {shape!r} is unknown; allowed: {', '.join(SHAPES)}")


def make_workload(
    n: int,
    seed: int,
    vocab: int,
    prompt_lens: tuple[int, int],
    output_lens: tuple[int, int],
    shape: str = "uniform",
) -> list[tuple[list[int], int]]:
    """n (prompt_token_ids, max_tokens) pairs drawn with a fixed seed. Per request the draws
    come in one order (prompt length, its token ids, output length), so a seed always gives
    the same workload."""
    rng = random.Random(seed)
    workload = []
    for _ in range(n):
        num_prompt = draw_length(rng, *prompt_lens, shape)
        ids = [rng.randrange(FIRST_TOKEN_ID, vocab) for _ in range(num_prompt)]
        workload.append((ids, draw_length(rng, *output_lens, shape)))
    return workload


def padded_batches(workload, concurrency: int):
    """Static batches as a padded `generate` runs them: [(index, ids, max_tokens, own_tokens)]
    per batch, every prompt left-padded to the batch's longest and every max_tokens raised to
    the batch's largest (own_tokens: how many of the row's tokens are real output)."""
    for start in range(0, len(workload), concurrency):
        batch = list(enumerate(workload))[start : start + concurrency]
        width = max(len(ids) for _, (ids, _) in batch)
        steps = max(m for _, (_, m) in batch)
        yield [(i, [PAD_TOKEN_ID] * (width - len(ids)) + ids, steps, m) for i, (ids, m) in batch]


def length_cdf(k: int, lo: int, hi: int, shape: str) -> float:
    """P(length <= k) for draw_length(lo, hi, shape)."""
    _check_range(lo, hi)
    if k < lo:
        return 0.0
    if k >= hi:
        return 1.0
    if shape == "uniform":
        return (k - lo + 1) / (hi - lo + 1)
    if shape == "log-uniform":  # round(x) <= k  <=>  x < k + 1/2
        return math.log((k + 0.5) / lo) / math.log(hi / lo)
    raise ValueError(f"workload shape {shape!r} is unknown; allowed: {', '.join(SHAPES)}")


def expected_max(lo: int, hi: int, shape: str, batch: int) -> float:
    """E[max of `batch` independent lengths]; batch=1 gives the mean."""
    return sum(
        k * (length_cdf(k, lo, hi, shape) ** batch - length_cdf(k - 1, lo, hi, shape) ** batch)
        for k in range(lo, hi + 1)
    )


def padding_factor(lo: int, hi: int, shape: str, batch: int) -> float:
    """E[max] / E[mean] over a batch: how many row-steps (or prompt positions) a padded static
    batch computes per real one, so about what continuous batching can gain over it."""
    return expected_max(lo, hi, shape, batch) / expected_max(lo, hi, shape, 1)


def drawn_padding_factor(lengths: list[int], concurrency: int) -> float:
    """The same ratio for the lengths actually drawn, batched in order:
    sum over batches of (rows x longest) / sum of lengths."""
    padded = sum(
        len(lengths[s : s + concurrency]) * max(lengths[s : s + concurrency])
        for s in range(0, len(lengths), concurrency)
    )
    return padded / sum(lengths)


def padding_context(workload, concurrency: int, prompt_lens, output_lens, shape: str) -> dict:
    """The theory next to the draw, for outputs (decode row-steps) and prompts (prefill)."""
    return {
        "outputs_emax_over_emean": round(padding_factor(*output_lens, shape, concurrency), 3),
        "outputs_drawn": round(drawn_padding_factor([m for _, m in workload], concurrency), 3),
        "prompts_emax_over_emean": round(padding_factor(*prompt_lens, shape, concurrency), 3),
        "prompts_drawn": round(
            drawn_padding_factor([len(ids) for ids, _ in workload], concurrency), 3
        ),
        "output_mean": round(expected_max(*output_lens, shape, 1), 1),
        "prompt_mean": round(expected_max(*prompt_lens, shape, 1), 1),
    }
