"""Speculative decoding with an n-gram proposer (prompt lookup): no draft model.

Text often repeats what came before it (code, quotes, lists, a document being summarised). The
proposer looks for the sequence's last n tokens earlier in its own tokens and proposes the tokens
that followed them there. The engine runs the proposals through the model in the same step as
the sequence's real token, one row each, and keeps the longest run the model agrees with plus
the model's own next token: a greedy output is exactly what plain decoding gives (lossless
verification), only in fewer steps.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


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
