"""Speculative decoding with an n-gram proposer (prompt lookup): proposal and verification.

Text often repeats what came before it (code, quotes, lists, a document being summarised). The
proposer looks for the sequence's last n tokens earlier in its own tokens and proposes the tokens
that followed them there. The scheduler puts a decode's draft in the same chunk as its real token,
so the model gives one row of logits after each; verification keeps the longest run of the draft
the model stands by, then one token of the model's own. Invariant: every token a request receives
is distributed exactly as plain decoding would draw it (greedy: it is the same token), so
speculation changes how many steps a request takes, never what it says.
"""

from __future__ import annotations

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view
from torch import Tensor

from engine.sampler import SamplingRequest, filtered_probs, sample, top_logprobs
from engine.sequence import Sequence

TokenLogprobs = list[tuple[int, float]]  # the token's logprob, then the top-n


def propose_ngram(token_ids: list[int], k: int, max_n: int = 4, min_n: int = 3) -> list[int]:
    """Up to `k` tokens that followed the latest earlier occurrence of the sequence's last n
    tokens, trying the longest n first (max_n down to min_n); [] when none occurs. A match of
    fewer than 3 tokens is mostly chance in open text: drafts from it are rejected, and their
    verification rows cost a single stream ~10% (measured with `brigade bench spec`)."""
    if k < 1 or len(token_ids) < min_n + 1:
        return []
    arr = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_n, len(arr) - 1), min_n - 1, -1):
        suffix = arr[-n:]
        windows = sliding_window_view(arr[:-1], n)  # [L - n, n]: every earlier n-gram
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n  # the most recent occurrence, what followed it
            return arr[start : start + k].tolist()
    return []


def propose_drafts(
    running: list[Sequence], *, num_speculative_tokens: int, max_rows: int, max_model_len: int
) -> dict[str, list[int]]:
    """N-gram drafts for the running decodes, in scheduling order, while the step's decode rows
    stay within `max_rows`. Only requests whose next tokens depend on their own position's
    logits alone get one (no penalties or logit bias, past min_tokens, no grammar, whose mask would be needed
    at every row): the verifications below see one row per position and nothing else. A draft
    never reaches past max_tokens or max_model_len."""
    if num_speculative_tokens == 0:
        return {}
    rows = sum(1 for seq in running if seq.num_uncomputed_tokens == 1)
    drafts: dict[str, list[int]] = {}
    for seq in sorted(running, key=lambda s: s.sort_key):
        p = seq.params
        if (
            seq.num_uncomputed_tokens != 1
            or p.repetition_penalty != 1.0
            or p.presence_penalty
            or p.frequency_penalty
            or p.logit_bias
            or seq.num_output_tokens < p.min_tokens
            or seq.grammar is not None
        ):
            continue
        room = min(
            num_speculative_tokens,
            max_rows - rows,
            p.max_tokens - seq.num_output_tokens - 1,  # the last token needs no draft
            max_model_len - seq.num_tokens - 1,
        )
        if room < 1:
            continue
        draft = propose_ngram(seq.token_ids, room)
        if draft:
            drafts[seq.request_id] = draft
            rows += len(draft)
    return drafts


def verify_greedy(draft: tuple[int, ...], target_ids: list[int]) -> list[int]:
    """A greedy request's draft against the argmax of each of its rows: target_ids[0] is the
    model's token after the real token, target_ids[j] its token after draft[j - 1]. Returns the
    accepted draft tokens, then one more (the model's own): at least one token, at most
    len(draft) + 1, and exactly the tokens plain greedy decoding would give."""
    assert len(target_ids) == len(draft) + 1, f"{len(target_ids)} rows for a {len(draft)} draft"
    # The greedy target is one-hot at the argmax t_j, so speculative sampling's rule below
    # degenerates: d_j == t_j: accept (p(d) = 1); d_j != t_j: reject (p(d) = 0) and the residual
    # max(p - q, 0) is one-hot at t_j, so t_j follows. The rows after a rejection were computed
    # on a wrong token: dropped.
    out: list[int] = []
    for d, t in zip(draft, target_ids, strict=False):
        if d != t:
            return out + [t]
        out.append(d)
    return out + [target_ids[-1]]  # every draft token stood: the last row's token follows


def verify_sampled(logits: Tensor, draft: tuple[int, ...], request: SamplingRequest) -> list[int]:
    """Speculative sampling for a sampled (temperature > 0) request whose draft came from a
    deterministic proposer. logits [len(draft) + 1, vocab]: the row after the real token, then
    one after each draft token. Returns the accepted draft tokens, then one more; each token is
    distributed exactly as the request's own sampling would draw it (the speculative sampling
    theorem), drawn from the request's own generator."""
    # p_j: the target, the request's filtered distribution at row j (temperature, top-k/p, min-p)
    # q_j: the draft's, one-hot at d_j (the proposer is deterministic), so q_j(d_j) = 1
    # accept d_j with probability min(1, p_j(d_j) / q_j(d_j)) = p_j(d_j):  u < p_j(d_j)
    # on reject draw from norm(max(p_j - q_j, 0)) = p_j with d_j removed, renormalised
    #   (P[token = x] = p(d) [x = d] + (1 - p(d)) p(x) / (1 - p(d)) [x != d] = p(x): exact)
    # all accepted: one more token from the last row, p_m
    probs = filtered_probs(logits, request.params).double()  # [m + 1, vocab]
    gen = request.generator
    out: list[int] = []
    for j, d in enumerate(draft):
        u = torch.rand((), generator=gen, dtype=torch.float64, device=probs.device)
        if u < probs[j, d]:
            out.append(d)
            continue
        residual = probs[j].clone()
        residual[d] = 0.0  # multinomial renormalises
        out.append(int(torch.multinomial(residual, 1, generator=gen)))
        return out
    out.append(int(torch.multinomial(probs[-1], 1, generator=gen)))
    return out


def sample_and_verify(
    logits: Tensor, drafts: list[tuple[int, ...]], requests: list[SamplingRequest]
) -> tuple[list[list[int]], list[list[TokenLogprobs | None]] | None]:
    """The tokens each request receives this step, and their logprobs when any request asked.

    logits [sum(1 + len(draft)), vocab] float32: per request, in order, the row after its last
    real token, then one row after each draft token. A request without a draft gets its row's
    sampled token; a greedy draft is verified against its rows' argmaxes, a sampled one by
    speculative sampling. Logprobs are those of the model's raw distribution at each row.
    """
    row_requests = [r for d, r in zip(drafts, requests, strict=True) for _ in range(1 + len(d))]
    speculative = [bool(d) and not r.params.greedy for d, r in zip(drafts, requests, strict=True)]
    runs: dict[int, list[int]] = {}  # request index -> its speculative sampling run
    if not any(speculative):
        row_ids, row_logprobs = sample(logits, row_requests)  # greedy rows: their argmax
    else:
        row_ids, plain, start = [0] * len(row_requests), [], 0
        for i, (d, r) in enumerate(zip(drafts, requests, strict=True)):
            n = 1 + len(d)
            if speculative[i]:
                runs[i] = verify_sampled(logits[start : start + n], d, r)
                row_ids[start : start + len(runs[i])] = runs[i]  # later rows: 0, never read
            else:
                plain += range(start, start + n)
            start += n
        if plain:
            drawn, _ = sample(logits[plain], [row_requests[i] for i in plain])
            for i, t in zip(plain, drawn, strict=True):
                row_ids[i] = t
        row_logprobs = None
        if any(r.params.logprobs is not None for r in row_requests):
            ids = torch.tensor(row_ids, device=logits.device)
            row_logprobs = top_logprobs(logits, ids, row_requests)
    tokens: list[list[int]] = []
    logprobs: list[list[TokenLogprobs | None]] | None = None if row_logprobs is None else []
    start = 0
    for i, d in enumerate(drafts):
        n = 1 + len(d)
        # without a draft verify_greedy is the row's own token (sampled or argmax)
        got = runs[i] if speculative[i] else verify_greedy(d, row_ids[start : start + n])
        tokens.append(got)
        if logprobs is not None:
            logprobs.append(row_logprobs[start : start + len(got)])
        start += n
    return tokens, logprobs
