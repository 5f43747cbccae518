"""Sampling as plain functions over a batch of logits, each row with its own parameters.

Order: penalties -> logit bias -> min_tokens mask -> grammar mask (constrained rows only) -> (greedy rows:
argmax) -> temperature -> top-k -> top-p -> min-p -> one draw per row from the row's own
generator, seeded for the row's output position (`draw_seed`). Filters whose parameters are neutral for the whole batch are skipped, so plain greedy
or plain temperature costs one pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from engine.params import SamplingParams
from kernels.cpu_argmax import argmax_rows


@dataclass(frozen=True)
class SamplingRequest:
    """What the sampler needs from one sequence this step."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None  # None only for greedy rows
    stop_ids_while_short: tuple[int, ...]  # eos/stop ids to mask while below min_tokens
    # constrained requests: [ceil(vocab / 32)] int32, bit t % 32 of word t // 32 set when token
    # t may come next (engine/grammar.py)
    token_bitmask: Tensor | None = None


def apply_penalties(
    logits: Tensor, requests: list[SamplingRequest]
) -> Tensor:  # logits [n, vocab] float32
    """Repetition (prompt + output tokens), presence and frequency (output tokens) penalties."""
    n, vocab = logits.shape
    dev = logits.device
    rep = torch.tensor([r.params.repetition_penalty for r in requests], device=dev)[:, None]
    pres = torch.tensor([r.params.presence_penalty for r in requests], device=dev)[:, None]
    freq = torch.tensor([r.params.frequency_penalty for r in requests], device=dev)[:, None]
    counts = torch.zeros(n, vocab + 1, device=dev)  # [n, vocab + 1]; column `vocab` is padding
    seen = torch.zeros(n, vocab + 1, dtype=torch.bool, device=dev)
    width_out = max(1, max(len(r.output_token_ids) for r in requests))
    width_all = max(len(r.prompt_token_ids) + len(r.output_token_ids) for r in requests)
    out_ids = torch.full((n, width_out), vocab, dtype=torch.int64)  # [n, width_out]
    all_ids = torch.full((n, width_all), vocab, dtype=torch.int64)  # [n, width_all]
    for i, r in enumerate(requests):
        out_ids[i, : len(r.output_token_ids)] = torch.tensor(r.output_token_ids, dtype=torch.int64)
        both = r.prompt_token_ids + r.output_token_ids
        all_ids[i, : len(both)] = torch.tensor(both, dtype=torch.int64)
    out_ids, all_ids = out_ids.to(dev), all_ids.to(dev)
    counts.scatter_add_(1, out_ids, torch.ones_like(out_ids, dtype=counts.dtype))
    seen.scatter_(1, all_ids, True)
    counts, seen = counts[:, :vocab], seen[:, :vocab]
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    return logits - freq * counts - pres * (counts > 0).to(logits.dtype)


def apply_logit_bias(logits: Tensor, requests: list[SamplingRequest]) -> Tensor:
    """A new [n, vocab] tensor: each row's biased tokens with their bias added (the others,
    and the rows without a bias, as they were)."""
    rows = [i for i, r in enumerate(requests) for _ in r.params.logit_bias]
    cols = [t for r in requests for t, _ in r.params.logit_bias]
    biases = [b for r in requests for _, b in r.params.logit_bias]
    dev = logits.device
    index = (torch.tensor(rows, device=dev), torch.tensor(cols, device=dev))
    return logits.index_put(index, torch.tensor(biases, dtype=logits.dtype, device=dev),
                            accumulate=True)  # fmt: skip


def disallowed_tokens(bitmask: Tensor, vocab_size: int) -> Tensor:
    """[m, words] int32 bitmask (bit t % 32 of word t // 32: token t allowed) -> [m, vocab_size]
    bool, True where the token is not allowed."""
    if bitmask.device.type == "cpu":
        return _unpack_with_numpy(bitmask, vocab_size)
    return _unpack_with_shifts(bitmask, vocab_size)


def _unpack_with_numpy(bitmask: Tensor, vocab_size: int) -> Tensor:
    packed = np.invert(bitmask.numpy()).view(np.uint8)  # little-endian bytes: token order
    bits = np.unpackbits(packed, axis=1, bitorder="little")[:, :vocab_size]  # one pass
    return torch.from_numpy(bits).view(torch.bool)


def _unpack_with_shifts(bitmask: Tensor, vocab_size: int) -> Tensor:
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = (bitmask[:, :, None] >> shifts) & 1  # [m, words, 32]
    return (allowed == 0).reshape(bitmask.shape[0], -1)[:, :vocab_size]


def apply_token_bitmask_(logits: Tensor, rows: list[int], bitmask: Tensor) -> None:
    """In place: in each of `rows` of `logits` [n, vocab], the tokens `bitmask` [len(rows),
    words] does not allow get -inf. Every other row, and every allowed logit, is left as it was
    (in place because a fresh [n, vocab] tensor costs more than the mask)."""
    n, vocab = logits.shape
    disallowed = disallowed_tokens(bitmask, vocab).to(logits.device)  # [m, vocab]
    with torch.inference_mode():  # the model's logits are inference tensors
        if rows == list(range(n)):
            logits.masked_fill_(disallowed, float("-inf"))
            return
        for k, row in enumerate(rows):
            logits[row].masked_fill_(disallowed[k], float("-inf"))


def apply_top_k(logits: Tensor, top_k: Tensor) -> Tensor:
    """Keep each row's `top_k[i]` largest logits (ties at the k-th value are kept)."""
    k_max = int(top_k.max())
    kth = logits.topk(k_max, dim=-1).values.gather(1, (top_k - 1)[:, None])  # [n, 1]
    return logits.masked_fill(logits < kth, float("-inf"))


BUCKET_SHIFT = 20  # a positive float32's bits >> 20: exponent + 3 mantissa bits, 2048 buckets


def apply_top_p(logits: Tensor, top_p: Tensor) -> Tensor:
    """Keep the smallest set of most likely tokens whose probability mass reaches `top_p[i]`.

    A token stays when the mass of the tokens ranked before it is below p (equal probabilities,
    common with bf16 logits, rank the lower token id first). Sorting the whole vocabulary costs
    ~20x the rest of the sampler, so each row first sums its probabilities into 2048 monotone
    buckets (the float's exponent and top 3 mantissa bits) and finds the boundary bucket: the
    lowest one at and above which the mass still reaches p. Every token above it stays (the mass
    ranked before it is below p), every token below it goes, and only the boundary bucket's
    tokens, a few hundred at most, are sorted to find where p is reached: exact.
    """
    n, vocab = logits.shape
    dev = logits.device
    probs = logits.softmax(dim=-1)  # [n, vocab]
    buckets = (probs.view(torch.int32) >> BUCKET_SHIFT).long()  # [n, vocab], monotone in probs
    hist = torch.zeros(n, (1 << (31 - BUCKET_SHIFT)) + 1, dtype=torch.float64, device=dev)
    hist.scatter_add_(1, buckets, probs.double())  # [n, 2049] mass per bucket; last column 0
    above = hist.flip(1).cumsum(1).flip(1)  # mass in bucket b and higher
    p = top_p.double()
    # the highest bucket whose mass-at-or-above reaches p (>= 0 even if rounding leaves the
    # total just under p)
    boundary = ((above[:, :-1] >= p[:, None]).sum(1) - 1).clamp_min(0)  # [n]
    mass_above = above.gather(1, (boundary + 1)[:, None]).squeeze(1)  # [n] strictly above it
    keep = buckets > boundary[:, None]  # [n, vocab]
    rows, cols = (buckets == boundary[:, None]).nonzero(as_tuple=True)  # [c] each, row-major
    vals = probs[rows, cols].double()  # [c]
    order = torch.sort(vals, descending=True, stable=True).indices
    order = order[torch.sort(rows[order], stable=True).indices]  # by row, then most likely
    rows, cols, vals = rows[order], cols[order], vals[order]
    counts = torch.bincount(rows, minlength=n)  # [n] boundary tokens per row
    starts = counts.cumsum(0) - counts  # [n] first boundary token of each row
    rank = torch.arange(rows.numel(), device=dev) - starts[rows]  # [c] place in its row
    # each row's running mass on its own (a sum running across rows would round a row's mass
    # differently with other rows beside it: the filter must not depend on the batch)
    per_row = torch.zeros(n, int(counts.max()), dtype=torch.float64, device=dev)
    per_row[rows, rank] = vals
    cum = per_row.cumsum(1)[rows, rank]  # [c]
    before = mass_above[rows] + (cum - vals)  # mass ranked before each boundary token
    kept = before < p[rows]  # the top token always stays (nothing is ranked before it)
    keep[rows[kept], cols[kept]] = True
    return logits.masked_fill(~keep, float("-inf"))


def apply_min_p(logits: Tensor, min_p: Tensor) -> Tensor:
    """Drop tokens whose probability is below `min_p[i]` times the row's top probability."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
    return logits.masked_fill(probs < threshold, float("-inf"))


MASK64 = (1 << 64) - 1


def draw_seed(seed: int, position: int) -> int:
    """The seed of a request's draws at output position `position` (splitmix64 of the pair).

    Each position's randomness depends on (seed, position) only, not on how many draws came
    before it in this process: a run continued elsewhere from its logged tokens samples what it
    would have sampled uninterrupted."""
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return (z ^ (z >> 31)) >> 1  # a non-negative int64, as torch's manual_seed takes


def draw(logits: Tensor, generators: list[torch.Generator | None]) -> Tensor:
    """One token per row of `logits` (overwritten) by inverse CDF: a uniform from the row's own
    generator, then one batched search of the rows' unnormalized cumulative distributions.

    Done in place on purpose: a fresh [n, vocab] tensor per operation costs more than the math.
    """
    weights = logits.sub_(logits.amax(dim=-1, keepdim=True)).exp_()  # softmax * const
    cdf = torch.cumsum(weights, dim=-1, out=weights)  # [n, vocab]
    u = torch.stack([torch.rand((), generator=g, device=logits.device) for g in generators])
    target = (u * cdf[:, -1])[:, None]  # [n, 1], in [0, total)
    token_ids = torch.searchsorted(cdf, target, right=True).squeeze(1)  # first cdf > target
    return token_ids.clamp_max(logits.shape[-1] - 1)


def filtered_probs(logits: Tensor, params: SamplingParams) -> Tensor:
    """[n, vocab] logits of one request -> the distribution its draw samples from: temperature,
    top-k, top-p and min-p applied, as in `sample` (float32, rows sum to 1)."""
    n, vocab = logits.shape
    dev = logits.device
    x = logits / params.temperature
    if params.top_k is not None:
        x = apply_top_k(x, torch.full((n,), min(params.top_k, vocab), device=dev))
    if params.top_p < 1.0:
        x = apply_top_p(x, torch.full((n,), params.top_p, device=dev))
    if params.min_p > 0.0:
        x = apply_min_p(x, torch.full((n,), params.min_p, device=dev))
    return x.softmax(dim=-1)


def top_logprobs(
    logits: Tensor, token_ids: Tensor, requests: list[SamplingRequest]
) -> list[list[tuple[int, float]] | None]:
    """Per row with params.logprobs set: the sampled token's logprob, then the top-n."""
    logprobs = logits.log_softmax(dim=-1)  # [n, vocab]
    n_max = max((r.params.logprobs or 0) for r in requests)
    sampled = logprobs.gather(1, token_ids[:, None]).squeeze(1).tolist()
    top_vals, top_ids = logprobs.topk(max(n_max, 1), dim=-1)
    top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
    ids = token_ids.tolist()
    result: list[list[tuple[int, float]] | None] = []
    for i, r in enumerate(requests):
        if r.params.logprobs is None:
            result.append(None)
            continue
        n = r.params.logprobs
        result.append(
            [(ids[i], sampled[i])] + list(zip(top_ids[i][:n], top_vals[i][:n], strict=True))
        )
    return result


def takes_the_argmax(params: SamplingParams, num_output_tokens: int, constrained: bool) -> bool:
    """`sample` gives this row its logits' argmax, untouched, and no logprobs: greedy, with no
    penalties, logit bias, min_tokens mask or grammar mask (the engine then needs only the
    argmax: engine/model.py greedy_tokens)."""
    return (
        params.greedy
        and params.logprobs is None
        and params.repetition_penalty == 1.0
        and not params.presence_penalty
        and not params.frequency_penalty
        and not params.logit_bias
        and num_output_tokens >= params.min_tokens
        and not constrained
    )


def sample(
    logits: Tensor, requests: list[SamplingRequest]
) -> tuple[list[int], list[list[tuple[int, float]] | None] | None]:
    """Sample one token per row of `logits` [n, vocab] (float32) with each row's own params.

    Returns the token ids and, when any request asked for them, per-row logprobs computed
    from the model's raw distribution (before penalties, logit bias, grammar masks,
    temperature and filters). The constrained rows of `logits` may be overwritten (masked) when no logprobs
    are asked for: the caller must not read them afterwards.
    """
    raw = logits
    dev = logits.device
    params = [r.params for r in requests]
    if any(
        p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
        for p in params
    ):
        logits = apply_penalties(logits, requests)
    if any(p.logit_bias for p in params):
        logits = apply_logit_bias(logits, requests)
    if any(r.stop_ids_while_short for r in requests):
        logits = logits.clone()
        for i, r in enumerate(requests):
            if r.stop_ids_while_short:
                logits[i, list(r.stop_ids_while_short)] = float("-inf")
    constrained = [i for i, r in enumerate(requests) if r.token_bitmask is not None]
    if constrained:
        if logits is raw and any(p.logprobs is not None for p in params):
            logits = logits.clone()  # the raw rows are read again for logprobs
        bitmask = torch.stack([requests[i].token_bitmask for i in constrained])
        apply_token_bitmask_(logits, constrained, bitmask)
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    all_random = len(random_rows) == len(params)
    # [n]; the answer for greedy rows
    token_ids = None if all_random else argmax_rows(logits)
    if random_rows:
        rows = torch.tensor(random_rows, device=dev)
        sub = [params[i] for i in random_rows]
        temperature = torch.tensor([p.temperature for p in sub], device=dev)[:, None]
        x = (logits if all_random else logits[rows]) / temperature  # a copy: draw() works in place
        if any(p.top_k is not None for p in sub):
            vocab = x.shape[-1]
            top_k = [min(p.top_k or vocab, vocab) for p in sub]
            x = apply_top_k(x, torch.tensor(top_k, device=dev))
        if any(p.top_p < 1.0 for p in sub):
            x = apply_top_p(x, torch.tensor([p.top_p for p in sub], device=dev))
        if any(p.min_p > 0.0 for p in sub):
            x = apply_min_p(x, torch.tensor([p.min_p for p in sub], device=dev))
        drawn = draw(x, [requests[i].generator for i in random_rows])
        token_ids = drawn if all_random else token_ids.index_copy(0, rows, drawn)
    logprobs = None
    if any(p.logprobs is not None for p in params):
        logprobs = top_logprobs(raw, token_ids, requests)
    return token_ids.tolist(), logprobs
